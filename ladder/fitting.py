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


MAX_STORED_SCHEDULE = 20_000


class FitInputError(ValueError):
    """Not enough finished runs, or a target that cannot be forecast."""


def target_spec(step: TrainStep):
    """The forecaster's description of a training step that may not have run yet.

    Its FLOPs are on the same axis as the ladder's table: our runs log cumulative FLOPs with the
    lm_head; a spec declared with Marin's accounting is forecast on Marin's axis (C without the
    lm_head), which is how its published rungs are imported (ladder/importer.py).
    """
    from forecasting.forecast import TargetSpec
    from trainer import lr_at_steps

    derived = step.derived
    lr = [float(x) for x in lr_at_steps(step.spec.job(), np.arange(1, derived.num_steps + 1))]
    per_token = derived.flops_per_token_no_lm_head if step.spec.accounting == "marin" else derived.flops_per_token
    return TargetSpec(
        name=step.name,
        params_active=float(derived.params_active),
        params_total=float(derived.params_total),
        tokens=float(derived.tokens),
        num_steps=derived.num_steps,
        tokens_per_step=float(derived.tokens_per_step),
        flops_per_token=3.0 * per_token,
        total_flops=3.0 * per_token * derived.tokens,
        lr=lr,
    )


def ladder_runs_for(dag: DAG, target: str) -> list[str]:
    """The training steps a forecast of `target` reads: the deps of the FitStep that targets it, else every other train step."""
    for step in dag:
        if isinstance(step, FitStep) and step.target == target:
            return list(step.deps)
    return [s.name for s in dag if isinstance(s, TrainStep) and s.name != target]


def table_from_steps(
    dag: DAG, store: Store, names: list[str], *, require_done: bool = True, allow_partial: bool = False,
    warnings: list[str] | None = None,
):
    """The runs of `names` as one table. With `allow_partial`, failed or interrupted runs that logged
    metrics are included too (a crashed rung still has a curve up to its crash; final-loss laws only use
    points at fraction 1, so a partial run informs the per-fraction fits and nothing else); each is named
    in `warnings`."""
    from forecasting.table import from_run_dirs

    dirs = []
    missing = []
    for name in names:
        run_dir = store.run_dir(name, dag.fingerprints[name])
        status = store.read_status(run_dir) or {}
        state = status.get("state", "not started")
        if require_done and state != "done":
            partial = allow_partial and state in ("failed", "interrupted") and store.exists(f"{run_dir}/metrics.jsonl")
            if not partial:
                missing.append(f"{name} ({state})")
                continue
            if warnings is not None:
                warnings.append(f"{name} is {state}; its partial curve is used")
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
    lr = payload["target"].get("lr")
    if lr is not None and len(lr) > MAX_STORED_SCHEDULE:
        # the schedule is recomputable from the spec; 390k floats in every refit would cost megabytes each
        payload["target"]["lr"] = None
        meta = {**meta, "target_lr_omitted": len(lr)}
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
