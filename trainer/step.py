"""The jitted train step: loss and gradients, AdamW with the scheduled LR, router-bias update, fault flags.

Kept apart from the loop (trainer/loop.py) because it is the one pure function the loop compiles: it
takes the state pytree and a global batch and returns the next state and device-side metrics. The loop
owns everything with side effects (data, checkpoints, sinks, faults policy).

Two memory levers live here, both read from ``TrainConfig``:

* ``remat`` is passed to ``model.loss_fn`` (each block under ``jax.checkpoint``); values do not change.
* ``microbatch_size`` splits the global batch into ``n = batch_size / microbatch_size`` micro-batches
  inside the ONE compiled step (``lax.scan``): float32 gradients and the reported losses are averaged,
  router load counts are summed, and one optimizer update and one router-bias update follow, so the
  bias rule sees the whole batch's load exactly as an un-split step does. Micro-batch ``i`` is rows
  ``i, i + n, i + 2n, ...`` of the batch: each device's contiguous block of rows holds exactly its share of
  every micro-batch, so the split is a local reshape on every device (no collective moves a row).

What differs from an un-split step (why ``microbatch_size`` is part of a job's identity): gradients and
losses only by float summation order (~1e-7 relative) for dense layers and for "ragged"/"dense" expert
dispatch; with "capacity" dispatch each micro-batch has its own buffers (C = capacity_factor * T_micro *
k / E, ranks counted within the micro-batch), so different tokens can be dropped; and the "switch" aux
loss (a product of batch-level fractions) is averaged per micro-batch. The sign-rule and quantile
bias updates are exact: counts are summed, and quantile balancing takes its quantile over the
concatenated per-token inputs of all micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from trainer import moe as moe_lib
from trainer import optim
from trainer import precision as precision_lib
from trainer import sharding as sharding_lib
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


# aux entries that are not means over tokens: recomputed from the summed expert counts after micro-batching
_LOAD_EXTREMES = ("expert_load_min", "expert_load_max")


def xla_compiler_options(job: TrainJob, platform: str) -> dict[str, str] | None:
    """Per-jit XLA options the train step needs: ``jax.jit(step, compiler_options=...)``.

    XLA:CPU (jaxlib 0.10.2) runs its ``cse_barrier_expander`` pass early, dropping the optimization
    barriers ``jax.checkpoint`` puts around recomputed blocks; a later CSE pass then merges each
    recomputation with the original forward, which undoes remat (measured: 4-layer dense step, temp
    35.8 MiB without remat, 32.8 MiB with "full"; 10.0 MiB once the pass is disabled). Disabling the
    pass for this one jit keeps the barriers and leaves results unchanged. GPU/TPU need nothing.
    """
    if job.train.remat != "none" and platform == "cpu":
        return {"xla_disable_hlo_passes": "cse_barrier_expander"}
    return None


def _default_mesh(job: TrainJob) -> jax.sharding.Mesh:
    """The mesh ``trainer.train`` builds for this job (same rule, same devices)."""
    from trainer.loop import resolve_mesh_axes  # the loop imports this module; resolve at call time

    return sharding_lib.make_mesh(resolve_mesh_axes(job, jax.device_count()))


def make_loss_and_grads(job: TrainJob, model: Any, *, mesh: jax.sharding.Mesh | None = None):
    """``(params, router_state, batch, loss_scale) -> ((objective, aux), grads)`` of one step's global batch.

    The objective is ``model.loss_fn`` (with ``job.train.remat``) times ``loss_scale``. With
    ``job.train.microbatch_size`` set it runs over micro-batches in a ``lax.scan`` and returns the same
    structure as the whole-batch call: mean objective and losses, mean float32 gradients, summed
    expert counts (and the whole-batch quantile-balancing target). ``mesh`` is the mesh the step will
    be jitted on (read only when micro-batching, to pin micro-batches and the gradient accumulator to
    the batch's and the parameters' shardings); None = the mesh ``trainer.train`` builds for ``job``.
    """
    cfg = job.model
    remat = job.train.remat
    mixed = job.train.precision == "bf16_mixed"

    def loss_and_grads(weights, router_state, batch, loss_scale):
        def objective(p):
            loss, aux = model.loss_fn(p, router_state, batch, cfg, remat=remat)
            return loss * loss_scale, aux

        return jax.value_and_grad(objective, has_aux=True)(weights)

    if job.train.num_microbatches == 1:
        if not mixed:
            return loss_and_grads

        def mixed_loss_and_grads(params, router_state, batch, loss_scale):
            weights = precision_lib.compute_copy(params, job, model)
            (loss, aux), grads = loss_and_grads(weights, router_state, batch, loss_scale)
            return (loss, aux), precision_lib.to_float32(grads)

        return mixed_loss_and_grads
    mesh = mesh if mesh is not None else _default_mesh(job)
    shards = mesh.devices.size
    if job.train.microbatch_size % shards:
        raise ValueError(
            f"train.microbatch_size={job.train.microbatch_size} does not split over the {shards} devices of the "
            f"mesh {dict(mesh.shape)} (every mesh axis splits the batch); use a multiple of {shards}."
        )
    return _make_accumulator(job, model, loss_and_grads, mesh)


def make_train_step(
    job: TrainJob,
    model: Any,
    optimizer: optax.GradientTransformation,
    groups: Any,
    *,
    mesh: jax.sharding.Mesh | None = None,
):
    """The un-jitted train step ``(state, batch, skip, loss_scale) -> (state, metrics)``.

    ``skip`` (bool) forces the update to be dropped (a skipped batch); ``loss_scale`` is 1.0, or NaN
    from the test-only fault injector. Gradients come from ``make_loss_and_grads`` (remat and
    micro-batching per ``job.train``; ``mesh`` as there).
    """
    cfg = job.model
    schedule = optim.lr_fn(job.optimizer, job.num_steps)
    loss_and_grads = make_loss_and_grads(job, model, mesh=mesh)

    def step_fn(state, batch, skip, loss_scale):
        params, router_state = state["params"], state["router_state"]

        (loss, aux), grads = loss_and_grads(params, router_state, batch, loss_scale)
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


def split_microbatches(batch: jax.Array, count: int, mesh: jax.sharding.Mesh) -> jax.Array:
    """``[B, ...] -> [count, B / count, ...]`` where micro-batch i is rows i, i + count, i + 2 * count, ...

    The batch is split over the mesh in contiguous blocks of ``B / devices`` rows; with ``B / count``
    divisible by the device count each block is whole groups of ``count`` consecutive rows, so every
    device keeps its own rows and the reshape moves nothing (the constraint pins that layout).
    """
    rows = batch.shape[0]
    split = batch.reshape(rows // count, count, *batch.shape[1:]).swapaxes(0, 1)
    spec = jax.sharding.PartitionSpec(None, sharding_lib.batch_axes(mesh))
    return jax.lax.with_sharding_constraint(split, jax.sharding.NamedSharding(mesh, spec))


def _make_accumulator(job: TrainJob, model: Any, loss_and_grads, mesh: jax.sharding.Mesh):
    """``(params, router_state, batch, loss_scale) -> ((loss, aux), grads)`` over micro-batches, with the
    same outputs as ``loss_and_grads`` on the whole batch (see the module docstring for what differs)."""
    cfg = job.model
    n = job.train.num_microbatches
    num_tokens = job.train.batch_size * cfg.seq_len
    micro_sharding = sharding_lib.batch_sharding(mesh)

    def accumulate(params, router_state, batch, loss_scale):
        micro_batches = split_microbatches(batch, n, mesh)
        param_shardings = sharding_lib.param_shardings(params, cfg, mesh, job.train.param_sharding)
        weights = precision_lib.compute_copy(params, job, model)  # bf16_mixed: once per step, not per micro-batch
        abstract = jax.eval_shape(lambda b: loss_and_grads(weights, router_state, b, loss_scale), micro_batches[0])
        (_, abstract_aux), _ = abstract

        def body(carry, micro_batch):
            grad_sum, sums, counts = carry
            micro_batch = jax.lax.with_sharding_constraint(micro_batch, micro_sharding)
            (loss, aux), grads = loss_and_grads(weights, router_state, micro_batch, loss_scale)
            grad_sum = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), grad_sum, grads)
            grad_sum = jax.lax.with_sharding_constraint(grad_sum, param_shardings)
            sums = {k: v + (loss if k == "_objective" else aux[k]) for k, v in sums.items()}
            stats = aux["router_stats"]
            if counts is not None:
                counts = counts + stats["expert_counts"]
            per_token = stats.get("qb_required_bias")
            return (grad_sum, sums, counts), per_token

        mean_keys = [k for k, v in abstract_aux.items() if k not in _LOAD_EXTREMES and k != "router_stats"]
        zero = jnp.zeros((), jnp.float32)
        sums0 = {"_objective": zero, **{k: zero for k in mean_keys}}
        grads0 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        grads0 = jax.lax.with_sharding_constraint(grads0, param_shardings)
        counts_struct = abstract_aux["router_stats"].get("expert_counts")
        counts0 = None if counts_struct is None else jnp.zeros(counts_struct.shape, counts_struct.dtype)
        (grad_sum, sums, counts), required_bias = jax.lax.scan(body, (grads0, sums0, counts0), micro_batches)

        grads = jax.tree.map(lambda g, p: (g / n).astype(p.dtype), grad_sum, params)
        aux = {k: sums[k] / n for k in mean_keys}
        router_stats: dict[str, jax.Array] = {}
        if counts is not None:
            aux.update(model.expert_load_extremes(counts, num_tokens, cfg))
            router_stats["expert_counts"] = counts
        else:
            aux.update({k: zero for k in _LOAD_EXTREMES})
        if required_bias is not None:  # [n, layers, T_micro, E] -> per layer over the whole batch's tokens
            moe_cfg = cfg.moe
            per_layer = required_bias.swapaxes(0, 1).reshape(required_bias.shape[1], -1, required_bias.shape[-1])
            router_stats["qb_bias"] = jnp.stack(
                [
                    moe_lib.quantile_balancing_bias(
                        per_layer[i], router_state["bias"][i], top_k=moe_cfg.top_k, num_bins=moe_cfg.quantile_bins
                    )
                    for i in range(per_layer.shape[0])
                ]
            )
        aux["router_stats"] = router_stats
        return (sums["_objective"] / n, aux), grads

    return accumulate


@dataclass(frozen=True)
class JittedStep:
    """The train step compiled-to-be for one (job, mesh): what the loop runs and what memory checks lower."""

    train_step: Callable  # jitted (state, batch, skip, loss_scale) -> (state, metrics); donates state
    optimizer: optax.GradientTransformation
    state_shardings: dict[str, Any]
    abstract_state: dict[str, Any]  # ShapeDtypeStructs with shardings (orbax restore, .lower())
    batch_sharding: NamedSharding
    replicated: NamedSharding
    router_state0: Any


def jit_train_step(job: TrainJob, model: Any, mesh: jax.sharding.Mesh) -> JittedStep:
    """State shardings (the sharding rule for params, optax's mirror of it for AdamW state, replicated
    step and router state), the abstract state, and ``make_train_step`` jitted on them with the donated
    state and the XLA options it needs. Allocates nothing."""
    cfg = job.model
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_params = jax.eval_shape(lambda k: model.init_params(cfg, k), jax.random.key(job.train.seed))
    groups = model.param_groups(abstract_params)
    optimizer = optim.build_optimizer(job.optimizer, abstract_params, groups)
    precision_lib.check_offload(job, mesh)
    param_shardings = sharding_lib.param_shardings(abstract_params, cfg, mesh, job.train.param_sharding)
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    opt_shardings = optim.state_shardings(optimizer, abstract_opt_state, param_shardings, replicated)
    router_state0 = model.init_router_state(cfg)
    state_shardings = precision_lib.place_state(job, {  # train.offload: host memory for master and/or AdamW state
        "step": replicated,
        "params": param_shardings,
        "opt_state": opt_shardings,
        "router_state": jax.tree.map(lambda _: replicated, router_state0),
    })
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        {
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            "params": abstract_params,
            "opt_state": abstract_opt_state,
            "router_state": jax.eval_shape(lambda: router_state0),
        },
        state_shardings,
    )
    batch_sharding = sharding_lib.batch_sharding(mesh)
    step_fn = make_train_step(job, model, optimizer, groups, mesh=mesh)
    step_fn = precision_lib.with_offload(step_fn, job, state_shardings)

    def step_on_mesh(*args):  # traced in the mesh's context: the expert-parallel MoE dispatch (shard_map) reads it
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return step_fn(*args)

    train_step = jax.jit(
        step_on_mesh,
        in_shardings=(state_shardings, batch_sharding, replicated, replicated),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,),
        compiler_options=xla_compiler_options(job, mesh.devices.flat[0].platform),
    )
    return JittedStep(train_step, optimizer, state_shardings, abstract_state, batch_sharding, replicated, router_state0)


def jit_eval_loss(job: TrainJob, model: Any, mesh: jax.sharding.Mesh) -> Callable:
    """``(params, router_state, batch) -> lm loss``, jitted and traced in the mesh's context like the train step, so
    ``train.eval_dispatch="as_trained"`` under expert parallelism evaluates with the all-to-all dispatch it trained
    with (outside the mesh an expert-parallel dispatch is the global-capacity one, with other drops);
    ``"dropless"`` (default) is the ragged dispatch for MoE models."""
    cfg = job.model
    dispatch = "ragged" if (job.train.eval_dispatch == "dropless" and cfg.moe is not None) else None

    def eval_on_mesh(params, router_state, batch):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return model.loss_fn(params, router_state, batch, cfg, dispatch=dispatch)[1]["lm_loss"]

    return jax.jit(eval_on_mesh, out_shardings=NamedSharding(mesh, PartitionSpec()))
