"""`ladder plot`: what the ladder predicted for a target against what the target did, as a PNG or an HTML page.

Why a data layer first: the PNG (views.png), the interactive HTML page (views.html), the report and the
tests all read the same plain tables (`PlotData`, views.common), so a number on a chart can be checked without
looking at pixels, and a second renderer costs no second reading of the store. This module builds them.

Sources: an experiment file + store (run directories and `{root}/forecasts/{target}/{n}.json`), a table
file (CSV/parquet, or a folder of run directories) with an optional forecast JSON, or the special source
`marin-535b-public`: Marin's 535B ladder from the package's public data (four rungs, the hero forecast made from them
here, a refit on the first half of the hero's published 10%, and that published 10% itself).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path, PurePosixPath
from typing import Optional

import numpy as np
import pandas as pd
import typer

from ladder.alerts import band_at_step
from ladder.views.common import (
    BAND_COLUMNS, CURVE_COLUMNS, HISTORY_COLUMNS, RESIDUAL_COLUMNS, X_COLUMNS, NothingToPlot, PlotData, PlotInputError,
    order_runs,
)

MARIN_SOURCE = "marin-535b-public"
TABLE_SUFFIXES = (".csv", ".parquet", ".pq", ".tsv")


# ---------------------------------------------------------------- building the tables


def _curve_table(table: pd.DataFrame) -> pd.DataFrame:
    out = pd.DataFrame({c: table[c] if c in table.columns else np.nan for c in CURVE_COLUMNS})
    out["run"] = out["run"].astype(str)
    if out["flops"].isna().any() and "params_active" in table.columns:
        # the forecaster's own default when a table logs no FLOPs: C = 6 N D
        out["flops"] = out["flops"].fillna(6.0 * table["params_active"] * out["tokens"])
    return out.sort_values(["run", "step"], kind="stable").reset_index(drop=True)


def rung_fits(table: pd.DataFrame, n_points: int = 40) -> tuple[pd.DataFrame, str | None]:
    """The fitted law drawn through each rung: (table of run, step, tokens, flops, loss; law formula or None).

    Matched progress (one law per training fraction) when >= 3 rungs carry whole curves, drawn along each
    rung that spans more than one fraction; otherwise (one eval per rung included) the compute law through the
    final points (run "L(C)"); an empty table when neither can be fitted.
    """
    from forecasting.fitting import FitError, fit_compute_law
    from forecasting.matched_progress import fit_profiled

    if table.empty:
        return pd.DataFrame(columns=CURVE_COLUMNS), None
    if {"fraction", "flops"} <= set(table.columns):
        try:
            fit = fit_profiled(table)
        except (FitError, ValueError):
            fit = None
        if fit is not None:
            frames = []
            for run, rows in table.groupby("run", sort=True):
                rows = rows.sort_values("step")
                last = rows.iloc[-1]
                if not (last["fraction"] > 0 and last["flops"] > 0):
                    continue
                flops_full = float(last["flops"] / last["fraction"])
                # the law exists only at the fractions it was fitted on (beyond them it is held flat): draw it there
                g_hi = min(float(last["fraction"]), max(fit.fractions))
                g_lo = min(max(float(rows["fraction"].min()), min(fit.fractions), 1e-4), g_hi)
                if g_hi <= g_lo * (1 + 1e-9):  # one eval (or one fitted fraction): no curve to draw through it
                    continue
                g = np.geomspace(g_lo, g_hi, n_points)
                steps = g * float(last["step"] / last["fraction"])
                per_step_tokens = float(last["tokens"] / last["step"]) if pd.notna(last.get("tokens", np.nan)) else np.nan
                frames.append(pd.DataFrame({
                    "run": str(run), "step": steps, "tokens": steps * per_step_tokens, "flops": g * flops_full,
                    "loss": fit.predict(g, flops_full),
                }))
            if frames:
                return pd.concat(frames, ignore_index=True)[CURVE_COLUMNS], fit.formula()
    final = table.sort_values("step").groupby("run").tail(1)
    if "flops" in final.columns and final["flops"].notna().all() and len(final) >= 3:
        try:
            law = fit_compute_law(final["flops"].to_numpy(float), final["loss"].to_numpy(float))
        except (FitError, ValueError):
            return pd.DataFrame(columns=CURVE_COLUMNS), None
        c = np.geomspace(float(final["flops"].min()), float(final["flops"].max()), n_points)
        return pd.DataFrame({"run": "L(C)", "step": np.nan, "tokens": np.nan, "flops": c, "loss": law.predict(c)}), law.formula()
    return pd.DataFrame(columns=CURVE_COLUMNS), None


def _band_table(forecast) -> pd.DataFrame:
    if forecast is None or not forecast.curve:
        return pd.DataFrame(columns=BAND_COLUMNS)
    return forecast.curve_frame()[BAND_COLUMNS].astype(float).sort_values("step").reset_index(drop=True)


def _all_bands(forecasts: list) -> pd.DataFrame:
    frames = [_band_table(f).assign(version=int(f.version), method=f.method) for f in forecasts if f.curve]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["version", "method", *BAND_COLUMNS])


def _history_table(forecasts: list) -> pd.DataFrame:
    rows = []
    for f in forecasts:
        rows.append({
            "version": int(f.version), "method": f.method, "created_at": f.created_at, "final_loss": f.final_loss,
            "final_loss_lo": f.final_loss_lo, "final_loss_hi": f.final_loss_hi, "live_points": f.band_terms.get("live_points", 0.0),
        })
    return pd.DataFrame(rows, columns=HISTORY_COLUMNS)


def _residual_table(actual: pd.DataFrame, forecasts: list) -> pd.DataFrame:
    rows = []
    for f in forecasts:
        for _, point in actual.iterrows():
            band = band_at_step(f, float(point["step"]))
            if band is None:
                continue
            pred, lo, hi = band
            rows.append({
                "version": int(f.version), "step": point["step"], "tokens": point["tokens"], "flops": point["flops"],
                "loss": point["loss"], "predicted": pred, "lo": lo, "hi": hi, "residual": point["loss"] / pred - 1,
            })
    return pd.DataFrame(rows, columns=RESIDUAL_COLUMNS)


def assemble(
    rung_table: pd.DataFrame, forecasts: list, actual: pd.DataFrame | None, *, target: str | None,
    title: str, loss_label: str = "eval loss (nats/token)", warnings: list[str] | None = None,
) -> PlotData:
    """PlotData from a table of rungs, the target's forecast versions (oldest first) and its actual curve."""
    forecasts = sorted(forecasts, key=lambda f: f.version)
    newest = forecasts[-1] if forecasts else None
    fits, _ = rung_fits(rung_table)
    actual_curve = _curve_table(actual) if actual is not None and not actual.empty else pd.DataFrame(columns=CURVE_COLUMNS)
    if newest is not None and not actual_curve.empty:
        per_step_tokens = newest.target.tokens_per_step
        per_token_flops = newest.target.planned_flops() / newest.target.tokens
        if actual_curve["tokens"].isna().any() and per_step_tokens:
            actual_curve["tokens"] = actual_curve["tokens"].fillna(actual_curve["step"] * per_step_tokens)
        if actual_curve["flops"].isna().any():
            actual_curve["flops"] = actual_curve["flops"].fillna(actual_curve["tokens"] * per_token_flops)
    method = f"{newest.method} (forecast v{newest.version})" if newest is not None else None
    return PlotData(
        title=title, target=target, method=method, rungs=_curve_table(rung_table), fits=fits,
        band=_band_table(newest), bands=_all_bands(forecasts), history=_history_table(forecasts), actual=actual_curve,
        residuals=_residual_table(actual_curve, forecasts), loss_label=loss_label, warnings=list(warnings or []),
        rung_order=order_runs(rung_table),
    )


