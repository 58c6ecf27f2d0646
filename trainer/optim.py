"""Optimizer and learning-rate schedule.

The schedule is *data*: ``lr_at_steps(job, steps)`` gives the learning rate of every step from the
spec alone, so the forecaster can read it without running anything, and the train step uses the very
same formula (``schedule_value`` runs on numpy or jax.numpy). The LR is driven by the training step,
not optax's internal update count: a non-finite step that is rejected (see loop.py) leaves optax's
state untouched but still consumes its step, so the two counts can differ and only the step is
recoverable from the spec.

Conventions. Steps are numbered as in metrics.jsonl: step ``s`` (1..N) is the update that completes
``s`` optimizer steps, so ``lr_at_steps(job, s)`` is the ``optim/learning_rate`` logged on the line with
``"step": s``. ``N`` = total steps, ``W`` = warmup steps:

- warmup: ``peak * s / W`` for ``s <= W``, so step W reaches the peak and the first step is not
  wasted at LR 0;
- after warmup, progress ``q = clip((s - W) / (N - W), 0, 1)`` reaches 1 at the last step;
  ``constant``: peak; ``cosine``: ``min + (peak - min) * (1 + cos(pi q)) / 2``; ``linear``:
  ``peak - (peak - min) * q``;
- ``wsd``: constant peak until the cooldown of ``D = round(decay_fraction * N)`` steps (never starting
  inside warmup), then with ``q = (s - (N - D)) / D``: ``linear`` ``peak - (peak - min) q`` or
  ``sqrt`` ``min + (peak - min)(1 - sqrt(q))`` (Hägele et al.'s 1 - sqrt cooldown).

``min = min_lr_fraction * peak``. Every schedule ends at ``min`` on the last step (except constant).

Parameter groups come from the model (``param_groups``): weight decay is applied only to matrices
(ndim >= 2) outside the ``norm`` and ``embedding`` groups, so norms, biases and embeddings are not
decayed. The router bias lives in the router state, outside the optimizer altogether.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainer.config import OptimizerConfig, ScheduleConfig, TrainJob

# conv: the short causal convolutions start as the identity (a pass-through); decay would pull them to zero
NO_DECAY_GROUPS: frozenset[str] = frozenset({"norm", "embedding", "conv"})


def warmup_steps(schedule: ScheduleConfig, num_steps: int) -> int:
    """Warmup length in steps: a fraction of ``num_steps`` if ``warmup < 1``, else a step count."""
    if schedule.warmup < 1:
        return int(round(schedule.warmup * num_steps))
    return int(schedule.warmup)


def cooldown_steps(schedule: ScheduleConfig, num_steps: int) -> int:
    """WSD cooldown length in steps (at least 1, never overlapping the warmup)."""
    decay = max(1, int(round(schedule.decay_fraction * num_steps)))
    return min(decay, max(1, num_steps - warmup_steps(schedule, num_steps)))


def schedule_value(step: Any, *, peak: float, schedule: ScheduleConfig, num_steps: int, xp: Any = np) -> Any:
    """LR of step ``step`` (1-based, scalar or array) with numpy (``xp=np``) or jax.numpy (``xp=jnp``)."""
    step = xp.asarray(step)
    dtype = xp.float64 if xp is np else xp.float32
    s1 = step.astype(dtype)  # optimizer steps completed once this update is applied
    floor = schedule.min_lr_fraction * peak
    warm = warmup_steps(schedule, num_steps)
    warm_factor = xp.minimum(1.0, s1 / warm) if warm > 0 else xp.ones_like(s1)
    if schedule.kind == "constant":
        decayed = xp.full_like(s1, peak)
    elif schedule.kind in ("cosine", "linear"):
        q = xp.clip((s1 - warm) / max(1, num_steps - warm), 0.0, 1.0)
        if schedule.kind == "cosine":
            decayed = floor + (peak - floor) * 0.5 * (1.0 + xp.cos(math.pi * q))
        else:
            decayed = peak - (peak - floor) * q
    elif schedule.kind == "wsd":
        decay = cooldown_steps(schedule, num_steps)
        q = xp.clip((s1 - (num_steps - decay)) / decay, 0.0, 1.0)
        if schedule.cooldown == "linear":
            decayed = peak - (peak - floor) * q
        else:
            decayed = floor + (peak - floor) * (1.0 - xp.sqrt(q))
    else:  # pragma: no cover - pydantic forbids other kinds
        raise ValueError(f"unknown schedule kind {schedule.kind!r}")
    return xp.where(s1 <= warm, peak * warm_factor, decayed)


def lr_at_steps(job: TrainJob, steps: np.ndarray) -> np.ndarray:
    """The learning rate of each step in ``steps`` (1..num_steps, as metrics.jsonl numbers them), float64."""
    return schedule_value(
        np.asarray(steps),
        peak=job.optimizer.learning_rate,
        schedule=job.optimizer.schedule,
        num_steps=job.num_steps,
        xp=np,
    )


def lr_fn(optimizer: OptimizerConfig, num_steps: int):
    """Jittable ``completed_steps -> lr`` (float32) for the update about to run: ``lr_at_steps`` of
    ``completed_steps + 1``, the same formula."""

    def fn(completed_steps):
        return schedule_value(
            completed_steps + 1, peak=optimizer.learning_rate, schedule=optimizer.schedule, num_steps=num_steps, xp=jnp
        )

    return fn


def weight_decay_mask(params: Any, groups: Any) -> Any:
    """True where weight decay applies: matrices (ndim >= 2) not in a ``NO_DECAY_GROUPS`` group."""
    return jax.tree.map(lambda p, g: bool(p.ndim >= 2 and g not in NO_DECAY_GROUPS), params, groups)


def build_optimizer(optimizer: OptimizerConfig, params: Any, groups: Any) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW (or, with ``name="muonh"``, Marin's MuonH / AdamH / Adam groups from
    trainer/muon.py), with the LR as an injectable hyperparameter.

    The returned transformation's state has ``.hyperparams["learning_rate"]``; the train step writes
    the scheduled LR there before each update (``with_learning_rate``), so what optax applies is
    exactly ``lr_at_steps`` of the step, and the logged LR is read back from that state.
    """
    mask = weight_decay_mask(params, groups)
    if optimizer.name == "muonh":
        return _build_muonh(optimizer, params, groups, mask)

    def make(learning_rate):
        parts = []
        if optimizer.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(optimizer.max_grad_norm))
        parts.append(
            optax.adamw(
                learning_rate=learning_rate,
                b1=optimizer.beta1,
                b2=optimizer.beta2,
                eps=optimizer.epsilon,
                weight_decay=optimizer.weight_decay,
                mask=mask,
            )
        )
        return optax.chain(*parts)

    return optax.inject_hyperparams(make)(learning_rate=optimizer.learning_rate)


