"""Parameter and FLOP accounting from a ModelConfig alone, and the peak FLOP/s that MFU divides by.

Why analytic: the ladder plans runs (steps, FLOPs, accelerator-hours) before anything is allocated,
and the forecaster's x-axis is compute. So every derived number comes from here, computed from the
config fields, and a test checks the analytic total against the initialised pytree.

Two conventions, both written down:

``convention="ladder"`` (ours; what ``throughput/mfu`` and metrics.jsonl ``flops`` use)
    Forward FLOPs per token = 2 x every matmul weight a token touches (attention q/k/v/o with each
    layer's own KV heads, router, k routed experts at their input width, latent projections, shared
    experts, dense FFNs, and Marin's GatedNorm matrices, per-head gates and short-conv taps: a multiply-add
    per weight too) + attention scores 4 * span * H * head_dim per layer, with span = seq_len on
    global layers and min(window, seq_len) on local ones (the full span, not the causal half: Levanter's
    and PaLM's convention) + the lm_head 2 * D * V (optional). Norms, softmax and elementwise ops are not
    counted. Training FLOPs = 3 x forward x tokens.
    ``ParamCounts.active`` excludes the embedding and the lm_head (reported separately).

``convention="marin"`` (reproduces Marin's published ladder numbers exactly)
    ``marin_active_params`` = Marin's ``small_scale_abl_launch._active_params``; ``marin_total_params``
    = the naming total behind "535B"; ``marin_forward_flops_per_token`` = ``train._compute_flops`` ->
    levanter ``lm_flops_per_token`` with its LatentMoE correction. Its quirks are kept on purpose:
    attention params use max(local, global) KV heads on every layer; routed-expert FLOPs are first
    priced at width d and then corrected to the latent width; the output projection is 2*d^2; the score
    term is span*H*(4*hd + 3); and the FLOPs code counts L // global_every global layers, although the
    model makes the last layer global too (d2048: 5 counted, 6 real). GatedNorm, sconv, attention gates
    and norms are in none of Marin's counts (they add ~0.03% to the hero, docs/marin_recipe.md §4c). With the
    block pieces declared, ``count_params(cfg).total`` plus the router bias (E per MoE layer; router state
    here, not a parameter) is Marin's exact count: 535,477,106,688 for the hero (#9277).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from trainer.config import ModelConfig

Convention = Literal["ladder", "marin"]


class ParamCounts(BaseModel):
    """Parameter counts by part. ``total`` is everything ``init_params`` allocates (the router bias is
    router state, not a parameter, and is not counted); ``active`` is what one token uses, excluding the
    embedding and the lm_head (both reported on their own)."""

    model_config = ConfigDict(frozen=True)

    total: int = Field(..., description="All parameters, as allocated by init_params.")
    active: int = Field(..., description="Parameters one token uses, excluding embedding and lm_head.")
    embedding: int = Field(..., description="Token embedding (also the output head when tied).")
    lm_head: int = Field(..., description="Untied output head; 0 when tied.")
    attention: int = Field(..., description="q/k/v/o projections of all layers.")
    norms: int = Field(..., description="RMSNorm gains.")
    router: int = Field(..., description="Router matrices.")
    routed_experts: int = Field(..., description="All routed experts of all layers.")
    routed_experts_active: int = Field(..., description="The top-k routed experts a token uses.")
    shared_experts: int = Field(..., description="Always-on shared experts.")
    latent_projection: int = Field(..., description="LatentMoE down/up projections.")
    dense_ffn: int = Field(..., description="SwiGLU FFNs of dense layers.")
    gated_norms: int = Field(0, description="GatedNorm W_down/W_up matrices (ModelConfig.gated_norm_rank).")
    attention_gates: int = Field(0, description="Per-head attention-output gates [D, H] (ModelConfig.head_gate).")
    convs: int = Field(0, description="Short causal convolution kernels [W, C] (ModelConfig.sconv_kernel).")

    @property
    def non_embedding_total(self) -> int:
        return self.total - self.embedding - self.lm_head


def _layer_kv_heads(cfg: ModelConfig, layer: int) -> int:
    """KV heads a layer allocates (and computes): its own, or max(local, global) in Marin's stored layout."""
    if cfg.kv_heads_layout == "stored_max":
        return cfg.stored_kv_heads
    return cfg.resolved_global_kv_heads if cfg.is_global_layer(layer) else cfg.resolved_kv_heads


def _attention_params(cfg: ModelConfig, layer: int) -> int:
    d, h, hd = cfg.hidden_dim, cfg.num_heads, cfg.resolved_head_dim
    return 2 * d * h * hd + 2 * d * _layer_kv_heads(cfg, layer) * hd


