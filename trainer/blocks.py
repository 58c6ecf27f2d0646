"""The pieces of Marin's hero block that a plain pre-norm transformer lacks, as pure functions.

Why they exist: a ladder only forecasts a hero trained with the same recipe, and Marin's 535B-A23B block
is not a plain Llama block. Each piece below is one formula, small enough to test against its definition
on a handful of numbers; ``trainer.model`` wires them in behind ``ModelConfig`` fields whose defaults
leave today's block unchanged. What each is for (Marin's ``experiments/grug/moe_hero_ep/model.py`` as
read; marin_hero_specs.md §2 in the team's notes):

- ``gated_norm``: after each RMSNorm (before attention, before the MLP, after the embedding and before
  the head), a low-rank (rank 128) gate ``x * sigmoid(silu(x W_down) W_up)`` lets the model re-scale
  channels per token, which the hyperball optimizer (fixed matrix norms) otherwise cannot.
- ``short_causal_conv``: a depthwise causal convolution over the sequence (kernel 4), ``out[t] =
  sum_j w[j] * x[t - j]``, on K, on the attention output and on the MLP output. Initialised to the
  identity (``w[0] = 1``), so a fresh model computes exactly what it would without it.
- ``qk_rms``: non-parametric RMS normalisation of each query and key head; with it the attention
  logits are bounded and ``qk_mult`` (1.3) sets their temperature on top of ``1/sqrt(head_dim)``.
- ``exclusive_self_attention`` (XSA): each head's output minus its component along that head's own
  value vector at the same position, ``z = y - (y.v / (|v|^2 + eps)) v``, so attention carries what the
  token does not already hold.
- ``head_gate``: one scalar per head and token, ``2 * sigmoid(x W_gate)`` (1 at init, W_gate = 0), on
  the attention output before ``w_o``.

Arrays are float32 or the compute dtype; every reduction runs in float32. Names carry shape suffixes
(B batch, L length, T = B*L tokens, D width, H heads, K head dim, C channels, W kernel taps, R rank).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QK_NORM_EPS = 1e-6  # Marin's non-parametric q/k rms_norm default
XSA_EPS = 1e-6  # added to |v|^2 in the XSA projection (Marin's constant)
GATED_NORM_RANK = 128  # Marin's _GATED_NORM_RANK
SCONV_KERNEL = 4  # Marin's sconv_kernel
SCONV_SITES = ("k", "attn", "mlp")  # the hero's sconv_sites (W&B config); "v" is also a site Marin's code knows


def rms_norm(x_TxD: jax.Array, gain_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm: rescale each position to unit root-mean-square, then a learned per-channel gain."""
    x32 = x_TxD.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps) * gain_D.astype(jnp.float32)
    return normed.astype(x_TxD.dtype)


def gated_norm(p: dict, x_TxD: jax.Array) -> jax.Array:
    """``x * sigmoid(silu(x @ w_down) @ w_up)`` with ``p = {"w_down": [D, R], "w_up": [R, D]}``."""
    hidden_TxR = jax.nn.silu(x_TxD @ p["w_down"].astype(x_TxD.dtype))
    logits_TxD = (hidden_TxR @ p["w_up"].astype(x_TxD.dtype)).astype(jnp.float32)
    return (x_TxD.astype(jnp.float32) * jax.nn.sigmoid(logits_TxD)).astype(x_TxD.dtype)


def short_causal_conv(x_BxLxC: jax.Array, kernel_WxC: jax.Array) -> jax.Array:
    """Depthwise causal convolution along L: ``out[b, t, c] = sum_j kernel[j, c] * x[b, t - j, c]``
    (terms with t - j < 0 are zero). A pad-and-shift sum: W is tiny, and it stays local to each shard of
    the batch (no cross-channel or cross-sequence dependency)."""
    length = x_BxLxC.shape[1]
    kernel = kernel_WxC.astype(x_BxLxC.dtype)
    out = kernel[0] * x_BxLxC
    for lag in range(1, kernel.shape[0]):
        if lag >= length:
            break
        shifted = jnp.pad(x_BxLxC, ((0, 0), (lag, 0), (0, 0)))[:, :length]
        out = out + kernel[lag] * shifted
    return out


def short_causal_conv_tokens(x_TxC: jax.Array, kernel_WxC: jax.Array, batch: int) -> jax.Array:
    """``short_causal_conv`` on a residual stream flattened to [T = B*L, C]."""
    c = x_TxC.shape[-1]
    return short_causal_conv(x_TxC.reshape(batch, -1, c), kernel_WxC).reshape(-1, c)


def identity_conv_kernel(shape: tuple[int, int]) -> jax.Array:
    """[W, C] kernel that passes its input through: tap 0 is 1, the earlier-position taps 0."""
    return jnp.zeros(shape, jnp.float32).at[0].set(1.0)


def qk_rms(x: jax.Array, eps: float = QK_NORM_EPS) -> jax.Array:
    """Non-parametric RMS normalisation over the last (head) dimension."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)).astype(x.dtype)


def exclusive_self_attention(y_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array, eps: float = XSA_EPS) -> jax.Array:
    """XSA: remove from each head's output ``y`` its component along the same head's value ``v`` at the same
    position, ``y - (y.v / (|v|^2 + eps)) v``. ``v`` is already expanded to the query heads (GQA)."""
    y32, v32 = y_BxLxHxK.astype(jnp.float32), v_BxLxHxK.astype(jnp.float32)
    dot = jnp.sum(y32 * v32, axis=-1, keepdims=True)
    norm_sq = jnp.sum(v32 * v32, axis=-1, keepdims=True)
    return (y32 - dot / (norm_sq + eps) * v32).astype(y_BxLxHxK.dtype)


def head_gate(x_TxD: jax.Array, w_DxH: jax.Array) -> jax.Array:
    """Per-token, per-head gate ``2 * sigmoid(x @ W_gate)`` [T, H] (float32; 1 everywhere when W_gate = 0)."""
    return 2.0 * jax.nn.sigmoid((x_TxD @ w_DxH.astype(x_TxD.dtype)).astype(jnp.float32))
