"""Where the orchestrator meets the forecaster: tables from run directories, targets from specs, stored forecasts.

The forecasting library knows nothing of steps, fingerprints or stores; it takes a table of runs
and a target description. This module makes both from a DAG (the finished rungs' run directories,
the target step's derived numbers and LR schedule) and files each forecast under
`{root}/forecasts/{target}/{n}.json`, a new version every time, never overwriting one.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ladder.dag import DAG, FitStep, TrainStep
from ladder.store import Store


class FitInputError(ValueError):
    """Not enough finished runs, or a target that cannot be forecast."""


def target_spec(step: TrainStep):
    """The forecaster's description of a training step that may not have run yet."""
    from forecasting.forecast import TargetSpec

    derived = step.derived
    lr = None
    if derived.num_steps <= 200_000:
        from trainer import lr_at_steps

        lr = [float(x) for x in lr_at_steps(step.spec.job(), np.arange(1, derived.num_steps + 1))]
    return TargetSpec(
        name=step.name,
        params_active=float(derived.params_active),
        params_total=float(derived.params_total),
        tokens=float(derived.tokens),
        num_steps=derived.num_steps,
        tokens_per_step=float(derived.tokens_per_step),
        flops_per_token=3.0 * derived.flops_per_token,
        total_flops=derived.total_flops,
        lr=lr,
    )


def ladder_runs_for(dag: DAG, target: str) -> list[str]:
    """The training steps a forecast of `target` reads: the deps of the FitStep that targets it, else every other train step."""
    for step in dag:
        if isinstance(step, FitStep) and step.target == target:
            return list(step.deps)
    return [s.name for s in dag if isinstance(s, TrainStep) and s.name != target]


def table_from_steps(dag: DAG, store: Store, names: list[str], *, require_done: bool = True):
    from forecasting.table import from_run_dirs

    dirs = []
    missing = []
    for name in names:
        run_dir = store.run_dir(name, dag.fingerprints[name])
        status = store.read_status(run_dir) or {}
        if require_done and status.get("state") != "done":
            missing.append(f"{name} ({status.get('state', 'not started')})")
            continue
        dirs.append(store.url_of(run_dir))
    if missing:
        raise FitInputError(
            f"the fit needs finished runs, and these are not: {', '.join(missing)}; run `ladder submit` first."
        )
    if len(dirs) < 2:
        raise FitInputError(f"a scaling fit needs at least 2 finished runs; found {len(dirs)}.")
    return from_run_dirs(dirs)


def store_forecast(store: Store, forecast, *, meta: dict[str, Any]) -> int:
    """File `forecast` as the next version for its target; returns the version number."""
    payload = json.loads(forecast.to_json())
    payload["ladder"] = meta
    version = store.write_forecast(forecast.target.name, payload)
    forecast.version = version
    return version


def load_forecast(store: Store, target: str, version: int | None = None):
    from forecasting.forecast import Forecast

    payload = store.read_forecast(target, version)
    if payload is None:
        return None
    payload.pop("ladder", None)
    return Forecast.model_validate(payload)


def run_fit_step(step: FitStep, context, task, store: Store) -> dict[str, Any]:
    """Body of a FitStep on a worker: fit the finished deps, forecast the target, store a new version."""
    from forecasting import api
    from forecasting.table import from_run_dirs

    table = from_run_dirs([dep.run_dir for dep in context.deps.values()])
    target = target_spec(task.target)
    forecast = api.forecast_target(
        table, target, method=step.config.method, n_bootstrap=step.config.n_bootstrap, seed=step.config.seed
    )
    version = store_forecast(
        store, forecast,
        meta={"fit_step": step.name, "fit_fingerprint": task.fingerprint, "target_fingerprint": task.target_fingerprint,
              "inputs": {name: dep.run_dir for name, dep in context.deps.items()}},
    )
    with store.fs.open(f"{store.run_dir(step.name, task.fingerprint)}/forecast.json", "w") as handle:
        handle.write(forecast.to_json(indent=2))
    return {"forecast_version": version, **forecast.summary()}
