"""Device memory of one training step, per device, before anything is allocated.

Why: the ladder plans runs that no machine here can hold (Marin's 535B hero), so whether a step fits
its accelerator must come from the spec alone, and it must describe the trainer that will run it. The
estimate has two halves:

* **State** (parameters, optimizer state, gradients, compute copies) is exact, not modelled: for a policy the
  trainer runs it builds the very state ``trainer.step.jit_train_step`` builds (``abstract_train_state``: the
  same calls on an abstract mesh, ``jax.eval_shape`` throughout, so 535B parameters cost nothing) and sums each
  leaf's per-device shard by its sharding, dtype and memory kind: ``train.param_sharding`` (ZeRO-3 splits),
  the optimizer's real state (AdamW mu/nu, MuonH momentum), ``train.offload`` (pinned_host leaves are host
  bytes), ``train.precision`` (bf16_mixed: one bf16 copy per step, dtypes read from ``cast_for_compute``
  itself). A test holds the abstract state equal to the jitted step's, leaf by leaf.
* **Activations** are analytic: bytes saved per token for the backward pass, layer by layer (attention
  with the score blocks our attention materialises, Marin's block pieces, the MoE capacity buffers sized by
  the dispatch's own function ``trainer.moe.capacity``, shared experts, the float32 exp of the loss over the
  vocabulary), times the tokens each device holds in one micro-batch, under the remat policy ("full" and
  "save_dots" keep less, plus the one block being recomputed). tests/test_capacity.py holds the model against
  JAX's saved residuals (per remat policy) and against XLA: ``measure_train_step`` compiles the real jitted
  step as the loop does and returns ``compiled.memory_analysis()`` per device.
* **Where the dispatch is global**: under plain jit the capacity buffers are sized by the global batch and
  GSPMD splits them only over the expert axis (measured), so each device holds data x fsdp times its own
  tokens' rows; the all-to-all layer (``moe.dispatch="alltoall"``, trainer/expert_parallel.py) sizes its
  buckets by the device's own tokens.
* **Two phases**: the backward (state on device, gradients, compute copies, activations) and the optimizer
  update (state, float32 gradients, and the offloaded state brought to the device for it); the total is
  the larger.

A ``MemoryPolicy`` with ``trainer_fields`` is one the trainer runs: the job's fields, with those set (``"trainer"``
= the job as declared; ``"trainer-sharded"`` = every memory feature on). One without describes a run the trainer
does not implement (Marin's hero: bf16 parameters on device, fused attention and loss kernels), so a plan can
be checked against what is public about it. Pure functions over a TrainJob and mesh axis sizes; no ladder imports.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from trainer.config import Frozen, ModelConfig, TrainJob

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
RematPolicy = Literal["none", "full", "save_dots"]


class MemoryPolicy(Frozen):
    """Where parameters, their float32 master and the optimizer state live, and which kernels run."""

    name: str = Field("trainer", description="Short name printed next to every figure that uses this policy.")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of the parameter copy kept on the device (the one the forward reads)."
    )
    master_params: Literal["none", "device", "host"] = Field(
        "none",
        description="A separate float32 master copy: 'none' (the device parameters are the master), on the "
        "'device', or offloaded to pinned 'host' memory.",
    )
    optimizer_state: Literal["device", "host"] = Field(
        "device", description="Where the float32 AdamW mu and nu live."
    )
    gradient_dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="Dtype of the gradients; None = the device parameter dtype (what autodiff gives)."
    )
    fused_kernels: bool = Field(
        False,
        description="Fused attention (FlashAttention: no score matrix kept) and a blockwise cross-entropy (no "
        "[tokens, vocab] logits kept). False = what this trainer's jnp code materialises.",
    )
    moe_buffers: Literal["global", "local"] = Field(
        "global",
        description="MoE capacity buffers: 'global' = this trainer's plain-jit dispatch, whose [E, C, D] buffers are "
        "sized by the global batch and split only over the expert axis (measured: GSPMD replicates them over the "
        "data and fsdp axes); 'local' = an all-to-all expert-parallel transport, each device buffering its own tokens.",
    )
    shard_weights_over_expert: bool = Field(
        False,
        description="Also split every matrix that the trainer's rule leaves whole on a device (all but the routed "
        "experts and the embedding table) over the 'expert' axis, FSDP-style, gathered when used (Marin: "
        "_FSDP_AXES = (data, expert)).",
    )
    remat: RematPolicy | None = Field(
        None,
        description="Rematerialisation this policy runs with, overriding TrainConfig.remat (for runs described "
        "rather than run here, e.g. Marin's remat_mode=recompute_all); None = the job's own.",
    )
    trainer_fields: dict[str, Any] | None = Field(
        None,
        description="A policy the trainer runs: the job's own fields with these dotted ones set (e.g. "
        "{'train.param_sharding': 'zero3'}; {} = the job as declared), estimated from the trainer's own code path "
        "(its state shardings, dtypes and memory kinds; the dtype/place fields above are then ignored). None = a "
        "policy described, not run here (its fields above say everything).",
    )
    description: str = Field("", description="Where the policy comes from.")


TRAINER_POLICY = MemoryPolicy(
    name="trainer",
    trainer_fields={},
    description="the trainer as the job declares it: state shardings, dtypes and memory kinds from its own code "
    "(trainer.step's state on an abstract mesh); attention score blocks and float32 logits materialised",
)
# Every memory feature the trainer has, on: what a job needs to set for a large MoE step to fit.
SHARDED_FIELDS: dict[str, Any] = {
    "model.moe.dispatch": "alltoall",
    "model.compute_dtype": "bfloat16",
    "train.precision": "bf16_mixed",
    "train.param_sharding": "zero3",
    "train.offload": "master_and_optimizer",
}
TRAINER_SHARDED_POLICY = MemoryPolicy(
    name="trainer-sharded",
    trainer_fields=SHARDED_FIELDS,
    description="the trainer with its memory features on: all-to-all expert parallelism (model.moe.dispatch="
    "'alltoall'), ZeRO-3 over every mesh axis (train.param_sharding='zero3'), bf16 compute weights with float32 "
    "master and moments (train.precision='bf16_mixed'), master and AdamW state in pinned host memory "
    "(train.offload='master_and_optimizer'); the job's remat and micro-batch",
)
MARIN_POLICY = MemoryPolicy(
    name="marin",
    param_dtype="bfloat16",
    master_params="host",
    optimizer_state="host",
    fused_kernels=True,
    moe_buffers="local",
    shard_weights_over_expert=True,
    remat="full",
    description="Marin's hero (marin_hero_specs.md §3): bf16 parameters on device, float32 master on pinned "
    "host (master_param_mode=FP32_PINNED_HOST), optimizer state offloaded (offload_opt_state=True), "
    "dense weights FSDP-sharded over the expert axis (model.py _FSDP_AXES), FlashAttention (gpu_fa4_cute), all-to-all "
    "expert parallelism (pooled-wave, EP64), every block recomputed (remat_mode=recompute_all), fused "
    "linear-softmax cross-entropy",
)
POLICIES: dict[str, MemoryPolicy] = {p.name: p for p in (TRAINER_POLICY, TRAINER_SHARDED_POLICY, MARIN_POLICY)}


def resolve_policy(value: str | MemoryPolicy | None) -> MemoryPolicy:
    """A policy from its name, its JSON, or itself; None = the trainer's."""
    if value is None:
        return TRAINER_POLICY
    if isinstance(value, MemoryPolicy):
        return value
    text = value.strip()
    if text.startswith("{"):
        return MemoryPolicy.model_validate_json(text)
    if text not in POLICIES:
        raise ValueError(f"unknown memory policy {value!r}; known: {sorted(POLICIES)} (or a MemoryPolicy as JSON).")
    return POLICIES[text]