def _shared_width(cfg: ModelConfig) -> int:
    m = cfg.moe
    return 0 if m is None else m.num_shared_experts * (m.shared_expert_dim or m.expert_dim)


def count_params(cfg: ModelConfig) -> ParamCounts:
    """Analytic parameter counts; ``total`` equals the size of ``init_params(cfg)`` exactly."""
    d, L = cfg.hidden_dim, cfg.num_layers
    parts = dict(attention=0, router=0, routed_experts=0, routed_experts_active=0, shared_experts=0,
                 latent_projection=0, dense_ffn=0, gated_norms=0, attention_gates=0, convs=0)
    norms = (2 * L + 1) * d + (d if cfg.embed_norm else 0)
    one_gated_norm = 2 * d * cfg.gated_norm_rank if cfg.gated_norm_rank else 0
    parts["gated_norms"] = (2 * L + 1 + (1 if cfg.embed_norm else 0)) * one_gated_norm
    taps = cfg.sconv_kernel or 0
    for i in range(L):
        parts["attention"] += _attention_params(cfg, i)
        parts["attention_gates"] += d * cfg.num_heads if cfg.head_gate else 0
        kv_channels = _layer_kv_heads(cfg, i) * cfg.resolved_head_dim
        parts["convs"] += taps * sum(
            width for site, width in (("k", kv_channels), ("v", kv_channels), ("attn", d), ("mlp", d))
            if cfg.sconv_at(site)
        )
        if cfg.is_moe_layer(i):
            m = cfg.moe
            assert m is not None
            din = m.latent_dim or d
            one_expert = 3 * din * m.expert_dim
            parts["router"] += d * m.num_experts
            parts["routed_experts"] += m.num_experts * one_expert
            parts["routed_experts_active"] += m.top_k * one_expert
            parts["shared_experts"] += 3 * d * _shared_width(cfg)
            parts["latent_projection"] += 2 * d * m.latent_dim if m.latent_dim else 0
            norms += m.latent_dim if m.latent_dim and m.latent_norm else 0
        else:
            parts["dense_ffn"] += 3 * d * cfg.resolved_dense_ffn_dim
    embedding = cfg.vocab_size * d
    lm_head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
    active = norms + sum(v for k, v in parts.items() if k != "routed_experts")
    total = embedding + lm_head + norms + sum(v for k, v in parts.items() if k != "routed_experts_active")
    return ParamCounts(total=total, active=active, embedding=embedding, lm_head=lm_head, norms=norms, **parts)


# ------------------------------------------------------------------------------------------
# FLOPs (ladder convention)


def _attention_span(cfg: ModelConfig, layer: int) -> int:
    if cfg.is_global_layer(layer) or cfg.sliding_window is None:
        return cfg.seq_len
    return min(cfg.sliding_window, cfg.seq_len)


def ladder_forward_flops_per_token(cfg: ModelConfig, *, include_lm_head: bool = True) -> float:
    """Our convention (module docstring): 2 x matmul weights touched + full-span attention scores."""
    counts = count_params(cfg)
    matmul_weights = (
        counts.attention + counts.router + counts.routed_experts_active + counts.shared_experts
        + counts.latent_projection + counts.dense_ffn + counts.gated_norms + counts.attention_gates + counts.convs
    )
    scores = sum(4 * _attention_span(cfg, i) * cfg.num_heads * cfg.resolved_head_dim for i in range(cfg.num_layers))
    head = 2 * cfg.hidden_dim * cfg.vocab_size if include_lm_head else 0
    return float(2 * matmul_weights + scores + head)


# ------------------------------------------------------------------------------------------
# Marin's conventions (marin_hero_specs.md §4), counted from ModelConfig fields only


def _marin_shape(cfg: ModelConfig) -> tuple[int, int, int, int, int, int, int, int, int]:
    """(d, L, H, hd, E, k, I, lat, shared width) with Marin's fall-backs for dense/plain MoE configs."""
    m = cfg.moe
    d = cfg.hidden_dim
    if m is None:
        return d, cfg.num_layers, cfg.num_heads, cfg.resolved_head_dim, 0, 0, 0, d, 0
    return (d, cfg.num_layers, cfg.num_heads, cfg.resolved_head_dim, m.num_experts, m.top_k, m.expert_dim,
            m.latent_dim or d, _shared_width(cfg))


