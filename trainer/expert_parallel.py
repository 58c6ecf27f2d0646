"""Expert parallelism as clusters run it: the routed-expert dispatch inside ``jax.shard_map``.

Why this module exists: under plain jit (``moe.dispatch_capacity``) XLA sees one global batch, so the
``[E, C, D]`` capacity buffers are sized by the GLOBAL token count and only split over the expert axis;
every device holds buffer rows for tokens it never had, and the step stops fitting long before the model
does. Here each device keeps its own tokens, builds buffers sized by its LOCAL tokens
(``C = ceil(capacity_factor * T_local * k / E)``), sends each expert's rows to the device that owns the
expert with ``jax.lax.all_to_all`` over the "expert" mesh axis, runs only its ``E / ep`` local experts on
``ep * C`` rows each, and sends the results back. That is the layout of GShard / MaxText / Megatron EP.

What stays outside the shard_map, on purpose: routing and the router statistics (``moe.route``,
expert counts, entropy, balance losses, quantile balancing). Routing is per token, so on a token-sharded
batch with a replicated router XLA runs it on each device's own tokens with no communication; the
statistics the balancers read are whole-batch reductions whose collectives XLA inserts (an all-reduce of
the per-device counts / histograms, an all-gather of the per-token quantile inputs). So the sign-rule and
quantile-balancing bias updates are the same code, on the same values, as a single-device step, and
micro-batching (which concatenates the per-token quantile inputs over micro-batches) is unchanged.

Two dispatches (``MoEConfig.dispatch``):

* ``"alltoall"``: fixed capacity buffers per device and expert. Equal to ``moe.dispatch_capacity`` when
  neither drops a token; what differs when they do is which tokens drop (ranks are counted among a
  device's own tokens, as on a cluster). Runs everywhere, XLA:CPU included.
* ``"ragged_alltoall"``: dropless. Assignments sorted by expert are exchanged with
  ``jax.lax.ragged_all_to_all`` (only the rows each device actually sends travel) and the local experts
  run as grouped GEMMs with ``jax.lax.ragged_dot``; MaxText's ``sparse_matmul`` uses the same layout
  (receive buffers sized for the worst case, a second local sort by expert after the exchange). XLA:CPU
  cannot compile the ragged all-to-all, so on a CPU mesh with more than one expert shard it is refused
  with that reason (``CPU_RAGGED_REFUSAL``); it is meant for GPU/TPU (``bench/gpu_checks.py``).

The mesh comes from the tracing context (``jax.sharding.get_abstract_mesh()``): the train step traces
inside ``use_abstract_mesh(mesh)`` (``trainer.step.jit_train_step``), so no mesh threads through the
model's signatures. Traced without a mesh (a plain ``jax.jit`` on one device) the whole batch is one
shard and the dispatch is exactly ``capacity`` / ``ragged``.

Shapes carry suffixes as in ``trainer.moe``: T tokens (local inside the shard_map), D width, E experts,
El = E / ep local experts, K top-k, C capacity, A = T*K assignments, R received rows.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trainer import moe as moe_lib
from trainer import sharding as sharding_lib
from trainer.config import MoEConfig

EXPERT_AXIS = "expert"
# What jaxlib 0.10.2 answers when a program with a ragged all-to-all is compiled for CPU.
CPU_RAGGED_REFUSAL = "UNIMPLEMENTED: HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"


def context_mesh():
    """The mesh the caller traces under (``jax.sharding.get_abstract_mesh()``), or None outside any."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def _axis_size(mesh, name: str) -> int:
    return int(dict(mesh.shape).get(name, 1))


def dispatch_alltoall(x_TxD: jax.Array, routing: moe_lib.Routing, experts: dict, cfg: MoEConfig):
    """Capacity-buffer expert parallelism (see the module docstring); ``moe._DISPATCH`` signature."""
    mesh = context_mesh()
    if mesh is None:
        return moe_lib.dispatch_capacity(x_TxD, routing, experts, cfg)
    return _on_mesh(_local_alltoall, x_TxD, routing, experts, cfg, mesh)


