"""The jitted train step: loss and gradients, AdamW with the scheduled LR, router-bias update, fault flags.

Kept apart from the loop (trainer/loop.py) because it is the one pure function the loop compiles: it
takes the state pytree and a global batch and returns the next state and device-side metrics. The loop
owns everything with side effects (data, checkpoints, sinks, faults policy).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from trainer import optim
from trainer.config import TrainJob

ROUTER_AUX_KEYS = {
    "expert_load_min": "train/router/load_min",
    "expert_load_max": "train/router/load_max",
    "drop_fraction": "train/router/drop_fraction",
    "routing_entropy": "train/router/entropy",
    "router_aux_loss": "train/router/aux_loss",
    "router_z_loss": "train/router/z_loss",
}


def _group_norms(params: Any, groups: Any) -> dict[str, jax.Array]:
    sums: dict[str, jax.Array] = {}
    for leaf, group in zip(jax.tree.leaves(params), jax.tree.leaves(groups)):
        sums[group] = sums.get(group, 0.0) + jnp.sum(jnp.square(leaf.astype(jnp.float32)))
    return {f"params/norm/{g}": jnp.sqrt(s) for g, s in sorted(sums.items())}


def make_train_step(job: TrainJob, model: Any, optimizer: optax.GradientTransformation, groups: Any):
    """The un-jitted train step ``(state, batch, skip, loss_scale) -> (state, metrics)``.

    ``skip`` (bool) forces the update to be dropped (a skipped batch); ``loss_scale`` is 1.0, or NaN
    from the test-only fault injector.
    """
    cfg = job.model
    schedule = optim.lr_fn(job.optimizer, job.num_steps)

    def step_fn(state, batch, skip, loss_scale):
        params, router_state = state["params"], state["router_state"]

        def objective(p):
            loss, aux = model.loss_fn(p, router_state, batch, cfg)
            return loss * loss_scale, aux

        (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
        grad_norm = optax.global_norm(grads)
        lr = schedule(state["step"])
        opt_state = optim.with_learning_rate(state["opt_state"], lr)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_router_state = model.update_router_state(router_state, aux, cfg)

        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        apply = finite & jnp.logical_not(skip)

        def keep_if_bad(new, old):
            return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)

        new_state = {
            "step": state["step"] + 1,
            "params": keep_if_bad(new_params, params),
            "opt_state": keep_if_bad(new_opt_state, state["opt_state"]),
            "router_state": keep_if_bad(new_router_state, router_state),
        }
        metrics = {
            "train/loss": aux["lm_loss"] * loss_scale,
            "train/objective": loss,
            "optim/learning_rate": optim.learning_rate_of(opt_state),
            "grad/norm/total": grad_norm,
            "params/norm/total": optax.global_norm(new_state["params"]),
            "_finite": finite,
            "_skipped": skip,
        }
        if "logit_z_loss" in aux:
            metrics["train/logit_z_loss"] = aux["logit_z_loss"]
        metrics.update(_group_norms(new_state["params"], groups))
        bias_leaves = jax.tree.leaves(new_state["router_state"])
        if bias_leaves:
            metrics["params/norm/router_bias"] = optax.global_norm(bias_leaves)
            metrics["train/router/bias_min"] = jnp.min(jnp.stack([jnp.min(b) for b in bias_leaves]))
            metrics["train/router/bias_max"] = jnp.max(jnp.stack([jnp.max(b) for b in bias_leaves]))
        for key, name in ROUTER_AUX_KEYS.items():
            if cfg.moe is not None and key in aux:
                metrics[name] = aux[key]
        return new_state, metrics

    return step_fn
