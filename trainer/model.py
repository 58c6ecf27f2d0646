"""The decoder-only MoE language model as pure functions over a nested dict of float32 arrays.

Why plain pytrees: the same params feed jit, grad, optax, orbax and sharding rules with no framework in
between (measured: the lowest per-step overhead on CPU, see docs/trainer_notes.md), and a
parameter's path names its role, which is all ``param_groups`` and ``trainer.sharding`` need.

Architecture (what ``ModelConfig`` can express): token embedding -> L pre-norm blocks -> RMSNorm ->
tied or untied output head. Each block is rotary attention with grouped-query heads (global layers may
use a different number of KV heads, as Marin's rungs do), a sliding window on local layers with every
n-th layer and the last one global, then an FFN that is a dense SwiGLU or a routed MoE
(``trainer.moe``). The loss is next-token cross-entropy plus an output-logit z-loss and the router's
balance and z losses, each with its configured weight.

Marin's hero block is expressible too (``trainer.blocks``, each piece a ModelConfig field that is off by
default): GatedNorm after the attention/FFN RMSNorms (``attn_gated_norm``/``ffn_gated_norm`` = {w_down, w_up};
``embed_norm`` + ``embed_gated_norm`` and ``final_gated_norm`` outside the blocks), short causal convolutions
(``attention.sconv_k``/``sconv_v``, ``sconv_attn``, ``sconv_ffn``, kernels [W, C]), q/k RMS with ``qk_mult``,
RoPE on local layers only and on part of each head, XSA, the per-head gate ``attention.head_gate`` [D, H],
Marin's stored-max KV layout and ``ffn.latent_norm``. ``param_groups`` labels the new leaves ``gated_norm``
(matrices: MuonH in Marin), ``attention_gate`` and ``conv`` (Adam in Marin, not to be weight-decayed) and
``norm`` for every 1-D gain.

The router bias is not a parameter: it lives in ``RouterState`` (``{"bias": f32[n_moe_layers, E]}``),
changes only through ``update_router_state`` after each optimizer step, and never receives a gradient.

By default layers are unrolled in Python (per-layer params ``"000"``, ``"001"``, ...). With
``ModelConfig.scan_layers`` the repeating units of equal-signature blocks (dense/MoE, window, KV heads,
param shapes) are stored stacked and run under ``lax.scan``, so compile time stays flat as depth grows
(``trainer.layers_scan`` has the plan and the layout; bench/RESULTS_trainer_compile.md the measurements);
the numbers equal the unrolled loop's (tests/test_trainer_scan.py). Each block is one function
(``_block``) so that a rematerialisation policy (``remat_policy``) can wrap it in ``jax.checkpoint``:
trading backward-pass recompute for activation memory is what lets big steps fit (the capacity plan
models the same policies). Names carry shape suffixes (B batch, L length, D width, H query heads,
G kv heads, K head dim, V vocab).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainer import blocks as pieces
from trainer import layers_scan
from trainer import moe as moe_lib
from trainer.config import ModelConfig

Params = dict[str, Any]
RouterState = dict[str, jax.Array]

_MASKED = -1e9  # additive mask; finite so a fully masked row could never produce NaN


# ------------------------------------------------------------------------------------------
# Shapes and initialisation


def layer_kv_heads(cfg: ModelConfig, layer: int) -> int:
    """KV heads of one layer: global layers may use fewer (Marin: 1-6 global vs 1-12 local)."""
    return cfg.resolved_global_kv_heads if cfg.is_global_layer(layer) else cfg.resolved_kv_heads


def layer_stored_kv_heads(cfg: ModelConfig, layer: int) -> int:
    """KV heads a layer allocates: its own (``kv_heads_layout="per_layer"``) or Marin's max(local, global)
    on every layer, of which a global layer uses the first ``global_kv_heads``."""
    return cfg.stored_kv_heads if cfg.kv_heads_layout == "stored_max" else layer_kv_heads(cfg, layer)


def layer_window(cfg: ModelConfig, layer: int) -> int | None:
    """Attention window of one layer, or None for full causal attention."""
    return None if cfg.is_global_layer(layer) else cfg.sliding_window


def moe_layer_indices(cfg: ModelConfig) -> list[int]:
    return [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]


def _ffn_shapes(cfg: ModelConfig, layer: int) -> dict:
    d = cfg.hidden_dim
    if not cfg.is_moe_layer(layer):
        f = cfg.resolved_dense_ffn_dim
        return {"w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    m = cfg.moe
    assert m is not None
    din = m.latent_dim or d
    shapes: dict = {
        "router": (d, m.num_experts),
        "experts": {
            "w_gate": (m.num_experts, din, m.expert_dim),
            "w_up": (m.num_experts, din, m.expert_dim),
            "w_down": (m.num_experts, m.expert_dim, din),
        },
    }
    if m.latent_dim:
        shapes["latent_down"] = (d, m.latent_dim)
        shapes["latent_up"] = (m.latent_dim, d)
        if m.latent_norm:
            shapes["latent_norm"] = (m.latent_dim,)
    if m.num_shared_experts:
        width = m.num_shared_experts * (m.shared_expert_dim or m.expert_dim)
        # n shared SwiGLU experts that are always on are exactly one SwiGLU of n-fold width.
        shapes["shared"] = {"w_gate": (d, width), "w_up": (d, width), "w_down": (width, d)}
    return shapes


def param_shapes(cfg: ModelConfig) -> dict:
    """The parameter pytree as shapes only: the single source of truth for init, accounting and sharding."""
    d, h, k = cfg.hidden_dim, cfg.num_heads, cfg.resolved_head_dim
    blocks = {}
    gated = {"w_down": (d, cfg.gated_norm_rank), "w_up": (cfg.gated_norm_rank, d)} if cfg.gated_norm_rank else None
    conv = cfg.sconv_kernel
    for i in range(cfg.num_layers):
        g = layer_stored_kv_heads(cfg, i)
        attention = {"wq": (d, h, k), "wk": (d, g, k), "wv": (d, g, k), "wo": (h, k, d)}
        if cfg.head_gate:
            attention["head_gate"] = (d, h)
        for site in ("k", "v"):
            if cfg.sconv_at(site):
                attention[f"sconv_{site}"] = (conv, g * k)
        block: dict = {"attn_norm": (d,)}
        if gated:
            block["attn_gated_norm"] = dict(gated)
        block["attention"] = attention
        if cfg.sconv_at("attn"):
            block["sconv_attn"] = (conv, d)
        block["ffn_norm"] = (d,)
        if gated:
            block["ffn_gated_norm"] = dict(gated)
        block["ffn"] = _ffn_shapes(cfg, i)
        if cfg.sconv_at("mlp"):
            block["sconv_ffn"] = (conv, d)
        blocks[f"{i:03d}"] = block
    shapes: dict = {"embed": (cfg.vocab_size, d), "blocks": blocks, "final_norm": (d,)}
    if cfg.embed_norm:
        shapes["embed_norm"] = (d,)
        if gated:
            shapes["embed_gated_norm"] = dict(gated)
    if gated:
        shapes["final_gated_norm"] = dict(gated)
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    if cfg.scan_layers:  # the stacked layout of trainer/layers_scan.py: a leading axis per scanned segment
        stack = lambda per_layer: (len(per_layer), *per_layer[0])  # noqa: E731
        shapes["blocks"] = layers_scan.stack_blocks(blocks, layer_segments(cfg), stack, is_leaf=_is_shape)
    return shapes


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def _unrolled(cfg: ModelConfig) -> ModelConfig:
    return cfg.model_copy(update={"scan_layers": False}) if cfg.scan_layers else cfg


def layer_signature(cfg: ModelConfig, layer: int) -> tuple:
    """What makes a layer's block a different program: everything ``_block`` reads from its layer index
    (dense or MoE, global or local, attention window, KV heads used) and the tree of its parameter shapes
    (every piece a block holds). Layers of equal signature can share a scan."""
    shapes = param_shapes(_unrolled(cfg))["blocks"][f"{layer:03d}"]
    paths = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)[0]
    uses = (cfg.is_moe_layer(layer), cfg.is_global_layer(layer), layer_window(cfg, layer), layer_kv_heads(cfg, layer))
    return (*uses, tuple((jax.tree_util.keystr(p), s) for p, s in paths))


@functools.lru_cache(maxsize=64)
def layer_segments(cfg: ModelConfig) -> tuple[layers_scan.Segment, ...]:
    """How ``forward`` runs the layers with ``cfg.scan_layers``: scanned segments and unrolled layers."""
    return layers_scan.plan_segments([layer_signature(cfg, i) for i in range(cfg.num_layers)])


def stack_params(params: Params, cfg: ModelConfig) -> Params:
    """Unrolled-layout params (``"000"``, ``"001"``, ...) in the stacked layout of ``cfg`` (``scan_layers``)."""
    blocks = layers_scan.stack_blocks(params["blocks"], layer_segments(cfg), jnp.stack)
    return {**params, "blocks": blocks}


def unstack_params(params: Params, cfg: ModelConfig) -> Params:
    """Stacked-layout params (or gradients) back in the unrolled layout: the exact inverse of ``stack_params``."""
    return {**params, "blocks": layers_scan.unstack_blocks(params["blocks"], layer_segments(cfg))}


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Normal(0, init_std) matrices (Marin: 0.5/sqrt(d)), unit RMSNorm gains; float32.

    Compiled as one program: drawing leaf by leaf eagerly costs a compile per distinct shape. With
    ``cfg.scan_layers`` the unrolled draw is stacked, so a scanned model starts from its unrolled twin's weights.
    """
    if cfg.scan_layers:
        return stack_params(_init_params_jit(_unrolled(cfg), key), cfg)
    return _init_params_jit(cfg, key)


