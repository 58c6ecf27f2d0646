"""Typed experiment specs, their identity, and the numbers derived from them.

An `ExperimentSpec` is a trainer `TrainJob` (model, data, optimizer and schedule, budget) plus what it
takes to run it (`ResourceSpec`) and free-form tags. The split matters because identity is
what a spec *computes*, not where it runs: the fingerprint hashes the job (minus the loop's
execution-only fields such as logging cadence and mesh) and the fingerprints of the steps it
reads from, and ignores resources, the store root, the cluster and logging. Changing a learning
rate moves a run to a new directory; moving it from a laptop to a cluster does not (Marin's
region-in-the-hash lesson, `docs/marin_recipe.md`).

Derived numbers (parameters, FLOPs, steps) are never typed by hand: `derived()` asks the trainer's
accounting module, so the plan, the forecaster and the trainer can never disagree.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainer.config import ModelConfig, TrainJob

SPEC_FORMAT_VERSION = 1


class ResourceSpec(BaseModel):
    """What one step asks the cluster for, expressed as Ray resources. Never part of identity."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus: float = Field(1.0, ge=0, description="CPU cores per host (Ray num_cpus).")
    gpus: float = Field(0.0, ge=0, description="GPUs per host (Ray num_gpus).")
    tpus: float = Field(0.0, ge=0, description="TPU chips per host (Ray custom resource 'TPU').")
    accelerator_type: str | None = Field(
        None, description="Accelerator model the step needs, e.g. 'H100', 'GB200', 'TPU-V5P' (Ray accelerator_type)."
    )
    hosts: int = Field(1, ge=1, description="Number of hosts the step spans (one process per host).")
    memory_gb: float | None = Field(None, gt=0, description="Host memory to reserve, in GiB (Ray memory).")
    custom: dict[str, float] = Field(
        default_factory=dict, description="Extra Ray custom resources, e.g. {'fake_accel': 1}."
    )
    cpu_devices_per_host: int | None = Field(
        None,
        ge=1,
        description="JAX CPU devices per host process (jax_num_cpu_devices): runs a device mesh on CPUs, as the "
        "multi-process tests do. Setting it runs the step in its own process(es), like a multi-host step.",
    )
    max_restarts: int = Field(
        2, ge=0, description="Multi-process steps: times the whole gang is restarted from its newest checkpoint after a member dies."
    )
    placement_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Multi-process steps: seconds to wait for the cluster to place every host of the gang (a gang the "
        "cluster cannot hold even when idle fails at once unless LADDER_GANG_AUTOSCALE=1).",
    )
    hang_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Multi-process steps: restart the gang when rank 0 has written no metrics line for this many "
        "seconds (a hung collective, a frozen host). Must exceed start-up plus compile and log_every steps; None = never.",
    )

    @field_validator("custom")
    @classmethod
    def _positive_custom(cls, value: dict[str, float]) -> dict[str, float]:
        for key, amount in value.items():
            if amount < 0:
                raise ValueError(f"custom resource {key!r} asks for {amount}; resource amounts must be >= 0.")
        return value

    def ray_options(self) -> dict[str, Any]:
        """Options for `ray.remote(...).options(**...)` for one host's process."""
        resources = dict(self.custom)
        if self.tpus:
            resources["TPU"] = self.tpus
        options: dict[str, Any] = {"num_cpus": self.cpus, "num_gpus": self.gpus}
        if resources:
            options["resources"] = resources
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        if self.memory_gb:
            options["memory"] = int(self.memory_gb * 1024**3)
        return options

    def describe(self) -> str:
        parts = []
        if self.hosts > 1:
            parts.append(f"{self.hosts} hosts x")
        if self.gpus:
            parts.append(f"{self.gpus:g} GPU")
        if self.tpus:
            parts.append(f"{self.tpus:g} TPU")
        if self.accelerator_type:
            parts.append(self.accelerator_type)
        parts.append(f"{self.cpus:g} CPU")
        parts.extend(f"{v:g} {k}" for k, v in sorted(self.custom.items()))
        return " ".join(parts)


class ExperimentSpec(TrainJob):
    """A training job plus its resource request and tags; the unit a training step runs."""

    resources: ResourceSpec = Field(default_factory=ResourceSpec, description="Cluster resources (not identity).")
    tags: dict[str, str] = Field(default_factory=dict, description="Free-form labels (not identity).")
    accounting: Literal["ladder", "marin"] = Field(
        "ladder",
        description="Convention of the derived parameter and FLOP counts (not identity: it changes how numbers are "
        "reported, not what trains): 'ladder' = ours, 'marin' = Marin's published counts (trainer.accounting).",
    )

    @staticmethod
    def tokens_for(model: ModelConfig, tokens_per_active_param: float) -> int:
        """A token budget proportional to active parameters (Marin uses 791 per active parameter)."""
        from trainer import accounting

        return int(round(tokens_per_active_param * accounting.count_params(model).active))

    def job(self) -> TrainJob:
        """The trainer's view: the same job without resources, tags and the accounting convention."""
        return TrainJob.model_validate(self.model_dump(exclude={"resources", "tags", "accounting"}))

    def identity(self) -> dict[str, Any]:
        """The canonical content that determines results (what the fingerprint hashes)."""
        payload = super().identity()
        for field in ("resources", "tags", "accounting"):
            payload.pop(field, None)
        return payload

    def derived(self) -> "DerivedNumbers":
        return derive_numbers(self)


