"""MuonH / AdamH / Adam (trainer/muon.py): Newton-Schulz gives near-orthogonal updates, every MuonH and AdamH
matrix keeps its Frobenius norm, the step is Marin's formula, the groups and LRs are Marin's, the sharded
step (8 fake devices) equals the single-device step with the experts orthogonalised where they live, and a
MuonH run resumes from its checkpoint bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from trainer import model, muon, optim
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

TINY = ModelConfig(
    hidden_dim=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    seq_len=16,
    moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, num_shared_experts=1, latent_dim=24, capacity_factor=2.0),
)
MUONH = OptimizerConfig(name="muonh", learning_rate=0.02, weight_decay=0.0, max_grad_norm=None, epsilon=1e-3,
                        schedule=ScheduleConfig(kind="constant", warmup=0))


def setup(cfg: ModelConfig = TINY, opt_cfg: OptimizerConfig = MUONH):
    params = model.init_params(cfg, jax.random.key(0))
    groups = model.param_groups(params)
    return params, groups, optim.build_optimizer(opt_cfg, params, groups)


@jax.jit
def grads_of(params, seed):
    batch = jax.random.randint(jax.random.key(seed), (4, TINY.seq_len + 1), 0, TINY.vocab_size)
    state = model.init_router_state(TINY)
    return jax.grad(lambda p: model.loss_fn(p, state, batch, TINY)[0])(params)


# --------------------------------------------------------------------------------------------
# Newton-Schulz


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48), (8, 200)])
def test_newton_schulz_gives_singular_values_near_one(shape):
    x = jax.random.normal(jax.random.key(0), shape) * 3.0
    singular = np.linalg.svd(np.asarray(muon.newton_schulz(x)), compute_uv=False)
    assert singular.min() > 0.75 and singular.max() < 1.2, singular
    # the input's singular values spread over a factor of ~10 (square) or more; NS brings them to about 1
    assert np.ptp(singular) < 0.35


def test_newton_schulz_in_bfloat16_as_marin_runs_it():
    x = jax.random.normal(jax.random.key(0), (64, 32)) * 3.0
    y = muon.newton_schulz(x, dtype=jnp.bfloat16)
    assert y.dtype == jnp.float32  # the input's dtype comes back
    singular = np.linalg.svd(np.asarray(y), compute_uv=False)
    assert singular.min() > 0.75 and singular.max() < 1.2, singular
    assert float(jnp.max(jnp.abs(y - muon.newton_schulz(x)))) > 0  # it did run in bf16


def test_newton_schulz_equals_optax_quintic_orthogonaliser():
    """Same iteration as optax.contrib's (private) orthogonaliser with its 'dion' preset = Marin's quintic."""
    from optax.contrib import _muon as optax_muon

    assert tuple(map(tuple, optax_muon._DION_NS_COEFFS)) == muon.QUINTIC_COEFFICIENTS
    for shape in [(40, 24), (24, 40)]:
        x = jax.random.normal(jax.random.key(3), shape)
        ours = muon.newton_schulz(x)
        ref = optax_muon.orthogonalize_via_newton_schulz(x, jnp.asarray(optax_muon._DION_NS_COEFFS), 5)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=1e-5)


def test_expert_stack_is_orthogonalised_matrix_by_matrix_and_heads_form_one_matrix():
    stack = jax.random.normal(jax.random.key(0), (3, 24, 16))
    dims = muon.matrix_dims(("blocks", "000", "ffn", "experts", "w_up"), 3)
    batched = muon.orthogonalize(stack, dims)
    for e in range(3):
        np.testing.assert_allclose(np.asarray(batched[e]), np.asarray(muon.newton_schulz(stack[e])), atol=1e-6)
    wq = jax.random.normal(jax.random.key(1), (32, 4, 8))
    dims = muon.matrix_dims(("blocks", "000", "attention", "wq"), 3)
    assert dims == MuonDimensionNumbers(reduction_axis=(0,), output_axis=(1, 2))
    as_matrix = muon.newton_schulz(wq.reshape(32, 32)).reshape(32, 4, 8)
    np.testing.assert_allclose(np.asarray(muon.orthogonalize(wq, dims)), np.asarray(as_matrix), atol=1e-6)
    wo = jax.random.normal(jax.random.key(2), (4, 8, 32))
    dims = muon.matrix_dims(("blocks", "000", "attention", "wo"), 3)
    as_matrix = muon.newton_schulz(wo.reshape(32, 32)).reshape(4, 8, 32)
    np.testing.assert_allclose(np.asarray(muon.orthogonalize(wo, dims)), np.asarray(as_matrix), atol=1e-6)


# --------------------------------------------------------------------------------------------
# Groups, norms, the formula, learning rates


def test_groups_are_marins():
    params, groups, _ = setup()
    labels = muon.optimizer_labels(params, groups)
    block = labels["blocks"]["000"]
    assert labels["lm_head"] == "adamh"
    assert labels["embed"] == labels["final_norm"] == block["attn_norm"] == block["ffn"]["router"] == "adam"
    assert {block["attention"][k] for k in ("wq", "wk", "wv", "wo")} == {"muonh"}
    assert {block["ffn"]["experts"][k] for k in ("w_gate", "w_up", "w_down")} == {"muonh"}
    assert block["ffn"]["latent_down"] == block["ffn"]["shared"]["w_up"] == "muonh"
    with pytest.raises(ValueError, match="group 'mystery'.*GROUP_OPTIMIZER"):
        muon.optimizer_labels({"w": jnp.zeros((2, 2))}, {"w": "mystery"})


def test_muonh_and_adamh_keep_every_matrix_norm_and_move_by_the_learning_rate():
    params, groups, opt = setup()
    labels = muon.optimizer_labels(params, groups)
    norms0 = muon.frobenius_norms(params, labels)
    state = opt.init(params)
    update = jax.jit(opt.update)
    p = params
    for seed in range(5):
        updates, state = update(grads_of(p, seed), state, p)
        moved = muon.frobenius_norms(updates, labels)
        p = optax.apply_updates(p, updates)
        # each matrix (each expert separately) moves by about lr of its norm: the step is orthogonal-ish to W
        ratios = [np.asarray(s / n) for s, n in zip(jax.tree.leaves(moved), jax.tree.leaves(norms0))]
        assert all(np.all((r > 0.5 * MUONH.learning_rate) & (r < 1.5 * MUONH.learning_rate)) for r in ratios)
    for before, after in zip(jax.tree.leaves(norms0), jax.tree.leaves(muon.frobenius_norms(p, labels))):
        np.testing.assert_allclose(np.asarray(after), np.asarray(before), rtol=2e-6)
    # the Adam group is not on a sphere: the embedding's norm changed
    assert abs(float(jnp.linalg.norm(p["embed"])) - float(jnp.linalg.norm(params["embed"]))) > 1e-4
    expert_norms = muon.frobenius_norms(params, labels)["blocks"]["001"]["ffn"]["experts"]["w_up"]
    assert expert_norms.shape == (TINY.moe.num_experts,)  # one radius per expert


def _numpy_ns(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    w = x.T if tall else x
    w = w / (np.linalg.norm(w) + 1e-8)
    for a, b, c in muon.QUINTIC_COEFFICIENTS:
        gram = w @ w.T
        w = a * w + (b * gram + c * gram @ gram) @ w
    return w.T if tall else w


def test_muonh_step_is_marins_formula():
    """Three steps on one matrix against Marin's MuonH written out in numpy: buf = mu buf + g,
    u = NS(mu buf + g), W' = W - lr ||W|| u / ||u||, W' <- ||W|| W' / ||W'||."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(12, 20)).astype(np.float32)
    params, groups = {"w": jnp.asarray(w)}, {"w": "dense_ffn"}
    opt = optim.build_optimizer(MUONH, params, groups)
    state, p = opt.init(params), params
    ref_w, buf, lr, mu = w.astype(np.float64), np.zeros_like(w, dtype=np.float64), MUONH.learning_rate, 0.95
    for _ in range(3):
        g = rng.normal(size=w.shape).astype(np.float32)
        updates, state = opt.update({"w": jnp.asarray(g)}, state, p)
        p = optax.apply_updates(p, updates)
        buf = mu * buf + g
        u = _numpy_ns(mu * buf + g)
        radius = np.linalg.norm(ref_w)
        moved = ref_w - lr * radius * u / np.linalg.norm(u)
        ref_w = moved / np.linalg.norm(moved) * radius
    np.testing.assert_allclose(np.asarray(p["w"]), ref_w, atol=2e-5)


