"""Device memory of one training step, per device, before anything is allocated.

Why: the ladder plans runs that no machine here can hold (Marin's 535B hero), so whether a step fits
its accelerator must come from the spec alone. The estimate has two halves:

* **State** (parameters, optimizer state, gradients) is exact, not modelled: it applies the trainer's own
  sharding rule (``trainer.sharding.param_partition_spec``) to the abstract parameter pytree
  (``jax.eval_shape`` of ``init_params``: no allocation, so it works for 535B parameters) on an abstract
  mesh, and sums each leaf's per-device shard. What the trainer keeps (trainer/step.py, optim.py,
  loop.py): float32 parameters, float32 AdamW mu and nu of the same shapes and shardings, float32
  gradients, the router bias ``f32[n_moe_layers, E]`` and the step counter (replicated). The state is
  donated, so the new state reuses the old one's buffers.
* **Activations** are analytic: bytes saved per token for the backward pass, layer by layer (attention
  with the score blocks our attention materialises, the MoE capacity buffers with their capacity factor,
  shared experts, the float32 exp of the loss over the vocabulary), times the tokens each device holds
  in one micro-batch, under the remat policy ("full" and "save_dots" keep less, plus the one block being
  recomputed). tests/test_capacity.py holds the model against JAX's saved residuals (per remat policy)
  and against XLA: ``measure_train_step`` compiles the real jitted step as the loop does and returns
  ``compiled.memory_analysis()`` per device.
* **Where the trainer's dispatch is global**: under plain jit the capacity buffers are sized by the global
  batch and GSPMD splits them only over the expert axis (measured), so each device holds data x fsdp
  times its own tokens' rows; an all-to-all transport (policy ``moe_buffers="local"``) holds its own.

A ``MemoryPolicy`` says where each copy lives. The default is what this trainer runs; other policies
describe runs the trainer does not implement (Marin's hero: bf16 parameters on device, float32 master and
optimizer state offloaded to host memory, fused attention and loss kernels) so a plan can be checked
against what is public about them. Pure functions over a TrainJob and mesh axis sizes; no ladder imports.
"""

from __future__ import annotations

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
    description: str = Field("", description="Where the policy comes from.")


