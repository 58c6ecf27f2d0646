"""Sharded, mixed-precision state and host offload (TrainConfig.param_sharding, precision, offload).

- The three fields are execution fields: a job's identity and fingerprint do not change with them.
- ``precision="bf16_mixed"`` gives the numbers of the per-use cast (``model.compute_dtype="bfloat16"``):
  loss, float32 gradients and the updated float32 master, whole-batch and micro-batched; its bf16 copy of
  the weights is made once per step, outside the micro-batch scan (the per-use path casts inside it).
- ``offload`` keeps the AdamW state (and the float32 master) in ``pinned_host`` memory, bit-identical
  steps, checkpoints restored into the same memory kind, and one clear error where no such memory exists.
- On 8 fake CPU devices (one subprocess, ``slow``): ``param_sharding="zero3"`` splits dense weights over the data axis
  and expert weights over expert and data, matches the single-device loss and gradients, holds about an
  eighth of the state per device, and gathers weights on use; the collectives that reduce gradients are
  counted (XLA:CPU keeps the partitioner's all-reduce + dynamic-slice, which XLA:GPU/TPU's
  ReduceScatterCreator turns into a reduce-scatter: see the assertion).
- ``trainer.train`` with all three set checkpoints and resumes exactly and equals the plain run's losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_trainer_remat_microbatch import (
    BATCH,
    MOE_NO_DROP,
    assert_trees_close,
    init_state,
    make_job,
    random_batch,
    step_and_grads,
    stop_then_resume,
    with_train,
)
from trainer import checkpoint as checkpoint_lib
from trainer import model, precision
from trainer import sharding as sharding_lib
from trainer import step as step_lib
from trainer.config import ModelConfig, TrainConfig, TrainJob

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bf16_job(moe=None, **train) -> TrainJob:
    job = make_job(moe, **train)
    return job.model_copy(update={"model": ModelConfig(**{**job.model.model_dump(), "compute_dtype": "bfloat16"})})


# --------------------------------------------------------------------------------------------
# Identity and validation


def test_sharding_precision_and_offload_are_execution_fields():
    job = bf16_job()
    for field, value in (("param_sharding", "zero3"), ("precision", "bf16_mixed"), ("offload", "master_and_optimizer")):
        assert field in TrainConfig.EXECUTION_FIELDS
        assert with_train(job, **{field: value}).identity() == job.identity(), field


def test_bf16_mixed_needs_bfloat16_compute():
    with pytest.raises(ValueError, match=r"train.precision='bf16_mixed'.*model.compute_dtype='bfloat16'"):
        job = make_job()
        TrainJob.model_validate({**job.model_dump(), "train": {**job.train.model_dump(), "precision": "bf16_mixed"}})


def test_unknown_param_sharding_rule_names_the_field():
    mesh = sharding_lib.make_mesh({"data": 1})
    with pytest.raises(ValueError, match="train.param_sharding"):
        sharding_lib.param_partition_spec(("w",), (4, 4), mesh, "zero2")


# --------------------------------------------------------------------------------------------
# Mixed precision


@pytest.mark.parametrize("moe, microbatch", [(None, None), pytest.param(MOE_NO_DROP, BATCH // 4, marks=pytest.mark.slow)], ids=["dense", "moe-micro"])
def test_bf16_mixed_gives_the_per_use_cast_numbers_with_float32_master_and_gradients(moe, microbatch):
    per_use = bf16_job(moe, microbatch_size=microbatch)
    mixed = with_train(per_use, precision="bf16_mixed")
    state, _, _ = init_state(per_use)
    batch = random_batch(per_use)
    ((loss_a, _), grads_a), (new_a, metrics_a) = step_and_grads(per_use, state, batch)
    ((loss_b, _), grads_b), (new_b, metrics_b) = step_and_grads(mixed, state, batch)
    assert {g.dtype for g in jax.tree.leaves(grads_b)} == {jnp.dtype(jnp.float32)}
    assert {p.dtype for p in jax.tree.leaves(new_b["params"])} == {jnp.dtype(jnp.float32)}
    assert {m.dtype for m in jax.tree.leaves(new_b["opt_state"]) if m.ndim} == {jnp.dtype(jnp.float32)}
    assert float(loss_b) == pytest.approx(float(loss_a), rel=1e-6)
    assert_trees_close(grads_b, grads_a, rtol=1e-5, atol=1e-7)
    assert_trees_close(new_b["params"], new_a["params"], rtol=1e-5, atol=1e-6)
    assert float(metrics_b["grad/norm/total"]) == pytest.approx(float(metrics_a["grad/norm/total"]), rel=1e-5)


def _weight_casts(closed_jaxpr) -> tuple[int, int]:
    """float32 -> bfloat16 casts of the traced function's inputs (the parameters) outside any scan, and of
    what a scan closes over (the weights every micro-batch reads) inside its body."""
    outside = inside = 0

    def is_cast(eqn, sources) -> bool:
        (x,), (y,) = eqn.invars, eqn.outvars
        return x in sources and x.aval.dtype == jnp.float32 and y.aval.dtype == jnp.bfloat16

    def visit(jaxpr, sources, in_scan: bool):
        nonlocal outside, inside
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "convert_element_type" and is_cast(eqn, sources):
                inside, outside = (inside + 1, outside) if in_scan else (inside, outside + 1)
            if eqn.primitive.name == "scan":
                body = eqn.params["jaxpr"].jaxpr
                visit(body, set(body.invars[: eqn.params["num_consts"]]), True)
            elif eqn.primitive.name in ("pjit", "closed_call", "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call"):
                for sub in jax.core.jaxprs_in_params(eqn.params):
                    inner = {v for v, o in zip(sub.invars, eqn.invars) if o in sources}
                    visit(sub, inner, in_scan)

    visit(closed_jaxpr.jaxpr, set(closed_jaxpr.jaxpr.invars), False)
    return outside, inside


def test_bf16_mixed_casts_the_master_once_per_step_not_per_microbatch():
    per_use = bf16_job(MOE_NO_DROP, microbatch_size=BATCH // 4)
    mixed = with_train(per_use, precision="bf16_mixed")
    state, _, _ = init_state(per_use)
    batch = random_batch(per_use)
    counts = {}
    for name, job in (("per_use", per_use), ("mixed", mixed)):
        fn = step_lib.make_loss_and_grads(job, model)
        counts[name] = _weight_casts(jax.make_jaxpr(fn)(state["params"], state["router_state"], batch, 1.0))
    assert counts["per_use"][1] > 0  # the per-use path casts inside the micro-batch loop
    assert counts["mixed"] == (len([p for p in jax.tree.leaves(model.cast_for_compute(state["params"], mixed.model))
                                    if p.dtype == jnp.bfloat16]), 0), counts


# --------------------------------------------------------------------------------------------
# Host offload (one CPU device here; 8 in the subprocess below)


def _host_kinds(tree) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def _run_steps(job: TrainJob, batch, steps: int = 2):
    mesh = sharding_lib.make_mesh({"data": 1})
    jitted = step_lib.jit_train_step(job, model, mesh)
    sh = jitted.state_shardings
    params = jax.jit(lambda k: model.init_params(job.model, k), out_shardings=sh["params"])(jax.random.key(0))
    state = {
        "step": jax.device_put(jnp.zeros((), jnp.int32), jitted.replicated),
        "params": params,
        "opt_state": jax.jit(jitted.optimizer.init, out_shardings=sh["opt_state"])(params),
        "router_state": jax.device_put(jitted.router_state0, sh["router_state"]),
    }
    kinds_at_init = {k: _host_kinds(state[k]) for k in ("params", "opt_state")}
    for _ in range(steps):
        state, metrics = jitted.train_step(state, jax.device_put(batch, jitted.batch_sharding), False, jnp.float32(1.0))
    return state, metrics, kinds_at_init, jitted


def test_offloaded_state_lives_in_pinned_host_memory_and_steps_are_bit_identical():
    job = make_job()
    batch = random_batch(job)
    ref, ref_metrics, _, _ = _run_steps(job, batch)
    assert _host_kinds(ref) == {"device"}
    for offload, on_host in (("optimizer", ("opt_state",)), ("master_and_optimizer", ("params", "opt_state"))):
        off, off_metrics, kinds_at_init, _ = _run_steps(with_train(job, offload=offload), batch)
        for name in ("params", "opt_state"):
            expected = {"pinned_host"} if name in on_host else {"device"}
            assert kinds_at_init[name] == expected and _host_kinds(off[name]) == expected, (offload, name)
        assert _host_kinds(off["step"]) == {"device"}
        for a, b in zip(jax.tree.leaves(off), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert float(off_metrics["train/loss"]) == float(ref_metrics["train/loss"])


def test_offloaded_checkpoint_restores_into_pinned_host_memory(tmp_path):
    job = with_train(make_job(), offload="master_and_optimizer")
    state, _, _, jitted = _run_steps(job, random_batch(job), steps=1)
    ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "ckpt"), every_steps=1, every_seconds=None, keep=1, async_save=False)
    ckpt.save(1, state, {"fingerprint": "x"})
    restored, meta = ckpt.restore_latest(jitted.abstract_state)
    ckpt.close()
    assert meta["step"] == 1
    assert _host_kinds(restored["params"]) == _host_kinds(restored["opt_state"]) == {"pinned_host"}
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _DeviceWithoutHostMemory:
    """A device of a platform that exposes only device memory (XLA:CPU here exposes pinned_host, so the
    refusal is exercised through this stand-in for the one attribute check_offload reads)."""

    platform = "tpu"

    def addressable_memories(self):
        return [type("Memory", (), {"kind": "device"})()]


class _Mesh:
    devices = np.array([_DeviceWithoutHostMemory()])


def test_offload_without_pinned_host_memory_is_one_clear_error():
    job = with_train(make_job(), offload="optimizer")
    with pytest.raises(ValueError, match=r"^train.offload='optimizer' keeps state in 'pinned_host' memory.*set train.offload='none'"):
        precision.check_offload(job, _Mesh())
    precision.check_offload(make_job(), _Mesh())  # no offload asked: nothing to refuse
    precision.check_offload(job, sharding_lib.make_mesh({"data": 1}))  # XLA:CPU has pinned_host


# --------------------------------------------------------------------------------------------
# 8 fake devices: ZeRO-3 over the data axes, bf16_mixed and offload on a mesh


SHARDED_SCRIPT = textwrap.dedent(
    """
    import json, re
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tests.test_trainer_precision import bf16_job
    from tests.test_trainer_remat_microbatch import MOE_NO_DROP, make_job, random_batch, with_train, init_state
    from trainer import model, sharding, step as step_lib

    OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

    def collectives(hlo):
        return {op: len(re.findall(r"\\b" + op + r"(-start)?\\(", hlo)) for op in OPS}

    def specs(tree):  # PartitionSpecs as lists, trailing Nones dropped (P('a', None) and P('a') are one sharding)
        def as_list(s):
            entries = [None if e is None else (list(e) if isinstance(e, tuple) else e) for e in s.spec]
            while entries and entries[-1] is None:
                entries.pop()
            return entries
        return jax.tree.map(as_list, tree)

    def abstract_inputs(jitted, job):
        b = jax.ShapeDtypeStruct((job.train.batch_size, job.model.seq_len + 1), jnp.int32, sharding=jitted.batch_sharding)
        r = jitted.replicated
        return jitted.abstract_state, b, jax.ShapeDtypeStruct((), jnp.bool_, sharding=r), jax.ShapeDtypeStruct((), jnp.float32, sharding=r)

    def run(job, axes, state0, batch):
        mesh = sharding.make_mesh(axes)
        jitted = step_lib.jit_train_step(job, model, mesh)
        compiled = jitted.train_step.lower(*abstract_inputs(jitted, job)).compile()
        state = jax.device_put(jax.tree.map(np.asarray, state0), jitted.state_shardings)  # a fresh copy: the step donates it
        new, metrics = compiled(state, jax.device_put(batch, jitted.batch_sharding), jnp.bool_(False), jnp.float32(1.0))
        p_sh = sharding.param_shardings(state0["params"], job.model, mesh, job.train.param_sharding)
        grads_fn = jax.jit(step_lib.make_loss_and_grads(job, model, mesh=mesh),
                           in_shardings=(p_sh, jitted.replicated, jitted.batch_sharding, jitted.replicated))
        (loss, _), grads = grads_fn(jax.device_put(state0["params"], p_sh), state0["router_state"], batch, jnp.float32(1.0))
        mem = compiled.memory_analysis()
        return {
            "loss": float(loss), "train_loss": float(metrics["train/loss"]),
            "grads": jax.tree.map(np.asarray, grads), "params": jax.tree.map(np.asarray, new["params"]),
            "collectives": collectives(compiled.as_text()),
            "argument_bytes": int(mem.argument_size_in_bytes),
            "param_specs": specs(jitted.state_shardings["params"]),
            "grad_specs": specs(jax.tree.map(lambda g: g.sharding, grads)),
            "kinds": sorted({l.sharding.memory_kind for l in jax.tree.leaves(new["opt_state"]) + jax.tree.leaves(new["params"])}),
        }

    def max_diff(a, b):
        return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    def scale(a):
        return max(float(np.max(np.abs(x))) for x in jax.tree.leaves(a))

    out = {"devices": jax.device_count(), "cases": {}}
    # each variant is two compiles on 8 devices: the whole-batch ZeRO-3 step on the dense and MoE meshes, the
    # micro-batched one on the mesh with an fsdp axis, and every policy at once in bfloat16
    cases = [
        ("dense", make_job(None, batch=16, hidden=64), {"data": 8}, ("default", "zero3")),
        ("moe", make_job(MOE_NO_DROP, batch=16, hidden=64), {"data": 4, "expert": 2}, ("default", "zero3")),
        ("moe_fsdp_axis", make_job(MOE_NO_DROP, batch=16, hidden=64), {"data": 2, "fsdp": 2, "expert": 2},
         ("default", "zero3_micro")),
        ("bf16", bf16_job(MOE_NO_DROP, batch=16, hidden=64), {"data": 4, "expert": 2}, ("zero3_mixed_micro_offload",)),
    ]
    for name, base, axes, names in cases:
        state0, _, _ = init_state(base)
        batch = random_batch(base)
        single = run(base, {"data": 1}, state0, batch)
        every = {"default": base, "zero3": with_train(base, param_sharding="zero3"),
                 "zero3_micro": with_train(base, param_sharding="zero3", microbatch_size=8),
                 "zero3_mixed_micro_offload": with_train(base, param_sharding="zero3", microbatch_size=8,
                                                         precision="bf16_mixed", offload="master_and_optimizer")}
        variants = {v: every[v] for v in names}
        case = {}
        for variant, job in variants.items():
            r = run(job, axes, state0, batch)
            case[variant] = {
                "loss_rel": abs(r["loss"] - single["loss"]) / abs(single["loss"]),
                "grad_diff": max_diff(r["grads"], single["grads"]) / scale(single["grads"]),
                "param_diff": max_diff(r["params"], single["params"]) / scale(single["params"]),
                "collectives": r["collectives"], "argument_bytes": r["argument_bytes"], "kinds": r["kinds"],
                "param_specs": r["param_specs"], "grad_specs": r["grad_specs"],
            }
        out["cases"][name] = case
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def sharded():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def _leaf(tree, *path):
    for key in path:
        tree = tree[key]
    return tree