@functools.partial(jax.jit, static_argnums=0)
def _init_params_jit(cfg: ModelConfig, key: jax.Array) -> Params:
    # Small models: one normal draw for all matrices, then sliced (a single threefry call compiles in a
    # fraction of the time of one draw per leaf). Large models: one draw per leaf, so that under jit with
    # output shardings no device materialises a flat copy of every parameter.
    shapes = param_shapes(cfg)
    paths_and_shapes, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)
    fixed = [_fixed_init(_group_of(_path_names(path))) for path, _ in paths_and_shapes]
    sizes = [int(np.prod(shape)) for _, shape in paths_and_shapes]
    std = cfg.resolved_init_std
    num_drawn = sum(n for n, constant in zip(sizes, fixed) if constant is None)
    draws = std * jax.random.normal(key, (num_drawn,), jnp.float32) if num_drawn <= _FLAT_INIT_MAX else None
    leaves, offset = [], 0
    for index, ((_, shape), size, constant) in enumerate(zip(paths_and_shapes, sizes, fixed)):
        if constant is not None:
            leaves.append(constant(shape))
        elif draws is None:
            leaves.append(std * jax.random.normal(jax.random.fold_in(key, index), shape, jnp.float32))
        else:
            leaves.append(draws[offset : offset + size].reshape(shape))
            offset += size
    return jax.tree_util.tree_unflatten(treedef, leaves)


