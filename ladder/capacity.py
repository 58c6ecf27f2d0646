"""The capacity plan of a training step: memory per device and whether it fits, step and wall time at a
stated MFU, accelerator-hours and their cost, with every assumption written next to the figures.

Why here and not in the trainer: the plan is about a *spec on a cluster* (hosts x devices per host, an
accelerator type, a price), while the trainer knows one job on one mesh. The memory figures come from
``trainer.memory`` (the trainer's real sharding rules on an abstract mesh, plus an activation model
checked against XLA), the FLOPs from the spec's derived numbers (``trainer.accounting`` in the spec's
convention, as ``ladder plan`` always reported them), and the peak FLOP/s and HBM sizes from the tables
in ``trainer.accounting``.

Memory policy: the trainer's own (``trainer.memory.TRAINER_POLICY``: the job's fields through the trainer's
own state shardings, dtypes and memory kinds) unless the spec declares another with the tag ``memory_policy``
(a policy name such as ``"marin"`` or ``"trainer-sharded"``, or a ``MemoryPolicy`` as JSON) or the caller
overrides it. When the policy is not the trainer's, the row also carries the trainer's own figure, so a
plan never hides what the code in this repository would need. A row whose trainer figure does not fit also
carries the figure with every memory feature of the trainer on (``trainer-sharded``), and the largest
micro-batch, if any, with which the step fits: what a user can set in the spec, with the fields named.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ladder.spec import ExperimentSpec

MEMORY_POLICY_TAG = "memory_policy"
DEFAULT_HEADROOM = 0.10
SECONDS_PER_DAY = 86_400.0
LEFT_OUT = (
    "not modelled: collective staging buffers (ZeRO-3 gathers count one block's weights whole; the all-to-all "
    "buckets are modelled from the expert-parallel layer's own sizing), XLA fusion temporaries beyond one block's "
    "backward, host-offload transfer buffers, the eval step, checkpoint writes; step time is FLOPs / (devices x "
    "peak x MFU), with no separate communication, data or checkpoint time"
)
VALIDATION = (
    "memory model checked (tests/test_capacity.py) against JAX's saved residuals (within 7% for every remat "
    "policy, float32 and bfloat16) and XLA's memory_analysis of the real jitted step on 8 fake CPU devices: "
    "plan/XLA 1.04-1.12 for plain jit, all-to-all expert parallelism, ZeRO-3 with bf16_mixed, host offload, and "
    "remat + micro-batching (BENCHMARKS.md, 'Capacity plan against XLA'); XLA:CPU computes bfloat16 in float32 and places "
    "pinned_host state in the same memory, so there bf16 activations are checked at float32 width and offloaded "
    "bytes against the device total"
)


class MemoryFigures(BaseModel):
    """One policy's per-device memory, in bytes, and whether it fits."""

    model_config = ConfigDict(frozen=True)

    policy: str
    remat: str = Field(description="Remat policy these figures assume (the job's, or the memory policy's override).")
    parts: dict[str, int] = Field(description="params, master_params, optimizer_state, gradients, compute_weights, "
                                              "activations, other.")
    total: int
    host_bytes_per_device: int
    fits: bool | None = Field(description="total <= HBM x (1 - headroom); None without a known accelerator.")
    needs_hbm_bytes: float = Field(description="HBM a device would need: total / (1 - headroom).")
    activation_bytes_per_token: float
    tokens_per_device: int
    microbatch_size: int = Field(0, description="Sequences per micro-batch these figures assume.")
    features: list[str] = Field(
        default_factory=list, description="Trainer fields these figures rely on (a policy the trainer runs)."
    )
    notes: list[str] = Field(default_factory=list)


class CapacityRow(BaseModel):
    """The capacity plan of one training step."""

    model_config = ConfigDict(frozen=True)

    step: str
    accelerator: str | None
    hosts: int
    devices_per_host: int
    devices: int
    mesh: dict[str, int]
    remat: str
    microbatch_size: int
    hbm_bytes: float | None
    headroom: float
    memory: MemoryFigures = Field(description="Under the step's memory policy.")
    memory_trainer: MemoryFigures | None = Field(
        None, description="Under the trainer's own policy, when the step's policy is another one."
    )
    memory_trainer_sharded: MemoryFigures | None = Field(
        None,
        description="With every memory feature of the trainer on (policy 'trainer-sharded'), when the trainer's "
        "own figure does not fit and the job does not already run that way.",
    )
    fits_with_microbatch: MemoryFigures | None = Field(
        None,
        description="The largest train.microbatch_size with which a trainer-run figure that does not fit would fit "
        "(its figures; microbatch_size says which), trying the trainer-sharded policy first; None when none does "
        "or nothing needed it.",
    )
    host_memory_bytes: float | None = Field(None, description="ResourceSpec.memory_gb per host, in bytes.")
    host_offload_bytes_per_host: int = Field(description="What the policy offloads to host memory, per host.")
    host_fits: bool | None = Field(
        None, description="host_offload_bytes_per_host <= host_memory_bytes; None without memory_gb or offload."
    )
    flops_per_step: float
    flops_convention: str
    peak_flops_per_device: float | None
    mfu: float
    step_seconds: float | None
    wall_seconds: float | None
    wall_days: float | None
    accelerator_hours: float | None
    price_per_hour: float | None
    cost_usd: float | None
    assumptions: list[str]


