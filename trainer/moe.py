"""Mixture-of-experts FFN: routing, load balancing and three interchangeable dispatch backends.

Why this module exists: the expert layer is where a tiny CPU run and an accelerator run differ most.
On a 2-core CPU the fastest exact-enough path is to sort token->expert assignments into fixed-capacity
buffers ``[E, C, D]`` and run one batched einsum ("capacity"); ``jax.lax.ragged_dot`` compiles to a
dense masked fallback there but is the dropless grouped GEMM on GPU/TPU ("ragged"); and "dense" runs
every expert on every token, the slow oracle the other two are tested against. All three take the same
routing decision and return the same ``[T, D]`` output, so switching backends never changes the model.
"alltoall" and "ragged_alltoall" are the same two ideas under expert parallelism (``shard_map`` with
all-to-all over the "expert" mesh axis, buffers sized by each device's own tokens): ``trainer.expert_parallel``.

Routing follows DeepSeek-V3 / Marin's hero: router logits in fp32, scores by sigmoid (or softmax),
experts *selected* on ``score + stop_gradient(bias)``, combine weights taken from the *unbiased* scores
(normalised over the selected k). The bias is not a parameter: it lives in the router state and is
set outside the optimizer, either by DeepSeek-V3's sign rule or by Marin's quantile balancing (QB),
whose per-step target is computed here from the same forward pass.

Shapes carry suffixes: T tokens, D model width, E experts, K top-k, C capacity, F expert width,
A = T*K assignments.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from trainer.blocks import rms_norm
from trainer.config import MoEConfig

LATENT_NORM_EPS = 1e-5  # MoEConfig.latent_norm: Marin's layer_norm_eps

DISPATCH_BACKENDS = ("capacity", "ragged", "dense", "alltoall", "ragged_alltoall")


class Routing(NamedTuple):
    """One layer's routing decision; identical input to every dispatch backend."""

    expert_ids_TxK: jax.Array  # int32, selected experts per token
    weights_TxK: jax.Array  # f32 combine weights (from unbiased scores)
    scores_TxE: jax.Array  # f32 router scores (sigmoid or softmax of the logits)
    logits_TxE: jax.Array  # f32 router logits
    qb_bias_E: jax.Array | None  # quantile-balancing target bias for the next step (balancing="quantile")
    # The per-token input of that target (balancing="quantile"): micro-batched steps concatenate it over
    # micro-batches and take the quantile of the whole batch, exactly as an un-split step does.
    qb_required_bias_TxE: jax.Array | None = None


# ------------------------------------------------------------------------------------------
# SwiGLU


def swiglu(x_TxD: jax.Array, w_gate_DxF: jax.Array, w_up_DxF: jax.Array, w_down_FxD: jax.Array) -> jax.Array:
    """Gated FFN used by dense layers, shared experts and (batched) routed experts."""
    return (jax.nn.silu(x_TxD @ w_gate_DxF) * (x_TxD @ w_up_DxF)) @ w_down_FxD


# ------------------------------------------------------------------------------------------
# Routing and balancing


def router_scores(logits_TxE: jax.Array, score_fn: str) -> jax.Array:
    """Router affinities in fp32: sigmoid (DeepSeek-V3, Marin) or softmax (Mixtral, OLMoE)."""
    logits_TxE = logits_TxE.astype(jnp.float32)
    return jax.nn.sigmoid(logits_TxE) if score_fn == "sigmoid" else jax.nn.softmax(logits_TxE, axis=-1)