class MemoryEstimate(BaseModel):
    """Per-device bytes of one train step, by part, and what they assume."""

    model_config = ConfigDict(frozen=True)

    policy: str
    mesh: dict[str, int] = Field(description="Mesh axis sizes the estimate used.")
    remat: str
    microbatch_size: int = Field(description="Sequences per micro-batch (the whole batch when not micro-batched).")
    tokens_per_device: int = Field(description="Tokens one device holds in one micro-batch.")
    params: int = Field(description="Device parameter copy (param_dtype).")
    master_params: int = Field(description="Float32 master copy on device (0 unless master_params='device').")
    optimizer_state: int = Field(description="AdamW mu + nu on device (0 when offloaded).")
    gradients: int = Field(description="Gradients, plus the accumulator when micro-batched.")
    compute_weights: int = Field(
        description="Compute-dtype copies of the weights (cast from float32 params; gathered fsdp shards)."
    )
    activations: int = Field(description="Saved activations and the working set of one block's backward.")
    other: int = Field(description="Router bias, step counter, optimizer scalars, the batch, attention masks and rotary tables.")
    offload_staging: int = Field(
        0, description="Offloaded state brought to the device for the optimizer update (a policy the trainer runs)."
    )
    total: int = Field(description="The larger of the backward phase (the parts summed) and the update phase "
                                   "(state, float32 gradients and offload_staging).")
    host_bytes: int = Field(description="Per-device bytes offloaded to host memory (master, optimizer state).")
    activation_bytes_per_token: float = Field(description="activations / tokens_per_device.")
    features: list[str] = Field(
        default_factory=list,
        description="For a policy the trainer runs: the trainer fields (and their values) these figures rely on.",
    )
    notes: list[str] = Field(default_factory=list)

    def parts(self) -> dict[str, int]:
        return {
            "params": self.params,
            "master_params": self.master_params,
            "optimizer_state": self.optimizer_state,
            "gradients": self.gradients,
            "compute_weights": self.compute_weights,
            "activations": self.activations,
            "other": self.other,
        }


# --------------------------------------------------------------------------------------------
# Mesh and per-leaf shards (the trainer's real rules)


