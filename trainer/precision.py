"""Mixed precision and host offload of the training state: where each copy of a weight lives, and in what dtype.

Why a module of its own: the train step (trainer/step.py) and the state placement (step.py's
``jit_train_step``, loop.py, checkpoint.py) must agree on one answer, and the capacity plan
(trainer/memory.py) describes the same policies. Two ``TrainConfig`` fields choose them:

* ``precision="bf16_mixed"`` is mixed precision as labs run it: the state holds float32 master
  parameters and float32 AdamW moments; each step makes ONE bfloat16 copy of the matmul weights from the
  master (``compute_copy``; norms and the router stay float32), before the micro-batch loop, so the copy
  is not remade per micro-batch or per use; forward and backward read that copy; its gradients (bf16 for
  the cast leaves) are cast to float32 per micro-batch and accumulated in float32; the optimizer updates
  the float32 master. ``precision="model"`` (default) keeps today's path: ``model.forward`` casts the
  float32 parameters to ``model.compute_dtype`` inside every loss call. Both compute the same numbers (the
  cast and its transpose are the same ops, only hoisted), which is why ``precision`` is an execution field
  and the dtype that does change results stays ``ModelConfig.compute_dtype``.
* ``offload`` keeps state between steps in the ``pinned_host`` memory kind: "optimizer" = the AdamW
  state, "master_and_optimizer" = the float32 master parameters too (Marin's hero:
  ``master_param_mode=FP32_PINNED_HOST``, ``offload_opt_state=True``). The state's shardings carry the
  memory kind (so init, checkpoint restore and donation all place it there); the jitted step moves the
  offloaded parts to device memory at its start (``jax.device_put`` inside jit: a host-to-device copy XLA
  schedules) and its outputs go back through out_shardings of the same kind. Values are bit-identical to
  no offload. A platform without a ``pinned_host`` memory gets one ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from trainer.config import TrainJob

HOST_MEMORY = "pinned_host"

# which top-level state entries each offload setting keeps on the host
OFFLOADED_STATE = {"none": (), "optimizer": ("opt_state",), "master_and_optimizer": ("params", "opt_state")}


def compute_copy(params: Any, job: TrainJob, model: Any) -> Any:
    """The per-step compute weights of ``precision="bf16_mixed"``: ``model.cast_for_compute`` of the float32
    master (matmul weights in ``model.compute_dtype``, norms and router float32); the master itself otherwise."""
    if job.train.precision != "bf16_mixed":
        return params
    return model.cast_for_compute(params, job.model)


def to_float32(grads: Any) -> Any:
    """Gradients of the compute copy in float32 (the dtype of the master and of the accumulator)."""
    return jax.tree.map(lambda g: g.astype(jnp.float32) if jnp.issubdtype(g.dtype, jnp.floating) else g, grads)


def host_memory_available(mesh: Mesh) -> bool:
    device = mesh.devices.flat[0]
    return any(m.kind == HOST_MEMORY for m in device.addressable_memories())


def check_offload(job: TrainJob, mesh: Mesh) -> None:
    """One clear error when ``train.offload`` asks for host memory that the mesh's devices do not have."""
    if job.train.offload == "none" or host_memory_available(mesh):
        return
    device = mesh.devices.flat[0]
    kinds = sorted(m.kind for m in device.addressable_memories())
    raise ValueError(
        f"train.offload={job.train.offload!r} keeps state in {HOST_MEMORY!r} memory, which the {device.platform} "
        f"devices here do not have (their memories: {kinds}); set train.offload='none'."
    )


def place_state(job: TrainJob, shardings: dict[str, Any]) -> dict[str, Any]:
    """State shardings with the offloaded entries (``OFFLOADED_STATE[job.train.offload]``) in host memory."""
    offloaded = OFFLOADED_STATE[job.train.offload]
    return {
        name: jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), tree) if name in offloaded else tree
        for name, tree in shardings.items()
    }


def on_device(shardings: Any) -> Any:
    """The same shardings in device memory."""
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


def with_offload(step_fn: Callable, job: TrainJob, stored: dict[str, Any]) -> Callable:
    """``step_fn`` reading and writing a state whose offloaded entries live in host memory: they are
    brought to the device before the step and put back (``stored`` shardings) after it."""
    offloaded = OFFLOADED_STATE[job.train.offload]
    if not offloaded:
        return step_fn

    def step(state, *args):
        state = {k: jax.device_put(v, on_device(stored[k])) if k in offloaded else v for k, v in state.items()}
        new_state, metrics = step_fn(state, *args)
        new_state = {k: jax.device_put(v, stored[k]) if k in offloaded else v for k, v in new_state.items()}
        return new_state, metrics

    return step


def params_on_device(params: Any) -> Any:
    """``params`` in device memory (for evaluation, which reads them outside the train step): a copy when they
    are offloaded, the arrays themselves otherwise."""
    def move(x):
        kind = getattr(x.sharding, "memory_kind", None)
        return jax.device_put(x, x.sharding.with_memory_kind("device")) if kind == HOST_MEMORY else x

    return jax.tree.map(move, params)
