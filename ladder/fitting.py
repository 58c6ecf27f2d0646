"""Where the orchestrator meets the forecaster: tables from run directories, targets from specs, stored forecasts.

The forecasting library knows nothing of steps, fingerprints or stores; it takes a table of runs
and a target description. This module makes both from a DAG (the finished rungs' run directories,
the target step's derived numbers and LR schedule) and files each forecast under
`{root}/forecasts/{target}/{n}.json`, never overwriting one: a new version whenever the inputs, the method
or its options (or its result) changed; a forecast identical to the newest version is not filed again.
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
    return from_run_dirs(dirs, notes=warnings)


def store_forecast(store: Store, forecast, *, meta: dict[str, Any]) -> int:
    """File `forecast` as the next version for its target, unless it is the newest version again (same
    inputs, method, options and result: see `store_forecast_if_changed`); returns the version number."""
    return store_forecast_if_changed(store, forecast, meta=meta)[0]


def store_forecast_if_changed(store: Store, forecast, *, meta: dict[str, Any]) -> tuple[int, bool]:
    """(version, stored_new). A forecast identical to the newest stored version of its target (same input
    table fingerprint, method, target, `meta["options"]`, law and final band) is not stored again: the
    refit history shows only versions that differ. A change of inputs or options, or of the method's code
    (it changes the result), makes a new version."""
    payload = json.loads(forecast.to_json())
    lr = payload["target"].get("lr")
    if lr is not None and len(lr) > MAX_STORED_SCHEDULE:
        # the schedule is recomputable from the spec; 390k floats in every refit would cost megabytes each
        payload["target"]["lr"] = None
        meta = {**meta, "target_lr_omitted": len(lr)}
    payload["ladder"] = meta
    target = forecast.target.name
    newest = store.read_forecast(target)
    if newest is not None and forecast_identity(newest) == forecast_identity(payload):
        forecast.version = int(newest["version"])
        return forecast.version, False
    version = store.write_forecast(target, payload)
    forecast.version = version
    return version, True


def forecast_identity(payload: dict[str, Any]) -> str:
    """What makes two stored forecasts the same one: inputs, method, target, options and the result itself
    (not when, by whom or under which version number it was stored)."""
    import hashlib

    target = dict(payload.get("target") or {})
    lr = target.pop("lr", None)
    meta = payload.get("ladder") or {}
    doc = {
        "inputs": payload.get("inputs_fingerprint"),
        "method": payload.get("method"),
        "target": target,
        "lr": hashlib.sha256(json.dumps(lr).encode()).hexdigest() if lr is not None else meta.get("target_lr_omitted"),
        "options": meta.get("options"),
        "refit": bool(meta.get("refit")),
        "law": payload.get("law"),
        "result": [float(f"{payload.get(k, float('nan')):.10g}") for k in ("final_loss", "final_loss_lo", "final_loss_hi")],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def forecast_options(method: str, n_bootstrap: int, seed: int) -> dict[str, Any]:
    """The options a forecast was asked for (part of its identity in the store)."""
    return {"method": method, "n_bootstrap": int(n_bootstrap), "seed": int(seed)}


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
    if task.recipe_warning:
        forecast.warnings.append(task.recipe_warning)
    version = store_forecast(
        store, forecast,
        meta={"fit_step": step.name, "fit_fingerprint": task.fingerprint, "target_fingerprint": task.target_fingerprint,
              "inputs": {name: dep.run_dir for name, dep in context.deps.items()},
              "options": forecast_options(step.config.method, step.config.n_bootstrap, step.config.seed)},
    )
    with store.fs.open(f"{store.run_dir(step.name, task.fingerprint)}/forecast.json", "w") as handle:
        handle.write(forecast.to_json(indent=2))
    log_fit_to_wandb(step, task, context.run_dir, forecast, table)
    return {"forecast_version": version, **forecast.summary()}


def log_fit_to_wandb(step: FitStep, task, run_dir: str, forecast, table) -> None:
    """The fit as a W&B run of the experiment's group (job type "fit", from the executor's environment): its
    forecast's final loss and band in the summary, and one chart of the whole forecast curve. W&B's mode
    and project are the target's (a hero with W&B disabled has a fit without W&B too); never fails the fit."""
    from trainer.metrics import WandbSink

    from ladder.overlay import forecast_chart

    train = task.target.spec.train
    sink = WandbSink(
        mode=train.wandb, project=train.wandb_project, run_dir=run_dir, name=step.name,
        config={"fit": step.config.model_dump(mode="json"), "target": task.target.name,
                "target_fingerprint": task.target_fingerprint, "inputs": sorted(task.deps),
                "table_runs": int(table["run"].nunique()), "table_rows": int(len(table))},
    )
    if sink.run is None:
        return
    try:
        sink.summary({f"forecast/{k}": v for k, v in forecast.summary().items() if isinstance(v, (int, float, str))})
        chart = forecast_chart(forecast, title=f"{task.target.name}: forecast v{forecast.version} by {step.name}")
        sink.run.log({"forecast/chart": chart}, step=0)
    except Exception as error:  # noqa: BLE001 - W&B must never fail the fit
        import logging

        logging.getLogger(__name__).warning("W&B logging of the fit failed: %s", error)
    finally:
        sink.close()
