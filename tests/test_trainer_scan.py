"""Scanned layers (``ModelConfig.scan_layers``, trainer/layers_scan.py) against today's unrolled loop.

- The plan: repeating units of equal signature are scanned, everything else unrolled, every layer once.
- The stacked layout holds the same weights (init is the unrolled draw, stacked), the same parameter
  groups, and its leading layer axis is never sharded.
- Loss, gradients, per-layer expert counts and the router-bias update equal the unrolled loop's (same
  weights) under remat none/full/save_dots and with micro-batching, for a dense model, an MoE with dense
  leading layers, and a sliding-window pattern whose global layers have fewer KV heads.
- What makes compile time flat: the lowered program of a scanned model does not grow with depth.
- ``trainer.train`` with scanned layers checkpoints and resumes exactly and logs the unrolled run's losses.
Shapes are tiny so each case takes seconds on 2 CPU cores.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import layers_scan, model, optim, sharding
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
from trainer.layers_scan import Segment, plan_segments
from tests.test_trainer_remat_microbatch import stop_then_resume

BATCH, SEQ = 4, 16

MODELS = {
    "dense": ModelConfig(hidden_dim=32, num_layers=3, num_heads=4, num_kv_heads=2, seq_len=SEQ),
    # layer 0 dense, layers 1-3 MoE (sign-rule bias, capacity dispatch with room to spare)
    "moe-dense-lead": ModelConfig(
        hidden_dim=32, num_layers=4, num_heads=4, seq_len=SEQ,
        moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, num_dense_layers=1, capacity_factor=2.0,
                      num_shared_experts=1),
    ),
    # local, global, local, global, global(last): local layers 2 KV heads in a 4-token window, global 1 KV head
    "sliding-gqa": ModelConfig(
        hidden_dim=32, num_layers=5, num_heads=4, num_kv_heads=2, global_kv_heads=1, sliding_window=4,
        global_every=2, seq_len=SEQ,
        moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, balancing="quantile", dispatch="dense"),
    ),
}


def scanned(cfg: ModelConfig) -> ModelConfig:
    return cfg.model_copy(update={"scan_layers": True})


def make_job(cfg: ModelConfig, **train) -> TrainJob:
    # Adam's epsilon 1e-3: see tests/test_trainer_remat_microbatch.py (keeps rounding-level gradient
    # differences from turning into visible first-update differences)
    return TrainJob(
        model=cfg,
        data=DataConfig(sources=[SourceConfig(name="code", kind="stdlib_code")], phases=[MixturePhase(weights={"code": 1.0})]),
        optimizer=OptimizerConfig(learning_rate=1e-2, epsilon=1e-3, schedule=ScheduleConfig(kind="constant", warmup=0)),
        train=TrainConfig(tokens=BATCH * SEQ * 10, batch_size=BATCH, **train),
    )


def assert_trees_close(a, b, *, rtol: float, atol: float) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------------
# The plan


def test_plan_scans_repeating_units_and_unrolls_the_rest():
    assert plan_segments("aaaa") == (Segment(0, 1, 4),)
    assert plan_segments("a") == (Segment(0, 1, 1),)
    # a leading dense layer, then three (local x3, global) units: one 4-layer body scanned 3 times (5 bodies)
    assert plan_segments("dlllglllglllg") == (Segment(0, 1, 1), Segment(1, 4, 3))
    # two units and a trailing global: scanning runs of equal layers traces fewer bodies (5) than the unit (6)
    assert plan_segments("dlllglllgg") == (
        Segment(0, 1, 1), Segment(1, 1, 3), Segment(4, 1, 1), Segment(5, 1, 3), Segment(8, 1, 2)
    )
    assert plan_segments("abcd") == tuple(Segment(i, 1, 1) for i in range(4))
    assert Segment(1, 4, 2).key == "scan001_2x4" and Segment(9, 1, 1).key == "009"
    assert Segment(1, 4, 2).layers(3) == [4, 8]


def test_a_deep_sliding_window_moe_compiles_seven_block_bodies_for_32_layers():
    """2 dense leading layers, then MoE; local x3 + global: 32 layers trace 7 block bodies, not 32."""
    cfg = ModelConfig(hidden_dim=32, num_layers=32, num_heads=4, num_kv_heads=2, global_kv_heads=1, sliding_window=8,
                      global_every=4, seq_len=SEQ, scan_layers=True,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, num_dense_layers=2))
    segments = model.layer_segments(cfg)
    covered = sorted(i for s in segments for j in range(s.unit) for i in s.layers(j))
    assert covered == list(range(32)) and segments[0].start == 0
    assert all(a.stop == b.start for a, b in zip(segments, segments[1:]))
    for s in segments:  # every repeat of a unit position is the same program
        for j in range(s.unit):
            assert len({model.layer_signature(cfg, i) for i in s.layers(j)}) == 1
    assert sum(s.unit for s in segments) == 7
    assert max(s.repeats for s in segments) == 7  # (local, local, local, global) x 7


# --------------------------------------------------------------------------------------------
# The stacked layout


@pytest.mark.parametrize("name", list(MODELS))
def test_stacked_layout_holds_the_unrolled_weights_and_groups(name):
    cfg = MODELS[name]
    params = model.init_params(cfg, jax.random.key(0))
    stacked = model.init_params(scanned(cfg), jax.random.key(0))
    assert jax.tree.map(jnp.shape, stacked) == jax.tree.map(
        tuple, model.param_shapes(scanned(cfg)), is_leaf=lambda x: isinstance(x, tuple)
    )
    assert_trees_close(model.unstack_params(stacked, scanned(cfg)), params, rtol=0, atol=0)
    assert_trees_close(model.stack_params(params, scanned(cfg)), stacked, rtol=0, atol=0)
    assert any(layers_scan.layer_axis_repeats(k) for k in (("blocks", key) for key in stacked["blocks"]))

    def elements_per_group(p):
        sizes: dict[str, int] = {}
        for leaf, group in zip(jax.tree.leaves(p), jax.tree.leaves(model.param_groups(p))):
            sizes[group] = sizes.get(group, 0) + leaf.size
        return sizes

    assert elements_per_group(stacked) == elements_per_group(params)


@pytest.mark.parametrize("rule", ["default", "zero3"])
def test_the_leading_layer_axis_is_never_sharded(rule):
    from trainer.memory import abstract_mesh

    if rule not in getattr(sharding, "PARAM_SHARDING_RULES", ("default",)):
        pytest.skip(f"this checkout has no {rule!r} sharding rule")
    extra = () if rule == "default" else (rule,)
    mesh = abstract_mesh({"data": 2, "fsdp": 2, "expert": 2})
    cfg = scanned(MODELS["moe-dense-lead"].model_copy(update={"hidden_dim": 64}))
    shapes = model.param_shapes(cfg)
    flat = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]
    checked = 0
    for path, shape in flat:
        names = tuple(str(p.key) for p in path)
        spec = tuple(sharding.param_partition_spec(names, shape, mesh, *extra))
        repeats = layers_scan.layer_axis_repeats(names)
        if repeats is None:
            continue
        assert shape[0] == repeats and (not spec or spec[0] is None), (names, spec)
        one_layer = ("blocks", "001", *names[3:])  # the first repeat's layer, unrolled
        assert spec[1:] == tuple(sharding.param_partition_spec(one_layer, shape[1:], mesh, *extra)), names
        checked += 1
    assert checked > 10
    # the rule really splits something here, so the comparison above is not between replicated specs only
    experts = sharding.param_partition_spec(("blocks", "scan001_3x1", "u0", "ffn", "experts", "w_up"), (3, 4, 64, 16),
                                            mesh, *extra)
    assert experts[0] is None and experts[1] == "expert"


# --------------------------------------------------------------------------------------------
# Same numbers as the unrolled loop


def random_batch(cfg: ModelConfig, seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (BATCH, cfg.seq_len + 1), 0, cfg.vocab_size)


def initial_state(job: TrainJob):
    cfg = job.model
    params = model.init_params(cfg, jax.random.key(0))
    groups = model.param_groups(params)
    optimizer = optim.build_optimizer(job.optimizer, params, groups)
    router_state = model.init_router_state(cfg)
    if router_state:  # a non-zero bias, so that selection depends on it
        router_state = {"bias": 0.01 * jax.random.normal(jax.random.key(7), router_state["bias"].shape)}
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params),
             "router_state": router_state}
    return state, optimizer, groups


def grads_and_step(job: TrainJob, batch):
    """(loss, aux), grads and one train step (new state, metrics) of ``job``, from one compiled program."""
    state, optimizer, groups = initial_state(job)
    grads_fn = step_lib.make_loss_and_grads(job, model)
    step_fn = step_lib.make_train_step(job, model, optimizer, groups)

    def both(state, batch):
        return grads_fn(state["params"], state["router_state"], batch, 1.0), step_fn(state, batch, False, 1.0)

    return jax.jit(both, compiler_options=step_lib.xla_compiler_options(job, "cpu"))(state, batch)


# Each case compiles four programs (~15 s of CPU on 2 shared cores): four run by default, the rest of the
# product (every model x remat none/full/save_dots and micro-batching) is marked slow.
FAST = {("dense", "none"), ("moe-dense-lead", "full")}
CASES = [(name, {"remat": remat}) for name in MODELS for remat in ("none", "full", "save_dots")]
CASES += [(name, {"microbatch_size": BATCH // 2, "remat": "full"}) for name in MODELS]
CASES = [
    pytest.param(name, train, id=f"{name}-{kind}", marks=() if (name, kind) in FAST else pytest.mark.slow)
    for name, train in CASES
    for kind in ["micro" if "microbatch_size" in train else train["remat"]]
]


@pytest.mark.parametrize(("name", "train"), CASES)
def test_scanned_layers_equal_the_unrolled_loop(name, train):
    cfg = MODELS[name]
    job, job_scan = make_job(cfg, **train), make_job(scanned(cfg), **train)
    batch = random_batch(cfg)
    ((loss, aux), grads), (new, metrics) = grads_and_step(job, batch)
    ((loss_s, aux_s), grads_s), (new_s, metrics_s) = grads_and_step(job_scan, batch)

    assert float(loss_s) == pytest.approx(float(loss), rel=1e-6)
    assert_trees_close(model.unstack_params(grads_s, job_scan.model), grads, rtol=1e-5, atol=1e-7)
    assert_trees_close(model.unstack_params(new_s["params"], job_scan.model), new["params"], rtol=1e-5, atol=1e-6)
    assert set(metrics_s) == set(metrics)
    for key in metrics:
        assert float(metrics_s[key]) == pytest.approx(float(metrics[key]), rel=1e-5, abs=1e-7), key
    if cfg.moe is None:
        return
    n_moe = len(model.moe_layer_indices(cfg))
    counts, counts_s = aux["router_stats"]["expert_counts"], aux_s["router_stats"]["expert_counts"]
    assert counts.shape == (n_moe, cfg.moe.num_experts)  # per MoE layer, in layer order, as the loop's
    np.testing.assert_array_equal(counts_s, counts)
    bias0 = initial_state(job)[0]["router_state"]["bias"]
    assert np.abs(np.asarray(new["router_state"]["bias"]) - np.asarray(bias0)).max() > 5e-4  # the update did something
    if cfg.moe.balancing == "bias":  # integer counts -> the very same sign-rule step
        np.testing.assert_array_equal(new_s["router_state"]["bias"], new["router_state"]["bias"])
    else:  # quantile of the same per-token values, up to float rounding
        np.testing.assert_allclose(new_s["router_state"]["bias"], new["router_state"]["bias"], atol=1e-6)


# --------------------------------------------------------------------------------------------
# Why compile time stays flat


def lowered_lines(cfg: ModelConfig) -> int:
    """Lines of the lowered (StableHLO) loss-and-gradient program: what XLA has to compile."""
    params = jax.eval_shape(lambda k: model.init_params(cfg, k), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((BATCH, cfg.seq_len + 1), jnp.int32)
    fn = jax.grad(lambda p, b: model.loss_fn(p, model.init_router_state(cfg), b, cfg)[0])
    return len(jax.jit(fn).lower(params, batch).as_text().splitlines())


def test_the_scanned_program_does_not_grow_with_depth():
    base = MODELS["moe-dense-lead"]
    sizes = {(layers, scan): lowered_lines(base.model_copy(update={"num_layers": layers, "scan_layers": scan}))
             for layers in (4, 16) for scan in (False, True)}
    print(f"lowered lines: {sizes}")
    # one dense layer + one scanned MoE body at any depth (a few lines per layer slice the stacked stats)
    assert sizes[(16, True)] < 1.1 * sizes[(4, True)]
    assert sizes[(16, False)] > 3 * sizes[(4, False)]  # the loop re-emits every layer


# --------------------------------------------------------------------------------------------
# End to end through trainer.train


@pytest.mark.slow  # about 25 s: three trainer.train runs
def test_train_with_scanned_layers_resumes_exactly_and_logs_the_unrolled_losses(tmp_path, monkeypatch):
    from trainer.loop import default_compilation_cache_dir, train
    from trainer.metrics import read_metrics

    monkeypatch.setenv("LADDER_CACHE_DIR", str(tmp_path / "cache"))
    steps, seq = 4, 32

    def job_of(cfg: ModelConfig) -> TrainJob:
        job = make_job(cfg.model_copy(update={"seq_len": seq}))
        return job.model_copy(update={
            "data": job.data.model_copy(update={"max_tokens_per_source": 50_000}),
            "train": TrainConfig(tokens=steps * BATCH * seq, batch_size=BATCH, log_every=1, eval_every=steps,
                                 eval_batches=1, checkpoint_every=2, wandb="disabled", progress=False,
                                 compilation_cache_dir=default_compilation_cache_dir()),
        })

    def losses(run_dir):
        rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    cfg = MODELS["moe-dense-lead"]
    job, job_scan = job_of(cfg), job_of(scanned(cfg))
    assert job_scan.identity() != job.identity()  # another parameter layout: another run directory
    unrolled = train(job, str(tmp_path / "unrolled"))
    straight = train(job_scan, str(tmp_path / "straight"))
    assert straight.completed and straight.steps == steps
    stop_then_resume(job_scan, str(tmp_path / "resumed"))
    assert losses(str(tmp_path / "resumed")) == losses(str(tmp_path / "straight"))
    scan_losses, loop_losses = losses(str(tmp_path / "straight")), losses(str(tmp_path / "unrolled"))
    assert sorted(scan_losses) == sorted(loop_losses) == list(range(1, steps + 1))
    for s in loop_losses:
        assert scan_losses[s] == pytest.approx(loop_losses[s], rel=1e-5), s
    assert unrolled.final_train_loss == pytest.approx(straight.final_train_loss, rel=1e-5)
