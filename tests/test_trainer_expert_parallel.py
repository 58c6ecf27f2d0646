"""Expert parallelism (``trainer.expert_parallel``): the shard_map + all-to-all MoE dispatch.

On 8 fake CPU devices (one subprocess that runs every mesh, because the device count must be set before
JAX starts), meshes expert=8, data=2 x expert=4, data=4 x expert=2 and data=2 x fsdp=2 x expert=2:

- "alltoall" gives the dense oracle's loss and gradients (fp32 tolerance; capacity large enough that
  nothing drops) and today's plain-jit "capacity" dispatch's; the compiled step has all-to-alls;
- with starved buffers the drop fraction is the whole batch's, counted per device (each device ranks its
  own tokens), which is what a numpy count over each device's block of tokens gives;
- the dropless ragged layout (offsets, second sort, ragged_dot, the exchange back) equals the dense
  oracle in outputs and gradients, with the ragged all-to-all replaced by a gather-based reference of its
  documented semantics (XLA:CPU cannot compile the primitive: pinned here, and the dispatch refuses);
- the whole train step on a mesh (``step.jit_train_step``) gives the single-device step's parameters and
  router-bias update for the sign rule and quantile balancing (exact and histogram), also with
  micro-batches and full remat.

The 2-process x 4-device run through a gang is ``test_expert_parallel_across_two_processes`` (slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

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
MESHES = ({"expert": 8}, {"data": 2, "expert": 4}, {"data": 4, "expert": 2}, {"data": 2, "fsdp": 2, "expert": 2})


def moe(**overrides) -> MoEConfig:
    """E=8, k=2; capacity_factor 4 = E/k: C = T_local, so no buffer ever overflows."""
    base = dict(num_experts=8, top_k=2, expert_dim=16, num_shared_experts=1, latent_dim=24, capacity_factor=4.0)
    return MoEConfig(**{**base, **overrides})


def make_job(moe_cfg: MoEConfig, *, batch: int = 16, **train) -> TrainJob:
    # Adam's epsilon 1e-3: its first update is g / (|g| + eps), which at eps = 1e-8 turns float-rounding
    # differences of near-zero gradients into visible parameter differences.
    return TrainJob(
        model=ModelConfig(hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=16, moe=moe_cfg),
        data=DataConfig(sources=[SourceConfig(name="code", kind="stdlib_code")], phases=[MixturePhase(weights={"code": 1.0})]),
        optimizer=OptimizerConfig(learning_rate=1e-2, epsilon=1e-3, schedule=ScheduleConfig(kind="constant", warmup=0)),
        train=TrainConfig(tokens=batch * 16 * 10, batch_size=batch, **train),
    )


SCRIPT = textwrap.dedent(
    """
    import functools, json, sys, time
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from tests.test_trainer_expert_parallel import MESHES, make_job, moe
    from trainer import expert_parallel as ep, model, moe as moe_lib, optim, sharding, step as step_lib

    PART = sys.argv[1]  # "fast": dispatch level and one train step; "slow": the whole model on every mesh
    t0 = time.time()

    def mark(what):
        print(f"{time.time() - t0:7.1f}s {what}", file=sys.stderr, flush=True)

    def max_diff(a, b):
        return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    def scale(a):
        return max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(a))

    def on_mesh(mesh, fn):
        def traced(*args):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fn(*args)
        return traced

    def a2a_count(compiled):
        return compiled.as_text().count(" all-to-all(")

    out = {"devices": jax.device_count(), "dispatch": {}, "loss": {}, "drops": {}, "steps": {}}
    job = make_job(moe())
    cfg = job.model
    params = jax.tree.map(np.asarray, model.init_params(cfg, jax.random.key(0)))
    router_state = {"bias": np.asarray(0.01 * jax.random.normal(jax.random.key(7), (2, 8)))}
    batch = np.asarray(jax.random.randint(jax.random.key(1), (16, cfg.seq_len + 1), 0, cfg.vocab_size))

    if PART == "fast":
        # one MoE layer's dispatch, gradients through x, the router logits (combine weights) and the experts
        moe_cfg = cfg.moe
        x = jax.random.normal(jax.random.key(3), (256, 24))
        logits = jax.random.normal(jax.random.key(4), (256, 8))
        experts = params["blocks"]["000"]["ffn"]["experts"]

        def dispatch_loss(fn):
            def f(x, logits, e):
                y, drop = fn(x, moe_lib.route(logits, jnp.zeros(8), moe_cfg), e, moe_cfg)
                return jnp.sum(jnp.sin(y)), (y, drop)
            return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

        (_, (y_ref, _)), g_ref = jax.jit(dispatch_loss(moe_lib.dispatch_dense))(x, logits, experts)
        out["y_scale"], out["grad_scale"] = scale(y_ref), scale(g_ref)
        reference = functools.partial(ep.dispatch_ragged_alltoall, exchange=ep.ragged_all_to_all_by_gather)
        backends = {"alltoall": ep.dispatch_alltoall, "ragged_reference": reference, "capacity": moe_lib.dispatch_capacity}
        for axes in MESHES:
            mesh = sharding.make_mesh(axes)
            expert_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert"))
            shardings = (sharding.batch_sharding(mesh),) * 2 + (expert_sharding,)
            row = {}
            for name, fn in backends.items():
                compiled = jax.jit(on_mesh(mesh, dispatch_loss(fn)), in_shardings=shardings).lower(x, logits, experts).compile()
                (_, (y, drop)), g = compiled(x, logits, experts)
                row[name] = {"y_diff": max_diff(y, y_ref), "grad_diff": max_diff(g, g_ref), "drop": float(drop),
                             "all_to_all": a2a_count(compiled)}
            out["dispatch"][json.dumps(axes)] = row
            mark(f"dispatch {axes}")

        # starved buffers: each device ranks its own tokens; the drop fraction is the whole batch's
        tight = moe(capacity_factor=1.0)
        mesh = sharding.make_mesh({"data": 2, "expert": 4})
        def drops(fn):
            def f(x, logits, e):
                routing = moe_lib.route(logits, jnp.zeros(8), tight)
                return fn(x, routing, e, tight)[1], routing.expert_ids_TxK
            return f
        shardings = (sharding.batch_sharding(mesh),) * 2 + (sharding.replicated(mesh),)
        for name in ("alltoall", "capacity"):
            drop, ids = jax.jit(on_mesh(mesh, drops(backends[name])), in_shardings=shardings)(x, logits, experts)
            out["drops"][name] = {"drop": float(drop), "ids": np.asarray(ids).tolist()}

        try:
            jax.jit(on_mesh(mesh, dispatch_loss(ep.dispatch_ragged_alltoall)))(x, logits, experts)  # refused when traced
            out["refusal"] = None
        except ValueError as err:
            out["refusal"] = str(err)
        try:  # the primitive itself, compiled for XLA:CPU
            spec = jax.sharding.PartitionSpec(("data", "expert"))
            ones = jnp.ones(4, jnp.int32)
            f = jax.shard_map(lambda a: jax.lax.ragged_all_to_all(a, jnp.zeros_like(a), jnp.arange(4, dtype=jnp.int32), ones,
                              jnp.full(4, 1, jnp.int32) * jax.lax.axis_index("expert"), ones, axis_name="expert"),
                              mesh=mesh, in_specs=spec, out_specs=spec)
            jax.jit(f).lower(jnp.ones((32, 2))).compile()
            out["cpu_primitive_error"] = None
        except Exception as err:
            out["cpu_primitive_error"] = str(err)
        mark("drops and refusals")

    if PART == "slow":
        def loss_and_grads(dispatch):
            def fn(p, s, b):
                (loss, aux), g = jax.value_and_grad(lambda q: model.loss_fn(q, s, b, cfg, dispatch=dispatch), has_aux=True)(p)
                return loss, aux["drop_fraction"], aux["router_stats"]["expert_counts"], g
            return fn

        ref_loss, _, ref_counts, ref_grads = jax.jit(loss_and_grads("dense"))(params, router_state, batch)
        out["ref_loss"], out["grad_scale"] = float(ref_loss), scale(ref_grads)
        for axes in MESHES:
            mesh = sharding.make_mesh(axes)
            p_sh, rep, b_sh = sharding.param_shardings(params, cfg, mesh), sharding.replicated(mesh), sharding.batch_sharding(mesh)
            row = {}
            for dispatch in ("alltoall", "capacity"):
                compiled = jax.jit(on_mesh(mesh, loss_and_grads(dispatch)), in_shardings=(p_sh, rep, b_sh)).lower(
                    params, router_state, batch).compile()
                loss, drop, counts, grads = compiled(params, router_state, batch)
                row[dispatch] = {"loss": float(loss), "drop": float(drop), "grad_diff": max_diff(grads, ref_grads),
                                 "counts_equal": bool(np.array_equal(np.asarray(counts), np.asarray(ref_counts))),
                                 "all_to_all": a2a_count(compiled), "grads": grads}
            row["alltoall_vs_capacity_grad_diff"] = max_diff(row["alltoall"].pop("grads"), row["capacity"].pop("grads"))
            out["loss"][json.dumps(axes)] = row
            mark(f"loss {axes}")

    # the whole train step on a mesh (step.jit_train_step) vs one device: params, router-bias update, loss
    def single_device_step(job):
        groups = model.param_groups(params)
        optimizer = optim.build_optimizer(job.optimizer, params, groups)
        state = {"step": np.int32(0), "params": params, "opt_state": optimizer.init(params), "router_state": router_state}
        fn = step_lib.make_train_step(job, model, optimizer, groups)
        return jax.jit(fn, compiler_options=step_lib.xla_compiler_options(job, "cpu"))(state, batch, False, 1.0)

    def mesh_step(job):
        jitted = step_lib.jit_train_step(job, model, sharding.make_mesh(job.train.mesh))
        state = {"step": np.int32(0), "params": params, "opt_state": jax.tree.map(np.asarray, jitted.optimizer.init(params)),
                 "router_state": router_state}
        state = jax.device_put(state, jitted.state_shardings)
        lowered = jitted.train_step.lower(state, batch, False, 1.0)
        compiled = lowered.compile()
        traced = {"all_to_all": a2a_count(compiled), "shard_maps": lowered.as_text().count("sdy.manual_computation")}
        return compiled(state, jax.device_put(batch, jitted.batch_sharding), False, 1.0), traced

    cases = {
        "quantile_micro_remat": dict(moe_cfg=moe(balancing="quantile"), train={"microbatch_size": 8, "remat": "full"}),
    } if PART == "fast" else {
        "bias": dict(moe_cfg=moe(balancing="bias", bias_update_rate=0.01), train={}),
        "quantile": dict(moe_cfg=moe(balancing="quantile"), train={}),
        "quantile_bins": dict(moe_cfg=moe(balancing="quantile", quantile_bins=64), train={}),
        "bias_micro": dict(moe_cfg=moe(balancing="bias", bias_update_rate=0.01), train={"microbatch_size": 8}),
    }
    for name, case in cases.items():
        ref_state, ref_metrics = single_device_step(make_job(case["moe_cfg"].model_copy(update={"dispatch": "dense"})))
        ep_job = make_job(case["moe_cfg"].model_copy(update={"dispatch": "alltoall"}),
                          mesh={"data": 2, "expert": 4}, **case["train"])
        (state, metrics), traced = mesh_step(ep_job)
        out["steps"][name] = {
            "loss": float(metrics["train/loss"]), "ref_loss": float(ref_metrics["train/loss"]),
            "param_diff": max_diff(state["params"], ref_state["params"]),
            "param_change": max_diff(ref_state["params"], params),
            "bias_diff": max_diff(state["router_state"], ref_state["router_state"]),
            "bias_change": max_diff(ref_state["router_state"], router_state),
            "drop": float(metrics["train/router/drop_fraction"]),
            **traced,
        }
        mark(f"step {name}")

    if PART == "fast":  # the eval loss traces in the mesh too: "as_trained" evaluates with the all-to-all dispatch
        def eval_job(dispatch, **train):
            j = make_job(moe(dispatch=dispatch), **train)
            return j.model_copy(update={"train": j.train.model_copy(update={"eval_dispatch": "as_trained"})})
        mesh = sharding.make_mesh({"data": 2, "expert": 4})
        as_trained = eval_job("alltoall", mesh={"data": 2, "expert": 4})
        p_sh = sharding.param_shardings(params, as_trained.model, mesh)
        args = (jax.device_put(params, p_sh), router_state, jax.device_put(batch, sharding.batch_sharding(mesh)))
        lowered = step_lib.jit_eval_loss(as_trained, model, mesh).lower(*args)
        compiled = lowered.compile()
        ref = step_lib.jit_eval_loss(eval_job("dense"), model, sharding.make_mesh({"data": 1}))(params, router_state, batch)
        out["eval"] = {"loss": float(compiled(*args)), "ref_loss": float(ref), "all_to_all": a2a_count(compiled),
                       "shard_maps": lowered.as_text().count("sdy.manual_computation")}
        mark("eval as trained")
    print("RESULT" + json.dumps(out))
    """
)


def run_script(part: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, part], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


@pytest.fixture(scope="module")
def fast() -> dict:
    return run_script("fast")


@pytest.fixture(scope="module")
def slow() -> dict:
    return run_script("slow")


def test_alltoall_and_the_ragged_layout_equal_the_dense_oracle_on_every_mesh(fast):
    """One MoE layer: outputs and gradients (x, router logits, experts) on four meshes of 8 devices."""
    assert fast["devices"] == 8
    assert set(fast["dispatch"]) == {json.dumps(m) for m in MESHES}
    for axes, row in fast["dispatch"].items():
        for name in ("alltoall", "ragged_reference", "capacity"):
            assert row[name]["y_diff"] < 1e-6 * fast["y_scale"], (axes, name, row[name])
            assert row[name]["grad_diff"] < 1e-6 * fast["grad_scale"], (axes, name, row[name])
            assert row[name]["drop"] == 0.0
        assert row["alltoall"]["all_to_all"] >= 4, (axes, row)  # there and back, forward and backward


def _drops(ids, devices: int, capacity: int, experts: int = 8) -> float:
    """Fraction of assignments whose rank among their device's assignments to the same expert is >= capacity."""
    dropped = 0
    for block in ids.reshape(devices, -1):
        seen = [0] * experts
        for e in block:
            dropped += seen[e] >= capacity
            seen[e] += 1
    return dropped / ids.size


