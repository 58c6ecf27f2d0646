"""Remat policies and micro-batching in the train step: same numbers, less XLA temp memory.

- ``TrainConfig.remat`` ("full", "save_dots") leaves loss and gradients equal to no remat (dense and MoE)
  and lowers the compiled step's ``memory_analysis().temp_size_in_bytes``.
- ``TrainConfig.microbatch_size`` = batch / 4 gives the whole batch's loss, gradients, updated params and
  router-bias update (dense; MoE with dropless dispatch; sign-rule and quantile balancing); with
  capacity dispatch the step is the mean over micro-batches that each have their own buffers.
- Micro-batches keep each device's rows on that device (8 fake CPU devices, in a subprocess).
- ``trainer.train`` runs a job with both set, checkpoints it and resumes it exactly.

Remat is compiled with ``step.xla_compiler_options`` as the loop should (XLA:CPU otherwise undoes it,
see that function). Shapes are tiny so each test takes seconds on 2 CPU cores.
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

from trainer import model, optim
from trainer import step as step_lib
from trainer.config import (
    DataConfig,
    MixturePhase,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ScheduleConfig,
    SourceConfig,
    TrainConfig,
    TrainJob,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 8

DENSE = None
MOE_RAGGED = MoEConfig(num_experts=4, top_k=2, expert_dim=16, dispatch="ragged", num_shared_experts=1)
MOE_QUANTILE = MoEConfig(num_experts=4, top_k=2, expert_dim=16, dispatch="dense", balancing="quantile")
# starved buffers (drops) and the batch-level Switch balance loss: the two terms micro-batching changes
MOE_CAPACITY = MoEConfig(num_experts=4, top_k=2, expert_dim=16, capacity_factor=1.0, aux_loss="switch",
                         aux_loss_weight=0.5)
MOE_NO_DROP = MoEConfig(num_experts=4, top_k=2, expert_dim=16, capacity_factor=2.0)  # E/k: nothing dropped


def make_job(moe: MoEConfig | None = DENSE, *, layers: int = 2, hidden: int = 32, seq: int = 16, batch: int = BATCH,
             **train) -> TrainJob:
    # Adam's epsilon is 1e-3 here: its first update is g / (|g| + eps), which for gradients near zero
    # turns float-rounding differences of 1e-9 into visible parameter differences at eps = 1e-8.
    return TrainJob(
        model=ModelConfig(hidden_dim=hidden, num_layers=layers, num_heads=4, num_kv_heads=2, seq_len=seq, moe=moe),
        data=DataConfig(sources=[SourceConfig(name="code", kind="stdlib_code")], phases=[MixturePhase(weights={"code": 1.0})]),
        optimizer=OptimizerConfig(learning_rate=1e-2, epsilon=1e-3, schedule=ScheduleConfig(kind="constant", warmup=0)),
        train=TrainConfig(tokens=batch * seq * 10, batch_size=batch, **train),
    )


def with_train(job: TrainJob, **train) -> TrainJob:
    return job.model_copy(update={"train": TrainConfig(**{**job.train.model_dump(), **train})})


def random_batch(job: TrainJob, seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (job.train.batch_size, job.model.seq_len + 1), 0, job.model.vocab_size)


def init_state(job: TrainJob):
    cfg = job.model
    params = model.init_params(cfg, jax.random.key(0))
    groups = model.param_groups(params)
    optimizer = optim.build_optimizer(job.optimizer, params, groups)
    state = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": optimizer.init(params),
        "router_state": model.init_router_state(cfg),
    }
    if cfg.moe is not None:  # a non-zero bias, so that selection depends on it
        state["router_state"] = {"bias": 0.01 * jax.random.normal(jax.random.key(7), state["router_state"]["bias"].shape)}
    return state, optimizer, groups


def loss_and_grads(job: TrainJob, state, batch):
    fn = jax.jit(step_lib.make_loss_and_grads(job, model), compiler_options=step_lib.xla_compiler_options(job, "cpu"))
    return fn(state["params"], state["router_state"], batch, jnp.float32(1.0))


def step_and_grads(job: TrainJob, state, batch):
    """(loss, aux), grads and the train step's (new state, metrics), from one compiled program."""
    _, optimizer, groups = init_state(job)
    grads_fn = step_lib.make_loss_and_grads(job, model)
    step_fn = step_lib.make_train_step(job, model, optimizer, groups)

    def both(state, batch):
        return grads_fn(state["params"], state["router_state"], batch, 1.0), step_fn(state, batch, False, 1.0)

    return jax.jit(both, compiler_options=step_lib.xla_compiler_options(job, "cpu"))(state, batch)