def route(logits_TxE: jax.Array, bias_E: jax.Array, cfg: MoEConfig) -> Routing:
    """Top-k selection on biased scores, combine weights from unbiased scores.

    The bias only changes *which* experts are chosen (it is stop-gradient and never reaches the
    output), so balancing cannot distort the function the router learns. With quantile balancing we
    take top-(k+1): the (k+1)-th biased score is each token's cutoff, from which the QB target bias
    for the next step is estimated (Marin's ``quantile_balancing_routes``).
    """
    k = cfg.top_k
    scores_TxE = router_scores(logits_TxE, cfg.router_score)
    biased_TxE = scores_TxE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    qb_bias_E = required_bias_TxE = None
    if cfg.balancing == "quantile":
        top_vals_TxK1, top_ids_TxK1 = jax.lax.top_k(biased_TxE, k + 1)
        expert_ids_TxK = top_ids_TxK1[:, :k]
        cutoff_T = top_vals_TxK1[:, k]
        required_bias_TxE = jax.lax.stop_gradient(cutoff_T[:, None] - scores_TxE)
        qb_bias_E = quantile_balancing_bias(required_bias_TxE, bias_E, top_k=k, num_bins=cfg.quantile_bins)
    else:
        _, expert_ids_TxK = jax.lax.top_k(biased_TxE, k)
    weights_TxK = jnp.take_along_axis(scores_TxE, expert_ids_TxK, axis=-1)
    if cfg.normalize_weights:
        weights_TxK = weights_TxK / (jnp.sum(weights_TxK, axis=-1, keepdims=True) + 1e-20)
    weights_TxK = weights_TxK * cfg.route_scale
    return Routing(expert_ids_TxK.astype(jnp.int32), weights_TxK, scores_TxE, logits_TxE, qb_bias_E, required_bias_TxE)


def quantile_balancing_bias(
    required_bias_TxE: jax.Array, current_bias_E: jax.Array, *, top_k: int, num_bins: int | None
) -> jax.Array:
    """Marin's quantile balancing (QB): the bias that would give every expert ~T*k/E tokens.

    ``required_bias[t, e] = cutoff_t - score[t, e]`` is the bias expert e needs to enter token t's
    top-k (the cutoff is the token's (k+1)-th biased score). Sorting it per expert, the value at rank
    ``ceil(T*k/E)`` is the bias under which exactly that many tokens would pick e. The result is
    centred (only differences between experts matter) and applied on the next step.

    ``num_bins=None`` takes the exact quantile by sorting (cheap at CPU sizes, and under GSPMD the sort
    is global). With ``num_bins`` it uses Marin's estimator: a per-expert histogram over
    ``[min(bias) - 1, max(bias) + 1]`` (scores lie in [0, 1], so every required bias falls inside) with
    linear interpolation inside the selected bin; its error is at most one bin width. On a mesh Marin
    psums the integer histogram; here jit/GSPMD reduces the bincount for us.
    """
    num_tokens, num_experts = required_bias_TxE.shape
    target_rank = (num_tokens * top_k + num_experts - 1) // num_experts
    required_bias_TxE = required_bias_TxE.astype(jnp.float32)
    if num_bins is None:
        bias_E = jnp.sort(required_bias_TxE, axis=0)[target_rank - 1]
    else:
        bias_E = _histogram_quantile(required_bias_TxE, current_bias_E, target_rank=target_rank, num_bins=num_bins)
    return jax.lax.stop_gradient(bias_E - jnp.mean(bias_E))