_FLAT_INIT_MAX = 64 * 2**20  # parameters drawn in one flat vector (about 256 MB of float32)


def _fixed_init(group: str):
    """The deterministic initialiser of a group, or None for a Normal(0, init_std) draw: unit gains, identity
    convolutions and zero head gates (so each Marin piece starts as a pass-through: gate 2*sigmoid(0) = 1)."""
    return {
        "norm": lambda shape: jnp.ones(shape, jnp.float32),
        "conv": pieces.identity_conv_kernel,
        "attention_gate": lambda shape: jnp.zeros(shape, jnp.float32),
    }.get(group)


def init_router_state(cfg: ModelConfig) -> RouterState:
    """Zero selection bias per MoE layer and expert; {} for a dense model."""
    if cfg.moe is None:
        return {}
    return {"bias": jnp.zeros((len(moe_layer_indices(cfg)), cfg.moe.num_experts), jnp.float32)}


# ------------------------------------------------------------------------------------------
# Parameter groups


def _path_names(path) -> list[str]:
    return [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]


def _group_of(names: list[str]) -> str:
    last = names[-1]
    if names[0] == "embed":
        return "embedding"
    if names[0] == "lm_head":
        return "lm_head"
    if last.startswith("sconv_"):
        return "conv"
    if last == "head_gate":
        return "attention_gate"
    if any(name.endswith("gated_norm") for name in names):
        return "gated_norm"
    if last.endswith("norm"):
        return "norm"
    if "attention" in names:
        return "attention"
    if "router" in names:
        return "router"
    if "experts" in names:
        return "experts"
    if "shared" in names:
        return "shared_experts"
    if last.startswith("latent_"):
        return "latent_projection"
    return "dense_ffn"


def param_groups(params: Params) -> Any:
    """Same structure as params, each leaf replaced by its group name (weight-decay masks, per-group norms).

    Groups: embedding, lm_head, norm (RMSNorm gains, latent_norm included), attention (wq/wk/wv/wo), router,
    experts, shared_experts, latent_projection, dense_ffn, and Marin's block pieces: gated_norm (the GatedNorm
    W_down/W_up matrices; Marin trains them with MuonH like other matrices), attention_gate (the per-head
    ``head_gate`` [D, H]; Adam in Marin) and conv (short-convolution kernels [W, C]; Adam in Marin, and
    identity-initialised, so they should not be weight-decayed towards zero).
    """
    return jax.tree_util.tree_map_with_path(lambda path, _: _group_of(_path_names(path)), params)