def abstract_mesh(axes: dict[str, int]):
    """A ``jax.sharding.AbstractMesh`` with the trainer's axis order (data, fsdp, expert)."""
    from jax.sharding import AbstractMesh

    from trainer.sharding import MESH_AXES

    unknown = set(axes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; use {MESH_AXES}.")
    names = tuple(a for a in MESH_AXES if a in axes)
    return AbstractMesh(tuple(int(axes[a]) for a in names), names)


def mesh_axes_for(job: TrainJob, num_devices: int) -> dict[str, int]:
    """``train.mesh``, or every device on "data" (the trainer's default when the mesh is None)."""
    return dict(job.train.mesh) if job.train.mesh is not None else {"data": int(num_devices)}


def _shard_elements(shape: tuple[int, ...], spec: Any, axes: dict[str, int]) -> int:
    total = 1
    for i, n in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        split = int(np.prod([axes.get(a, 1) for a in names])) if names else 1
        total *= -(-n // split)
    return total


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)


def param_leaves(cfg: ModelConfig) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """(path, shape) of every parameter, from ``jax.eval_shape(init_params)``: nothing is allocated."""
    import jax

    from trainer import model

    abstract = jax.eval_shape(lambda k: model.init_params(cfg, k), jax.random.key(0))
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    return [(_names(path), tuple(leaf.shape)) for path, leaf in leaves]


def abstract_train_state(job: TrainJob, axes: dict[str, int]) -> dict[str, Any]:
    """The trainer's state for ``job`` as ``jax.ShapeDtypeStruct`` leaves carrying their shardings (and memory
    kinds) on an abstract mesh of these axis sizes: nothing is allocated and no device is needed.

    Built as ``trainer.step.jit_train_step`` builds the state the loop places and the step donates (the same
    calls, in the same order; tests/test_capacity.py holds the two equal leaf by leaf): the parameter tree of
    ``init_params``, ``trainer.sharding.param_shardings`` under ``train.param_sharding``, the optimizer of
    ``trainer.optim.build_optimizer`` with ``optim.state_shardings`` for its state, a replicated step counter and
    router state, and ``trainer.precision.place_state`` putting what ``train.offload`` names in host memory.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from trainer import model, optim
    from trainer import precision as precision_lib
    from trainer import sharding as sharding_lib

    cfg = job.model
    mesh = abstract_mesh(axes)
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_params = jax.eval_shape(lambda k: model.init_params(cfg, k), jax.random.key(job.train.seed))
    groups = model.param_groups(abstract_params)
    optimizer = optim.build_optimizer(job.optimizer, abstract_params, groups)
    param_shardings = sharding_lib.param_shardings(abstract_params, cfg, mesh, job.train.param_sharding)
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    opt_shardings = optim.state_shardings(optimizer, abstract_opt_state, param_shardings, replicated)
    router_state0 = jax.eval_shape(lambda: model.init_router_state(cfg))
    shardings = precision_lib.place_state(job, {
        "step": replicated,
        "params": param_shardings,
        "opt_state": opt_shardings,
        "router_state": jax.tree.map(lambda _: replicated, router_state0),
    })
    shapes = {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "params": abstract_params,
        "opt_state": abstract_opt_state,
        "router_state": router_state0,
    }
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


def leaf_shard_bytes(leaf: Any) -> int:
    """Bytes one device holds of an abstract leaf under its sharding (ceil division where it is uneven)."""
    spec = tuple(leaf.sharding.spec)
    axes = dict(leaf.sharding.mesh.shape)
    return _shard_elements(tuple(leaf.shape), spec, axes) * np.dtype(leaf.dtype).itemsize


def leaf_memory_kind(leaf: Any) -> str:
    """"host" for a leaf placed in a host memory kind (``pinned_host``/``unpinned_host``), else "device"."""
    kind = getattr(leaf.sharding, "memory_kind", None)
    return "host" if kind is not None and "host" in kind else "device"


def shard_elements(cfg: ModelConfig, axes: dict[str, int]) -> dict[tuple[str, ...], int]:
    """Per-device element count of every parameter under ``trainer.sharding.param_partition_spec``."""
    return {path: stored for path, (stored, _) in policy_shards(cfg, axes, TRAINER_POLICY).items()}


def policy_shards(cfg: ModelConfig, axes: dict[str, int], policy: MemoryPolicy) -> dict[tuple[str, ...], tuple[int, int]]:
    """Per parameter: (elements stored per device, elements per device while in use).

    Stored: ``trainer.sharding.param_partition_spec`` on the mesh, then, if the policy shards weights over
    "expert", a further split by the expert-axis size of every matrix the rule leaves whole on it (not the
    routed experts, not the embedding table). In use: the same without the fsdp-style splits, i.e. what a
    device gathers while the weight's block runs.
    """
    from trainer.sharding import param_partition_spec

    mesh = abstract_mesh(axes)
    expert = axes.get("expert", 1)
    out = {}
    for path, shape in param_leaves(cfg):
        spec = tuple(param_partition_spec(path, shape, mesh))
        stored = _shard_elements(shape, spec, axes)
        in_use = _shard_elements(shape, tuple(None if e == "fsdp" else e for e in spec), axes)
        if policy.shard_weights_over_expert and expert > 1 and len(shape) >= 2 and "experts" not in path and path[0] != "embed":
            split = [-(-n // int(np.prod([axes.get(a, 1) for a in ((e,) if isinstance(e, str) else (e or ()))])))
                     for n, e in zip(shape, spec + (None,) * (len(shape) - len(spec)))]
            if any(n % expert == 0 for n in split):
                stored //= expert
        out[path] = (stored, in_use)
    return out


# --------------------------------------------------------------------------------------------
# Activations: bytes saved per token, per layer
#
# The items follow what JAX saves for the backward pass of trainer/model.py and trainer/moe.py (read with
# jax's ``saved_residuals``; tests/test_capacity.py checks the totals per remat policy): float32 RMSNorm
# intermediates, q/k/v and the per-block key/value slices and float32 softmax of our blocked attention,
# SwiGLU gate/up and silu residuals, the router's float32 scores, the capacity buffers' input and expert
# hidden activations, and the float32 exp of the loss's logsumexp.

Item = tuple[str, float, str]  # (name, bytes per token, kind), kinds as in SAVED_KINDS


def _attention_blocks(cfg: ModelConfig, window: int | None) -> tuple[float, float]:
    """(mean keys per query, key rows copied per token) of ``trainer.model.attention``: query blocks of
    ``query_block_size`` rows see every key up to the block's end (and from its window's start); a block
    whose key range is not the whole sequence slices (copies) its keys and values."""
    from trainer.model import query_block_size

    length = cfg.seq_len  # the batch holds seq_len + 1 tokens; the model reads seq_len of them
    block = query_block_size(length)
    rows = keys = copied = 0
    for start in range(0, length, block):
        end = min(length, start + block)
        first = 0 if window is None else max(0, start - window + 1)
        rows += end - start
        keys += (end - start) * (end - first)
        if first > 0 or end < length:
            copied += end - first
    return keys / rows, copied / length


def constant_bytes(cfg: ModelConfig) -> int:
    """The step's device-resident constants: each distinct attention mask tile ``trainer.model.attention`` builds
    (float32 [group x block rows, keys] per query block; layers of one (window, group) share them) and the rotary
    cos/sin tables."""
    from trainer.model import layer_kv_heads, layer_window, query_block_size

    length, block = cfg.seq_len, query_block_size(cfg.seq_len)
    total = 0
    for window, group in {(layer_window(cfg, i), cfg.num_heads // layer_kv_heads(cfg, i)) for i in range(cfg.num_layers)}:
        for start in range(0, length, block):
            end = min(length, start + block)
            first = 0 if window is None else max(0, start - window + 1)
            total += group * (end - start) * (end - first) * 4
    return total + 2 * length * (cfg.rotary_dim // 2) * 4


def dispatch_replication(mesh: dict[str, int], policy: MemoryPolicy) -> float:
    """How many times more capacity-buffer rows a device holds than its own tokens fill: 1 for a 'local'
    (all-to-all) transport; data x fsdp for this trainer's 'global' buffers, which are sized by the global
    batch and split over "expert" only (measured on CPU: GSPMD replicates them over "data"; over "fsdp" it
    replicates part of them, so with an fsdp axis this is conservative, up to 1.8x the measured total)."""
    if policy.moe_buffers == "local":
        return 1.0
    return float(mesh.get("data", 1) * mesh.get("fsdp", 1))


CAPACITY_DISPATCHES = ("capacity", "alltoall")  # fixed [E, C, ...] buffers; the others are dropless


def buffer_rows_per_token(cfg: ModelConfig, tokens_per_device: int, mesh: dict[str, int], policy: MemoryPolicy) -> float:
    """Expert-buffer rows a device holds per token it owns, from the dispatch's own sizing function,
    ``trainer.moe.capacity`` (C = ceil(capacity_factor * T * k / E)): for 'local' buffers (the all-to-all layer,
    trainer/expert_parallel.py ``_local_alltoall``) T is the device's own tokens and it holds E x C rows (sends
    its [E, C] buffer, receives [E / ep, ep x C]); for this trainer's 'global' plain-jit buffers T is the whole
    micro-batch, and E x C rows are split over "expert" only (``dispatch_replication``). Dropless dispatches
    hold top_k rows per token (times the same replication when global)."""
    from trainer.moe import capacity

    m = cfg.moe
    if m is None:
        return 0.0
    replication = dispatch_replication(mesh, policy)
    if m.dispatch not in CAPACITY_DISPATCHES:
        return replication * m.top_k
    if policy.moe_buffers == "local":
        return m.num_experts * capacity(tokens_per_device, m) / tokens_per_device
    devices = int(np.prod(list(mesh.values()))) if mesh else 1
    global_tokens = tokens_per_device * devices
    return m.num_experts * capacity(global_tokens, m) * replication / global_tokens


def _norm_bytes(cfg: ModelConfig, width: int | None = None) -> float:
    """RMSNorm: three float32 [d] intermediates, two per-token scalars, and the cast back to the compute dtype."""
    c, d = DTYPE_BYTES[cfg.compute_dtype], width or cfg.hidden_dim
    return 3 * d * 4 + 8 + (d * c if c != 4 else 0)


def _gated_norm_items(cfg: ModelConfig, site: str) -> list[Item]:
    """Marin's GatedNorm after a norm (``trainer.blocks.gated_norm``), measured with JAX's saved residuals:
    float32 x, logits and sigmoid over d, four rank-wide values (the down projection, silu's residuals and
    output), and the cast back when computing in bf16; the two projections' outputs are dots."""
    if not cfg.gated_norm_rank:
        return []
    c, d, r = DTYPE_BYTES[cfg.compute_dtype], cfg.hidden_dim, cfg.gated_norm_rank
    return [(f"{site}_gated_norm", 3 * d * 4 + 4 * r * c + (d * c if c != 4 else 0), "other"),
            (f"{site}_gated_norm_dots", (r + d) * c, "dot_save_only")]