class DerivedNumbers(BaseModel):
    """Numbers computed from a spec by the trainer's accounting module."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    params_active: int
    params_total: int
    num_steps: int
    tokens: int
    tokens_per_step: int
    flops_per_token: float = Field(description="Forward FLOPs per token including the lm_head.")
    flops_per_token_no_lm_head: float
    total_flops: float = Field(description="Training FLOPs (3 x forward, lm_head included) over all steps.")
    accounting: str = Field("ladder", description="Convention of these counts (ExperimentSpec.accounting).")


def derive_numbers(spec: TrainJob) -> DerivedNumbers:
    from trainer import accounting

    convention = getattr(spec, "accounting", "ladder")
    if convention == "marin":
        params_active = accounting.marin_active_params(spec.model)
        params_total = accounting.marin_total_params(spec.model)
    else:
        counts = accounting.count_params(spec.model)
        params_active, params_total = counts.active, counts.total
    steps = spec.num_steps
    tokens = steps * spec.tokens_per_step
    fpt = float(accounting.forward_flops_per_token(spec.model, include_lm_head=True, convention=convention))
    return DerivedNumbers(
        params_active=int(params_active),
        params_total=int(params_total),
        num_steps=steps,
        tokens=tokens,
        tokens_per_step=spec.tokens_per_step,
        flops_per_token=fpt,
        flops_per_token_no_lm_head=float(
            accounting.forward_flops_per_token(spec.model, include_lm_head=False, convention=convention)
        ),
        total_flops=3.0 * fpt * tokens,
        accounting=convention,
    )


def canonical_json(payload: Any) -> str:
    """JSON with sorted keys and no whitespace: equal content gives equal bytes."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def fingerprint(payload: Any) -> str:
    """sha256 of the canonical JSON of `payload`."""
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field annotation holds (unwrapping Optional, list[...], dict[..., ...])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


@functools.lru_cache(maxsize=None)
def _spec_places() -> tuple[dict[str, str], dict[str, list[str]]]:
    """Where each config class sits in an ExperimentSpec ('TrainConfig' -> 'train', 'MoEConfig' -> 'model.moe'),
    and every field name's places ('learning_rate' -> ['optimizer.learning_rate'])."""
    places: dict[str, str] = {"ExperimentSpec": "", "TrainJob": ""}
    fields: dict[str, list[str]] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            place = f"{prefix}.{name}" if prefix else name
            fields.setdefault(name, []).append(place)
            many = typing.get_origin(info.annotation) in (list, tuple) or any(
                typing.get_origin(a) in (list, tuple) for a in typing.get_args(info.annotation))
            for sub in _models_in(info.annotation):
                if sub.__name__ not in places:
                    places[sub.__name__] = place + ("[i]" if many else "")
                    walk(sub, places[sub.__name__])

    walk(ExperimentSpec, "")
    return places, fields


def _model_at(root: type[BaseModel] | None, loc: tuple) -> type[BaseModel] | None:
    """The model class that holds the last element of `loc`, starting from `root`."""
    model = root
    for part in loc[:-1]:
        if model is None:
            return None
        if isinstance(part, int) or part not in model.model_fields:
            continue  # a list index or a dict key
        subs = _models_in(model.model_fields[part].annotation)
        model = subs[0] if subs else None
    return model


def short_message(problem: dict[str, Any]) -> str:
    kind, ctx = problem["type"], problem.get("ctx") or {}
    bounds = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
              "less_than_equal": ("le", "<=")}
    if kind in bounds:
        key, sign = bounds[kind]
        bound = ctx.get(key)
        return f"must be {sign} {bound:g}" if isinstance(bound, (int, float)) else f"must be {sign} {bound}"
    if kind == "missing":
        return "is required"
    message = problem["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if message.startswith("Input should be "):
        message = "must be " + message.removeprefix("Input should be ")
    return message


def explain_validation_error(error: ValidationError, where: str | None = None) -> str:
    """One sentence per problem, naming the field by its place in the spec and echoing the bad value:
    ``train.tokens=-5 must be > 0``, ``model.num_head: unknown field; did you mean num_heads?``.

    The place comes from the model that failed (a TrainConfig built on its own is ``train``); `where`
    names the place instead (e.g. "schedule" for command-line options)."""
    places, fields = _spec_places()
    title = getattr(error, "title", "")
    base = where if where is not None else places.get(title, title)
    root = _spec_classes().get(title)
    lines = []
    for problem in error.errors():
        loc = tuple(problem["loc"])
        path = base
        for part in loc:
            path = f"{path}[{part}]" if isinstance(part, int) else (f"{path}.{part}" if path else str(part))
        path = path or "spec"
        if problem["type"] == "extra_forbidden":
            name = str(loc[-1]) if loc else ""
            model = _model_at(root, loc)
            known = list(model.model_fields) if model is not None else []
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            elsewhere = [p for p in fields.get(name, []) if p != path]
            if close:
                hint = f"did you mean {close[0]}?"
            elif elsewhere:
                hint = f"it belongs in {' or '.join(elsewhere)}"
            else:
                hint = "remove it or check its spelling"
            lines.append(f"{path}: unknown field; {hint} (`ladder schema` lists every field)")
            continue
        message = short_message(problem)
        value = problem.get("input")
        scalar = isinstance(value, (int, float, str, bool)) or value is None
        if problem["type"].startswith(("value_error", "assertion_error")) or problem["type"] == "missing" or not scalar:
            lines.append(f"{path}: {message}" if problem["type"] != "missing" else f"{path} {message}")
        else:
            lines.append(f"{path}={value!r} {message}")
    return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def _spec_classes() -> dict[str, type[BaseModel]]:
    classes: dict[str, type[BaseModel]] = {"ExperimentSpec": ExperimentSpec, "TrainJob": TrainJob}

    def walk(model: type[BaseModel]) -> None:
        for info in model.model_fields.values():
            for sub in _models_in(info.annotation):
                if sub.__name__ not in classes:
                    classes[sub.__name__] = sub
                    walk(sub)

    walk(ExperimentSpec)
    return classes