def _marin_layer_params(cfg: ModelConfig, *, experts_counted: int) -> int:
    d, _, h, hd, e, _, i_dim, lat, shared = _marin_shape(cfg)
    kv = max(cfg.resolved_kv_heads, cfg.resolved_global_kv_heads)  # Marin stores max(local, global)
    attn = 2 * d * h * hd + 2 * d * kv * hd
    if cfg.moe is None:
        return attn + 3 * d * cfg.resolved_dense_ffn_dim
    latent = 2 * d * lat if cfg.moe.latent_dim else 0
    return attn + d * e + experts_counted * 3 * lat * i_dim + latent + 3 * d * shared


def marin_active_params(cfg: ModelConfig) -> int:
    """Marin ``_active_params``: L * (attn + router + k*3*lat*I + 2*d*lat + shared); no embeddings/norms."""
    k = cfg.moe.top_k if cfg.moe else 0
    return cfg.num_layers * _marin_layer_params(cfg, experts_counted=k)


def marin_total_params(cfg: ModelConfig) -> int:
    """Marin's naming total ("535B"): every layer with all E experts, plus untied embedding and lm_head."""
    e = cfg.moe.num_experts if cfg.moe else 0
    heads = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * cfg.hidden_dim
    return cfg.num_layers * _marin_layer_params(cfg, experts_counted=e) + heads


def marin_forward_flops_per_token(cfg: ModelConfig, *, include_lm_head: bool = True) -> float:
    """Marin ``train._compute_flops`` / levanter ``lm_flops_per_token`` (forward, per token), exactly."""
    d, L, h, hd, e, k, i_dim, lat, shared = _marin_shape(cfg)
    if cfg.moe is None:
        mlp = 2 * 3 * d * cfg.resolved_dense_ffn_dim
    else:
        mlp = 2 * 3 * d * i_dim * k + 2 * 3 * d * shared + 2 * d * e
    dense_proj = 2 * d * d

    def qkv(kv_heads: int) -> int:
        return 2 * d * (h * hd + 2 * kv_heads * hd)

    def scores(span: int) -> int:
        return span * h * (4 * hd + 3)

    if cfg.sliding_window is None:
        n_global, local_span = L, cfg.seq_len
    else:
        n_global, local_span = L // cfg.global_every, cfg.sliding_window
    fpt = L * (mlp + dense_proj)
    fpt += n_global * (qkv(cfg.resolved_global_kv_heads) + scores(cfg.seq_len))
    fpt += (L - n_global) * (qkv(cfg.resolved_kv_heads) + scores(local_span))
    if cfg.moe is not None and cfg.moe.latent_dim:
        fpt += L * (2 * 3 * i_dim * k * (lat - d) + 2 * 2 * d * lat)
    if include_lm_head:
        fpt += 2 * d * cfg.vocab_size
    return float(fpt)


# ------------------------------------------------------------------------------------------
# Public FLOP API


def forward_flops_per_token(
    cfg: ModelConfig, *, include_lm_head: bool = True, convention: Convention = "ladder"
) -> float:
    """Forward model FLOPs per token under the chosen convention (see module docstring)."""
    if convention == "marin":
        return marin_forward_flops_per_token(cfg, include_lm_head=include_lm_head)
    return ladder_forward_flops_per_token(cfg, include_lm_head=include_lm_head)


def train_flops(
    cfg: ModelConfig, tokens: int, *, include_lm_head: bool = True, convention: Convention = "ladder"
) -> float:
    """Training FLOPs (forward + backward = 3 x forward) for `tokens` tokens."""
    return 3.0 * forward_flops_per_token(cfg, include_lm_head=include_lm_head, convention=convention) * tokens


# ------------------------------------------------------------------------------------------
# Peak FLOP/s and MFU

# Dense (non-sparse) bf16 peak per chip, from the vendors' datasheets.
PEAK_BF16_FLOPS: dict[str, float] = {
    "h100": 989.4e12,  # NVIDIA H100 SXM datasheet: 1,979 TFLOPS bf16 "with sparsity" -> 989 dense
    "h200": 989.4e12,  # NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity (same Hopper tensor cores)
    "gb200": 2.5e15,  # NVIDIA GB200 NVL72 datasheet: 360 PFLOPS bf16 sparse / 72 GPUs = 5 PF -> 2.5 PF dense per GPU
    "tpu v4": 275e12,  # Google Cloud TPU v4 docs: 275 TFLOPS bf16 per chip
    "tpu v5p": 459e12,  # Google Cloud TPU v5p docs: 459 TFLOPS bf16 per chip
    "tpu v6e": 918e12,  # Google Cloud TPU v6e (Trillium) docs: 918 TFLOPS bf16 per chip
}