def _conv_bytes(cfg: ModelConfig, width: int) -> float:
    """A short causal convolution (``trainer.blocks.short_causal_conv``) keeps its kernel's shifted inputs."""
    return cfg.sconv_kernel * width * DTYPE_BYTES[cfg.compute_dtype]


def layer_activation_items(
    cfg: ModelConfig, layer: int, policy: MemoryPolicy, buffer_rows: float | None = None
) -> list[Item]:
    """What one block saves per token for its backward pass, as (name, bytes, kind).

    kind "input": the block's input (all that remat "full" keeps); "dot": a no-batch-dim matmul output that
    the backward needs anyway (SwiGLU gate and up); "dot_save_only": a no-batch-dim matmul output that only
    "save_dots" keeps (q/k/v and output projections, router logits, latent down-projection: without remat
    their consumers' residuals are kept instead); "other": the rest, recomputed under any remat policy.
    ``buffer_rows``: expert-buffer rows per token (``buffer_rows_per_token``); None = capacity_factor x top_k
    for capacity-buffer dispatches, top_k for dropless ones (a device buffering its own tokens, T large).
    """
    from trainer.model import layer_kv_heads, layer_stored_kv_heads, layer_window

    c, f = DTYPE_BYTES[cfg.compute_dtype], 4
    d, h, k = cfg.hidden_dim, cfg.num_heads, cfg.resolved_head_dim
    g, stored = layer_kv_heads(cfg, layer), layer_stored_kv_heads(cfg, layer)
    items: list[Item] = [
        ("block_input", d * c, "input"),
        ("attn_norm", _norm_bytes(cfg), "other"),
        *_gated_norm_items(cfg, "attn"),
        ("qkv_projections", (h + 2 * stored) * k * c, "dot_save_only"),
    ]
    # Marin's pieces (trainer/blocks.py), each measured with JAX's saved residuals
    for site in ("k", "v"):
        if cfg.sconv_at(site):
            items += [(f"sconv_{site}", _conv_bytes(cfg, stored * k), "other"),
                      (f"sconv_{site}_out", stored * k * c, "dot_save_only")]  # save_dots keeps it (measured)
    if cfg.qk_norm:
        items.append(("qk_norm", 2 * (h + g) * k * f + 8 * (h + g), "other"))
    if policy.fused_kernels:
        items.append(("attention_lse", h * f, "other"))  # FlashAttention keeps one logsumexp per query row
    else:
        mean_keys, copied = _attention_blocks(cfg, layer_window(cfg, layer))
        items += [
            ("attention_q_k_v", (h + 2 * g) * k * c, "other"),  # per-block queries, transposed keys and values
            ("attention_kv_slices", 2 * copied * g * k * c, "other"),
            ("attention_softmax", h * mean_keys * f, "other"),
            ("attention_out", h * k * c, "other"),
        ]
    if cfg.xsa:
        items.append(("xsa", 2 * h * k * f + 16 * h, "other"))
    if cfg.head_gate:
        items += [("head_gate", h * k * c + 8 * h, "other"), ("head_gate_logits", h * c, "dot_save_only")]
    items += [
        ("attention_concat", h * k * c, "other"),
        ("attention_output_projection", d * c, "dot_save_only"),
    ]
    if cfg.sconv_at("attn"):
        items += [("sconv_attn", _conv_bytes(cfg, d), "other"), ("sconv_attn_out", d * c, "dot_save_only")]
    items += [
        ("residual_mid", d * c, "other"),
        ("ffn_norm", _norm_bytes(cfg), "other"),
        *_gated_norm_items(cfg, "ffn"),
    ]
    if cfg.sconv_at("mlp"):
        items += [("sconv_mlp", _conv_bytes(cfg, d), "other"), ("sconv_mlp_out", d * c, "dot_save_only")]
    if cfg.is_moe_layer(layer):
        m = cfg.moe
        assert m is not None
        din = m.latent_dim or d
        rows = buffer_rows if buffer_rows is not None else (
            m.capacity_factor * m.top_k if m.dispatch in CAPACITY_DISPATCHES else m.top_k)
        items += [
            ("router_logits", m.num_experts * f, "dot_save_only"),
            ("router_scores_and_z_loss", 2 * m.num_experts * f + 3 * m.top_k * 4 + 17, "other"),
            ("dispatch_indices", 2 * m.top_k * 4 + 2 * rows * 4, "other"),
            # buffer rows: the assembled input, then gate, up, and silu's residuals and silu(gate) * up
            ("expert_buffers", rows * (din + 6 * m.expert_dim) * c, "other"),
            ("combine", (m.top_k + 1) * din * c, "other"),
        ]
        if m.latent_dim:
            items.append(("latent_down", din * c, "dot_save_only"))
            if m.latent_norm:
                items.append(("latent_norm", _norm_bytes(cfg, din), "other"))
        if m.num_shared_experts:
            width = m.num_shared_experts * (m.shared_expert_dim or m.expert_dim)
            items += [("shared_gate_up", 2 * width * c, "dot"), ("shared_silu", 4 * width * c, "other")]
    else:
        ffn = cfg.resolved_dense_ffn_dim
        items += [("dense_gate_up", 2 * ffn * c, "dot"), ("dense_silu", 4 * ffn * c, "other")]
    return items