def assert_trees_close(a, b, *, rtol: float, atol: float) -> None:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


_TEMP_BYTES: dict[str, int] = {}


def stop_then_resume(job: TrainJob, run_dir: str, *, stop_after: int = 2):
    """``trainer.train`` stopped after ``stop_after`` steps, then run again in the same directory to the end: the
    second run resumes from the first's checkpoint. Returns the resumed run's result."""
    from trainer.loop import train

    calls = iter(range(100))
    stopped = train(job, run_dir, should_stop=lambda: next(calls) >= stop_after)
    assert not stopped.completed and stopped.steps == stop_after
    resumed = train(job, run_dir)
    assert resumed.completed and resumed.resumed_from_step == stop_after
    return resumed


def temp_bytes(job: TrainJob) -> int:
    """XLA's scratch memory of the compiled train step (what remat and micro-batching shrink); cached."""
    key = job.model_dump_json()
    if key not in _TEMP_BYTES:
        state, optimizer, groups = init_state(job)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        fn = jax.jit(step_lib.make_train_step(job, model, optimizer, groups),
                     compiler_options=step_lib.xla_compiler_options(job, "cpu"))
        batch = jax.ShapeDtypeStruct((job.train.batch_size, job.model.seq_len + 1), jnp.int32)
        flag, scale = jax.ShapeDtypeStruct((), jnp.bool_), jax.ShapeDtypeStruct((), jnp.float32)
        _TEMP_BYTES[key] = int(fn.lower(abstract, batch, flag, scale).compile().memory_analysis().temp_size_in_bytes)
    return _TEMP_BYTES[key]


MEMORY_JOB = make_job(DENSE, layers=4, hidden=64, seq=128)  # 4 blocks of 1024 tokens x 64


# --------------------------------------------------------------------------------------------
# Remat


@pytest.mark.parametrize("remat", ["full", "save_dots"])
@pytest.mark.parametrize("moe", [DENSE, MOE_CAPACITY], ids=["dense", "moe"])
def test_remat_leaves_loss_and_grads_unchanged(moe, remat):
    job = make_job(moe)
    state, _, _ = init_state(job)
    batch = random_batch(job)
    (loss, aux), grads = loss_and_grads(job, state, batch)
    (loss_r, aux_r), grads_r = loss_and_grads(with_train(job, remat=remat), state, batch)
    assert float(loss_r) == pytest.approx(float(loss), rel=1e-6)
    assert_trees_close(grads_r, grads, rtol=1e-5, atol=1e-7)
    if moe is not None:
        np.testing.assert_array_equal(aux_r["router_stats"]["expert_counts"], aux["router_stats"]["expert_counts"])
        assert float(aux_r["drop_fraction"]) == float(aux["drop_fraction"])


def test_remat_is_an_execution_field_and_microbatch_size_is_identity():
    assert "remat" in TrainConfig.EXECUTION_FIELDS
    assert "microbatch_size" not in TrainConfig.EXECUTION_FIELDS


@pytest.mark.slow  # 10-18 s of compilation on 2 cores; CI runs the slow set
def test_full_remat_lowers_xla_temp_memory():
    """Without remat the backward keeps every block's intermediates; "full" keeps block inputs and
    recomputes one block at a time; "save_dots" keeps the 2-D GEMM outputs in between."""
    sizes = {remat: temp_bytes(with_train(MEMORY_JOB, remat=remat)) for remat in ("none", "save_dots", "full")}
    print(f"temp bytes (dense): {sizes}")
    assert sizes["full"] < 0.5 * sizes["none"]
    assert sizes["full"] < sizes["save_dots"] < sizes["none"]