def dispatch_ragged_alltoall(
    x_TxD: jax.Array,
    routing: moe_lib.Routing,
    experts: dict,
    cfg: MoEConfig,
    *,
    exchange: Callable | None = None,
    always_exchange: bool = False,
):
    """Dropless expert parallelism with ragged all-to-all + ragged_dot; ``moe._DISPATCH`` signature.

    ``exchange`` replaces ``jax.lax.ragged_all_to_all`` (tests on CPU pass ``ragged_all_to_all_by_gather``);
    ``always_exchange`` runs it even with one expert shard (a single-GPU check of the primitive)."""
    mesh = context_mesh()
    if mesh is None:
        return moe_lib.dispatch_ragged(x_TxD, routing, experts, cfg)
    ep = _axis_size(mesh, EXPERT_AXIS)
    if exchange is None and (ep > 1 or always_exchange) and mesh.abstract_device.platform == "cpu":
        raise ValueError(
            f"moe.dispatch='ragged_alltoall' needs jax.lax.ragged_all_to_all over the {ep} expert shards, which "
            f"XLA:CPU cannot compile ({CPU_RAGGED_REFUSAL}); use moe.dispatch='alltoall' on CPU, or run on GPU/TPU."
        )
    local = _local_ragged(exchange or jax.lax.ragged_all_to_all, always_exchange=always_exchange)
    return _on_mesh(local, x_TxD, routing, experts, cfg, mesh)


def _on_mesh(local_fn: Callable, x_TxD, routing: moe_lib.Routing, experts: dict, cfg: MoEConfig, mesh):
    """Run ``local_fn`` on each device's tokens and expert block; returns the global ``[T, D]`` and the
    whole batch's drop fraction."""
    ep = _axis_size(mesh, EXPERT_AXIS)
    if cfg.num_experts % ep:
        raise ValueError(
            f"moe.num_experts={cfg.num_experts} does not split over the mesh's {ep} expert shards; "
            "choose train.mesh['expert'] that divides the number of experts."
        )
    token_axes = sharding_lib.batch_axes(mesh)  # the batch is split over every mesh axis
    shards = 1
    for a in token_axes:
        shards *= _axis_size(mesh, a)
    if x_TxD.shape[0] % shards:
        raise ValueError(
            f"{x_TxD.shape[0]} tokens do not split over the {shards} devices of the mesh {dict(mesh.shape)}; "
            "use a (micro-)batch size divisible by the device count."
        )
    tokens = P(token_axes)
    expert_spec = P(EXPERT_AXIS) if EXPERT_AXIS in mesh.axis_names else P()

    def body(x, ids, weights, local_experts):
        y, kept = local_fn(x, ids, weights, local_experts, cfg=cfg, ep=ep)
        kept_total = jax.lax.psum(kept, token_axes)
        return y, 1.0 - kept_total / (ids.size * shards)

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, jax.tree.map(lambda _: expert_spec, experts)),
        out_specs=(tokens, P()),
    )
    return mapped(x_TxD, routing.expert_ids_TxK, routing.weights_TxK, experts)


# ------------------------------------------------------------------------------------------
# Capacity buffers + all_to_all