def devices_per_host(spec: ExperimentSpec) -> int:
    """Accelerators per host (GPUs or TPU chips), else the fake CPU devices the step asks for, else 1."""
    per_host = spec.resources.gpus or spec.resources.tpus or spec.resources.cpu_devices_per_host
    return max(1, int(round(per_host))) if per_host else 1


def memory_policy_of(spec: ExperimentSpec, override: str | None = None):
    """The CLI's policy, else the spec's ``memory_policy`` tag, else the trainer's."""
    from trainer import memory

    return memory.resolve_policy(override or spec.tags.get(MEMORY_POLICY_TAG))


def _figures(job, mesh: dict[str, int], policy, hbm: float | None, headroom: float) -> MemoryFigures:
    from trainer import memory

    est = memory.estimate_memory(job, mesh, policy)
    return MemoryFigures(
        policy=est.policy,
        remat=est.remat,
        parts=est.parts(),
        total=est.total,
        host_bytes_per_device=est.host_bytes,
        fits=None if hbm is None else est.total <= hbm * (1.0 - headroom),
        needs_hbm_bytes=est.total / (1.0 - headroom),
        activation_bytes_per_token=est.activation_bytes_per_token,
        tokens_per_device=est.tokens_per_device,
        microbatch_size=est.microbatch_size,
        features=list(est.features),
        notes=list(est.notes),
    )


def microbatch_sizes(job, devices: int) -> list[int]:
    """Micro-batch sizes the trainer accepts for ``job`` on this many devices, largest first, below the batch:
    divisors of train.batch_size that split over every device (trainer.config.TrainConfig's rule)."""
    batch = job.train.batch_size
    return [m for m in range(batch - 1, 0, -1) if batch % m == 0 and m % devices == 0]


def _fitting_microbatch(job, mesh, policy, hbm: float, headroom: float) -> MemoryFigures | None:
    """The figures of the largest micro-batch with which ``job`` fits under ``policy``; None if none does."""
    from trainer import memory

    devices = 1
    for size in mesh.values():
        devices *= size
    for size in microbatch_sizes(job, devices):
        trial = memory.with_trainer_fields(job, {"train.microbatch_size": size})
        figures = _figures(trial, mesh, policy, hbm, headroom)
        if figures.fits:
            return figures
    return None


def _normalised(accelerator: str) -> str:
    return accelerator.replace("-", " ").replace("_", " ")