@pytest.mark.slow
def test_full_remat_lowers_xla_temp_memory_of_an_moe():
    moe_job = make_job(MoEConfig(num_experts=4, top_k=2, expert_dim=64), layers=4, hidden=64, seq=128)
    sizes = {remat: temp_bytes(with_train(moe_job, remat=remat)) for remat in ("none", "save_dots", "full")}
    print(f"temp bytes (moe): {sizes}")
    assert sizes["full"] < 0.5 * sizes["none"]
    assert sizes["full"] < sizes["save_dots"] < sizes["none"]


def test_unknown_remat_is_rejected():
    with pytest.raises(ValueError, match="remat"):
        model.remat_policy("everything")
    with pytest.raises(ValueError):
        TrainConfig(tokens=100, batch_size=1, remat="everything")


# --------------------------------------------------------------------------------------------
# Micro-batching


@pytest.mark.parametrize(
    "moe", [DENSE, MOE_RAGGED, MOE_QUANTILE], ids=["dense", "moe-ragged-sign-rule", "moe-dropless-quantile"]
)
def test_microbatches_give_the_whole_batch_step(moe):
    job = make_job(moe)
    micro = with_train(job, microbatch_size=BATCH // 4)
    state, _, _ = init_state(job)
    batch = random_batch(job)

    ((loss, aux), grads), (new, metrics) = step_and_grads(job, state, batch)
    ((loss_m, aux_m), grads_m), (new_m, metrics_m) = step_and_grads(micro, state, batch)
    assert float(loss_m) == pytest.approx(float(loss), rel=1e-6)
    assert_trees_close(grads_m, grads, rtol=1e-5, atol=1e-7)
    for key in ("lm_loss", "logit_z_loss", "router_z_loss", "routing_entropy", "expert_load_min", "expert_load_max"):
        assert float(aux_m[key]) == pytest.approx(float(aux[key]), rel=1e-6, abs=1e-7), key
    assert_trees_close(new_m["params"], new["params"], rtol=1e-5, atol=1e-6)
    assert_trees_close(new_m["opt_state"], new["opt_state"], rtol=1e-5, atol=1e-8)
    for key in metrics:
        assert float(metrics_m[key]) == pytest.approx(float(metrics[key]), rel=1e-5, abs=1e-7), key
    if moe is not None:
        np.testing.assert_array_equal(aux_m["router_stats"]["expert_counts"], aux["router_stats"]["expert_counts"])
        moved = np.abs(np.asarray(new["router_state"]["bias"]) - np.asarray(state["router_state"]["bias"])).max()
        assert moved > 5e-4  # the bias update did something (gamma = 1e-3), and the micro-batched one did the same
        if moe.balancing == "bias":  # integer counts -> the very same sign-rule step
            np.testing.assert_array_equal(new_m["router_state"]["bias"], new["router_state"]["bias"])
        else:  # quantile of the same per-token values, up to float rounding of the router GEMM
            np.testing.assert_allclose(new_m["router_state"]["bias"], new["router_state"]["bias"], atol=1e-6)


def _rows_of_microbatch(batch: jax.Array, index: int, count: int) -> jax.Array:
    return batch[index::count]


def test_capacity_buffers_and_switch_loss_are_per_microbatch():
    """Capacity buffers and the Switch aux loss depend on the whole batch: micro-batched, the step is the
    mean over micro-batches (rows i, i+4, ...) each computed on its own, which differs from one batch."""
    job = make_job(MOE_CAPACITY)
    micro = with_train(job, microbatch_size=BATCH // 4)
    state, _, _ = init_state(job)
    batch = random_batch(job)
    (loss, aux), _ = loss_and_grads(job, state, batch)
    (loss_m, aux_m), grads_m = loss_and_grads(micro, state, batch)
    one_microbatch = jax.jit(step_lib.make_loss_and_grads(make_job(MOE_CAPACITY, batch=BATCH // 4), model))
    parts = [one_microbatch(state["params"], state["router_state"], _rows_of_microbatch(batch, i, 4), 1.0)
             for i in range(4)]
    assert float(loss_m) == pytest.approx(np.mean([float(p[0][0]) for p in parts]), rel=1e-6)
    assert_trees_close(grads_m, jax.tree.map(lambda *g: sum(g) / 4, *[p[1] for p in parts]), rtol=1e-5, atol=1e-7)
    for key in ("drop_fraction", "router_aux_loss"):
        assert float(aux_m[key]) == pytest.approx(np.mean([float(p[0][1][key]) for p in parts]), rel=1e-6), key
        assert float(aux_m[key]) != pytest.approx(float(aux[key]), rel=1e-4), key


@pytest.mark.slow  # 10-18 s of compilation on 2 cores; CI runs the slow set
def test_microbatching_lowers_xla_temp_memory():
    sizes = {
        "whole": temp_bytes(MEMORY_JOB),
        "4 micro": temp_bytes(with_train(MEMORY_JOB, microbatch_size=BATCH // 4)),
        "4 micro + full remat": temp_bytes(with_train(MEMORY_JOB, microbatch_size=BATCH // 4, remat="full")),
    }
    print(f"temp bytes: {sizes}")
    assert sizes["4 micro"] < 0.5 * sizes["whole"]
    assert sizes["4 micro + full remat"] < sizes["4 micro"]


def test_microbatch_size_must_divide_the_batch_and_the_mesh():
    with pytest.raises(ValueError, match="not a multiple of train.microbatch_size"):
        TrainConfig(tokens=1000, batch_size=8, microbatch_size=3)
    with pytest.raises(ValueError, match="data-parallel"):
        TrainConfig(tokens=1000, batch_size=16, microbatch_size=2, mesh={"data": 4})
    assert TrainConfig(tokens=1000, batch_size=16, microbatch_size=4, mesh={"data": 4}).num_microbatches == 4
    assert TrainConfig(tokens=1000, batch_size=16).num_microbatches == 1


SHARDED_SCRIPT = textwrap.dedent(
    """
    import json, re, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from tests.test_trainer_remat_microbatch import MOE_NO_DROP, make_job, random_batch, with_train, init_state
    from trainer import model, sharding, step as step_lib

    def collectives(hlo):
        ops = ("all-to-all", "collective-permute", "all-gather", "all-reduce", "reduce-scatter")
        return {op: len(re.findall(r"\\b" + op + r"(-start)?\\(", hlo)) for op in ops}

    whole = make_job(MOE_NO_DROP, batch=16, mesh={"data": 4, "expert": 2})
    micro = with_train(whole, microbatch_size=8)  # 2 micro-batches, 1 row per device each
    state, _, _ = init_state(whole)
    params, router_state = state["params"], state["router_state"]
    batch = random_batch(whole)
    mesh = sharding.make_mesh(whole.train.mesh)
    p_sh, rep, b_sh = sharding.param_shardings(params, whole.model, mesh), sharding.replicated(mesh), sharding.batch_sharding(mesh)
    out = {"devices": jax.device_count()}

    # the split alone: which rows each device holds before and after
    sharded_batch = jax.device_put(batch, b_sh)
    split_fn = jax.jit(lambda b: step_lib.split_microbatches(b, 2, mesh), in_shardings=b_sh)
    split = split_fn(sharded_batch)
    rows_before = {s.device.id: {tuple(r) for r in np.asarray(s.data)} for s in sharded_batch.addressable_shards}
    rows_after = {s.device.id: {tuple(r) for r in np.asarray(s.data).reshape(-1, batch.shape[1])} for s in split.addressable_shards}
    out["split"] = {
        "collectives": collectives(split_fn.lower(sharded_batch).compile().as_text()),
        "rows_stay": all(rows_after[d] <= rows_before[d] for d in rows_before),
        "rows_per_device": sorted({len(v) for v in rows_after.values()}),
        "microbatch_0_is_even_rows": bool(np.array_equal(np.asarray(split[0]), np.asarray(batch)[0::2])),
    }

    ref = jax.jit(step_lib.make_loss_and_grads(make_job(MOE_NO_DROP, batch=16), model))(params, router_state, batch, 1.0)
    for name, job in (("whole", whole), ("micro", micro)):
        fn = jax.jit(step_lib.make_loss_and_grads(job, model), in_shardings=(p_sh, rep, b_sh, rep))
        compiled = fn.lower(params, router_state, batch, 1.0).compile()
        (loss, aux), grads = compiled(jax.device_put(params, p_sh), jax.device_put(router_state, rep), sharded_batch,
                                      jnp.float32(1.0))
        diffs = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref[1]))]
        out[name] = {
            "loss": float(loss), "ref_loss": float(ref[0][0]), "max_grad_diff": max(diffs),
            "collectives": collectives(compiled.as_text()),
            "expert_grad_spec": [str(a) for a in grads["blocks"]["000"]["ffn"]["experts"]["w_up"].sharding.spec],
        }
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.slow  # 10-18 s of compilation on 2 cores; CI runs the slow set
def test_microbatches_stay_on_their_devices_on_an_8_device_mesh():
    """On a data x expert mesh of 8 fake CPU devices: splitting the batch into micro-batches compiles to
    no collective at all and every device keeps its own rows; the micro-batched step compiles to the
    same collectives as the whole-batch step, keeps expert gradients expert-sharded, and matches the
    single-device values."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["devices"] == 8
    split = out["split"]
    assert sum(split["collectives"].values()) == 0, split["collectives"]
    assert split["rows_stay"] and split["rows_per_device"] == [2]  # 2 micro-batches x 1 row on each device
    assert split["microbatch_0_is_even_rows"]
    whole, micro = out["whole"], out["micro"]
    assert whole["collectives"]["all-reduce"] > 0  # the count sees collectives (gradient reductions)
    assert micro["collectives"] == whole["collectives"], (micro["collectives"], whole["collectives"])
    for r in (whole, micro):
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["max_grad_diff"] < 1e-5
        assert r["expert_grad_spec"][0] == "expert"


# --------------------------------------------------------------------------------------------
# End to end through trainer.train


def test_train_with_full_remat_and_microbatches_checkpoints_and_resumes_exactly(tmp_path, monkeypatch):
    from trainer.loop import default_compilation_cache_dir, train
    from trainer.metrics import read_metrics

    monkeypatch.setenv("LADDER_CACHE_DIR", str(tmp_path / "cache"))
    steps = 4
    job = make_job(MOE_NO_DROP, seq=32)
    job = job.model_copy(update={
        "data": job.data.model_copy(update={"max_tokens_per_source": 50_000}),
        "train": TrainConfig(tokens=steps * BATCH * 32, batch_size=BATCH, remat="full", microbatch_size=BATCH // 4,
                             log_every=1, eval_every=steps, eval_batches=1, eval_dispatch="as_trained",
                             checkpoint_every=2, wandb="disabled", progress=False,
                             compilation_cache_dir=default_compilation_cache_dir()),
    })

    def losses(run_dir):
        rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    straight = train(job, str(tmp_path / "straight"))
    assert straight.completed and straight.steps == steps and np.isfinite(straight.final_train_loss)
    assert sorted(os.listdir(tmp_path / "straight" / "checkpoints"))  # checkpoints were written

    stop_then_resume(job, str(tmp_path / "resumed"))
    assert losses(str(tmp_path / "resumed")) == losses(str(tmp_path / "straight"))
    first, last = losses(str(tmp_path / "straight"))[1], losses(str(tmp_path / "straight"))[steps]
    assert last < first