def outside_activation_bytes(cfg: ModelConfig, policy: MemoryPolicy) -> float:
    """Per token outside the blocks: token ids, the last block's output, the final norm, and the loss
    (the float32 exp of the logsumexp over the vocabulary, or a blockwise loss's two scalars)."""
    c, f = DTYPE_BYTES[cfg.compute_dtype], 4
    loss = 2 * f if policy.fused_kernels else cfg.vocab_size * f
    pieces = sum(b for _, b, _ in _gated_norm_items(cfg, "final"))
    if cfg.embed_norm:
        pieces += _norm_bytes(cfg) + sum(b for _, b, _ in _gated_norm_items(cfg, "embed"))
    return 4 + cfg.hidden_dim * c + _norm_bytes(cfg) + loss + 13 + pieces


SAVED_KINDS = {"none": ("input", "dot", "other"), "full": ("input",), "save_dots": ("input", "dot", "dot_save_only")}


def saved_bytes_per_token(
    cfg: ModelConfig, remat: str, policy: MemoryPolicy = TRAINER_POLICY, buffer_rows: float | None = None
) -> float:
    """Bytes per token kept from the forward to the backward pass under a remat policy (no working set)."""
    if remat not in SAVED_KINDS:
        raise ValueError(f"unknown remat policy {remat!r}; use none, full or save_dots.")
    kinds = SAVED_KINDS[remat]
    blocks = sum(
        b for i in range(cfg.num_layers) for _, b, kind in layer_activation_items(cfg, i, policy, buffer_rows)
        if kind in kinds
    )
    return blocks + outside_activation_bytes(cfg, policy)