def capacity_row(
    name: str,
    spec: ExperimentSpec,
    *,
    mfu: float,
    price_per_hour: float | None = None,
    accelerator: str | None = None,
    memory_policy: str | None = None,
    headroom: float = DEFAULT_HEADROOM,
) -> CapacityRow:
    """The capacity plan of training step ``name`` (see the module docstring for where each figure comes from)."""
    from trainer import accounting, memory

    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu} must be a fraction in (0, 1], e.g. 0.4.")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom} must be a fraction in [0, 1), e.g. 0.1.")
    if price_per_hour is not None and price_per_hour < 0:
        raise ValueError(f"price_per_hour={price_per_hour} must be >= 0 (USD per accelerator-hour).")
    job = spec.job()
    derived = spec.derived()
    accelerator = accelerator or spec.resources.accelerator_type
    hosts, per_host = spec.resources.hosts, devices_per_host(spec)
    devices = hosts * per_host
    mesh = memory.mesh_axes_for(job, devices)
    policy = memory_policy_of(spec, memory_policy)

    hbm = peak = None
    if accelerator:
        try:
            hbm = accounting.hbm_bytes(accelerator)
        except ValueError:
            hbm = None
        try:
            peak = accounting.peak_flops_per_second(_normalised(accelerator))
        except ValueError:
            peak = None

    figures = _figures(job, mesh, policy, hbm, headroom)
    trainer_figures = None if policy == memory.TRAINER_POLICY else _figures(job, mesh, memory.TRAINER_POLICY, hbm, headroom)
    own = figures if policy == memory.TRAINER_POLICY else trainer_figures
    sharded = suggestion = None
    if own.fits is False:
        sharded_job = memory.with_trainer_fields(job, memory.TRAINER_SHARDED_POLICY.trainer_fields)
        if policy != memory.TRAINER_SHARDED_POLICY and sharded_job != job:
            sharded = _figures(job, mesh, memory.TRAINER_SHARDED_POLICY, hbm, headroom)
        runnable = [(p, f) for p, f in ((memory.TRAINER_SHARDED_POLICY, sharded), (memory.TRAINER_POLICY, own))
                    if f is not None]
        if policy.trainer_fields is not None:
            runnable.insert(0, (policy, figures))
        if not any(f.fits for _, f in runnable):
            for candidate, _ in runnable:
                suggestion = _fitting_microbatch(job, mesh, candidate, hbm, headroom)
                if suggestion is not None:
                    break

    flops_per_step = derived.total_flops / derived.num_steps
    step_seconds = wall = hours = cost = None
    if peak is not None:
        step_seconds = flops_per_step / (devices * peak * mfu)
        wall = step_seconds * derived.num_steps
        hours = wall * devices / 3600.0
        cost = hours * price_per_hour if price_per_hour is not None else None

    host_memory = spec.resources.memory_gb * 2**30 if spec.resources.memory_gb else None
    host_offload = figures.host_bytes_per_device * per_host

    cfg = job.model
    mesh_devices = 1
    for size in mesh.values():
        mesh_devices *= size
    assumptions = [
        f"devices = {hosts} hosts x {per_host} per host = {devices}; mesh {mesh}"
        + ("" if mesh_devices == devices else f" (uses {mesh_devices} of them)" if mesh_devices < devices
           else f" (needs {mesh_devices} devices: more than the resources ask for)")
        + f"; {flops_per_step:.4g} FLOPs per step",
        f"MFU {mfu:.0%} of the peak; FLOPs in the spec's '{derived.accounting}' convention (3 x forward FLOPs per "
        "token x tokens per step, lm_head included)",
    ]
    if accelerator is None:
        assumptions.append("no accelerator type: no HBM check, no step time (set resources.accelerator_type or --accelerator)")
    else:
        assumptions.append(
            f"peak {peak / 1e12:,.0f} TFLOP/s dense bf16 per {accelerator} (vendor datasheet, trainer.accounting.PEAK_BF16_FLOPS)"
            if peak is not None else f"no peak FLOP/s known for {accelerator!r}: no step time"
        )
        assumptions.append(
            f"HBM {hbm / 1e9:,.0f} GB per {accelerator} (vendor docs, trainer.accounting.HBM_BYTES); {headroom:.0%} held "
            "back for the runtime, allocator fragmentation and compiler scratch"
            if hbm is not None else f"no HBM size known for {accelerator!r}: no fit check"
        )
    if policy.trainer_fields is not None:
        run = memory.with_trainer_fields(job, policy.trainer_fields)
        offloaded = {"none": "nothing", "optimizer": "the optimizer state",
                     "master_and_optimizer": "the float32 master and the optimizer state"}[run.train.offload]
        dtypes = (f"dtypes and places from the trainer's state shardings: float32 parameters (the master) and "
                  f"{run.optimizer.name} state, "
                  f"{'one bf16 compute copy per step' if run.train.precision == 'bf16_mixed' else 'weights cast per use'}"
                  f" to compute {run.model.compute_dtype}, float32 gradients; {offloaded} in pinned host memory")
    else:
        dtypes = (f"dtypes: device params {policy.param_dtype}, gradients {policy.gradient_dtype or policy.param_dtype}, "
                  f"AdamW mu+nu float32 on {policy.optimizer_state}, master "
                  f"{'= device params' if policy.master_params == 'none' else 'float32 on ' + policy.master_params}, "
                  f"compute {cfg.compute_dtype}")
    assumptions += [
        f"memory policy '{policy.name}': {policy.description or policy.model_dump_json()}",
        dtypes,
        f"remat '{figures.remat}'"
        + (f" (the policy's; the spec says '{memory.remat_of(job)}')" if figures.remat != memory.remat_of(job) else "")
        + f"; micro-batch {memory.microbatch_of(job)} of {job.train.batch_size} sequences "
        f"({figures.tokens_per_device:,} tokens per device per micro-batch)",
        LEFT_OUT,
        VALIDATION,
    ]
    if price_per_hour is not None:
        assumptions.append(f"cost at {price_per_hour:g} USD per accelerator-hour (given)")
    return CapacityRow(
        step=name,
        accelerator=accelerator,
        hosts=hosts,
        devices_per_host=per_host,
        devices=devices,
        mesh=mesh,
        remat=figures.remat,
        microbatch_size=memory.microbatch_of(job),
        hbm_bytes=hbm,
        headroom=headroom,
        memory=figures,
        memory_trainer=trainer_figures,
        memory_trainer_sharded=sharded,
        fits_with_microbatch=suggestion,
        host_memory_bytes=host_memory,
        host_offload_bytes_per_host=host_offload,
        host_fits=None if host_memory is None or not host_offload else host_offload <= host_memory,
        flops_per_step=flops_per_step,
        flops_convention=derived.accounting,
        peak_flops_per_device=peak,
        mfu=mfu,
        step_seconds=step_seconds,
        wall_seconds=wall,
        wall_days=None if wall is None else wall / SECONDS_PER_DAY,
        accelerator_hours=hours,
        price_per_hour=price_per_hour,
        cost_usd=cost,
        assumptions=assumptions,
    )


def fit_verdict(figures: MemoryFigures, hbm: float | None) -> str:
    """'fits' / 'does not fit (needs X GB)' / '-' for a text table."""
    if figures.fits is None or hbm is None:
        return "-"
    if figures.fits:
        return "fits"
    return f"does not fit (needs {figures.needs_hbm_bytes / 1e9:,.0f} GB)"
