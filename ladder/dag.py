"""Steps and the DAG they form.

A step is a name, what it runs, and what it waits for. Three kinds cover a scaling ladder:

- `TrainStep`: trains one `ExperimentSpec` with the shared trainer (a rung or the hero);
- `FitStep`: fits scaling laws to finished training steps and writes a versioned forecast for a
  target step that has not run yet;
- `FunctionStep`: any Python function, for everything else (data prep, exports, evaluations).

Dependencies come in two strengths. `deps` are inputs: their fingerprints are part of this
step's identity, so changing an input moves this step to a new directory. `after` only orders
execution: the hero waits for its forecast so the forecast is made before the hero is seen, but
refitting the forecaster must never fork the hero's run directory.

`build_ladder(rungs, hero)` makes the usual rungs -> fit -> hero DAG in one call; any other DAG is
built by listing steps. `DAG` rejects duplicate names, unknown dependencies and cycles with an
error that names the offending steps.
"""

from __future__ import annotations

import inspect
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, ClassVar, Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field

from ladder.spec import ExperimentSpec, ResourceSpec, fingerprint

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")


class DagError(ValueError):
    """A DAG that cannot be run: duplicate names, unknown dependencies, cycles, bad names."""


class FitConfig(BaseModel):
    """How a fit step fits the ladder and forecasts its target."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str = Field("auto", description="Forecasting method (see `ladder fit --help`); 'auto' picks the best backtested one.")
    n_bootstrap: int = Field(200, ge=0, description="Bootstrap resamples for intervals.")
    seed: int = Field(0, description="Seed of the bootstrap.")
    overlay_refit_every: int = Field(
        10, ge=0,
        description="While the target trains, refit its forecast with its live prefix every this many evals (0: never). "
        "How the forecast is watched, not what it is: not part of the fit's fingerprint.",
    )

    IDENTITY_EXCLUDES: ClassVar[frozenset[str]] = frozenset({"overlay_refit_every"})


@dataclass(frozen=True, eq=False)
class Step(ABC):
    """Base of every step. Subclasses say what runs; this holds the wiring."""

    name: str
    deps: tuple[str, ...] = ()
    after: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise DagError(
                f"step name {self.name!r} is not allowed; use letters, digits, '_', '.', '-' (max 100 chars), "
                "starting with a letter or digit."
            )
        object.__setattr__(self, "deps", tuple(self.deps))
        object.__setattr__(self, "after", tuple(self.after))

    kind: str = field(default="step", init=False)

    @abstractmethod
    def content(self) -> dict[str, Any]:
        """What this step computes, without its dependencies (hashed into the fingerprint)."""

    def describe(self) -> str:
        return self.kind

    @property
    def flops(self) -> float | None:
        return None


@dataclass(frozen=True, eq=False)
class TrainStep(Step):
    """Train one experiment spec with the shared trainer."""

    spec: ExperimentSpec | None = None
    kind: str = field(default="train", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.spec, ExperimentSpec):
            raise DagError(f"TrainStep {self.name!r} needs spec=ExperimentSpec(...), got {type(self.spec).__name__}.")

    def content(self) -> dict[str, Any]:
        return {"kind": "train", "spec": self.spec.identity()}

    @cached_property
    def derived(self):
        return self.spec.derived()

    @property
    def flops(self) -> float | None:
        return self.derived.total_flops

    def describe(self) -> str:
        d = self.derived
        return f"train {_si(d.params_active)} active / {_si(d.params_total)} total on {_si(d.tokens)} tokens"


@dataclass(frozen=True, eq=False)
class FitStep(Step):
    """Fit laws to the training steps in `deps` and forecast `target` (a TrainStep, usually the hero)."""

    target: str = ""
    config: FitConfig = field(default_factory=FitConfig)
    kind: str = field(default="fit", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.target:
            raise DagError(f"FitStep {self.name!r} needs target=<name of the step to forecast>.")
        if len(self.deps) < 2:
            raise DagError(
                f"FitStep {self.name!r} has {len(self.deps)} input run(s); a scaling fit needs at least 2 "
                "finished training steps in deps."
            )

    def content(self) -> dict[str, Any]:
        config = self.config.model_dump(mode="json", exclude=set(FitConfig.IDENTITY_EXCLUDES))
        return {"kind": "fit", "target": self.target, "config": config}

    def describe(self) -> str:
        return f"fit {len(self.deps)} runs -> forecast {self.target}"


@dataclass(frozen=True, eq=False)
class FunctionStep(Step):
    """Run `fn(ctx, **config)`; its JSON-able return value is the step's result.

    Identity is the function's qualified name, `version` and `config`: bump `version` when the
    function's behaviour changes and its old outputs must not be reused.
    """

    fn: Callable[..., Any] | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    version: str = "1"
    resources: ResourceSpec = field(default_factory=ResourceSpec)
    kind: str = field(default="function", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not callable(self.fn):
            raise DagError(f"FunctionStep {self.name!r} needs fn=<callable>, got {self.fn!r}.")
        params = inspect.signature(self.fn).parameters
        if not params:
            raise DagError(f"FunctionStep {self.name!r}: {self.fn.__qualname__} must accept the step context as its first argument.")
        object.__setattr__(self, "config", dict(self.config))

    def content(self) -> dict[str, Any]:
        return {
            "kind": "function",
            "fn": f"{self.fn.__module__}.{self.fn.__qualname__}",
            "version": self.version,
            "config": dict(self.config),
        }

    def describe(self) -> str:
        return f"function {self.fn.__qualname__}"


class DAG:
    """A validated set of steps with their fingerprints, in a topological order."""

    def __init__(self, steps: Iterable[Step]):
        steps = list(steps)
        by_name: dict[str, Step] = {}
        for step in steps:
            if not isinstance(step, Step):
                raise DagError(f"{step!r} is not a Step; build steps with TrainStep, FitStep or FunctionStep.")
            if step.name in by_name and by_name[step.name] is not step:
                raise DagError(f"two steps are named {step.name!r}; step names must be unique.")
            by_name[step.name] = step
        for step in by_name.values():
            for dep in (*step.deps, *step.after):
                if dep not in by_name:
                    raise DagError(
                        f"step {step.name!r} depends on {dep!r}, which is not a step of this experiment; "
                        f"known steps: {', '.join(sorted(by_name))}."
                    )
            if isinstance(step, FitStep):
                target = by_name.get(step.target)
                if not isinstance(target, TrainStep):
                    raise DagError(f"FitStep {step.name!r} targets {step.target!r}, which is not a TrainStep of this experiment.")
                for dep in step.deps:
                    if not isinstance(by_name[dep], TrainStep):
                        raise DagError(f"FitStep {step.name!r} reads {dep!r}, which is not a TrainStep.")
        self.steps: dict[str, Step] = by_name
        self.order: list[str] = _topological_order(by_name)
        self.fingerprints: dict[str, str] = {}
        for name in self.order:
            step = by_name[name]
            payload = {"content": step.content(), "deps": {d: self.fingerprints[d] for d in step.deps}}
            if isinstance(step, FitStep):
                payload["target"] = fingerprint(by_name[step.target].content())
            self.fingerprints[name] = fingerprint(payload)

    def __getitem__(self, name: str) -> Step:
        try:
            return self.steps[name]
        except KeyError:
            raise DagError(f"no step named {name!r}; known steps: {', '.join(self.order)}.") from None

    def __iter__(self):
        return (self.steps[n] for n in self.order)

    def __len__(self) -> int:
        return len(self.steps)

    def upstream(self, names: Iterable[str]) -> list[str]:
        """`names` and everything they wait for, in topological order."""
        wanted: set[str] = set()
        stack = [self[n].name for n in names]
        while stack:
            name = stack.pop()
            if name in wanted:
                continue
            wanted.add(name)
            stack.extend((*self.steps[name].deps, *self.steps[name].after))
        return [n for n in self.order if n in wanted]

    def waits_for(self, name: str) -> tuple[str, ...]:
        step = self.steps[name]
        return (*step.deps, *step.after)

    def dependants(self, name: str) -> list[str]:
        return [n for n in self.order if name in self.waits_for(n)]


def _topological_order(steps: Mapping[str, Step]) -> list[str]:
    """Kahn's algorithm, ties broken by declaration order; a cycle is named in the error."""
    waits = {n: set((*s.deps, *s.after)) for n, s in steps.items()}
    order: list[str] = []
    ready = [n for n in steps if not waits[n]]
    while ready:
        name = ready.pop(0)
        order.append(name)
        for other in steps:
            if name in waits[other]:
                waits[other].discard(name)
                if not waits[other] and other not in order and other not in ready:
                    ready.append(other)
    if len(order) != len(steps):
        cycle = _find_cycle({n: w for n, w in waits.items() if w})
        raise DagError(f"the steps form a cycle: {' -> '.join(cycle)}; remove one of these dependencies.")
    return order


def _find_cycle(waits: Mapping[str, set[str]]) -> list[str]:
    start = next(iter(waits))
    path, seen = [start], {start}
    node = start
    while True:
        node = sorted(waits[node] & set(waits))[0]
        if node in seen:
            return path[path.index(node):] + [node]
        path.append(node)
        seen.add(node)


def build_ladder(
    rungs: Iterable[TrainStep],
    hero: TrainStep,
    *,
    fit_name: str = "fit",
    fit: FitConfig | None = None,
) -> list[Step]:
    """rungs -> fit -> hero: the fit reads every rung and forecasts the hero before it starts."""
    rungs = list(rungs)
    fit_step = FitStep(
        name=fit_name, deps=tuple(r.name for r in rungs), target=hero.name, config=fit or FitConfig()
    )
    hero = TrainStep(name=hero.name, spec=hero.spec, deps=hero.deps, after=(*hero.after, fit_step.name))
    return [*rungs, fit_step, hero]


def _si(value: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"