@pytest.mark.slow  # the 8-device subprocess compiles 14 steps (about 95 s on 2 cores)
def test_zero3_matches_the_single_device_step_on_8_devices(sharded):
    assert sharded["devices"] == 8
    for name, case in sharded["cases"].items():
        bf16 = name == "bf16"
        for variant, r in case.items():
            assert r["loss_rel"] < (2e-3 if bf16 else 1e-5), (name, variant, r["loss_rel"])
            assert r["grad_diff"] < (2e-2 if bf16 else 1e-4), (name, variant, r["grad_diff"])
            assert r["param_diff"] < (2e-2 if bf16 else 1e-4), (name, variant, r["param_diff"])


@pytest.mark.slow  # the 8-device subprocess compiles 14 steps (about 95 s on 2 cores)
def test_zero3_shards_dense_and_expert_weights_over_the_data_axes(sharded):
    dense = sharded["cases"]["dense"]
    assert _leaf(dense["default"]["param_specs"], "blocks", "000", "ffn", "w_up") == []  # data only: replicated
    assert "data" in _leaf(dense["zero3"]["param_specs"], "blocks", "000", "ffn", "w_up")
    moe = sharded["cases"]["moe"]["zero3"]["param_specs"]
    assert _leaf(moe, "blocks", "000", "ffn", "experts", "w_up")[0] == "expert"
    assert "data" in _leaf(moe, "blocks", "000", "ffn", "experts", "w_up")[1:]
    assert ["data", "expert"] in _leaf(moe, "embed") or ("data" in _leaf(moe, "embed") and "expert" in _leaf(moe, "embed"))
    assert _leaf(moe, "blocks", "000", "attn_norm") == []
    # the gradient of a split weight comes out split like it (reduced to its shard, not kept whole)
    grads = sharded["cases"]["moe"]["zero3"]["grad_specs"]
    assert _leaf(grads, "blocks", "000", "ffn", "experts", "w_up") == _leaf(moe, "blocks", "000", "ffn", "experts", "w_up")