def test_adam_group_runs_at_three_thirteenths_and_follows_the_poked_learning_rate():
    """Adam's first update from a zero state is -lr * g / (|g| + eps): the Adam group's applied LR is visible."""
    opt_cfg = MUONH.model_copy(update={"epsilon": 1e-12})
    params = {"embed": jnp.zeros((4, 3)), "lm_head": jnp.ones((3, 4))}
    groups = {"embed": "embedding", "lm_head": "lm_head"}
    opt = optim.build_optimizer(opt_cfg, params, groups)
    state = opt.init(params)
    assert float(optim.learning_rate_of(state)) == pytest.approx(opt_cfg.learning_rate)
    grads = {"embed": jnp.ones((4, 3)), "lm_head": jnp.ones((3, 4))}
    for lr in (0.013, 0.0026):
        updates, new_state = opt.update(grads, optim.with_learning_rate(state, lr), params)
        assert float(updates["embed"][0, 0]) == pytest.approx(-lr * 3 / 13, rel=1e-5)
        assert float(optim.learning_rate_of(new_state)) == pytest.approx(lr)
    explicit = optim.build_optimizer(opt_cfg.model_copy(update={"adam_learning_rate": 0.001}), params, groups)
    updates, _ = explicit.update(grads, explicit.init(params), params)
    assert float(updates["embed"][0, 0]) == pytest.approx(-0.001, rel=1e-5)