def _histogram_quantile(
    values_TxE: jax.Array, current_bias_E: jax.Array, *, target_rank: int, num_bins: int
) -> jax.Array:
    """Per-expert value at rank `target_rank` from a fixed-range integer histogram (interpolated)."""
    num_experts = values_TxE.shape[1]
    current_bias_E = jax.lax.stop_gradient(current_bias_E.astype(jnp.float32))
    lower = jnp.min(current_bias_E) - 1.0
    width = (jnp.max(current_bias_E) + 1.0 - lower) / num_bins
    bins_TxE = jnp.clip(jnp.floor((values_TxE - lower) / width).astype(jnp.int32), 0, num_bins - 1)
    flat = (jnp.arange(num_experts, dtype=jnp.int32)[None, :] * num_bins + bins_TxE).reshape(-1)
    hist_ExN = jnp.bincount(flat, length=num_experts * num_bins).reshape(num_experts, num_bins)
    cumulative_ExN = jnp.cumsum(hist_ExN, axis=-1)
    chosen_E = jnp.argmax(cumulative_ExN >= target_rank, axis=-1)
    below_E = jnp.where(
        chosen_E > 0, jnp.take_along_axis(cumulative_ExN, jnp.maximum(chosen_E - 1, 0)[:, None], axis=-1)[:, 0], 0
    )
    in_bin_E = jnp.take_along_axis(hist_ExN, chosen_E[:, None], axis=-1)[:, 0]
    fraction_E = (target_rank - below_E).astype(jnp.float32) / jnp.maximum(in_bin_E, 1)
    return lower + (chosen_E.astype(jnp.float32) + fraction_E) * width


def sign_rule_bias_update(bias_NxE: jax.Array, counts_NxE: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3 aux-loss-free update: raise underloaded experts' bias by gamma, lower overloaded ones."""
    counts_NxE = counts_NxE.astype(jnp.float32)
    mean_load_Nx1 = jnp.mean(counts_NxE, axis=-1, keepdims=True)
    return bias_NxE + rate * jnp.sign(mean_load_Nx1 - counts_NxE)


def expert_counts(expert_ids_TxK: jax.Array, num_experts: int) -> jax.Array:
    """Assignments per expert (before any capacity drop): the load the balancers equalise."""
    return jnp.bincount(expert_ids_TxK.reshape(-1), length=num_experts).astype(jnp.int32)


def normalized_probs(scores_TxE: jax.Array) -> jax.Array:
    """Scores as a distribution over experts (sigmoid scores do not sum to 1)."""
    return scores_TxE / (jnp.sum(scores_TxE, axis=-1, keepdims=True) + 1e-20)


def switch_aux_loss(routing: Routing, num_experts: int) -> jax.Array:
    """Switch-Transformer balance loss E * sum_e f_e * P_e over the whole batch; 1.0 when balanced."""
    k = routing.expert_ids_TxK.shape[1]
    f_E = expert_counts(routing.expert_ids_TxK, num_experts) / (routing.expert_ids_TxK.shape[0] * k)
    p_E = jnp.mean(normalized_probs(routing.scores_TxE), axis=0)
    return num_experts * jnp.sum(jax.lax.stop_gradient(f_E) * p_E)


def sequence_aux_loss(routing: Routing, num_experts: int, batch: int) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss: the Switch loss per sequence, averaged; 1.0 when balanced."""
    t, k = routing.expert_ids_TxK.shape
    ids_BxLK = routing.expert_ids_TxK.reshape(batch, (t // batch) * k)
    onehot_BxLKxE = jax.nn.one_hot(ids_BxLK, num_experts, dtype=jnp.float32)
    f_BxE = jnp.mean(onehot_BxLKxE, axis=1)  # fraction of each sequence's assignments per expert
    p_BxE = jnp.mean(normalized_probs(routing.scores_TxE).reshape(batch, t // batch, num_experts), axis=1)
    return num_experts * jnp.mean(jnp.sum(jax.lax.stop_gradient(f_BxE) * p_BxE, axis=-1))


def router_z_loss(logits_TxE: jax.Array) -> jax.Array:
    """ST-MoE router z-loss mean(logsumexp(logits)^2): keeps router logits from drifting large."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_TxE.astype(jnp.float32), axis=-1)))


def routing_entropy(scores_TxE: jax.Array) -> jax.Array:
    """Mean per-token entropy (nats) of the normalised router distribution; log(E) = undecided router."""
    p = normalized_probs(scores_TxE)
    return jnp.mean(-jnp.sum(p * jnp.log(p + 1e-20), axis=-1))


# ------------------------------------------------------------------------------------------
# Dispatch backends: all map (x_TxD, routing, expert weights) -> (y_TxD, dropped fraction)


def capacity(num_tokens: int, cfg: MoEConfig) -> int:
    """Per-expert buffer rows C = ceil(capacity_factor * T * k / E), never more than T (no expert
    can receive more than T assignments because a token's k experts are distinct)."""
    return min(num_tokens, int(math.ceil(cfg.capacity_factor * num_tokens * cfg.top_k / cfg.num_experts)))


def _combine(out_AxD: jax.Array, weights_TxK: jax.Array) -> jax.Array:
    """Weighted sum of each token's k expert outputs, accumulated in float32."""
    t, k = weights_TxK.shape
    combined = jnp.einsum("tkd,tk->td", out_AxD.reshape(t, k, -1), weights_TxK.astype(jnp.float32),
                          preferred_element_type=jnp.float32)
    return combined.astype(out_AxD.dtype)


def _batched_experts(x_ExCxD: jax.Array, experts: dict) -> jax.Array:
    gate = jnp.einsum("ecd,edf->ecf", x_ExCxD, experts["w_gate"])
    up = jnp.einsum("ecd,edf->ecf", x_ExCxD, experts["w_up"])
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, experts["w_down"])