def activation_bytes_per_token(
    cfg: ModelConfig, remat: str, policy: MemoryPolicy, buffer_rows: float | None = None
) -> float:
    """Peak activation bytes per token of one micro-batch: what the forward saves, plus (under remat) the
    block being recomputed, whose full set of residuals lives while its backward runs."""
    saved = saved_bytes_per_token(cfg, remat, policy, buffer_rows)
    if remat == "none":
        return saved
    kinds = SAVED_KINDS[remat]
    recomputed = max(
        sum(b for _, b, kind in layer_activation_items(cfg, i, policy, buffer_rows)
            if kind in SAVED_KINDS["none"] and kind not in kinds)
        for i in range(cfg.num_layers)
    )
    return saved + recomputed


# --------------------------------------------------------------------------------------------
# The estimate


def remat_of(job: TrainJob) -> str:
    return job.train.remat


def microbatch_of(job: TrainJob) -> int:
    """Sequences per micro-batch (the whole batch when the step is not micro-batched)."""
    return job.train.microbatch_size or job.train.batch_size


def with_trainer_fields(job: TrainJob, fields: dict[str, Any]) -> TrainJob:
    """``job`` with dotted fields set (``{"model.moe.dispatch": "alltoall", "train.remat": "full"}``), validated
    as the job itself is: an unknown section or field, or a bad value, is a ValueError naming it."""
    from pydantic import ValidationError

    data = job.model_dump()
    for dotted, value in fields.items():
        node, parts = data, dotted.split(".")
        for i, part in enumerate(parts):
            if node is None:  # a section the job does not have (model.moe of a dense model): nothing to set
                break
            if not isinstance(node, dict) or part not in node:
                import difflib

                where = ".".join(parts[:i]) or "the job"
                known = sorted(node) if isinstance(node, dict) else []
                close = difflib.get_close_matches(part, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known: {known}"
                raise ValueError(f"memory policy field {dotted!r}: {where} has no field {part!r} ({hint}).")
            if i < len(parts) - 1:
                node = node[part]
            else:
                node[part] = value
    try:
        return TrainJob.model_validate(data)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(p) for p in problem["loc"])
        raise ValueError(f"memory policy fields {fields}: {where}: {problem['msg']}.") from None


EP_DISPATCHES = ("alltoall", "ragged_alltoall")  # trainer/expert_parallel.py: each device dispatches its own tokens

# The trainer fields the memory of a step depends on, with what each does to it (``trainer_features``).
MEMORY_FIELDS: dict[str, str] = {
    "model.moe.dispatch": "expert dispatch; 'alltoall'/'ragged_alltoall' = expert parallelism, capacity buckets sized "
    "by each device's own tokens (trainer/expert_parallel.py), else plain jit with buffers sized by the global batch",
    "model.compute_dtype": "dtype of activations and matmul weights",
    "train.precision": "'bf16_mixed' = one bf16 copy of the matmul weights per step, float32 master and moments",
    "train.param_sharding": "'zero3' = parameters, gradients and optimizer state split over every mesh axis, "
    "gathered per block",
    "train.offload": "state kept in pinned host memory between steps",
    "train.remat": "activations kept for the backward pass",
    "train.microbatch_size": "sequences per forward/backward (activations scale with it)",
    "train.mesh": "mesh axis sizes",
}


def _field(job: TrainJob, dotted: str) -> Any:
    node: Any = job
    for part in dotted.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def trainer_features(job: TrainJob) -> list[str]:
    """The trainer fields a plan of ``job`` relies on, as ``field=value``: those of ``MEMORY_FIELDS`` set away from
    their defaults, and the remat policy always (the mesh is printed beside every figure anyway)."""
    from trainer.config import ModelConfig, MoEConfig, TrainConfig

    defaults = {"model": ModelConfig, "model.moe": MoEConfig, "train": TrainConfig}
    out = []
    for dotted in MEMORY_FIELDS:
        section, name = dotted.rsplit(".", 1)
        value = _field(job, dotted)
        if value is None and section == "model.moe":
            continue
        default = defaults[section].model_fields[name].default
        if (value != default or name == "remat") and name != "mesh":
            out.append(f"{dotted}={value!r}")
    return out


def activation_policy(job: TrainJob) -> MemoryPolicy:
    """What the activation model needs to know of the trainer's code for ``job``: no fused kernels (the jnp
    attention keeps its score blocks, the loss its float32 logits), and local capacity buffers under an
    expert-parallel dispatch."""
    moe = job.model.moe
    local = moe is not None and moe.dispatch in EP_DISPATCHES
    return MemoryPolicy(name="trainer", moe_buffers="local" if local else "global", fused_kernels=False)


def _gathered_in_use(path: tuple[str, ...], leaf: Any) -> tuple[str, int]:
    """(block key, elements a device holds of this parameter while its block runs): every split gathered but
    the routed experts' split of E over "expert" (expert parallelism keeps it); a stacked (scanned) leaf
    counts one layer's slice."""
    from trainer import layers_scan

    spec = tuple(leaf.sharding.spec) + (None,) * (len(leaf.shape) - len(tuple(leaf.sharding.spec)))
    axes = dict(leaf.sharding.mesh.shape)
    kept = tuple(e if (i == 0 and e == "expert" and "experts" in path) else None for i, e in enumerate(spec))
    in_use = _shard_elements(tuple(leaf.shape), kept, axes)
    key = path[0]
    if path[0] == "blocks" and len(path) > 1:
        key = path[1]
        repeats = layers_scan.layer_axis_repeats(path)
        if repeats:
            key, in_use = f"{path[1]}/{path[2]}", in_use // repeats
    return key, in_use