def test_muonh_fields_are_out_of_identity_at_default_and_refused_without_muonh():
    from trainer.config import identity_payload

    assert set(identity_payload(OptimizerConfig())) == {
        "learning_rate", "beta1", "beta2", "epsilon", "weight_decay", "max_grad_norm", "schedule"
    }
    assert identity_payload(OptimizerConfig(name="muonh"))["name"] == "muonh"
    with pytest.raises(ValueError, match="optimizer.ns_steps is only read by optimizer.name='muonh'"):
        OptimizerConfig(ns_steps=3)


# --------------------------------------------------------------------------------------------
# Sharded step, and no gather of the experts

SHARDED_SCRIPT = textwrap.dedent(
    """
    import json, re
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tests.test_trainer_muon import sharded_job
    from trainer import model, sharding, step as step_lib

    def collectives(hlo):
        ops = ("all-to-all", "collective-permute", "all-gather", "all-reduce", "reduce-scatter")
        return {op: len(re.findall(r"\\b" + op + r"(-start)?\\(", hlo)) for op in ops}

    def run(job, mesh, steps=3):
        jitted = step_lib.jit_train_step(job, model, mesh)
        params = model.init_params(job.model, jax.random.key(0))
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": jitted.optimizer.init(params),
                 "router_state": jitted.router_state0}
        state = jax.device_put(state, jitted.state_shardings)
        for i in range(steps):
            batch = jax.random.randint(jax.random.key(10 + i), (job.train.batch_size, job.model.seq_len + 1), 0,
                                       job.model.vocab_size)
            state, metrics = jitted.train_step(state, jax.device_put(batch, jitted.batch_sharding), False, 1.0)
        return state, metrics

    out = {"devices": jax.device_count(), "meshes": {}}
    ref, ref_metrics = run(sharded_job(None), sharding.make_mesh({"data": 1}, devices=jax.devices()[:1]))
    ref_params = [np.asarray(leaf) for leaf in jax.tree.leaves(ref["params"])]
    for axes, micro in (({"data": 2, "fsdp": 2, "expert": 2}, None), ({"expert": 8}, 8)):
        job = sharded_job(micro)
        state, metrics = run(job.model_copy(update={"train": job.train.model_copy(update={"mesh": axes})}),
                             sharding.make_mesh(axes))
        diffs = [float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(jax.tree.leaves(state["params"]), ref_params)]
        trace = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state["opt_state"])
                 if "experts" in jax.tree_util.keystr(path) and leaf.ndim == 3]
        out["meshes"][f"{json.dumps(axes)} micro={micro}"] = {
            "max_param_diff": max(diffs), "loss": float(metrics["train/loss"]),
            "ref_loss": float(ref_metrics["train/loss"]),
            "expert_state_specs": sorted({str(leaf.sharding.spec[0]) for leaf in trace}),
            "expert_state_leaves": len(trace),
        }

    # the optimizer update alone on an expert-only mesh: experts sharded over E, everything else replicated
    job = sharded_job(None)
    mesh = sharding.make_mesh({"expert": 8})
    jitted = step_lib.jit_train_step(job.model_copy(update={"train": job.train.model_copy(update={"mesh": {"expert": 8}})}),
                                     model, mesh)
    p_sh = jitted.state_shardings["params"]
    o_sh = jitted.state_shardings["opt_state"]
    abstract = jitted.abstract_state
    update = jax.jit(jitted.optimizer.update, in_shardings=(p_sh, o_sh, p_sh), out_shardings=(p_sh, o_sh))
    hlo = update.lower(abstract["params"], abstract["opt_state"], abstract["params"]).compile().as_text()
    out["update_collectives"] = collectives(hlo)
    print("RESULT" + json.dumps(out))
    """
)


def sharded_job(microbatch_size: int | None) -> TrainJob:
    # capacity factor E / k: no token is ever dropped, so micro-batches give the whole-batch step
    cfg = TINY.model_copy(update={"num_layers": 1, "moe": TINY.moe.model_copy(update={"num_experts": 8, "capacity_factor": 4.0})})
    return TrainJob(
        model=cfg,
        data=DataConfig(sources=[SourceConfig(name="code", kind="stdlib_code")], phases=[MixturePhase(weights={"code": 1.0})]),
        optimizer=MUONH,
        train=TrainConfig(tokens=16 * cfg.seq_len * 3, batch_size=16, microbatch_size=microbatch_size),
    )


