"""Typed configuration of one training job: model, data, optimizer and schedule, and the loop.

These pydantic models are the contract between the orchestrator (``ladder``) and the trainer:
``ladder`` composes them into an experiment spec, fingerprints them, and hands a ``TrainJob`` to
``trainer.train``. They are frozen and forbid unknown fields so that a typo fails loudly instead of
silently training something else. Fields that change results live in ``ModelConfig``,
``DataConfig``, ``OptimizerConfig`` and the numeric part of ``TrainConfig``; fields that only say
*how* or *where* a run executes (logging, mesh, checkpoint cadence) are listed in
``TrainConfig.EXECUTION_FIELDS`` so identity hashing can leave them out.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Frozen(BaseModel):
    """Base for every config: immutable, unknown fields rejected, validated on assignment.

    ``OMITTED_AT_DEFAULT`` maps fields added after runs existed to the value every earlier run had (their
    default, unless the field came with a new default): ``identity_payload`` leaves them out while they hold
    it, so adding a field changes neither the fingerprint nor the checkpoint check of any earlier job. Every
    config class may declare its own.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
    OMITTED_AT_DEFAULT: ClassVar[dict[str, object]] = {}


def identity_payload(config: BaseModel) -> dict:
    """``config.model_dump(mode="json")`` minus, at every level, the ``OMITTED_AT_DEFAULT`` fields that
    hold their default."""
    payload = config.model_dump(mode="json")
    for name in type(config).model_fields:
        value = getattr(config, name)
        omitted = getattr(type(config), "OMITTED_AT_DEFAULT", {})
        if name in omitted and payload.get(name) == omitted[name]:
            del payload[name]
        elif isinstance(value, BaseModel):
            payload[name] = identity_payload(value)
    return payload


# --------------------------------------------------------------------------------------------
# Model


class MoEConfig(Frozen):
    """Routed mixture-of-experts FFN (per MoE layer)."""

    OMITTED_AT_DEFAULT: ClassVar[dict[str, object]] = {"latent_norm": False}

    num_experts: int = Field(8, ge=1, description="Routed experts E per MoE layer.")
    top_k: int = Field(2, ge=1, description="Experts each token is routed to.")
    expert_dim: int = Field(256, ge=1, description="Intermediate width of one routed SwiGLU expert.")
    num_shared_experts: int = Field(0, ge=0, description="Always-on shared SwiGLU experts.")
    shared_expert_dim: int | None = Field(
        None, ge=1, description="Intermediate width of one shared expert (default: expert_dim)."
    )
    latent_dim: int | None = Field(
        None,
        ge=1,
        description="LatentMoE: project d -> latent_dim before the routed experts and back after "
        "(Marin's hero); None runs experts at the hidden width.",
    )
    latent_norm: bool = Field(
        False, description="LatentMoE: RMSNorm (learned gain) on the latent input of the routed experts (Marin's "
        "latent_norm); read only with latent_dim.",
    )
    num_dense_layers: int = Field(0, ge=0, description="Leading layers that use a dense SwiGLU FFN instead.")
    router_score: Literal["sigmoid", "softmax"] = Field(
        "sigmoid", description="Router score function, computed in fp32."
    )
    balancing: Literal["bias", "quantile", "none"] = Field(
        "bias",
        description="Router-bias balancing: 'bias' = DeepSeek-V3 aux-loss-free sign rule, 'quantile' = "
        "Marin's quantile balancing, 'none' = no bias.",
    )
    bias_update_rate: float = Field(1e-3, ge=0, description="Gamma of the sign-rule bias update per step.")
    quantile_bins: int | None = Field(
        None,
        ge=2,
        description="Quantile balancing: None = exact per-expert quantile (sort); an int = Marin's fixed-range "
        "histogram estimator with this many bins (the hero used 10_000).",
    )
    normalize_weights: bool = Field(
        True, description="Renormalise the k selected combine weights to sum to 1 (DeepSeek-V3 sigmoid, Qwen3)."
    )
    route_scale: float = Field(
        1.0, gt=0, description="Multiplier on the combine weights after normalisation (DeepSeek-V3: 2.5)."
    )
    aux_loss: Literal["none", "switch", "sequence"] = Field(
        "none", description="Optional auxiliary load-balancing loss."
    )
    aux_loss_weight: float = Field(0.0, ge=0, description="Weight of the auxiliary balancing loss.")
    router_z_loss_weight: float = Field(0.0, ge=0, description="Weight of the router logit z-loss.")
    capacity_factor: float = Field(
        1.25, gt=0, description="Per-expert buffer = capacity_factor * tokens * top_k / E (capacity dispatch)."
    )
    dispatch: Literal["capacity", "ragged", "dense", "alltoall", "ragged_alltoall"] = Field(
        "capacity",
        description="Expert dispatch backend: 'capacity' (sort + fixed buffers, default on CPU), "
        "'ragged' (dropless jax.lax.ragged_dot, for accelerators), 'dense' (every expert on every token; test oracle); "
        "expert parallel (shard_map, buffers sized by each device's tokens, all-to-all over the 'expert' mesh axis): "
        "'alltoall' (capacity buffers, any platform), 'ragged_alltoall' (dropless ragged all-to-all, GPU/TPU only).",
    )

    @model_validator(mode="after")
    def _check(self) -> "MoEConfig":
        if self.top_k > self.num_experts:
            raise ValueError(
                f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}; "
                "lower top_k or add experts."
            )
        if self.balancing == "quantile" and self.top_k >= self.num_experts:
            raise ValueError(
                f"moe.balancing='quantile' takes the top-(k+1) scores, so moe.top_k={self.top_k} must be below "
                f"moe.num_experts={self.num_experts}; lower top_k or use balancing='bias'."
            )
        if self.aux_loss != "none" and self.aux_loss_weight == 0:
            raise ValueError("moe.aux_loss is set but moe.aux_loss_weight is 0; give a positive weight or aux_loss='none'.")
        return self