# ---------------------------------------------------------------- sources


def marin_public_data(n_bootstrap: int = 50, refit_prefix_step: int = 18000) -> PlotData:
    """Marin's 535B ladder: four rungs, the hero forecast from them (v1), a refit on the published prefix up
    to `refit_prefix_step` (v2), and the hero's published first 10% (13 evals, steps 3k-39k).

    The public data never changes, so the forecasts are computed once per process (a copy is returned)."""
    return copy.deepcopy(_marin_public_data(n_bootstrap, refit_prefix_step))


@functools.lru_cache(maxsize=4)
def _marin_public_data(n_bootstrap: int, refit_prefix_step: int) -> PlotData:
    from forecasting.api import forecast_target, refit_forecast
    from forecasting.forecast import TargetSpec
    from forecasting.public_data import data_dir, linear_decay_schedule, marin_ladder

    table, hero, observed = marin_ladder(data_dir() / "marin_535b_ladder")
    target = TargetSpec(
        name=hero["name"], params_active=hero["params_active"], params_total=hero["params_total"], tokens=hero["tokens"],
        num_steps=hero["num_steps"], tokens_per_step=hero["tokens_per_step"], total_flops=hero["total_flops"],
        lr=linear_decay_schedule(hero["num_steps"]).tolist(),
    )
    ladder_only = forecast_target(table, target, n_bootstrap=n_bootstrap)
    ladder_only.version = 1
    refit = refit_forecast(table, target, observed[observed["step"] <= refit_prefix_step], prior=ladder_only, n_bootstrap=n_bootstrap)
    refit.version = 2
    return assemble(
        table, [ladder_only, refit], observed, target=hero["name"],
        title=f"Marin 535B-A23B hero ({hero['name']}): forecast from 4 rungs, refit on steps <= {refit_prefix_step}",
        loss_label="dropless Paloma macro loss (nats/token)",
        warnings=["rung compute excludes the lm_head (Marin's convention); the rungs' LR schedule is assumed (linear decay)"],
    )