@pytest.mark.slow  # about 25 s: an 8-device subprocess
def test_sharded_muonh_step_equals_single_device_and_keeps_experts_local():
    """3 MuonH train steps on data x fsdp x expert, and on expert=8 with 2 micro-batches (8 fake CPU devices),
    give the single-device parameters; the experts' momentum stays expert-sharded; and on an
    expert-only mesh the optimizer update compiles to no collective at all (each device orthogonalises and
    projects its own experts; no gather of E)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["devices"] == 8
    assert len(out["meshes"]) == 2
    for name, r in out["meshes"].items():
        assert r["max_param_diff"] < 2e-5, (name, r)
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), name
        assert r["expert_state_leaves"] == 3, name  # the momentum of w_gate, w_up, w_down (one layer)
        assert r["expert_state_specs"] == ["expert"], (name, r)
    assert sum(out["update_collectives"].values()) == 0, out["update_collectives"]


# --------------------------------------------------------------------------------------------
# Resume


@pytest.mark.slow  # about 17 s: three trainer.train runs
def test_muonh_run_resumes_from_its_checkpoint_bit_for_bit(tmp_path, monkeypatch):
    from trainer.loop import default_compilation_cache_dir, train
    from trainer.metrics import read_metrics

    monkeypatch.setenv("LADDER_CACHE_DIR", str(tmp_path / "cache"))
    steps, batch = 6, 8
    job = TrainJob(
        model=TINY,
        data=DataConfig(sources=[SourceConfig(name="code", kind="stdlib_code")], phases=[MixturePhase(weights={"code": 1.0})],
                        max_tokens_per_source=50_000),
        optimizer=MUONH.model_copy(update={"schedule": ScheduleConfig(kind="linear", warmup=2, min_lr_fraction=0.05)}),
        train=TrainConfig(tokens=steps * batch * TINY.seq_len, batch_size=batch, log_every=1, eval_every=steps,
                          eval_batches=1, checkpoint_every=3, wandb="disabled", progress=False,
                          compilation_cache_dir=default_compilation_cache_dir()),
    )

    def rows(run_dir):
        return [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "train/loss" in r]

    straight = train(job, str(tmp_path / "straight"))
    assert straight.completed and straight.steps == steps
    calls = iter(range(100))
    stopped = train(job, str(tmp_path / "resumed"), should_stop=lambda: next(calls) >= 3)
    assert not stopped.completed and stopped.steps == 3
    resumed = train(job, str(tmp_path / "resumed"))
    assert resumed.completed and resumed.resumed_from_step == 3
    keys = ("train/loss", "grad/norm/total", "params/norm/total", "optim/learning_rate")
    assert [[r[k] for k in keys] for r in rows(str(tmp_path / "resumed"))] == [
        [r[k] for k in keys] for r in rows(str(tmp_path / "straight"))
    ]
    lrs = [r["optim/learning_rate"] for r in rows(str(tmp_path / "straight"))]
    assert lrs[1] == pytest.approx(MUONH.learning_rate)  # warmup of 2 steps reaches the MuonH peak
    # the hyperball keeps the MuonH/AdamH norms: only the Adam group (embedding, router, gains) moves the total
    first, last = rows(str(tmp_path / "straight"))[0], rows(str(tmp_path / "straight"))[-1]
    assert last["params/norm/attention"] == pytest.approx(first["params/norm/attention"], rel=1e-5)
    assert last["params/norm/experts"] == pytest.approx(first["params/norm/experts"], rel=1e-5)


def test_marins_block_pieces_get_marins_groups():
    """GatedNorm gates -> MuonH; per-head gate, conv kernels and gains -> Adam (Marin's create_mask)."""
    from experiments import marin_mini

    cfg = marin_mini.mini_model(16)
    params = jax.eval_shape(lambda k: model.init_params(cfg, k), jax.random.key(0))
    labels = muon.optimizer_labels(params, model.param_groups(params))
    flat = {jax.tree_util.keystr(path): label for path, label in jax.tree_util.tree_leaves_with_path(labels)}
    gated = [label for path, label in flat.items() if "gated_norm" in path]
    assert gated and set(gated) == {"muonh"}
    for piece in ("head_gate", "sconv_k", "sconv_attn", "sconv_ffn", "latent_norm"):
        found = [label for path, label in flat.items() if piece in path]
        assert found and set(found) == {"adam"}, piece
    assert flat["['lm_head']"] == "adamh"