def _local_alltoall(x_TxD, ids_TxK, weights_TxK, experts: dict, *, cfg: MoEConfig, ep: int):
    """One device: its tokens into ``[E, C, D]`` buffers (C from the local token count), buffer rows of
    expert e to the device owning e, local experts on ``[El, ep*C, D]``, results back, combine.

    The buffer bookkeeping is ``moe.dispatch_capacity``'s (ranks by a one-hot running count, gathers with
    custom VJPs both ways); only the expert computation in the middle is exchanged."""
    t, d = x_TxD.shape
    e, k = cfg.num_experts, cfg.top_k
    c = moe_lib.capacity(t, cfg)
    ids_A = ids_TxK.reshape(-1)
    num_assign = ids_A.shape[0]
    rank_A = moe_lib.expert_ranks(ids_A, e)
    kept_A = rank_A < c
    slot_A = jnp.where(kept_A, ids_A * c + rank_A, e * c)
    assignment_A = jnp.arange(num_assign, dtype=jnp.int32)
    token_of_slot = jnp.full((e * c + 1,), t, jnp.int32).at[slot_A].set(assignment_A // k)[: e * c]
    assignment_of_slot = jnp.full((e * c + 1,), num_assign, jnp.int32).at[slot_A].set(assignment_A)[: e * c]
    buffer_ExCxD = moe_lib._rows_to_slots(x_TxD, token_of_slot, slot_A.reshape(t, k)).reshape(e, c, d)

    local_e = e // ep
    if ep > 1:
        # [ep (destination), El, C, D] -> [ep (source), El, C, D]: my experts' rows from every device
        sent = jax.lax.all_to_all(buffer_ExCxD.reshape(ep, local_e, c, d), EXPERT_AXIS, 0, 0)
        rows_ElxRxD = sent.transpose(1, 0, 2, 3).reshape(local_e, ep * c, d)
    else:
        rows_ElxRxD = buffer_ExCxD
    out_ElxRxD = moe_lib._batched_experts(rows_ElxRxD, experts)
    if ep > 1:
        back = out_ElxRxD.reshape(local_e, ep, c, d).transpose(1, 0, 2, 3)
        out_ExCxD = jax.lax.all_to_all(back, EXPERT_AXIS, 0, 0).reshape(e, c, d)
    else:
        out_ExCxD = out_ElxRxD
    out_AxD = moe_lib._slots_to_assignments(out_ExCxD.reshape(e * c, d), slot_A, assignment_of_slot)
    return moe_lib._combine(out_AxD, weights_TxK), jnp.sum(kept_A.astype(jnp.float32))


# ------------------------------------------------------------------------------------------
# Dropless: ragged all-to-all + ragged_dot


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _inverse_permutation(order: jax.Array) -> jax.Array:
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _local_ragged(exchange: Callable, *, always_exchange: bool = False):
    """The dropless per-device body over an ``exchange`` with ``jax.lax.ragged_all_to_all``'s signature
    and semantics (the real primitive; tests pass a reference built from all_gather, see
    ``ragged_all_to_all_by_gather``, because XLA:CPU cannot compile the primitive). With one expert shard
    nothing needs exchanging; ``always_exchange`` runs the exchange anyway (``bench/gpu_checks.py`` on a
    single GPU, to check the primitive inside the real layout)."""

    def local(x_TxD, ids_TxK, weights_TxK, experts: dict, *, cfg: MoEConfig, ep: int):
        t, d = x_TxD.shape
        e, k = cfg.num_experts, cfg.top_k
        local_e = e // ep
        ids_A = ids_TxK.reshape(-1)
        num_assign = ids_A.shape[0]
        order_A = jnp.argsort(ids_A, stable=True)
        x_sorted_AxD = x_TxD[order_A // k]
        sizes_E = jnp.bincount(ids_A, length=e).astype(jnp.int32)
        if ep == 1 and not always_exchange:
            out_sorted = _ragged_experts(x_sorted_AxD, sizes_E, experts)
        else:
            me = jax.lax.axis_index(EXPERT_AXIS)
            # sizes_SxE[s, e]: assignments device s sends to expert e (every device of my expert group)
            sizes_SxE = jax.lax.all_gather(sizes_E, EXPERT_AXIS)
            to_device_SxS = sizes_SxE.reshape(ep, ep, local_e).sum(-1)  # [sender, receiver]
            send_sizes = to_device_SxS[me]
            input_offsets = _exclusive_cumsum(send_sizes)
            # where my chunk lands in each receiver's buffer: after the chunks of lower-ranked senders
            output_offsets = _exclusive_cumsum(to_device_SxS, axis=0)[me]
            recv_sizes = to_device_SxS[:, me]
            recv_rows = ep * num_assign  # worst case: every device of the group sends all its rows to me
            received_RxD = exchange(
                x_sorted_AxD, jnp.zeros((recv_rows, d), x_TxD.dtype), input_offsets, send_sizes,
                output_offsets, recv_sizes, axis_name=EXPERT_AXIS,
            )
            # The buffer holds sender 0's rows (sorted by my local experts), then sender 1's, ...: sort
            # them by local expert so each expert's rows are contiguous for ragged_dot; padding rows last.
            mine_SxEl = jax.lax.dynamic_slice_in_dim(sizes_SxE, me * local_e, local_e, axis=1)
            group_ends = jnp.cumsum(mine_SxEl.reshape(-1))
            group_R = jnp.searchsorted(group_ends, jnp.arange(recv_rows, dtype=jnp.int32), side="right")
            expert_R = jnp.where(group_R < ep * local_e, group_R % local_e, local_e)
            by_expert_R = jnp.argsort(expert_R, stable=True)
            out_R = _ragged_experts(received_RxD[by_expert_R], mine_SxEl.sum(0), experts)
            out_RxD = out_R[_inverse_permutation(by_expert_R)]
            # Send each result back to where its row came from (the transpose of the first exchange).
            back_offsets = jnp.take(
                _exclusive_cumsum(to_device_SxS, axis=1), me, axis=1
            )  # sender s's input offset for me
            out_sorted = exchange(
                out_RxD, jnp.zeros((num_assign, d), x_TxD.dtype), _exclusive_cumsum(recv_sizes), recv_sizes,
                back_offsets, send_sizes, axis_name=EXPERT_AXIS,
            )
        out_AxD = out_sorted[_inverse_permutation(order_A)]
        return moe_lib._combine(out_AxD, weights_TxK), jnp.asarray(num_assign, jnp.float32)

    return local


def _ragged_experts(x_RxD: jax.Array, group_sizes_El: jax.Array, experts: dict) -> jax.Array:
    """Grouped SwiGLU over rows sorted by (local) expert; rows past sum(group_sizes) are padding."""
    group_sizes_El = group_sizes_El.astype(jnp.int32)
    gate = jax.lax.ragged_dot(x_RxD, experts["w_gate"], group_sizes_El)
    up = jax.lax.ragged_dot(x_RxD, experts["w_up"], group_sizes_El)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, experts["w_down"], group_sizes_El)


def ragged_all_to_all_by_gather(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``'s documented semantics (one slice per peer) from ``all_gather`` and a
    gather: every device sees every peer's operand, so it costs ``ep`` times the memory of the real
    collective. For checking the ragged dispatch's offsets on XLA:CPU, which has no ragged all-to-all."""
    del recv_sizes  # implied by the senders' send_sizes, as the primitive requires
    me = jax.lax.axis_index(axis_name)
    all_operands_SxNxD = jax.lax.all_gather(operand, axis_name)
    ep, rows = all_operands_SxNxD.shape[:2]
    # what sender s sends me: operand_s[in_s[me] : in_s[me] + size_s[me]] written at out_s[me]
    start_S = jax.lax.all_gather(input_offsets, axis_name)[:, me]
    size_S = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    at_S = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    r = jnp.arange(output.shape[0], dtype=jnp.int32)[:, None]
    inside_RxS = (r >= at_S[None, :]) & (r < (at_S + size_S)[None, :])
    source_RxS = jnp.arange(ep, dtype=jnp.int32)[None, :] * rows + start_S[None, :] + r - at_S[None, :]
    source_R = jnp.sum(jnp.where(inside_RxS, source_RxS, 0), axis=1)
    filled_R = jnp.any(inside_RxS, axis=1)
    gathered = all_operands_SxNxD.reshape(ep * rows, *operand.shape[1:])[jnp.clip(source_R, 0, ep * rows - 1)]
    return jnp.where(filled_R.reshape(-1, *([1] * (operand.ndim - 1))), gathered, output)