@pytest.mark.slow  # the 8-device subprocess compiles 14 steps (about 95 s on 2 cores)
def test_zero3_holds_a_fraction_of_the_state_and_gathers_weights_on_use(sharded):
    for name in ("dense", "moe"):
        default, zero3 = sharded["cases"][name]["default"], sharded["cases"][name]["zero3"]
        # params + AdamW mu/nu per device: about 1/8 on a data-only mesh, against replicated dense weights
        assert zero3["argument_bytes"] < default["argument_bytes"] / (5 if name == "dense" else 2.5), name
        assert zero3["collectives"]["all-gather"] > default["collectives"]["all-gather"], name
        # gradients of split weights are reduced to their shards: XLA:CPU emits the SPMD partitioner's
        # all-reduce + dynamic-slice (it has no ReduceScatterCreator pass; XLA:GPU/TPU's collective pipeline
        # rewrites the pair into one reduce-scatter), so on CPU the reductions show up as all-reduces
        reductions = zero3["collectives"]["reduce-scatter"] + zero3["collectives"]["all-reduce"]
        assert reductions > default["collectives"]["reduce-scatter"] + default["collectives"]["all-reduce"], name


@pytest.mark.slow  # the 8-device subprocess compiles 14 steps (about 95 s on 2 cores)
def test_bf16_mixed_with_zero3_microbatches_and_offload_on_a_mesh(sharded):
    r = sharded["cases"]["bf16"]["zero3_mixed_micro_offload"]
    assert r["kinds"] == ["pinned_host"]