def _trainer_state(job: TrainJob, axes: dict[str, int]) -> dict[str, Any]:
    """The state half under the trainer's own code path (``abstract_train_state``): exact, per leaf. The
    compute copy's dtypes come from ``trainer.model.cast_for_compute`` itself (evaluated abstractly).

    Memoised: tracing a large model's init and optimizer takes seconds, and a capacity plan's micro-batch search
    asks again for every micro-batch size, which the state does not depend on."""
    unbatched = job.model_copy(update={"train": job.train.model_copy(update={"microbatch_size": None})})
    return dict(_trainer_state_of(unbatched.model_dump_json(), tuple(sorted(axes.items()))))


@functools.lru_cache(maxsize=64)
def _trainer_state_of(job_json: str, axes_items: tuple[tuple[str, int], ...]) -> dict[str, Any]:
    import jax

    from trainer import model

    job, axes = TrainJob.model_validate_json(job_json), dict(axes_items)
    state = abstract_train_state(job, axes)
    params = state["params"]
    compute = jax.eval_shape(lambda p: model.cast_for_compute(p, job.model), params)
    out = dict(params=0, master_params=0, optimizer_state=0, gradients=0, micro_gradients=0, compute_weights=0,
               other=0, host_bytes=0, param_elements=0)
    mixed = job.train.precision == "bf16_mixed"
    gathered: dict[str, int] = {}
    cast = 0
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), copy in zip(flat, jax.tree.leaves(compute)):
        names = _names(path)
        size = leaf_shard_bytes(leaf)
        itemsize, c = np.dtype(leaf.dtype).itemsize, np.dtype(copy.dtype).itemsize
        elements = size // itemsize
        out["param_elements"] += elements
        out["host_bytes" if leaf_memory_kind(leaf) == "host" else "params"] += size
        # autodiff's gradient has the dtype of what it differentiates (the parameter, or bf16_mixed's compute
        # copy, cast to float32 at once unless micro-batches accumulate it) and the parameter's sharding
        out["gradients"] += size
        out["micro_gradients"] += elements * c if mixed else size
        if c != itemsize:
            cast += elements * c  # the compute copy (per use under precision 'model', once per step under bf16_mixed)
        key, in_use = _gathered_in_use(names, leaf)
        if in_use > elements:
            gathered[key] = gathered.get(key, 0) + in_use * c
    out["compute_weights"] = cast + (max(gathered.values()) if gathered else 0)
    out["gathered"] = bool(gathered)
    for part in ("opt_state", "router_state", "step"):
        for leaf in jax.tree.leaves(state[part]):
            size = leaf_shard_bytes(leaf)
            if leaf_memory_kind(leaf) == "host":
                out["host_bytes"] += size
            elif part == "opt_state" and len(leaf.shape) > 0:
                out["optimizer_state"] += size
            else:
                out["other"] += size
    return out