# ------------------------------------------------------------------------------------------
# Building blocks


rms_norm = pieces.rms_norm  # RMSNorm with a learned gain (lives in trainer.blocks so trainer.moe can use it too)


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [L, K/2] for rotary position embedding (static, so XLA folds them)."""
    inv_freq = theta ** (-np.arange(0, head_dim // 2, dtype=np.float64) * 2.0 / head_dim)
    angles_LxK2 = np.arange(seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles_LxK2).astype(np.float32), np.sin(angles_LxK2).astype(np.float32)


def apply_rotary(x_BxLxHxK: jax.Array, cos_LxK2: np.ndarray, sin_LxK2: np.ndarray) -> jax.Array:
    """Rotate channel pairs (i, i + K/2) by position-dependent angles: relative position in q.k.

    With tables for fewer channels than K (``ModelConfig.rope_fraction`` < 1, Marin's half-RoPE) only the
    first 2 * K2 channels rotate; the rest pass through without position."""
    rotary = 2 * cos_LxK2.shape[-1]
    if rotary < x_BxLxHxK.shape[-1]:
        rotated = apply_rotary(x_BxLxHxK[..., :rotary], cos_LxK2, sin_LxK2)
        return jnp.concatenate([rotated, x_BxLxHxK[..., rotary:]], axis=-1)
    half = x_BxLxHxK.shape[-1] // 2
    cos, sin = cos_LxK2[:, None, :], sin_LxK2[:, None, :]
    x1, x2 = x_BxLxHxK[..., :half], x_BxLxHxK[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention_mask_bias(seq_len: int, window: int | None) -> np.ndarray:
    """Additive [L, L] mask: causal, and within `window` positions (self included) on local layers."""
    q = np.arange(seq_len)[:, None]
    k = np.arange(seq_len)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    return np.where(allowed, 0.0, _MASKED).astype(np.float32)


def query_block_size(seq_len: int) -> int:
    """Query rows per attention block: 64, or more so that there are at most 16 blocks."""
    return max(64, -(-seq_len // 16))


@jax.custom_vjp
def _masked_softmax_attention(q_BxGxRxK, k_BxGxSxK, v_BxGxSxK, mask_RxS):
    """softmax(q k^T + mask) v over rows R (query heads x positions) and keys S."""
    return _attention_forward(q_BxGxRxK, k_BxGxSxK, v_BxGxSxK, mask_RxS)[0]


def _attention_forward(q, k, v, mask_RxS):
    scores = jnp.einsum("bgrk,bgsk->bgrs", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores + mask_RxS, axis=-1)  # float32 whatever the compute dtype
    out = jnp.einsum("bgrs,bgsk->bgrk", probs.astype(v.dtype), v)
    return out, (q, k, v, probs, out)


def _attention_backward(residuals, d_out):
    """Hand-written backward (FlashAttention's delta = rowsum(dO * O) form): ~25% faster on CPU than
    autodiff, which materialises the softmax Jacobian product less directly."""
    q, k, v, probs, out = residuals
    f32 = jnp.float32
    d_v = jnp.einsum("bgrs,bgrk->bgsk", probs.astype(v.dtype), d_out)
    d_probs = jnp.einsum("bgrk,bgsk->bgrs", d_out, v, preferred_element_type=f32)
    delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1, keepdims=True)
    d_scores = (probs * (d_probs - delta)).astype(q.dtype)
    d_q = jnp.einsum("bgrs,bgsk->bgrk", d_scores, k)
    d_k = jnp.einsum("bgrs,bgrk->bgsk", d_scores, q)
    return d_q, d_k, d_v.astype(v.dtype), None


_masked_softmax_attention.defvjp(_attention_forward, _attention_backward)


def attention(
    p: dict,
    x_TxD: jax.Array,
    batch: int,
    cfg: ModelConfig,
    window: int | None,
    *,
    kv_heads: int | None = None,
    rope: bool = True,
) -> jax.Array:
    """Rotary grouped-query attention over tokens flattened to [T = B*L, D], written as plain GEMMs.

    - Projections are 2-D matmuls on [T, D] (XLA:CPU ran a 3-D SwiGLU 3-4x slower than the same
      flattened one).
    - Query heads sharing a KV head are folded into the row dimension ([B, G, (H/G)*Lq, K] x
      [B, G, Lk, K]), so each KV head is read once.
    - Queries are processed in blocks that only see the keys their mask can allow: keys after the
      block (causal) and before its window are never computed, which cuts causal score FLOPs to
      ~(n+1)/2n of full attention and local layers to about their window.
    - The block core has a hand-written backward (see ``_attention_backward``).
    Measured on this 2-core CPU, one layer fwd+bwd incl. projections, B16 L256 H4 K32 (median of 12,
    interleaved): 32 ms here, against 58 ms for one full masked einsum and 70 ms for
    ``jax.nn.dot_product_attention(is_causal=True)``.

    Marin's pieces (``trainer.blocks``, each behind its ModelConfig field): short causal convolutions on the
    flat K/V projections (``sconv_k``/``sconv_v``), then ``kv_heads`` < allocated heads keeps the first ones
    (``kv_heads_layout="stored_max"`` on a global layer); non-parametric q/k RMS (``qk_norm``); RoPE only when
    ``rope`` (``_block`` turns it off on global layers when ``rope_global_layers`` is False) and on the first
    ``cfg.rotary_dim`` channels; queries scaled by ``qk_mult / sqrt(head_dim)``; after the core, XSA and the
    per-head gate ``2 * sigmoid(x @ head_gate)``, then ``wo``.
    """
    d = x_TxD.shape[-1]
    length = x_TxD.shape[0] // batch
    _, num_heads, head_dim = p["wq"].shape
    num_kv = kv_heads or p["wk"].shape[1]
    group = num_heads // num_kv
    cos, sin = rotary_tables(length, cfg.rotary_dim, cfg.rope_theta)

    def project(w_DxNxK: jax.Array, conv: str | None = None) -> jax.Array:
        n = w_DxNxK.shape[1]
        flat_TxNK = x_TxD @ w_DxNxK.reshape(d, n * head_dim)
        if conv is not None and conv in p:
            flat_TxNK = pieces.short_causal_conv_tokens(flat_TxNK, p[conv], batch)
        out = flat_TxNK.reshape(batch, length, n, head_dim)
        return out[:, :, :num_kv] if conv is not None and n > num_kv else out

    def position(x_BxLxNxK: jax.Array) -> jax.Array:
        if cfg.qk_norm:
            x_BxLxNxK = pieces.qk_rms(x_BxLxNxK)
        return apply_rotary(x_BxLxNxK, cos, sin) if rope else x_BxLxNxK

    q_BxGxNxLxK = (
        (position(project(p["wq"])) * (cfg.qk_mult * head_dim**-0.5))
        .transpose(0, 2, 1, 3)
        .reshape(batch, num_kv, group, length, head_dim)
    )
    k_BxGxLxK = position(project(p["wk"], "sconv_k")).transpose(0, 2, 1, 3)
    v_BxLxGxK = project(p["wv"], "sconv_v")
    v_BxGxLxK = v_BxLxGxK.transpose(0, 2, 1, 3)
    mask_LxL = attention_mask_bias(length, window)
    block = query_block_size(length)
    outputs = []
    for q_start in range(0, length, block):
        q_end = min(length, q_start + block)
        k_start = 0 if window is None else max(0, q_start - window + 1)
        rows = group * (q_end - q_start)
        q_rows = q_BxGxNxLxK[:, :, :, q_start:q_end].reshape(batch, num_kv, rows, head_dim)
        mask_RxS = np.tile(mask_LxL[q_start:q_end, k_start:q_end], (group, 1))  # same mask for each head of a group
        out = _masked_softmax_attention(
            q_rows, k_BxGxLxK[:, :, k_start:q_end], v_BxGxLxK[:, :, k_start:q_end], jnp.asarray(mask_RxS)
        )
        outputs.append(out.reshape(batch, num_heads, q_end - q_start, head_dim))
    out_BxLxHxK = jnp.concatenate(outputs, axis=2).transpose(0, 2, 1, 3)
    if cfg.xsa:  # query head h reads KV head h // group, so that is "its own" value vector
        out_BxLxHxK = pieces.exclusive_self_attention(out_BxLxHxK, jnp.repeat(v_BxLxGxK, group, axis=2))
    if cfg.head_gate:
        gate_BxLxHx1 = pieces.head_gate(x_TxD, p["head_gate"]).reshape(batch, length, num_heads, 1)
        out_BxLxHxK = out_BxLxHxK * gate_BxLxHx1.astype(out_BxLxHxK.dtype)
    out_TxHK = out_BxLxHxK.reshape(-1, num_heads * head_dim)
    return out_TxHK @ p["wo"].reshape(num_heads * head_dim, d)


def dense_ffn(p: dict, x_TxD: jax.Array) -> jax.Array:
    return moe_lib.swiglu(x_TxD, p["w_gate"], p["w_up"], p["w_down"])


# ------------------------------------------------------------------------------------------
# Forward and loss


def cast_for_compute(params: Params, cfg: ModelConfig) -> Params:
    """Matmul weights in the compute dtype (bf16 on accelerators); norms and the router stay float32.

    The residual stream follows the embedding's dtype; norms, softmax, router scores and the loss are
    computed in float32 regardless, so bf16 only touches the GEMMs.
    """
    if cfg.compute_dtype == "float32":
        return params
    dtype = jnp.dtype(cfg.compute_dtype)
    groups = param_groups(params)
    return jax.tree.map(lambda w, g: w if g in ("norm", "router") else w.astype(dtype), params, groups)


REMAT_POLICIES = ("none", "full", "save_dots")


def remat_policy(remat: str):
    """The ``jax.checkpoint`` policy of a ``TrainConfig.remat`` value ("none" is not a policy: no checkpoint).

    "full": nothing saveable, so only each block's inputs are kept and the whole block is recomputed in
    the backward pass. "save_dots": ``dots_with_no_batch_dims_saveable``. Every projection here is a
    2-D GEMM on [T, D] (QKV/O, dense FFN, router, shared experts, latent projections), so their
    outputs are saved; the dots with batch dims are recomputed: the attention core ([B, G] batched,
    the part quadratic in the context) and the routed experts' ``[E, C, F]`` einsums, which hold most
    of an MoE layer's activations. That matches MaxText's "minimal" policy on a model whose batch
    is flattened into the GEMMs' row dimension.
    """
    if remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    if remat == "save_dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    raise ValueError(f"unknown remat {remat!r}; choose one of {REMAT_POLICIES}.")


def _block(
    block: dict, x_TxD: jax.Array, bias_E: jax.Array | None, *, cfg: ModelConfig, layer: int, batch: int, dispatch: str
) -> tuple[jax.Array, dict]:
    """One pre-norm transformer block: the unit a remat policy checkpoints.

    With Marin's pieces on: RMSNorm -> GatedNorm -> attention -> short conv -> residual, then RMSNorm ->
    GatedNorm -> FFN (routed + shared) -> short conv -> residual (``trainer.blocks``).
    """
    h_TxD = _pre_norm(block, "attn", x_TxD, cfg)
    rope = cfg.rope_global_layers or not cfg.is_global_layer(layer)
    a_TxD = attention(
        block["attention"], h_TxD, batch, cfg, layer_window(cfg, layer), kv_heads=layer_kv_heads(cfg, layer), rope=rope
    )
    x_TxD = x_TxD + _branch_conv(block, "sconv_attn", a_TxD, batch)
    h_TxD = _pre_norm(block, "ffn", x_TxD, cfg)
    if bias_E is None:
        return x_TxD + _branch_conv(block, "sconv_ffn", dense_ffn(block["ffn"], h_TxD), batch), {}
    assert cfg.moe is not None
    y_TxD, stats = moe_lib.moe_ffn(block["ffn"], h_TxD, bias_E, cfg.moe, batch=batch, dispatch=dispatch)
    return x_TxD + _branch_conv(block, "sconv_ffn", y_TxD, batch), stats


def _pre_norm(block: dict, branch: str, x_TxD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The branch's RMSNorm, then its GatedNorm when the block has one."""
    h_TxD = rms_norm(x_TxD, block[f"{branch}_norm"], cfg.norm_eps)
    gated = block.get(f"{branch}_gated_norm")
    return h_TxD if gated is None else pieces.gated_norm(gated, h_TxD)


def _branch_conv(block: dict, name: str, y_TxD: jax.Array, batch: int) -> jax.Array:
    """A branch output through its short causal convolution when the block has one."""
    return y_TxD if name not in block else pieces.short_causal_conv_tokens(y_TxD, block[name], batch)


def forward(
    params: Params,
    router_state: RouterState,
    tokens_BxL: jax.Array,
    cfg: ModelConfig,
    *,
    dispatch: str | None = None,
    remat: str = "none",
) -> tuple[jax.Array, list[dict]]:
    """Logits [B, L, V] (float32) and the per-MoE-layer router statistics.

    The residual stream is kept as [T = B*L, D] so every projection is a 2-D GEMM. ``remat`` other than
    "none" wraps each block in ``jax.checkpoint`` with ``remat_policy(remat)``: the values are the same,
    only what the backward pass keeps versus recomputes changes (it matters only under a gradient).
    """
    dispatch = dispatch or (cfg.moe.dispatch if cfg.moe else "dense")
    policy = None if remat == "none" else remat_policy(remat)
    params = cast_for_compute(params, cfg)
    batch, length = tokens_BxL.shape
    x_TxD = params["embed"][tokens_BxL.reshape(-1)]
    if "embed_norm" in params:  # Marin: RMSNorm (+ GatedNorm) on the embedding
        x_TxD = rms_norm(x_TxD, params["embed_norm"], cfg.norm_eps)
        if "embed_gated_norm" in params:
            x_TxD = pieces.gated_norm(params["embed_gated_norm"], x_TxD)

    def layer_fn(i: int):
        block_fn = functools.partial(_block, cfg=cfg, layer=i, batch=batch, dispatch=dispatch)
        if policy is not None:
            block_fn = jax.checkpoint(block_fn, policy=policy)
        return block_fn

    if cfg.scan_layers:
        x_TxD, layer_stats = _scanned_layers(layer_fn, params["blocks"], router_state, x_TxD, cfg)
    else:
        layer_stats = []
        moe_index = 0
        for i in range(cfg.num_layers):
            bias_E = router_state["bias"][moe_index] if cfg.is_moe_layer(i) else None
            x_TxD, stats = layer_fn(i)(params["blocks"][f"{i:03d}"], x_TxD, bias_E)
            if cfg.is_moe_layer(i):
                layer_stats.append(stats)
                moe_index += 1
    x_TxD = rms_norm(x_TxD, params["final_norm"], cfg.norm_eps)
    if "final_gated_norm" in params:
        x_TxD = pieces.gated_norm(params["final_gated_norm"], x_TxD)
    x_TxD = x_TxD.astype(params["embed"].dtype)
    head_DxV = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    logits_TxV = (x_TxD @ head_DxV).astype(jnp.float32)
    return logits_TxV.reshape(batch, length, -1), layer_stats


def _scanned_layers(
    layer_fn, blocks: dict, router_state: RouterState, x_TxD: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, list[dict]]:
    """The layers of ``layer_segments(cfg)`` over stacked blocks: each scanned segment is one ``lax.scan``
    whose body runs the unit's layers unrolled (each under its remat policy, so remat sits inside the
    scanned body); unrolled layers run as in the loop. Returns the per-MoE-layer stats in layer order.

    ``jax.checkpoint`` keeps ``prevent_cse=True`` here although JAX's docs say a scan makes it unneeded:
    measured on XLA:CPU (bench_trainer_compile's model, 16 layers, remat "full"), prevent_cse=False left
    36.4 MiB of temp memory against 16.9 MiB with it (the unrolled loop: 14.6 MiB).
    """
    moe_index = {layer: n for n, layer in enumerate(moe_layer_indices(cfg))}
    stats_of: dict[int, dict] = {}
    for segment in layer_segments(cfg):
        if not segment.scanned:
            i = segment.start
            bias_E = router_state["bias"][moe_index[i]] if i in moe_index else None
            x_TxD, stats = layer_fn(i)(blocks[segment.key], x_TxD, bias_E)
            if i in moe_index:
                stats_of[i] = stats
            continue
        positions = [layers_scan.position_key(j) for j in range(segment.unit)]
        unit_fns = [layer_fn(segment.start + j) for j in range(segment.unit)]
        biases_RxE = {
            key: router_state["bias"][np.array([moe_index[i] for i in segment.layers(j)])]
            for j, key in enumerate(positions)
            if segment.start + j in moe_index
        }

        def body(x_TxD, per_repeat, positions=positions, unit_fns=unit_fns):
            unit_params, unit_bias = per_repeat
            unit_stats = {}
            for key, fn in zip(positions, unit_fns):
                x_TxD, stats = fn(unit_params[key], x_TxD, unit_bias.get(key))
                if key in unit_bias:
                    unit_stats[key] = stats
            return x_TxD, unit_stats

        x_TxD, stacked = jax.lax.scan(body, x_TxD, (blocks[segment.key], biases_RxE))
        for j, key in enumerate(positions):
            for r, i in enumerate(segment.layers(j)):
                if key in stacked:
                    stats_of[i] = jax.tree.map(lambda a, r=r: a[r], stacked[key])
    return x_TxD, [stats_of[i] for i in sorted(stats_of)]


def _router_aux(layer_stats: list[dict], cfg: ModelConfig, num_tokens: int) -> dict:
    """Aggregate per-layer router statistics into the scalars LOOP logs and the state update needs."""
    zero = jnp.zeros((), jnp.float32)
    if not layer_stats:
        return {
            "router_aux_loss": zero,
            "router_z_loss": zero,
            "drop_fraction": zero,
            "routing_entropy": zero,
            "expert_load_min": zero,
            "expert_load_max": zero,
            "router_stats": {},
        }
    assert cfg.moe is not None

    def mean_over_layers(name: str) -> jax.Array:
        return jnp.mean(jnp.stack([s[name] for s in layer_stats]))

    counts_NxE = jnp.stack([s["expert_counts"] for s in layer_stats])
    router_stats = {"expert_counts": counts_NxE}
    if "qb_bias" in layer_stats[0]:
        router_stats["qb_bias"] = jnp.stack([s["qb_bias"] for s in layer_stats])
        router_stats["qb_required_bias"] = jnp.stack([s["qb_required_bias"] for s in layer_stats])
    return {
        "router_aux_loss": mean_over_layers("router_aux_loss"),
        "router_z_loss": mean_over_layers("router_z_loss"),
        "drop_fraction": mean_over_layers("drop_fraction"),
        "routing_entropy": mean_over_layers("routing_entropy"),
        **expert_load_extremes(counts_NxE, num_tokens, cfg),
        "router_stats": router_stats,
    }


def expert_load_extremes(counts_NxE: jax.Array, num_tokens: int, cfg: ModelConfig) -> dict[str, jax.Array]:
    """Least and most loaded expert (over all MoE layers) as a multiple of the uniform load T*k/E."""
    assert cfg.moe is not None
    uniform_load = num_tokens * cfg.moe.top_k / cfg.moe.num_experts
    return {"expert_load_min": jnp.min(counts_NxE) / uniform_load, "expert_load_max": jnp.max(counts_NxE) / uniform_load}


def loss_fn(
    params: Params,
    router_state: RouterState,
    batch_BxL1: jax.Array,
    cfg: ModelConfig,
    *,
    dispatch: str | None = None,
    remat: str = "none",
) -> tuple[jax.Array, dict]:
    """Training loss and its parts (``remat``: see ``forward``; the training step passes TrainConfig.remat).

    loss = CE + logit_z_loss_weight * mean(logsumexp(logits)^2)
              + aux_loss_weight * router_aux_loss + router_z_loss_weight * router_z_loss,
    where the router terms are means over MoE layers (so a weight means the same at any depth).
    """
    inputs_BxL, targets_BxL = batch_BxL1[:, :-1], batch_BxL1[:, 1:]
    logits_BxLxV, layer_stats = forward(params, router_state, inputs_BxL, cfg, dispatch=dispatch, remat=remat)
    lse_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    target_logits_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    lm_loss = jnp.mean(lse_BxL - target_logits_BxL)
    logit_z_loss = jnp.mean(jnp.square(lse_BxL))
    aux = {"lm_loss": lm_loss, "logit_z_loss": logit_z_loss, **_router_aux(layer_stats, cfg, inputs_BxL.size)}
    loss = lm_loss + cfg.logit_z_loss_weight * logit_z_loss
    if cfg.moe is not None:
        loss = loss + cfg.moe.aux_loss_weight * aux["router_aux_loss"]
        loss = loss + cfg.moe.router_z_loss_weight * aux["router_z_loss"]
    return loss, aux


def update_router_state(router_state: RouterState, aux: dict, cfg: ModelConfig) -> RouterState:
    """Next step's selection bias, applied outside the optimizer (pure, jittable).

    'bias': DeepSeek-V3 sign rule, bias += gamma * sign(mean_load - load) per layer.
    'quantile': Marin's QB, bias = the centred per-expert quantile computed in this step's forward.
    'none': unchanged.
    """
    if cfg.moe is None or not router_state:
        return router_state
    stats = aux["router_stats"]
    if cfg.moe.balancing == "bias":
        return {"bias": moe_lib.sign_rule_bias_update(router_state["bias"], stats["expert_counts"], cfg.moe.bias_update_rate)}
    if cfg.moe.balancing == "quantile":
        return {"bias": stats["qb_bias"].astype(jnp.float32)}
    return router_state