def expert_ranks(ids_A: jax.Array, num_experts: int, *, max_onehot_elements: int = 1 << 24) -> jax.Array:
    """Each assignment's rank among earlier assignments to the same expert (its buffer row).

    A running count over a one-hot [A, E] matrix is ~3x cheaper than a sort on CPU; for large A*E
    (hundreds of experts on accelerators) a stable argsort keeps memory linear in A.
    """
    num_assign = ids_A.shape[0]
    if num_assign * num_experts <= max_onehot_elements:
        onehot_AxE = jax.nn.one_hot(ids_A, num_experts, dtype=jnp.int32)
        return jnp.sum((jnp.cumsum(onehot_AxE, axis=0) - 1) * onehot_AxE, axis=1)
    order_A = jnp.argsort(ids_A, stable=True)
    counts_E = jnp.bincount(ids_A, length=num_experts)
    starts_E = jnp.cumsum(counts_E) - counts_E
    rank_sorted_A = jnp.arange(num_assign, dtype=jnp.int32) - starts_E[ids_A[order_A]]
    return jnp.zeros((num_assign,), jnp.int32).at[order_A].set(rank_sorted_A)


@jax.custom_vjp
def _rows_to_slots(x_TxD: jax.Array, token_of_slot_S: jax.Array, slot_TxK: jax.Array) -> jax.Array:
    """buffer[s] = x[token_of_slot[s]] (row T = zeros). The backward is a gather too: token t's
    gradient is the sum of its k slots' gradients (dropped assignments point at the zero row)."""
    return jnp.concatenate([x_TxD, jnp.zeros((1, x_TxD.shape[1]), x_TxD.dtype)])[token_of_slot_S]


def _rows_to_slots_fwd(x_TxD, token_of_slot_S, slot_TxK):
    return _rows_to_slots(x_TxD, token_of_slot_S, slot_TxK), (token_of_slot_S, slot_TxK)


def _rows_to_slots_bwd(residuals, d_buffer_SxD):
    token_of_slot_S, slot_TxK = residuals
    padded = jnp.concatenate([d_buffer_SxD, jnp.zeros((1, d_buffer_SxD.shape[1]), d_buffer_SxD.dtype)])
    return jnp.sum(padded[slot_TxK], axis=1), None, None


_rows_to_slots.defvjp(_rows_to_slots_fwd, _rows_to_slots_bwd)


@jax.custom_vjp
def _slots_to_assignments(out_SxD: jax.Array, slot_A: jax.Array, assignment_of_slot_S: jax.Array) -> jax.Array:
    """out_A[a] = out[slot[a]] (row S = zeros for dropped assignments). Each slot holds at most one
    assignment, so the backward is the inverse gather instead of XLA's scatter-add."""
    return jnp.concatenate([out_SxD, jnp.zeros((1, out_SxD.shape[1]), out_SxD.dtype)])[slot_A]