class ModelConfig(Frozen):
    """Decoder-only transformer with optional MoE FFNs."""

    OMITTED_AT_DEFAULT: ClassVar[dict[str, object]] = {
        "scan_layers": False,
        # Marin's block pieces (trainer/blocks.py): off by default, so earlier jobs keep their identity
        "gated_norm_rank": None,
        "embed_norm": False,
        "sconv_kernel": None,
        "sconv_sites": ["k", "attn", "mlp"],
        "qk_norm": False,
        "qk_mult": 1.0,
        "rope_global_layers": True,
        "rope_fraction": 1.0,
        "xsa": False,
        "head_gate": False,
        "kv_heads_layout": "per_layer",
    }

    vocab_size: int = Field(256, ge=2, description="Vocabulary size (256 for the byte tokenizer).")
    hidden_dim: int = Field(128, ge=1, description="Residual stream width d.")
    num_layers: int = Field(4, ge=1, description="Transformer blocks L.")
    num_heads: int = Field(4, ge=1, description="Query heads H.")
    num_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads on sliding-window (or all) layers; default num_heads (no GQA)."
    )
    global_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads on global layers when they differ (Marin); default num_kv_heads."
    )
    head_dim: int | None = Field(None, ge=1, description="Per-head width; default hidden_dim // num_heads.")
    seq_len: int = Field(256, ge=2, description="Training context length in tokens.")
    sliding_window: int | None = Field(
        None, ge=1, description="Window of local attention layers; None = every layer is global."
    )
    global_every: int = Field(
        4, ge=1, description="With sliding_window: every n-th layer (and the last) attends globally."
    )
    rope_theta: float = Field(10_000.0, gt=0, description="RoPE base frequency.")
    tie_embeddings: bool = Field(False, description="Share the token embedding with the output head.")
    dense_ffn_dim: int | None = Field(
        None, ge=1, description="SwiGLU width of dense FFN layers; default 4 * hidden_dim * 2/3 rounded."
    )
    moe: MoEConfig | None = Field(None, description="MoE settings; None = a dense model.")
    logit_z_loss_weight: float = Field(0.0, ge=0, description="Weight of the output-logit z-loss.")
    init_std: float | None = Field(None, gt=0, description="Init std of weights; default 0.5 / sqrt(hidden_dim).")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Dtype of matmuls and activations (params stay float32; router, softmax, norms and loss run "
        "in float32). bfloat16 for accelerators; on CPU float32 is faster.",
    )
    scan_layers: bool = Field(
        False,
        description="Store blocks of equal shape stacked along a leading layer axis and run each repeating run of "
        "them with one jax.lax.scan (trainer/layers_scan.py): compile time stays flat as layers grow. Same "
        "results as the unrolled loop up to float rounding, but a different parameter/checkpoint layout, so "
        "it is part of a job's identity when on.",
    )
    # Marin's hero block (trainer/blocks.py); each default is the plain block
    gated_norm_rank: int | None = Field(
        None, ge=1, description="GatedNorm rank (Marin: 128): after the attention and MLP RMSNorms (and the embed/final "
        "norms) x is gated by sigmoid(silu(x W_down) W_up); None = no GatedNorm.",
    )
    embed_norm: bool = Field(
        False, description="RMSNorm (plus a GatedNorm when gated_norm_rank is set) right after the token embedding (Marin)."
    )
    sconv_kernel: int | None = Field(
        None, ge=1, description="Taps of the short depthwise causal convolutions at sconv_sites (Marin: 4); None = none."
    )
    sconv_sites: tuple[Literal["k", "v", "attn", "mlp"], ...] = Field(
        ("k", "attn", "mlp"),
        description="Where short convolutions run: 'k'/'v' after the key/value projections, 'attn' on the attention "
        "output, 'mlp' on the FFN output (Marin's hero: k, attn, mlp). Read only with sconv_kernel.",
    )
    qk_norm: bool = Field(False, description="Non-parametric RMS normalisation of each query and key head (Marin).")
    qk_mult: float = Field(
        1.0, gt=0, description="Multiplier on the queries on top of 1/sqrt(head_dim) (Marin: 1.3 with qk_norm)."
    )
    rope_global_layers: bool = Field(
        True, description="Rotary embedding on global layers too; False = RoPE on sliding-window layers only (Marin)."
    )
    rope_fraction: float = Field(
        1.0, gt=0, le=1, description="Fraction of each head's channels that rotary embedding rotates (Marin's "
        "half-RoPE: 0.5); the rest carry no position.",
    )
    xsa: bool = Field(
        False, description="Exclusive self-attention: remove from each head's output its component along that head's "
        "own value vector (Marin).",
    )
    head_gate: bool = Field(
        False, description="Per-head attention-output gate 2*sigmoid(x W_gate) before w_o, W_gate zero-initialised (Marin)."
    )
    kv_heads_layout: Literal["per_layer", "stored_max"] = Field(
        "per_layer",
        description="'per_layer': each layer allocates its own KV heads; 'stored_max': every layer allocates "
        "max(num_kv_heads, global_kv_heads) and global layers use the first global_kv_heads of them (Marin's "
        "layout, which its parameter counts count).",
    )

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.head_dim is None and self.hidden_dim % self.num_heads:
            raise ValueError(
                f"num_heads={self.num_heads} does not divide hidden_dim={self.hidden_dim}; "
                "pick heads that divide it or set head_dim explicitly."
            )
        for name in ("num_kv_heads", "global_kv_heads"):
            kv = getattr(self, name)
            if kv is not None and self.num_heads % kv:
                raise ValueError(
                    f"{name}={kv} does not divide num_heads={self.num_heads}; grouped-query attention needs "
                    "query heads to be a multiple of key/value heads."
                )
        if self.moe is not None and self.moe.num_dense_layers > self.num_layers:
            raise ValueError(
                f"moe.num_dense_layers={self.moe.num_dense_layers} exceeds num_layers={self.num_layers}."
            )
        rotary = self.resolved_head_dim * self.rope_fraction
        if rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(
                f"rope_fraction={self.rope_fraction} of head_dim={self.resolved_head_dim} is {rotary} channels; rotary "
                "embedding rotates channel pairs, so pick a fraction that gives an even whole number."
            )
        if len(set(self.sconv_sites)) != len(self.sconv_sites) or (self.sconv_kernel and not self.sconv_sites):
            raise ValueError(
                f"sconv_sites={list(self.sconv_sites)} must name each site at most once and at least one site when "
                "sconv_kernel is set; use a subset of ['k', 'v', 'attn', 'mlp']."
            )
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_dim // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """Channels per head that rotary embedding rotates (the first ones; all with rope_fraction 1)."""
        return int(self.resolved_head_dim * self.rope_fraction)

    @property
    def stored_kv_heads(self) -> int:
        """KV heads Marin's layout allocates on every layer: max(local, global)."""
        return max(self.resolved_kv_heads, self.resolved_global_kv_heads)

    def sconv_at(self, site: str) -> bool:
        """Whether a short convolution runs at `site` ('k', 'v', 'attn', 'mlp')."""
        return self.sconv_kernel is not None and site in self.sconv_sites

    @property
    def resolved_kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def resolved_global_kv_heads(self) -> int:
        return self.global_kv_heads or self.resolved_kv_heads

    @property
    def resolved_dense_ffn_dim(self) -> int:
        return self.dense_ffn_dim or int(math.ceil(8 * self.hidden_dim / 3 / 64) * 64)

    @property
    def resolved_init_std(self) -> float:
        return self.init_std or 0.5 / math.sqrt(self.hidden_dim)

    def is_global_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) attends over the whole context."""
        if self.sliding_window is None:
            return True
        return (layer + 1) % self.global_every == 0 or layer == self.num_layers - 1

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.num_dense_layers


# --------------------------------------------------------------------------------------------
# Data


class SourceConfig(Frozen):
    """One text source read through fsspec."""

    name: str = Field(..., min_length=1, description="Short unique name used in mixture weights and metrics.")
    paths: list[str] = Field(
        default_factory=list,
        description="fsspec URLs or globs of files; empty with kind='stdlib' means the default offline corpus.",
    )
    kind: Literal["text", "jsonl", "parquet", "stdlib_code", "stdlib_docs"] = Field(
        "text",
        description="File format, or one of the built-in offline corpora taken from this Python's standard "
        "library (source code, or docstrings and documentation text).",
    )
    text_field: str = Field("text", description="Column/key holding the text (jsonl, parquet).")
    validation_fraction: float = Field(
        0.02, gt=0, lt=0.5, description="Held-out fraction of this source's tokens for evaluation."
    )


class MixturePhase(Frozen):
    """Mixture weights in force from `start_fraction` of training until the next phase."""

    start_fraction: float = Field(0.0, ge=0, lt=1, description="Fraction of training where this phase starts.")
    weights: dict[str, float] = Field(..., description="Source name -> sampling weight; must sum to 1.")

    @model_validator(mode="after")
    def _check(self) -> "MixturePhase":
        if any(w < 0 for w in self.weights.values()):
            raise ValueError("mixture weights must be non-negative; remove or zero the negative entries.")
        total = sum(self.weights.values())
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(
                f"mixture weights sum to {total:.6g}, not 1; normalise them (phase starting at {self.start_fraction})."
            )
        return self


class DataConfig(Frozen):
    """Where tokens come from: sources, a phased mixture, a tokenizer."""

    sources: list[SourceConfig] = Field(..., min_length=1, description="Text sources.")
    phases: list[MixturePhase] = Field(
        ..., min_length=1, description="Mixture phases; the first starts at 0, later ones at increasing fractions."
    )
    tokenizer: str | None = Field(
        None, description="Path/URL of a Hugging Face tokenizer.json; None = byte-level (vocab 256)."
    )
    max_tokens_per_source: int | None = Field(
        None, ge=1, description="Cap on tokens read from each source (keeps caches small)."
    )

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"data.sources has duplicate names {names}; give each source a unique name.")
        if self.phases[0].start_fraction != 0:
            raise ValueError("data.phases[0].start_fraction must be 0; the first phase starts training.")
        starts = [p.start_fraction for p in self.phases]
        if starts != sorted(starts) or len(set(starts)) != len(starts):
            raise ValueError(f"data.phases start fractions {starts} must be strictly increasing.")
        for i, phase in enumerate(self.phases):
            unknown = set(phase.weights) - set(names)
            if unknown:
                raise ValueError(
                    f"data.phases[{i}].weights names unknown sources {sorted(unknown)}; known sources: {names}."
                )
        return self


# --------------------------------------------------------------------------------------------
# Optimizer and schedule


class ScheduleConfig(Frozen):
    """Learning-rate schedule: linear warmup, then a decay shape. LR(step) is a pure function of this."""

    kind: Literal["constant", "cosine", "linear", "wsd"] = Field("cosine", description="Decay shape after warmup.")
    warmup: float = Field(
        0.01, ge=0, description="Warmup length: a fraction of total steps if < 1, else a number of steps."
    )
    min_lr_fraction: float = Field(
        0.1, ge=0, le=1, description="Final LR as a fraction of peak (cosine, linear, wsd)."
    )
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="WSD: fraction of total steps spent in the cooldown."
    )
    cooldown: Literal["linear", "sqrt"] = Field(
        "sqrt", description="WSD cooldown shape: linear, or (1 - sqrt) as in Hägele et al."
    )


class OptimizerConfig(Frozen):
    """AdamW with parameter groups (no weight decay on norms, biases, embeddings) and clipping, or Marin's
    MuonH / AdamH / Adam groups (``name="muonh"``, see trainer/muon.py)."""

    # Added after runs existed: left out of identity at these defaults (see Frozen).
    OMITTED_AT_DEFAULT: ClassVar[dict[str, object]] = {
        "name": "adamw",
        "adam_learning_rate": None,
        "momentum": 0.95,
        "nesterov": True,
        "ns_steps": 5,
        "ns_epsilon": 1e-8,
        "ns_dtype": "float32",
    }
    MUONH_FIELDS: ClassVar[tuple[str, ...]] = (
        "adam_learning_rate", "momentum", "nesterov", "ns_steps", "ns_epsilon", "ns_dtype"
    )

    name: Literal["adamw", "muonh"] = Field(
        "adamw",
        description="'adamw'; or 'muonh' = Marin's groups: MuonH (Newton-Schulz + Frobenius hyperball) for matrices "
        "and GatedNorm gates, AdamH for the lm_head, Adam for embeddings, router, gains, gates and conv kernels.",
    )
    learning_rate: float = Field(
        3e-3, gt=0, description="Peak learning rate (with name='muonh': of the MuonH and AdamH groups)."
    )
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1 (AdamW; with muonh the AdamH and Adam groups).")
    beta2: float = Field(0.95, ge=0, lt=1, description="Adam beta2.")
    epsilon: float = Field(1e-8, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(
        0.1,
        ge=0,
        description="Decoupled weight decay on matrices (with muonh only on Adam-group matrices such as the router: "
        "the hyperball keeps MuonH/AdamH norms fixed).",
    )
    max_grad_norm: float | None = Field(1.0, gt=0, description="Global-norm clipping; None disables it.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="LR schedule.")
    adam_learning_rate: float | None = Field(
        None,
        gt=0,
        description="muonh: peak LR of the Adam group (same schedule shape); None = learning_rate * 3/13 (Marin's "
        "heuristic: MuonH at 13/3 of the Adam LR).",
    )
    momentum: float = Field(0.95, ge=0, lt=1, description="muonh: MuonH momentum (buf = momentum * buf + g).")
    nesterov: bool = Field(True, description="muonh: Nesterov momentum (update = momentum * buf + g).")
    ns_steps: int = Field(5, ge=1, description="muonh: Newton-Schulz steps (quintic coefficients, one triple per step).")
    ns_epsilon: float = Field(1e-8, gt=0, description="muonh: epsilon of the Newton-Schulz Frobenius pre-normalisation.")
    ns_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="muonh: dtype of the Newton-Schulz matmuls (Marin: bfloat16; XLA:CPU emulates bf16)."
    )

    @model_validator(mode="after")
    def _check_muonh_fields(self) -> "OptimizerConfig":
        if self.name != "muonh":
            changed = [f for f in self.MUONH_FIELDS if getattr(self, f) != self.OMITTED_AT_DEFAULT[f]]
            if changed:
                raise ValueError(
                    f"optimizer.{changed[0]} is only read by optimizer.name='muonh' (name is {self.name!r}); "
                    "set name='muonh' or remove it."
                )
        return self

    @property
    def resolved_adam_learning_rate(self) -> float:
        """The Adam group's peak LR under muonh."""
        return self.adam_learning_rate or self.learning_rate / 13 * 3