def _build_muonh(optimizer: OptimizerConfig, params: Any, groups: Any, decay_mask: Any) -> optax.GradientTransformation:
    from trainer import muon

    settings = muon.MuonHSettings(
        adam_lr_ratio=optimizer.resolved_adam_learning_rate / optimizer.learning_rate,
        momentum=optimizer.momentum,
        nesterov=optimizer.nesterov,
        ns_steps=optimizer.ns_steps,
        ns_epsilon=optimizer.ns_epsilon,
        ns_dtype=jnp.dtype(optimizer.ns_dtype),
        beta1=optimizer.beta1,
        beta2=optimizer.beta2,
        epsilon=optimizer.epsilon,
        weight_decay=optimizer.weight_decay,
        max_grad_norm=optimizer.max_grad_norm,
    )
    labels = muon.optimizer_labels(params, groups)
    adam_decay_mask = jax.tree.map(lambda m, label: bool(m and label == muon.ADAM), decay_mask, labels)
    return muon.muonh_optimizer(settings, labels, adam_decay_mask, learning_rate=optimizer.learning_rate)


def state_shardings(optimizer: optax.GradientTransformation, abstract_opt_state: Any, param_shardings: Any, other: Any) -> Any:
    """The optimizer state's shardings: each copy of the parameter tree in it (AdamW mu/nu, MuonH momentum)
    gets ``param_shardings``, everything else (counts, the injected LR) gets ``other``.

    ``optax.tree_map_params`` plus the masked sub-states of ``optax.multi_transform`` (MuonH's groups):
    a ``MaskedNode`` holds no array and stays as it is.
    """
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    return optax.tree_map_params(
        optimizer,
        lambda value, sharding: value if masked(value) else sharding,
        abstract_opt_state,
        param_shardings,
        transform_non_params=lambda _: other,
        is_leaf=masked,
    )


def with_learning_rate(opt_state: Any, lr: jax.Array) -> Any:
    """``opt_state`` (from ``build_optimizer``) with its learning rate set to ``lr``."""
    hyper = dict(opt_state.hyperparams)
    hyper["learning_rate"] = jnp.asarray(lr, dtype=jnp.asarray(hyper["learning_rate"]).dtype)
    return opt_state._replace(hyperparams=hyper)


def learning_rate_of(opt_state: Any) -> jax.Array:
    """The learning rate stored in ``opt_state`` (the one the last update used)."""
    return opt_state.hyperparams["learning_rate"]