def _read_forecasts(path: str) -> list:
    """Forecasts from a JSON file (one Forecast, a list of them, or a stored version with a 'ladder' key) or a folder of {n}.json."""
    from forecasting.forecast import Forecast

    p = Path(path)
    files = sorted(p.glob("*.json"), key=lambda f: int(f.stem) if f.stem.isdigit() else 0) if p.is_dir() else [p]
    out = []
    for i, file in enumerate(files, start=1):
        try:
            payload = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise PlotInputError(f"{file}: not a readable forecast JSON ({error}).") from None
        for item in payload if isinstance(payload, list) else [payload]:
            item = dict(item)
            item.pop("ladder", None)
            try:
                forecast = Forecast.model_validate(item)
            except Exception as error:  # pydantic's error lists the missing fields
                raise PlotInputError(f"{file}: not a full forecast (write it with `ladder forecast ... --json`): {error}") from None
            if not forecast.version:
                forecast.version = len(out) + 1 if len(files) == 1 else i
            out.append(forecast)
    return out


def table_plot_data(table_path: str, target: str | None = None, forecast_path: str | None = None) -> PlotData:
    """PlotData from a table of runs (CSV/parquet or run directories) and an optional forecast JSON."""
    from forecasting.api import load_table
    from forecasting.table import TableError

    try:
        table = load_table(table_path)
    except (TableError, OSError, ValueError) as error:
        raise PlotInputError(f"{table_path}: {error}") from None
    forecasts = _read_forecasts(forecast_path) if forecast_path else []
    if target is None and forecasts:
        target = forecasts[-1].target.name
    runs = set(table["run"].astype(str))
    if target is not None and target not in runs and not forecasts:
        raise PlotInputError(f"target {target!r} is neither a run of {table_path} nor named by a forecast; give --forecast FILE.")
    actual = table[table["run"].astype(str) == target] if target else None
    rungs = table[table["run"].astype(str) != target] if target else table
    name = PurePosixPath(table_path).name
    return assemble(rungs, forecasts, actual, target=target, title=f"{name}: {target or 'ladder'}")


def experiment_plot_data(experiment: str, target: str | None = None, root: str | None = None) -> PlotData:
    """PlotData from an experiment's DAG and store: rung run dirs (finished or not), forecast versions, the target's run."""
    from forecasting.table import TableError, from_run_dirs
    from ladder.dag import FitStep, TrainStep
    from ladder.fitting import FitInputError, ladder_runs_for, load_forecast, table_from_steps
    from ladder.loader import load_experiment
    from ladder.store import Store

    exp = load_experiment(experiment)
    dag = exp.dag
    store = Store(root)
    train_names = [s.name for s in dag if isinstance(s, TrainStep)]
    if target is None:
        fit_targets = sorted({s.target for s in dag if isinstance(s, FitStep)})
        if len(fit_targets) != 1:
            raise PlotInputError(
                f"{experiment}: name the target to plot (one of {', '.join(train_names)}); "
                f"the experiment has {len(fit_targets)} fit targets."
            )
        target = fit_targets[0]
    if target not in train_names:
        raise PlotInputError(f"{target!r} is not a training step of {experiment}; choose one of {', '.join(train_names)}.")

    def started(name: str) -> bool:
        return store.exists(f"{store.run_dir(name, dag.fingerprints[name])}/spec.json")

    names = [n for n in ladder_runs_for(dag, target) if started(n)]
    warnings = []
    try:
        rungs = table_from_steps(dag, store, names, require_done=False, warnings=warnings)
    except (FitInputError, TableError):
        try:
            dirs = [store.url_of(store.run_dir(n, dag.fingerprints[n])) for n in names]
            rungs = from_run_dirs(dirs) if dirs else pd.DataFrame(columns=CURVE_COLUMNS)
        except TableError:
            rungs = pd.DataFrame(columns=CURVE_COLUMNS)
    if rungs.empty:
        warnings.append("no rung has logged a metric yet")
    actual = None
    if started(target):
        try:
            actual = from_run_dirs([store.url_of(store.run_dir(target, dag.fingerprints[target]))], notes=warnings)
        except TableError:
            actual = None
    forecasts = [f for f in (load_forecast(store, target, v) for v in store.list_forecasts(target)) if f is not None]
    if rungs.empty and actual is None and not forecasts:
        raise NothingToPlot(
            f"nothing to plot yet for {target}: no run of {experiment} has logged metrics under {store.url} and no "
            f"forecast is stored; run `ladder submit {experiment}` (or pass --root where the runs are)."
        )
    if not forecasts:
        warnings.append(f"no stored forecast for {target}; run `ladder forecast {experiment} {target}`")
    return assemble(rungs, forecasts, actual, target=target, title=f"{exp.name}: {target}", warnings=warnings)