def _slots_to_assignments_fwd(out_SxD, slot_A, assignment_of_slot_S):
    return _slots_to_assignments(out_SxD, slot_A, assignment_of_slot_S), (slot_A, assignment_of_slot_S)


def _slots_to_assignments_bwd(residuals, d_out_AxD):
    slot_A, assignment_of_slot_S = residuals
    padded = jnp.concatenate([d_out_AxD, jnp.zeros((1, d_out_AxD.shape[1]), d_out_AxD.dtype)])
    return padded[assignment_of_slot_S], None, None


_slots_to_assignments.defvjp(_slots_to_assignments_fwd, _slots_to_assignments_bwd)


def dispatch_capacity(x_TxD: jax.Array, routing: Routing, experts: dict, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Assignments into fixed ``[E, C, D]`` buffers, one batched einsum, gathered back.

    An assignment's buffer row is its rank among the assignments of the same expert (earlier tokens
    first); ranks >= C are dropped and contribute zero. Rows move by gathers only, forward and backward:
    integer scatters record which token fills each buffer row and which assignment owns it, and custom
    VJPs gather through those inverse maps instead of letting XLA emit float scatter-adds (MaxText does
    the same for its sort). Deterministic, and several times cheaper on CPU.
    """
    t, d = x_TxD.shape
    e, k = cfg.num_experts, cfg.top_k
    c = capacity(t, cfg)
    ids_A = routing.expert_ids_TxK.reshape(-1)
    num_assign = ids_A.shape[0]
    rank_A = expert_ranks(ids_A, e)
    kept_A = rank_A < c
    slot_A = jnp.where(kept_A, ids_A * c + rank_A, e * c)  # e*c = the zero / discard row
    assignment_A = jnp.arange(num_assign, dtype=jnp.int32)
    token_of_slot = jnp.full((e * c + 1,), t, jnp.int32).at[slot_A].set(assignment_A // k)[: e * c]
    assignment_of_slot = jnp.full((e * c + 1,), num_assign, jnp.int32).at[slot_A].set(assignment_A)[: e * c]
    buffer_ExCxD = _rows_to_slots(x_TxD, token_of_slot, slot_A.reshape(t, k)).reshape(e, c, d)
    out_ExCxD = _batched_experts(buffer_ExCxD, experts)
    out_AxD = _slots_to_assignments(out_ExCxD.reshape(e * c, d), slot_A, assignment_of_slot)
    return _combine(out_AxD, routing.weights_TxK), 1.0 - jnp.mean(kept_A.astype(jnp.float32))


def dispatch_ragged(x_TxD: jax.Array, routing: Routing, experts: dict, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Dropless: sort assignments by expert and run grouped GEMMs with ``jax.lax.ragged_dot``."""
    e, k = cfg.num_experts, cfg.top_k
    ids_A = routing.expert_ids_TxK.reshape(-1)
    order_A = jnp.argsort(ids_A, stable=True)
    group_sizes_E = jnp.bincount(ids_A, length=e).astype(jnp.int32)
    x_sorted = x_TxD[order_A // k]
    gate = jax.lax.ragged_dot(x_sorted, experts["w_gate"], group_sizes_E)
    up = jax.lax.ragged_dot(x_sorted, experts["w_up"], group_sizes_E)
    out_sorted = jax.lax.ragged_dot(jax.nn.silu(gate) * up, experts["w_down"], group_sizes_E)
    out_A = jnp.zeros_like(out_sorted).at[order_A].set(out_sorted)
    return _combine(out_A, routing.weights_TxK), jnp.zeros((), jnp.float32)


def dispatch_dense(x_TxD: jax.Array, routing: Routing, experts: dict, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Oracle: every expert on every token, weighted by the sparse combine weights (E/k x the FLOPs)."""
    combine_TxE = jnp.sum(
        jax.nn.one_hot(routing.expert_ids_TxK, cfg.num_experts, dtype=jnp.float32) * routing.weights_TxK[..., None],
        axis=1,
    )
    out_ExTxD = _batched_experts(jnp.broadcast_to(x_TxD, (cfg.num_experts, *x_TxD.shape)), experts)
    y_TxD = jnp.einsum("te,etd->td", combine_TxE, out_ExTxD, preferred_element_type=jnp.float32)
    return y_TxD.astype(x_TxD.dtype), jnp.zeros((), jnp.float32)


def _expert_parallel(name: str):
    """A dispatch of ``trainer.expert_parallel`` (shard_map over the mesh; it imports this module, so it is
    looked up when traced)."""

    def dispatch(x_TxD: jax.Array, routing: Routing, experts: dict, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
        from trainer import expert_parallel

        return getattr(expert_parallel, f"dispatch_{name}")(x_TxD, routing, experts, cfg)

    return dispatch


_DISPATCH = {
    "capacity": dispatch_capacity,
    "ragged": dispatch_ragged,
    "dense": dispatch_dense,
    "alltoall": _expert_parallel("alltoall"),
    "ragged_alltoall": _expert_parallel("ragged_alltoall"),
}


# ------------------------------------------------------------------------------------------
# The MoE FFN


def moe_ffn(
    params: dict, x_TxD: jax.Array, bias_E: jax.Array, cfg: MoEConfig, *, batch: int, dispatch: str
) -> tuple[jax.Array, dict]:
    """Routed experts (optionally in a latent space) plus always-on shared experts.

    Returns the FFN output and this layer's statistics: expert counts, drop fraction, entropy,
    balance and z losses, and (quantile balancing) the next-step bias target. Tokens arrive flattened
    to [T = batch * L, D]; `batch` is needed only by the sequence-wise balance loss.
    """
    if dispatch not in _DISPATCH:
        raise ValueError(f"unknown MoE dispatch {dispatch!r}; choose one of {DISPATCH_BACKENDS}.")
    logits_TxE = x_TxD.astype(jnp.float32) @ params["router"].astype(jnp.float32)
    routing = route(logits_TxE, bias_E, cfg)

    expert_in = x_TxD @ params["latent_down"] if cfg.latent_dim else x_TxD
    if cfg.latent_dim and cfg.latent_norm:  # Marin's latent_norm; eps = its layer_norm_eps
        expert_in = rms_norm(expert_in, params["latent_norm"], LATENT_NORM_EPS)
    routed, drop_fraction = _DISPATCH[dispatch](expert_in, routing, params["experts"], cfg)
    if cfg.latent_dim:
        routed = routed @ params["latent_up"]
    y_TxD = routed
    if cfg.num_shared_experts:
        shared = params["shared"]
        y_TxD = y_TxD + swiglu(x_TxD, shared["w_gate"], shared["w_up"], shared["w_down"])

    stats = {
        "expert_counts": expert_counts(routing.expert_ids_TxK, cfg.num_experts),
        "drop_fraction": drop_fraction,
        "routing_entropy": routing_entropy(routing.scores_TxE),
        "router_z_loss": router_z_loss(logits_TxE),
        "router_aux_loss": _aux_loss(routing, cfg, batch=batch),
    }
    if routing.qb_bias_E is not None:
        stats["qb_bias"] = routing.qb_bias_E
        stats["qb_required_bias"] = routing.qb_required_bias_TxE
    return y_TxD, stats


def _aux_loss(routing: Routing, cfg: MoEConfig, *, batch: int) -> jax.Array:
    if cfg.aux_loss == "switch":
        return switch_aux_loss(routing, cfg.num_experts)
    if cfg.aux_loss == "sequence":
        return sequence_aux_loss(routing, cfg.num_experts, batch)
    return jnp.zeros((), jnp.float32)