def _described_state(job: TrainJob, axes: dict[str, int], policy: MemoryPolicy) -> dict[str, Any]:
    """The state half of a described policy (one the trainer does not run): its dtypes and places applied to
    the trainer's parameter shards (``policy_shards``)."""
    cfg = job.model
    shards = policy_shards(cfg, axes, policy)
    elements = sum(stored for stored, _ in shards.values())
    param_bytes = DTYPE_BYTES[policy.param_dtype]
    grad_bytes = DTYPE_BYTES[policy.gradient_dtype or policy.param_dtype]
    c = DTYPE_BYTES[cfg.compute_dtype]
    out = dict(
        params=elements * param_bytes,
        master_params=elements * 4 if policy.master_params == "device" else 0,
        optimizer_state=2 * elements * 4 if policy.optimizer_state == "device" else 0,
        gradients=elements * grad_bytes,
        micro_gradients=elements * grad_bytes,
        host_bytes=(elements * 4 if policy.master_params == "host" else 0)
        + (2 * elements * 4 if policy.optimizer_state == "host" else 0),
        param_elements=elements,
    )
    # Compute-dtype copies: weights cast from float32 params (norms and the router stay float32), and the
    # largest block's weights gathered whole while it runs when they are stored split (fsdp).
    compute_weights = 0
    if c != param_bytes:
        cast = sum(stored for path, (stored, _) in shards.items() if not path[-1].endswith("norm") and "router" not in path)
        compute_weights += cast * c
    gathered: dict[str, int] = {}
    for path, (stored, in_use) in shards.items():
        if in_use > stored:
            key = path[1] if path[0] == "blocks" else path[0]
            gathered[key] = gathered.get(key, 0) + in_use
    if gathered:
        compute_weights += max(gathered.values()) * c
    out["compute_weights"] = compute_weights
    out["gathered"] = bool(gathered)
    n_moe = sum(1 for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    out["other"] = (n_moe * cfg.moe.num_experts * 4 if cfg.moe else 0) + 64
    return out


def estimate_memory(
    job: TrainJob,
    mesh: dict[str, int],
    policy: str | MemoryPolicy | None = None,
    *,
    activation_dtype: Literal["float32", "bfloat16"] | None = None,
) -> MemoryEstimate:
    """Per-device memory of ``job``'s train step on a mesh with these axis sizes (see module docstring).

    ``activation_dtype`` overrides the width activations are counted at (None = ``model.compute_dtype``): XLA:CPU
    computes bfloat16 in float32 (measured: a bf16 step's temp is within 2% of its float32 twin's), so the check
    against CPU compiles passes "float32"; the state half keeps its real dtypes."""
    policy = resolve_policy(policy)
    axes = {k: int(v) for k, v in mesh.items()}
    runs = policy.trainer_fields is not None
    if runs:
        job = with_trainer_fields(job, policy.trainer_fields)
    cfg = job.model
    devices = int(np.prod(list(axes.values()))) if axes else 1
    notes: list[str] = []
    state = _trainer_state(job, axes) if runs else _described_state(job, axes, policy)
    acts = activation_policy(job) if runs else policy

    microbatch = microbatch_of(job)
    accumulating = microbatch < job.train.batch_size
    gradients = state["gradients"]
    if accumulating:
        # the scan's float32 carry lives next to each micro-batch's gradients (bf16_mixed: of the bf16 copy)
        gradients = state["micro_gradients"] + state["param_elements"] * 4
        notes.append("micro-batched: a float32 gradient accumulator next to each micro-batch's gradients")
    if state["gathered"]:
        notes.append("weights stored split (fsdp) are gathered whole for the block that runs: the largest block counted")

    remat = policy.remat or remat_of(job)
    tokens = math.ceil(microbatch * cfg.seq_len / devices)
    replication = dispatch_replication(axes, acts) if cfg.moe is not None else 1.0
    if replication > 1:
        notes.append(f"MoE capacity buffers are global: each device holds {replication:g}x its own tokens' rows")
    rows = buffer_rows_per_token(cfg, tokens, axes, acts) if cfg.moe is not None else None
    # XLA:CPU keeps bfloat16 activations in float32: the CPU validation passes activation_dtype="float32"
    act_cfg = cfg if activation_dtype is None else cfg.model_copy(update={"compute_dtype": activation_dtype})
    per_token = activation_bytes_per_token(act_cfg, remat, acts, rows)
    activations = int(round(per_token * tokens))

    n_moe = sum(1 for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    if accumulating and cfg.moe is not None and cfg.moe.balancing == "quantile":
        # trainer/step.py stacks every micro-batch's per-token quantile-balancing inputs [T, E] (float32) of
        # every MoE layer to take the whole batch's quantile after the scan
        kept = math.ceil(job.train.batch_size * cfg.seq_len / devices) * n_moe * cfg.moe.num_experts * 4
        activations += kept
        notes.append(f"micro-batched quantile balancing keeps the whole batch's router margins: {kept / 1e9:.3g} GB")
    # other: router bias, counters, the batch's rows on this device, and the constants (masks, rotary tables)
    other = state["other"] + math.ceil(job.train.batch_size / devices) * (cfg.seq_len + 1) * 4 + constant_bytes(cfg)
    parts = dict(params=state["params"], master_params=state["master_params"], optimizer_state=state["optimizer_state"],
                 gradients=gradients, compute_weights=state["compute_weights"], activations=activations, other=other)
    backward = sum(parts.values())
    # The update: activations and the compute copy are gone; what is offloaded comes to the device for it
    # (trainer.precision.with_offload; the new values are written back over the staged copies' buffers).
    staged = state["host_bytes"] if runs else 0
    update = parts["params"] + parts["master_params"] + parts["optimizer_state"] + state["gradients"] + other + staged
    if staged:
        notes.append(f"update phase: {update / 1e9:.3g} GB per device (float32 gradients and the {staged / 1e9:.3g} GB of "
                     "offloaded state brought to the device for the update); the peak is the larger phase")
    return MemoryEstimate(
        policy=policy.name,
        mesh=axes,
        remat=remat,
        microbatch_size=microbatch,
        tokens_per_device=tokens,
        **parts,
        offload_staging=staged,
        total=max(backward, update),
        host_bytes=state["host_bytes"],
        activation_bytes_per_token=per_token,
        features=trainer_features(job) if runs else [],
        notes=notes,
    )


# --------------------------------------------------------------------------------------------
# What XLA says (needs the mesh's devices; tests use fake CPU devices)


def measure_train_step(job: TrainJob, mesh: dict[str, int]) -> dict[str, int]:
    """Compile the trainer's jitted train step (same state, shardings and donation as trainer/loop.py)
    for ``mesh`` and return XLA's per-device ``memory_analysis()``: argument, output, alias and temp
    bytes, and ``peak`` = argument + output - alias + temp (the donated state is counted once)."""
    import jax
    import jax.numpy as jnp

    from trainer import model, sharding
    from trainer.step import jit_train_step

    jitted = jit_train_step(job, model, sharding.make_mesh(mesh))
    compiled = jitted.train_step.lower(
        jitted.abstract_state,
        jax.ShapeDtypeStruct((job.train.batch_size, job.model.seq_len + 1), jnp.int32, sharding=jitted.batch_sharding),
        jax.ShapeDtypeStruct((), jnp.bool_, sharding=jitted.replicated),
        jax.ShapeDtypeStruct((), jnp.float32, sharding=jitted.replicated),
    ).compile()
    stats = compiled.memory_analysis()
    out = {
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
        "temp": int(stats.temp_size_in_bytes),
        "host_argument": int(stats.host_argument_size_in_bytes),
        "host_output": int(stats.host_output_size_in_bytes),
        "host_alias": int(stats.host_alias_size_in_bytes),
        "host_temp": int(stats.host_temp_size_in_bytes),
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["host_peak"] = out["host_argument"] + out["host_output"] - out["host_alias"] + out["host_temp"]
    return out