def plot_data(source: str, target: str | None = None, *, root: str | None = None, forecast: str | None = None) -> PlotData:
    """Dispatch on the source: `marin-535b-public`, a table (file suffix or a folder), else an experiment."""
    if source == MARIN_SOURCE:
        return marin_public_data()
    is_table = PurePosixPath(source).suffix.lower() in TABLE_SUFFIXES or (Path(source).is_dir() and not source.endswith(".py"))
    if is_table:
        return table_plot_data(source, target, forecast)
    if forecast is not None:
        raise PlotInputError("--forecast goes with a table source; an experiment's forecasts are read from its store (--root).")
    return experiment_plot_data(source, target, root)


# ---------------------------------------------------------------- rendering


def marin_public_plot(out_path: str | Path, x: str = "compute") -> Path:
    """Render Marin's 535B ladder (rungs, hero band, hero's published first 10%) to a .png or .html file."""
    return render(marin_public_data(), out_path, x)


def render(data: PlotData, out_path: str | Path, x: str = "compute") -> Path:
    suffix = Path(out_path).suffix.lower()
    if suffix == ".png":
        from ladder.views.png import render_png

        return render_png(data, out_path, x)
    if suffix in (".html", ".htm"):
        from ladder.views.html import render_html

        return render_html(data, out_path, x)
    raise PlotInputError(f"--out {out_path}: the file name must end in .png or .html.")


# ---------------------------------------------------------------- command


def plot_command(
    source: str = typer.Argument(..., help=f"Experiment file/module, a table of runs (CSV/parquet or a folder of run directories), or {MARIN_SOURCE!r}."),
    target: Optional[str] = typer.Argument(None, help="Training step (or table run) to show against its forecast; default: the experiment's single fit target."),
    out: str = typer.Option(..., "--out", "-o", help="Output file: FILE.png (matplotlib) or FILE.html (interactive, no network needed)."),
    root: Optional[str] = typer.Option(None, "--root", help="Store root (any fsspec URL); default $LADDER_ROOT or ./ladder-runs."),
    x: str = typer.Option("compute", "--x", help="x axis: 'compute' (FLOPs) or 'tokens'."),
    forecast: Optional[str] = typer.Option(None, "--forecast", help="With a table source: a forecast JSON file (or folder of versions) to draw."),
) -> None:
    """Plot the ladder, its fits, the target's forecast band, refit history and residuals (PNG or HTML)."""
    if x not in X_COLUMNS:
        typer.echo(f"error: --x must be 'compute' or 'tokens', not {x!r}.", err=True)
        raise typer.Exit(2)
    if Path(out).suffix.lower() not in (".png", ".html", ".htm"):
        typer.echo(f"error: --out {out}: the file name must end in .png or .html.", err=True)
        raise typer.Exit(2)
    from ladder.loader import ExperimentError

    try:
        data = plot_data(source, target, root=root, forecast=forecast)
        path = render(data, out, x)
    except (PlotInputError, ExperimentError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    except NothingToPlot as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    for line in data.warnings:
        typer.echo(f"warning: {line}", err=True)
    typer.echo(
        f"wrote {path}: {data.rungs['run'].nunique()} rungs, {len(data.actual)} actual points of {data.target}, "
        f"{len(data.history)} forecast version(s)"
    )