# --------------------------------------------------------------------------------------------
# Training loop


class TrainConfig(Frozen):
    """Budget, batch, seed and the cadences of the loop."""

    EXECUTION_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {
            "log_every",
            "eval_every",
            "checkpoint_every",
            "checkpoint_every_seconds",
            "keep_checkpoints",
            "wandb",
            "wandb_project",
            "mesh",
            "progress",
            "max_bad_steps",
            "max_rollbacks",
            "compilation_cache",
            "compilation_cache_dir",
            "peak_flops_per_second",
            "async_checkpointing",
            "remat",
            "param_sharding",
            "precision",
            "offload",
        }
    )
    # Identity fields added after runs existed are left out of a job's identity while at their default,
    # so adding a field changes neither the fingerprint nor the checkpoint check of any earlier job.
    # eval_windows is the exception: its default changed what every eval reads, so it is left out only at "first",
    # the rule of every run before it existed (a ladder started then keeps its fingerprints by asking for it).
    OMITTED_AT_DEFAULT: ClassVar[dict[str, object]] = {"microbatch_size": None, "eval_windows": "first"}

    tokens: int = Field(..., gt=0, description="Training token budget; steps = round(tokens / (batch_size * seq_len)).")
    batch_size: int = Field(16, ge=1, description="Global batch size in sequences.")
    seed: int = Field(0, description="Seed of the initialisation and of the data order.")
    eval_every: int | None = Field(
        None, ge=1, description="Evaluate every n steps (and at the end); default: about DEFAULT_EVALS_PER_RUN evals per "
        "run (never more often than every MIN_DEFAULT_EVAL_INTERVAL steps), so every rung logs a curve a law can fit.",
    )
    eval_batches: int = Field(4, ge=1, description="Validation batches per source per evaluation.")
    eval_windows: Literal["spread", "first"] = Field(
        "spread", description="Which held-out windows an eval reads: 'spread' evenly over each source's held-out split, "
        "or 'first', the split's first windows in a row (what every run read before this field existed: a ladder "
        "started then asks for it to keep measuring its new runs like its finished ones, and keeps its fingerprints).",
    )
    log_every: int = Field(10, ge=1, description="Write train metrics every n steps.")
    checkpoint_every: int | None = Field(200, ge=1, description="Checkpoint every n steps (and at the end).")
    checkpoint_every_seconds: float | None = Field(None, gt=0, description="Also checkpoint after this many seconds.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept (newest).")
    max_bad_steps: int = Field(3, ge=1, description="Consecutive non-finite steps before rolling back.")
    max_rollbacks: int = Field(2, ge=0, description="Rollbacks allowed before failing the run.")
    wandb: Literal["offline", "online", "disabled", "auto"] = Field(
        "auto", description="W&B mode; 'auto' = online if WANDB_API_KEY is set, else offline."
    )
    wandb_project: str = Field("ladder", description="W&B project name.")
    mesh: dict[str, int] | None = Field(
        None, description="Device mesh axis sizes, e.g. {'data': 4, 'expert': 2}; None = all devices on 'data'."
    )
    progress: bool = Field(True, description="Show a rich progress bar.")
    compilation_cache: bool = Field(
        True, description="Use JAX's persistent compilation cache (start-up of a repeated config drops by seconds)."
    )
    compilation_cache_dir: str | None = Field(
        None, description="Persistent compilation cache directory; None = $LADDER_CACHE_DIR/jax or ~/.cache/ladder/jax."
    )
    peak_flops_per_second: float | None = Field(
        None, gt=0, description="Peak FLOP/s of the whole mesh for MFU; None = table by device kind (measured on CPU)."
    )
    async_checkpointing: bool = Field(True, description="Write checkpoints in the background (orbax async).")
    remat: Literal["none", "full", "save_dots"] = Field(
        "none",
        description="Rematerialisation of each transformer block in the training loss: 'none'; 'full' = "
        "jax.checkpoint saving only block inputs (all recomputed in the backward pass); 'save_dots' = keep the "
        "2-D GEMM outputs, recompute attention cores and routed-expert einsums. Same results (an execution field).",
    )
    microbatch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per micro-batch: the step accumulates float32 gradients over batch_size / "
        "microbatch_size micro-batches and applies one update. None = the whole batch at once. Part of the "
        "job's identity: capacity dispatch buffers and the 'switch' aux loss are per micro-batch.",
    )
    eval_dispatch: Literal["dropless", "as_trained"] = Field(
        "dropless",
        description="Expert dispatch of evaluations: 'dropless' (ragged_dot, no token dropped: eval loss measures the "
        "model, not its capacity buffers, as Marin's eval_dropless metric does) or 'as_trained' (the training dispatch).",
    )
    # Sharded, mixed-precision state (trainer/precision.py, trainer/sharding.py). All three are execution fields:
    # they change where state lives and which collectives run, not what is computed (float summation order aside).
    param_sharding: Literal["default", "zero3"] = Field(
        "default",
        description="Sharding rule of parameters, gradients and optimizer state: 'default' = routed experts over "
        "'expert', every matrix over 'fsdp' only when the mesh has that axis; 'zero3' = FSDP over the data-parallel "
        "axes too (ZeRO-3): dense matrices split over every mesh axis (all carry data parallelism outside the experts), "
        "routed experts over 'expert' on E and over 'data'/'fsdp' on another dim; gathered on use, gradients reduced to "
        "their shard.",
    )
    precision: Literal["model", "bf16_mixed"] = Field(
        "model",
        description="Mixed-precision policy: 'model' = float32 parameters, each loss call casting the weights it reads "
        "to model.compute_dtype; 'bf16_mixed' = labs' policy: float32 master parameters and AdamW moments, ONE "
        "bfloat16 copy of the matmul weights per step (norms and router stay float32), bf16 forward/backward, "
        "gradients cast to float32 and accumulated in float32 across micro-batches. Needs model.compute_dtype="
        "'bfloat16' (the dtype that changes results lives there).",
    )
    offload: Literal["none", "optimizer", "master_and_optimizer"] = Field(
        "none",
        description="Host offload through JAX memory kinds: 'optimizer' keeps the AdamW state in pinned host memory "
        "between steps, 'master_and_optimizer' the float32 master parameters too; each step brings them to the device "
        "for its update and writes them back. Needs a platform with a 'pinned_host' memory.",
    )

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.microbatch_size is None:
            return self
        if self.batch_size % self.microbatch_size:
            raise ValueError(
                f"train.batch_size={self.batch_size} is not a multiple of train.microbatch_size={self.microbatch_size}; "
                "pick a micro-batch size that divides the batch (or None for no micro-batching)."
            )
        if self.mesh is not None:
            shards = math.prod(self.mesh.values())
            if self.microbatch_size % shards:
                raise ValueError(
                    f"train.microbatch_size={self.microbatch_size} does not split over the {shards} data-parallel "
                    f"shards of train.mesh={self.mesh} (every mesh axis splits the batch); use a multiple of {shards}."
                )
        return self

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step (1 without micro-batching)."""
        return self.batch_size // self.microbatch_size if self.microbatch_size else 1


DEFAULT_EVALS_PER_RUN = 25
MIN_DEFAULT_EVAL_INTERVAL = 2


def eval_interval(eval_every: int | None, num_steps: int) -> int:
    """The eval cadence a run uses: the one given, else one that follows the run's length (tens of evals)."""
    if eval_every is not None:
        return int(eval_every)
    return max(min(MIN_DEFAULT_EVAL_INTERVAL, num_steps), round(num_steps / DEFAULT_EVALS_PER_RUN))