TRAINER_POLICY = MemoryPolicy(
    name="trainer",
    description="what trainer/ runs today: float32 parameters, AdamW state and gradients on device; "
    "attention score blocks and float32 logits materialised",
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
POLICIES: dict[str, MemoryPolicy] = {p.name: p for p in (TRAINER_POLICY, MARIN_POLICY)}


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
    other: int = Field(description="Router bias, step counter and optimizer scalars.")
    total: int
    host_bytes: int = Field(description="Per-device bytes offloaded to host memory (master, optimizer state).")
    activation_bytes_per_token: float = Field(description="activations / tokens_per_device.")
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


def param_leaves(cfg: ModelConfig) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """(path, shape) of every parameter, from ``jax.eval_shape(init_params)``: nothing is allocated."""
    import jax

    from trainer import model

    abstract = jax.eval_shape(lambda k: model.init_params(cfg, k), jax.random.key(0))
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    return [(tuple(str(getattr(p, "key", getattr(p, "idx", p))) for p in path), tuple(leaf.shape)) for path, leaf in leaves]


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


def dispatch_replication(mesh: dict[str, int], policy: MemoryPolicy) -> float:
    """How many times more capacity-buffer rows a device holds than its own tokens fill: 1 for a 'local'
    (all-to-all) transport; data x fsdp for this trainer's 'global' buffers, which are sized by the global
    batch and split over "expert" only (measured on CPU: GSPMD replicates them over "data"; over "fsdp" it
    replicates part of them, so with an fsdp axis this is conservative, up to 1.8x the measured total)."""
    if policy.moe_buffers == "local":
        return 1.0
    return float(mesh.get("data", 1) * mesh.get("fsdp", 1))


def _norm_bytes(cfg: ModelConfig) -> float:
    """RMSNorm: three float32 [d] intermediates, two per-token scalars, and the cast back to the compute dtype."""
    c = DTYPE_BYTES[cfg.compute_dtype]
    return 3 * cfg.hidden_dim * 4 + 8 + (cfg.hidden_dim * c if c != 4 else 0)


def layer_activation_items(
    cfg: ModelConfig, layer: int, policy: MemoryPolicy, replication: float = 1.0
) -> list[Item]:
    """What one block saves per token for its backward pass, as (name, bytes, kind).

    kind "input": the block's input (all that remat "full" keeps); "dot": a no-batch-dim matmul output that
    the backward needs anyway (SwiGLU gate and up); "dot_save_only": a no-batch-dim matmul output that only
    "save_dots" keeps (q/k/v and output projections, router logits, latent down-projection: without remat
    their consumers' residuals are kept instead); "other": the rest, recomputed under any remat policy.
    ``replication`` scales the capacity buffers (``dispatch_replication``).
    """
    from trainer.model import layer_kv_heads, layer_window

    c, f = DTYPE_BYTES[cfg.compute_dtype], 4
    d, h, k = cfg.hidden_dim, cfg.num_heads, cfg.resolved_head_dim
    g = layer_kv_heads(cfg, layer)
    items: list[Item] = [
        ("block_input", d * c, "input"),
        ("attn_norm", _norm_bytes(cfg), "other"),
        ("qkv_projections", (h + 2 * g) * k * c, "dot_save_only"),
    ]
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
    items += [
        ("attention_concat", h * k * c, "other"),
        ("attention_output_projection", d * c, "dot_save_only"),
        ("residual_mid", d * c, "other"),
        ("ffn_norm", _norm_bytes(cfg), "other"),
    ]
    if cfg.is_moe_layer(layer):
        m = cfg.moe
        assert m is not None
        din = m.latent_dim or d
        rows = replication * (m.capacity_factor * m.top_k if m.dispatch == "capacity" else m.top_k)
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
    return 4 + cfg.hidden_dim * c + _norm_bytes(cfg) + loss + 13


SAVED_KINDS = {"none": ("input", "dot", "other"), "full": ("input",), "save_dots": ("input", "dot", "dot_save_only")}


def saved_bytes_per_token(
    cfg: ModelConfig, remat: str, policy: MemoryPolicy = TRAINER_POLICY, replication: float = 1.0
) -> float:
    """Bytes per token kept from the forward to the backward pass under a remat policy (no working set)."""
    if remat not in SAVED_KINDS:
        raise ValueError(f"unknown remat policy {remat!r}; use none, full or save_dots.")
    kinds = SAVED_KINDS[remat]
    blocks = sum(
        b for i in range(cfg.num_layers) for _, b, kind in layer_activation_items(cfg, i, policy, replication)
        if kind in kinds
    )
    return blocks + outside_activation_bytes(cfg, policy)


def activation_bytes_per_token(cfg: ModelConfig, remat: str, policy: MemoryPolicy, replication: float = 1.0) -> float:
    """Peak activation bytes per token of one micro-batch: what the forward saves, plus (under remat) the
    block being recomputed, whose full set of residuals lives while its backward runs."""
    saved = saved_bytes_per_token(cfg, remat, policy, replication)
    if remat == "none":
        return saved
    kinds = SAVED_KINDS[remat]
    recomputed = max(
        sum(b for _, b, kind in layer_activation_items(cfg, i, policy, replication)
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


def estimate_memory(
    job: TrainJob, mesh: dict[str, int], policy: str | MemoryPolicy | None = None
) -> MemoryEstimate:
    """Per-device memory of ``job``'s train step on a mesh with these axis sizes (see module docstring)."""
    policy = resolve_policy(policy)
    cfg = job.model
    axes = {k: int(v) for k, v in mesh.items()}
    devices = int(np.prod(list(axes.values()))) if axes else 1
    shards = policy_shards(cfg, axes, policy)
    elements = sum(stored for stored, _ in shards.values())
    param_bytes = DTYPE_BYTES[policy.param_dtype]
    grad_bytes = DTYPE_BYTES[policy.gradient_dtype or policy.param_dtype]
    c = DTYPE_BYTES[cfg.compute_dtype]
    notes: list[str] = []

    params = elements * param_bytes
    master = elements * 4 if policy.master_params == "device" else 0
    optimizer = 2 * elements * 4 if policy.optimizer_state == "device" else 0
    host = (elements * 4 if policy.master_params == "host" else 0) + (
        2 * elements * 4 if policy.optimizer_state == "host" else 0
    )

    microbatch = microbatch_of(job)
    accumulating = microbatch < job.train.batch_size
    # Micro-batched, a float32 accumulator (the scan's carry) lives next to each micro-batch's gradients.
    gradients = elements * grad_bytes + (elements * 4 if accumulating else 0)
    if accumulating:
        notes.append("micro-batched: a float32 gradient accumulator next to each micro-batch's gradients")

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
        notes.append("weights stored split (fsdp) are gathered whole for the block that runs: the largest block counted")

    remat = policy.remat or remat_of(job)
    tokens = math.ceil(microbatch * cfg.seq_len / devices)
    replication = dispatch_replication(axes, policy) if cfg.moe is not None else 1.0
    if replication > 1:
        notes.append(f"MoE capacity buffers are global: each device holds {replication:g}x its own tokens' rows")
    per_token = activation_bytes_per_token(cfg, remat, policy, replication)
    activations = int(round(per_token * tokens))

    n_moe = sum(1 for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    if accumulating and cfg.moe is not None and cfg.moe.balancing == "quantile":
        # trainer/step.py stacks every micro-batch's per-token quantile-balancing inputs [T, E] (float32) of
        # every MoE layer to take the whole batch's quantile after the scan
        kept = math.ceil(job.train.batch_size * cfg.seq_len / devices) * n_moe * cfg.moe.num_experts * 4
        activations += kept
        notes.append(f"micro-batched quantile balancing keeps the whole batch's router margins: {kept / 1e9:.3g} GB")
    other = (n_moe * cfg.moe.num_experts * 4 if cfg.moe else 0) + 64
    total = params + master + optimizer + gradients + compute_weights + activations + other
    return MemoryEstimate(
        policy=policy.name,
        mesh=axes,
        remat=remat,
        microbatch_size=microbatch,
        tokens_per_device=tokens,
        params=params,
        master_params=master,
        optimizer_state=optimizer,
        gradients=gradients,
        compute_weights=compute_weights,
        activations=activations,
        other=other,
        total=total,
        host_bytes=host,
        activation_bytes_per_token=per_token,
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
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out