# --------------------------------------------------------------------------------------------
# End to end through trainer.train


@pytest.mark.slow  # 38-56 s on 2 cores: two real trainings, a checkpoint and a resume
def test_train_with_zero3_bf16_mixed_and_offload_resumes_exactly(tmp_path, monkeypatch):
    from trainer.loop import default_compilation_cache_dir, train
    from trainer.metrics import read_metrics

    monkeypatch.setenv("LADDER_CACHE_DIR", str(tmp_path / "cache"))
    steps = 4

    def job_with(**train):
        job = bf16_job(MOE_NO_DROP, seq=32)
        return job.model_copy(update={
            "data": job.data.model_copy(update={"max_tokens_per_source": 50_000}),
            "train": TrainConfig(tokens=steps * BATCH * 32, batch_size=BATCH, microbatch_size=BATCH // 2, log_every=1,
                                 eval_every=2, eval_batches=1, checkpoint_every=2, wandb="disabled", progress=False,
                                 compilation_cache_dir=default_compilation_cache_dir(), **train),
        })

    def losses(run_dir):
        rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        return {(r["step"], k): r[k] for r in rows for k in ("train/loss", "eval/loss") if k in r}

    plain = job_with()
    policy = job_with(param_sharding="zero3", precision="bf16_mixed", offload="master_and_optimizer")
    assert policy.identity() == plain.identity()
    reference = train(plain, str(tmp_path / "plain"))
    straight = train(policy, str(tmp_path / "straight"))
    assert reference.completed and straight.completed
    stop_then_resume(policy, str(tmp_path / "resumed"))
    assert losses(str(tmp_path / "resumed")) == losses(str(tmp_path / "straight"))
    assert losses(str(tmp_path / "straight")) == losses(str(tmp_path / "plain"))