def test_each_device_fills_buffers_sized_by_its_own_tokens(fast):
    import numpy as np

    a2a, cap = fast["drops"]["alltoall"], fast["drops"]["capacity"]
    ids = np.asarray(a2a["ids"])  # [256 tokens, k=2] on 8 devices; capacity_factor 1.0: C = T * k / E
    assert ids.shape == (256, 2) and np.array_equal(ids, np.asarray(cap["ids"]))
    assert a2a["drop"] == pytest.approx(_drops(ids, devices=8, capacity=32 * 2 // 8), abs=1e-7)
    assert cap["drop"] == pytest.approx(_drops(ids, devices=1, capacity=256 * 2 // 8), abs=1e-7)
    assert a2a["drop"] > cap["drop"] > 0  # 8 small buffers overflow more often than one global one


def test_ragged_alltoall_is_refused_on_cpu_with_the_compilers_reason(fast):
    from trainer.expert_parallel import CPU_RAGGED_REFUSAL

    assert fast["cpu_primitive_error"] and CPU_RAGGED_REFUSAL in fast["cpu_primitive_error"]
    assert fast["refusal"] and CPU_RAGGED_REFUSAL in fast["refusal"] and "dispatch='alltoall'" in fast["refusal"]


def _assert_step_matches(row: dict) -> None:
    assert row["loss"] == pytest.approx(row["ref_loss"], rel=1e-6)
    assert row["param_change"] > 1e-3 and row["param_diff"] < 1e-3 * row["param_change"], row
    assert row["bias_change"] > 1e-3, row  # the balancer moved the bias ...
    assert row["bias_diff"] < 1e-5, row  # ... exactly as on one device (whole-batch counts / quantiles)
    assert row["drop"] == 0.0
    assert row["all_to_all"] > 0
    assert row["shard_maps"] >= 2, row  # the step traced in the mesh's context: each MoE layer is a shard_map


def test_train_step_with_microbatches_and_remat_equals_the_single_device_step(fast):
    """jit_train_step on data=2 x expert=4, quantile balancing, 2 micro-batches, full remat, against one
    device's un-split dense-oracle step."""
    _assert_step_matches(fast["steps"]["quantile_micro_remat"])


def test_eval_as_trained_runs_the_alltoall_dispatch_on_the_mesh(fast):
    """trainer.step.jit_eval_loss (what the loop evaluates with) traces in the mesh's context: with
    eval_dispatch="as_trained" the expert-parallel model evaluates through its all-to-all, equal to the dense oracle."""
    assert fast["eval"]["shard_maps"] >= 2, fast["eval"]  # each MoE layer is a shard_map (outside the mesh: none)
    assert fast["eval"]["all_to_all"] > 0
    assert fast["eval"]["loss"] == pytest.approx(fast["eval"]["ref_loss"], rel=1e-6)


@pytest.mark.slow
def test_whole_model_loss_and_gradients_equal_the_dense_oracle_on_every_mesh(slow):
    assert set(slow["loss"]) == {json.dumps(m) for m in MESHES}
    tol = 1e-5 * slow["grad_scale"]
    for axes, row in slow["loss"].items():
        a2a, cap = row["alltoall"], row["capacity"]
        assert a2a["loss"] == pytest.approx(slow["ref_loss"], rel=1e-6), axes
        assert a2a["grad_diff"] < tol, (axes, a2a["grad_diff"])
        assert a2a["drop"] == 0.0 and cap["drop"] == 0.0
        assert a2a["counts_equal"] and cap["counts_equal"], axes  # the balancers' load: whole batch, exact
        assert cap["loss"] == pytest.approx(a2a["loss"], rel=1e-6)
        assert row["alltoall_vs_capacity_grad_diff"] < tol, axes
        assert a2a["all_to_all"] >= 2 * 2 * 2, axes  # 2 MoE layers x (there, back) x (forward, backward)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bias", "quantile", "quantile_bins", "bias_micro"])
def test_train_step_on_a_mesh_equals_the_single_device_step(slow, case):
    _assert_step_matches(slow["steps"][case])


def test_dispatch_values_and_a_mesh_that_cannot_hold_the_experts():
    assert moe(dispatch="alltoall").dispatch == "alltoall"
    assert MoEConfig().dispatch == "capacity"  # the default (and so every fingerprint) is unchanged
    job = make_job(moe(dispatch="alltoall"), mesh={"data": 4, "expert": 2})
    assert job.train.mesh == {"data": 4, "expert": 2}
    with pytest.raises(ValueError, match=r"train.mesh\['expert'\]=3"):
        make_job(moe(dispatch="alltoall"), batch=24, mesh={"expert": 3})
    make_job(moe(dispatch="capacity"), batch=24, mesh={"expert": 3})  # plain jit replicates what does not divide


GANG_EXPERIMENT = '''
from ladder import ExperimentSpec, ResourceSpec, TrainStep
from trainer.config import (DataConfig, MixturePhase, ModelConfig, MoEConfig, OptimizerConfig, ScheduleConfig,
                            SourceConfig, TrainConfig)


def spec(hosts, dispatch, mesh):
    return ExperimentSpec(
        model=ModelConfig(hidden_dim=32, num_layers=2, num_heads=2, seq_len=16,
                          moe=MoEConfig(num_experts=8, top_k=2, expert_dim=16, capacity_factor=4.0, dispatch=dispatch)),
        data=DataConfig(sources=[SourceConfig(name="code", kind="stdlib_code")], phases=[MixturePhase(weights={"code": 1.0})],
                        max_tokens_per_source=100_000),
        optimizer=OptimizerConfig(learning_rate=1e-2, schedule=ScheduleConfig(kind="cosine", warmup=2)),
        train=TrainConfig(tokens=8 * 16 * 16, batch_size=16, eval_every=8, eval_batches=1, log_every=1,
                          wandb="disabled", progress=False, mesh=mesh),
        resources=ResourceSpec(cpus=1, hosts=hosts, cpu_devices_per_host=8 // hosts),
    )


oracle = TrainStep(name="one-process-dense", spec=spec(1, "dense", {"data": 8}))
one = TrainStep(name="one-process-alltoall", spec=spec(1, "alltoall", {"expert": 8}))
two = TrainStep(name="two-process-alltoall", spec=spec(2, "alltoall", {"expert": 8}))
'''


@pytest.mark.slow
def test_expert_parallel_across_two_processes(tmp_path):
    """2 processes x 4 CPU devices (gloo) through a gang, expert=8 (the all-to-all crosses the processes):
    the same losses, step by step, as one process with 8 devices, and as the dense oracle on one process."""
    from pathlib import Path

    import numpy as np

    from trainer.metrics import read_metrics

    experiment, root = tmp_path / "ep_gang.py", tmp_path / "root"
    experiment.write_text(GANG_EXPERIMENT)
    result = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", str(experiment), "--root", str(root)],
                            capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    def losses(name: str) -> list[float]:
        [run_dir] = Path(root).glob(f"runs/{name}-*")
        rows = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if "train/loss" in r]
        assert [r["step"] for r in rows] == list(range(1, 9))
        assert all(r.get("train/router/drop_fraction", 0.0) == 0.0 for r in rows)
        return [r["train/loss"] for r in rows]

    oracle, one, two = losses("one-process-dense"), losses("one-process-alltoall"), losses("two-process-alltoall")
    np.testing.assert_allclose(two, one, rtol=1e-5)
    np.testing.assert_allclose(one, oracle, rtol=1e-4)


def test_without_a_mesh_the_dispatches_are_todays_single_device_ones():
    """Traced outside any mesh (a plain jit, e.g. an eval with eval_dispatch='as_trained'), the whole batch
    is one shard: "alltoall" is "capacity" and "ragged_alltoall" is "ragged", even with drops."""
    import jax
    import numpy as np

    from trainer import model

    cfg = make_job(moe(capacity_factor=1.0)).model
    params = model.init_params(cfg, jax.random.key(0))
    state = model.init_router_state(cfg)
    batch = jax.random.randint(jax.random.key(1), (4, cfg.seq_len + 1), 0, cfg.vocab_size)

    def loss(dispatch):
        return jax.jit(lambda p: model.loss_fn(p, state, batch, cfg, dispatch=dispatch))(params)

    for ep_name, today in (("alltoall", "capacity"), ("ragged_alltoall", "ragged")):
        (ep_loss, ep_aux), (ref_loss, ref_aux) = loss(ep_name), loss(today)
        assert float(ep_loss) == float(ref_loss)
        assert float(ep_aux["drop_fraction"]) == float(ref_aux["drop_fraction"])
    assert float(loss("alltoall")[1]["drop_fraction"]) > 0