def evals_logged(eval_every: int | None, num_steps: int) -> int:
    """How many evals a run of `num_steps` logs (every interval, plus the last step)."""
    every = eval_interval(eval_every, num_steps)
    return num_steps // every + (0 if num_steps % every == 0 else 1)


class TrainJob(Frozen):
    """Everything the trainer needs to run one job; `trainer.train(job, run_dir)` consumes it."""

    model: ModelConfig = Field(..., description="Architecture.")
    data: DataConfig = Field(..., description="Sources and mixture.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer and LR schedule.")
    train: TrainConfig = Field(..., description="Budget, batch, seed, cadences.")

    @model_validator(mode="after")
    def _check(self) -> "TrainJob":
        per_step = self.train.batch_size * self.model.seq_len
        if per_step > self.train.tokens:
            raise ValueError(
                f"train.batch_size * model.seq_len = {per_step} tokens per step exceeds train.tokens="
                f"{self.train.tokens}; raise tokens or shrink the batch."
            )
        if self.train.precision == "bf16_mixed" and self.model.compute_dtype != "bfloat16":
            raise ValueError(
                f"train.precision='bf16_mixed' computes in bfloat16 but model.compute_dtype is "
                f"{self.model.compute_dtype!r}; set model.compute_dtype='bfloat16' or train.precision='model'."
            )
        moe, expert_shards = self.model.moe, (self.train.mesh or {}).get("expert", 1)
        if moe is not None and moe.dispatch in ("alltoall", "ragged_alltoall") and moe.num_experts % expert_shards:
            raise ValueError(
                f"model.moe.dispatch={moe.dispatch!r} places moe.num_experts={moe.num_experts} experts on the "
                f"train.mesh['expert']={expert_shards} shards, which does not divide them; pick an expert axis that divides "
                "the number of experts."
            )
        if self.data.tokenizer is None and self.model.vocab_size < 256:
            raise ValueError(
                f"model.vocab_size={self.model.vocab_size} is too small for the byte tokenizer; use 256 or more."
            )
        return self

    def identity(self) -> dict:
        """What determines results, as JSON data: the job minus TrainConfig's execution fields (and the
        fields of ``OMITTED_AT_DEFAULT`` at their default). The fingerprints hash this."""
        payload = identity_payload(self)
        train = payload["train"]
        for field in TrainConfig.EXECUTION_FIELDS:
            train.pop(field, None)
        return payload

    @property
    def num_steps(self) -> int:
        return max(1, round(self.train.tokens / (self.train.batch_size * self.model.seq_len)))

    @property
    def eval_interval(self) -> int:
        """Steps between evals: train.eval_every, else about DEFAULT_EVALS_PER_RUN evals over the run."""
        return eval_interval(self.train.eval_every, self.num_steps)

    @property
    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.model.seq_len
