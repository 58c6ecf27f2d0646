"""Load an experiment: a Python file or module that builds steps at module level.

An experiment is plain Python (`experiments/foo.py`): it builds `Step` objects (directly, in lists,
or through `build_ladder`) and leaves them at module level. The loader collects them in the order
they appear and validates them as one DAG. A module may instead define `STEPS` (an iterable of
steps) to say exactly which steps it exposes.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from dataclasses import dataclass
from types import ModuleType

from pydantic import ValidationError

from ladder.dag import DAG, DagError, Step
from ladder.spec import explain_validation_error


class ExperimentError(ValueError):
    """An experiment that cannot be loaded: not found, raises on import, invalid spec, no steps."""


@dataclass
class Experiment:
    ref: str
    module: ModuleType
    dag: DAG

    @property
    def name(self) -> str:
        """`foo` for experiments/foo.py and for experiments.foo."""
        if self.ref.endswith(".py") or os.sep in self.ref:
            return os.path.splitext(os.path.basename(self.ref))[0]
        return self.module.__name__.rsplit(".", 1)[-1]


def load_experiment(ref: str) -> Experiment:
    """Load by path (`experiments/foo.py`) or by module name (`experiments.foo`)."""
    module = _import(ref)
    steps = _collect_steps(module, ref)
    if not steps:
        raise ExperimentError(
            f"{ref} defines no steps at module level; build TrainStep/FitStep/FunctionStep objects "
            "(or a list of them, e.g. from build_ladder) as module-level variables, or define STEPS."
        )
    try:
        dag = DAG(steps)
    except DagError as error:
        raise ExperimentError(f"{ref}: {error}") from None
    return Experiment(ref=ref, module=module, dag=dag)


def _import(ref: str) -> ModuleType:
    is_path = ref.endswith(".py") or os.sep in ref or os.path.exists(ref)
    try:
        if is_path:
            path = os.path.abspath(ref)
            if not os.path.exists(path):
                raise ExperimentError(f"experiment file {ref} does not exist; pass a path to a .py file or a module name.")
            for folder in (os.path.dirname(path), os.getcwd()):  # as `python file.py` would see its neighbours
                if folder not in sys.path:
                    sys.path.insert(0, folder)
            digest = hashlib.sha1(path.encode()).hexdigest()[:8]
            name = f"ladder_experiment_{os.path.splitext(os.path.basename(path))[0]}_{digest}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            _pickle_by_value(module)
            return module
        return importlib.import_module(ref)
    except ExperimentError:
        raise
    except ValidationError as error:
        where = _line_in(error, os.path.abspath(ref) if is_path else None)
        problems = "; ".join(explain_validation_error(error).splitlines())
        raise ExperimentError(f"{ref}{where} builds an invalid spec: {problems}") from None
    except DagError as error:
        raise ExperimentError(f"{ref}: {error}") from None
    except ModuleNotFoundError as error:
        if not is_path and error.name and ref.startswith(error.name):
            raise ExperimentError(f"no experiment module named {ref!r}; pass a path to a .py file or an importable module.") from None
        raise ExperimentError(f"{ref} raised while being loaded: ModuleNotFoundError: {error}") from error
    except Exception as error:
        raise ExperimentError(f"{ref} raised while being loaded: {type(error).__name__}: {error}") from error


def _line_in(error: BaseException, path: str | None) -> str:
    """' line N' of the experiment file where `error` was raised (its last frame in that file), else ''."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if path is None or os.path.abspath(f.filename) == path]
    if path is None:
        frames = [f for f in frames if "site-packages" not in f.filename and "/ladder/" not in f.filename
                  and "/trainer/" not in f.filename]
    return f" line {frames[-1].lineno}" if frames else ""


def _pickle_by_value(module: ModuleType) -> None:
    """Functions defined in a file loaded by path are not importable on Ray workers: ship them by value."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


def _collect_steps(module: ModuleType, ref: str) -> list[Step]:
    explicit = getattr(module, "STEPS", None)
    if explicit is not None:
        items = list(explicit.values()) if isinstance(explicit, dict) else explicit
        if isinstance(items, Step):
            items = [items]
        if not isinstance(items, (list, tuple)):
            raise ExperimentError(
                f"{ref}: STEPS must be a list of steps, got {type(explicit).__name__} ({explicit!r:.60}); "
                "e.g. STEPS = [rung_a, rung_b, fit, hero], or remove STEPS to collect every module-level step."
            )
        for index, item in enumerate(items):
            if not isinstance(item, (Step, list, tuple)):
                raise ExperimentError(
                    f"{ref}: STEPS[{index}] is a {type(item).__name__} ({item!r:.60}), not a step; STEPS lists "
                    "TrainStep/FitStep/FunctionStep objects."
                )
    candidates = [explicit] if explicit is not None else list(vars(module).values())
    found: list[Step] = []
    seen: set[int] = set()

    def visit(value, depth: int = 0) -> None:
        if isinstance(value, Step):
            if id(value) not in seen:
                seen.add(id(value))
                found.append(value)
        elif isinstance(value, (list, tuple)) and depth < 2:
            for item in value:
                visit(item, depth + 1)
        elif isinstance(value, dict) and depth < 2:
            for item in value.values():
                visit(item, depth + 1)

    for value in candidates:
        visit(value)
    return _prefer_rewired(found)


def _prefer_rewired(steps: list[Step]) -> list[Step]:
    """build_ladder returns a copy of the hero with an extra `after` edge; keep that copy, not both.

    Only that exact case collapses (same kind, content and deps, one `after` a superset of the
    other's); any other two steps sharing a name reach the DAG, which rejects them.
    """
    kept: list[Step] = []
    for step in steps:
        twin = next((k for k in kept if k.name == step.name), None)
        if twin is not None and _same_but_after(twin, step):
            if set(step.after) >= set(twin.after):
                kept[kept.index(twin)] = step
            continue
        kept.append(step)
    return kept


def _same_but_after(a: Step, b: Step) -> bool:
    try:
        same = type(a) is type(b) and a.deps == b.deps and a.content() == b.content()
    except Exception:
        return False
    return same and (set(a.after) <= set(b.after) or set(b.after) <= set(a.after))
