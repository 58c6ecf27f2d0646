"""LR schedules as data, and the optimizer applying exactly that LR with the right weight-decay groups."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.config import (
    DataConfig,
    MixturePhase,
    ModelConfig,
    OptimizerConfig,
    ScheduleConfig,
    SourceConfig,
    TrainConfig,
    TrainJob,
)
from trainer.optim import build_optimizer, learning_rate_of, lr_at_steps, lr_fn, with_learning_rate


def make_job(num_steps: int = 100, peak: float = 1.0, **schedule) -> TrainJob:
    model = ModelConfig(hidden_dim=32, num_layers=1, num_heads=2, seq_len=8)
    data = DataConfig(
        sources=[SourceConfig(name="code", kind="stdlib_code")], phases=[MixturePhase(weights={"code": 1.0})]
    )
    optimizer = OptimizerConfig(learning_rate=peak, schedule=ScheduleConfig(**schedule))
    return TrainJob(
        model=model, data=data, optimizer=optimizer, train=TrainConfig(tokens=num_steps * 2 * 8, batch_size=2)
    )


def lr(job: TrainJob, *steps: int) -> list[float]:
    return [float(x) for x in lr_at_steps(job, np.array(steps))]


def test_warmup_steps_and_fraction():
    # steps are numbered as in metrics.jsonl: step s is the update that completes s steps (1..N)
    job = make_job(kind="constant", warmup=10)
    assert lr(job, 1, 5, 10, 11, 100) == pytest.approx([0.1, 0.5, 1.0, 1.0, 1.0])
    job = make_job(kind="constant", warmup=0.05)  # 5 of 100 steps
    assert lr(job, 1, 5, 6) == pytest.approx([0.2, 1.0, 1.0])
    job = make_job(kind="constant", warmup=0)
    assert lr(job, 1) == pytest.approx([1.0])


def test_cosine_and_linear_decay_to_min_fraction():
    job = make_job(kind="cosine", warmup=10, min_lr_fraction=0.1)
    # progress q = (s - 10) / 90: half way at step 55, done at the last step (100)
    assert lr(job, 10, 55, 100) == pytest.approx([1.0, 0.55, 0.1])
    job = make_job(kind="linear", warmup=10, min_lr_fraction=0.1)
    assert lr(job, 25, 55, 100) == pytest.approx([0.85, 0.55, 0.1])


@pytest.mark.parametrize("cooldown, at_quarter", [("linear", 0.775), ("sqrt", 0.55)])
def test_wsd_cooldown_shapes(cooldown, at_quarter):
    job = make_job(kind="wsd", warmup=10, min_lr_fraction=0.1, decay_fraction=0.2, cooldown=cooldown)
    # stable through step 80, cooldown over the last 20 steps; a quarter in at step 85
    assert lr(job, 51, 80, 85, 100) == pytest.approx([1.0, 1.0, at_quarter, 0.1])


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear", "wsd"])
def test_optax_applies_exactly_the_scheduled_lr(kind):
    """Adam's first update from a zero state is -lr * sign(g): the applied LR is visible in the update."""
    job = make_job(num_steps=40, peak=0.5, kind=kind, warmup=5, min_lr_fraction=0.2)
    optimizer = job.optimizer.model_copy(update={"weight_decay": 0.0, "max_grad_norm": None})
    params = {"w": jnp.zeros((2, 2))}
    opt = build_optimizer(optimizer, params, {"w": "attention"})
    schedule = lr_fn(optimizer, job.num_steps)

    @jax.jit
    def first_update(completed_steps):
        state = with_learning_rate(opt.init(params), schedule(completed_steps))
        updates, state = opt.update({"w": jnp.ones((2, 2))}, state, params)
        return updates["w"][0, 0], learning_rate_of(state)

    completed = np.arange(job.num_steps)
    applied, logged = zip(*(first_update(s) for s in completed))
    expected = lr_at_steps(job, completed + 1)
    np.testing.assert_allclose(np.array(logged), expected, rtol=1e-6)
    np.testing.assert_allclose(-np.array(applied), expected, rtol=1e-5)


def test_weight_decay_skips_norms_embeddings_and_vectors():
    params = {
        "embed": jnp.ones((4, 3)),
        "attn": jnp.ones((3, 3)),
        "norm": jnp.ones((3,)),
        "bias": jnp.ones((3,)),
        "experts": jnp.ones((2, 3, 3)),
    }
    groups = {"embed": "embedding", "attn": "attention", "norm": "norm", "bias": "attention", "experts": "experts"}
    optimizer = OptimizerConfig(learning_rate=0.5, weight_decay=0.1, max_grad_norm=None)
    opt = build_optimizer(optimizer, params, groups)
    state = opt.init(params)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zero_grads, state, params)
    shrink = {k: float(-v.ravel()[0]) for k, v in updates.items()}
    assert shrink == pytest.approx({"embed": 0.0, "attn": 0.05, "norm": 0.0, "bias": 0.0, "experts": 0.05})