# Memory (HBM) per chip in bytes, from the vendors' pages (GB = 1e9 bytes, GiB = 2**30):
HBM_BYTES: dict[str, float] = {
    "h100": 80e9,  # NVIDIA H100 SXM datasheet: 80 GB HBM3
    "h200": 141e9,  # NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s
    "gb200": 13.4e12 / 72,  # NVIDIA GB200 NVL72 page: up to 13.4 TB HBM3e over 72 Blackwell GPUs -> 186 GB each
    "tpu v4": 32 * 2**30,  # Google Cloud TPU v4 docs: 32 GiB HBM2 per chip
    "tpu v5p": 95e9,  # Google Cloud TPU v5p docs (cloud.google.com/tpu/docs/v5p): "HBM2e capacity 95 GB, 2765 GBps"
    "tpu v6e": 32e9,  # Google Cloud TPU v6e (Trillium) docs: 32 GB HBM per chip
}

# jax `device_kind` strings and common spellings -> table keys.
_ALIASES = {
    "nvidia h100": "h100", "h100 80gb hbm3": "h100", "nvidia h100 80gb hbm3": "h100", "h100-sxm": "h100",
    "nvidia h200": "h200", "h200-sxm": "h200", "nvidia gb200": "gb200", "b200": "gb200", "nvidia b200": "gb200",
    "v4": "tpu v4", "tpu v5": "tpu v5p", "v5p": "tpu v5p", "tpu v5p": "tpu v5p",
    "v6e": "tpu v6e", "tpu v6 lite": "tpu v6e", "tpu v6e": "tpu v6e",
}


def _accelerator_key(name: str) -> str | None:
    n = " ".join(name.lower().replace("_", " ").split())
    if n in PEAK_BF16_FLOPS:
        return n
    if n in _ALIASES:
        return _ALIASES[n]
    for token in ("gb200", "h200", "h100"):  # e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H200 141GB"
        if token in n:
            return token
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("LADDER_CACHE_DIR") or Path.home() / ".cache" / "ladder")


def measure_cpu_matmul_peak(size: int = 2048, repeats: int = 10) -> float:
    """Best-of-`repeats` f32 FLOP/s of one jitted [n, n] @ [n, n] matmul on the default CPU backend."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jax.random.normal(jax.random.key(0), (size, size), jnp.float32), cpu)
    b = jax.device_put(jax.random.normal(jax.random.key(1), (size, size), jnp.float32), cpu)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, b).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def _machine_id() -> dict:
    return {"machine": platform.machine(), "processor": platform.processor(), "node": platform.node(),
            "cpu_count": os.cpu_count()}


def cpu_matmul_peak(*, refresh: bool = False) -> float:
    """The measured CPU f32 matmul peak, measured once per machine and cached as JSON in cache_dir()."""
    path = cache_dir() / "cpu_matmul_peak.json"
    machine = _machine_id()
    if not refresh and path.exists():
        try:
            cached = json.loads(path.read_text())
            if cached.get("machine_id") == machine and cached.get("flops_per_second", 0) > 0:
                return float(cached["flops_per_second"])
        except (OSError, ValueError):
            pass  # unreadable cache: measure again
    peak = measure_cpu_matmul_peak()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"flops_per_second": peak, "machine_id": machine, "measured_at": time.time()}))
    tmp.replace(path)
    return peak


def peak_flops_per_second(accelerator: str | None) -> float:
    """Per-chip peak: the bf16 dense table for known accelerators; None/"cpu" = measured f32 matmul peak."""
    if accelerator is None or accelerator.lower() == "cpu":
        return cpu_matmul_peak()
    key = _accelerator_key(accelerator)
    if key is None:
        raise ValueError(
            f"no peak FLOP/s known for accelerator {accelerator!r}; known: {sorted(PEAK_BF16_FLOPS)} (or None for CPU)."
        )
    return PEAK_BF16_FLOPS[key]


def mfu(cfg: ModelConfig, tokens_per_second: float, peak: float, *, num_chips: int = 1) -> float:
    """Model FLOPs utilisation as a fraction: 3 x forward FLOPs/token x tokens/s over the chips' peak."""
    return train_flops(cfg, 1) * tokens_per_second / (peak * num_chips)


def hbm_bytes(accelerator: str) -> float:
    """HBM per chip (``HBM_BYTES``) of a known accelerator, by any spelling ``peak_flops_per_second`` accepts
    and Ray's hyphenated accelerator types ("TPU-V5P")."""
    key = _accelerator_key(accelerator) or _accelerator_key(accelerator.replace("-", " "))
    if key is None:
        raise ValueError(f"no HBM size known for accelerator {accelerator!r}; known: {sorted(HBM_BYTES)}.")
    return HBM_BYTES[key]
