"""`ladder plot`: what the ladder predicted for a target against what the target did, as a PNG or an HTML page.

Why a data layer first: the PNG (matplotlib), the interactive HTML page (ladder.plot_html) and the tests
all read the same plain tables (`PlotData`), so a number on a chart can be checked without looking at
pixels, and a second renderer costs no second reading of the store. The tables are:

- rungs:     the ladder's curves (run, step, tokens, flops, loss),
- fits:      the fitted law's curve for each rung (matched progress when the ladder holds whole curves,
             else the compute law L(C) through the rungs' final points),
- band:      the newest stored forecast of the target (step, tokens, flops, loss, lo, hi),
- history:   one row per stored forecast version (final loss and its interval): how the forecast moved,
- actual:    the target's own curve so far (partially finished runs included),
- residuals: actual / predicted - 1 at every actual point, for every forecast version.

Sources: an experiment file + store (run directories and `{root}/forecasts/{target}/{n}.json`), a table
file (CSV/parquet, or a folder of run directories) with an optional forecast JSON, or the special source
`marin-535b-public`: Marin's 535B ladder from the package's public data (four rungs, the hero forecast made from them
here, a refit on the first half of the hero's published 10%, and that published 10% itself).
"""

from __future__ import annotations

import copy
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Optional

import numpy as np
import pandas as pd
import typer

from ladder.alerts import band_at_step

MARIN_SOURCE = "marin-535b-public"
TABLE_SUFFIXES = (".csv", ".parquet", ".pq", ".tsv")
X_COLUMNS = {"compute": "flops", "tokens": "tokens"}
BAND_COLOR, FIRST_BAND_COLOR = "#6a3d9a", "#999999"
X_LABELS = {"compute": "training compute (FLOPs)", "tokens": "training tokens"}
CURVE_COLUMNS = ["run", "step", "tokens", "flops", "loss"]
BAND_COLUMNS = ["step", "tokens", "flops", "loss", "lo", "hi"]
HISTORY_COLUMNS = ["version", "method", "created_at", "final_loss", "final_loss_lo", "final_loss_hi", "live_points"]
RESIDUAL_COLUMNS = ["version", "step", "tokens", "flops", "loss", "predicted", "lo", "hi", "residual"]


class PlotInputError(ValueError):
    """A source, target or output that cannot be plotted; the message says what to change."""


class NothingToPlot(RuntimeError):
    """A valid source with nothing in it yet: no rung metrics, no target metrics, no stored forecast."""


@dataclass
class PlotData:
    """Everything a plot shows, as plain tables (see the module docstring)."""

    title: str
    target: str | None
    method: str | None
    rungs: pd.DataFrame
    fits: pd.DataFrame
    band: pd.DataFrame
    bands: pd.DataFrame
    history: pd.DataFrame
    actual: pd.DataFrame
    residuals: pd.DataFrame
    loss_label: str = "eval loss (nats/token)"
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: every table as a list of row dicts (NaN -> None)."""

        def rows(df: pd.DataFrame) -> list[dict]:
            clean = df.astype(object).where(pd.notna(df), None)
            return [{k: _plain(v) for k, v in row.items()} for row in clean.to_dict(orient="records")]

        return {
            "title": self.title, "target": self.target, "method": self.method, "loss_label": self.loss_label,
            "warnings": list(self.warnings),
            **{name: rows(getattr(self, name)) for name in ("rungs", "fits", "band", "bands", "history", "actual", "residuals")},
        }


def _plain(v: Any) -> Any:
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        return float(v) if math.isfinite(float(v)) else None
    return v


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

    Matched progress (one law per training fraction) when >= 3 rungs carry whole curves; otherwise the
    compute law through the final points (run "L(C)"); an empty table when neither can be fitted.
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


def drawn_band(data: PlotData, version: int | None = None) -> pd.DataFrame:
    """The band as drawn: a refit's curve before the target's first actual eval (its live law extrapolated
    backwards, not evidence) is left out; the tables keep it."""
    if version is None:
        band, method = data.band, data.method or ""
    else:
        band = data.bands[data.bands["version"] == version]
        method = str(band["method"].iloc[0]) if not band.empty else ""
    if method.startswith("refit") and not data.actual.empty:
        band = band[band["step"] >= float(data.actual["step"].min())]
    return band


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


# ---------------------------------------------------------------- PNG


def _x(df: pd.DataFrame, x: str) -> np.ndarray:
    return df[X_COLUMNS[x]].to_numpy(float)


def zoom_range(data: PlotData, x: str) -> tuple[float, float] | None:
    """The late-curve window on the x axis: from the target's first actual point (else 5% of the band's end) to its end."""
    col = X_COLUMNS[x]
    ends = [float(df[col].max()) for df in (data.band, data.actual) if not df.empty and df[col].notna().any()]
    if not ends:
        return None
    end = max(ends)
    start = float(data.actual[col].min()) if not data.actual.empty and data.actual[col].notna().any() else 0.05 * end
    return 0.8 * start, end * 1.05


def render_png(data: PlotData, out: str | Path, x: str = "compute") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target_name = data.target or "(no target)"
    out = Path(out)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (ax_all, ax_zoom), (ax_hist, ax_res) = axes
    colors = [c for c in plt.rcParams["axes.prop_cycle"].by_key()["color"] if c not in (BAND_COLOR, FIRST_BAND_COLOR)]
    run_colors = {run: colors[i % len(colors)] for i, run in enumerate(sorted(data.rungs["run"].unique()))}
    versions = sorted(int(v) for v in data.bands["version"].unique()) if not data.bands.empty else []
    for ax in (ax_all, ax_zoom):
        for run, rows in data.rungs.groupby("run", sort=True):
            ax.plot(_x(rows, x), rows["loss"], "o", ms=3, color=run_colors[run], label=f"rung {run}")
        for i, (run, rows) in enumerate(data.fits.groupby("run", sort=True)):
            ax.plot(_x(rows, x), rows["loss"], "-", lw=1, alpha=0.7, color=run_colors.get(run, "0.4"), label="fitted law" if i == 0 else None)
        if len(versions) > 1:
            first = drawn_band(data, versions[0])
            ax.plot(_x(first, x), first["loss"], "--", color=FIRST_BAND_COLOR, lw=1, label=f"{target_name}: forecast v{versions[0]} (first)")
            ax.plot(_x(first, x), first["lo"], ":", color=FIRST_BAND_COLOR, lw=0.8)
            ax.plot(_x(first, x), first["hi"], ":", color=FIRST_BAND_COLOR, lw=0.8)
        band = drawn_band(data)
        if len(band) == 1:  # a final-loss forecast: one point with its interval
            row = band.iloc[0]
            ax.errorbar(_x(band, x), [row["loss"]], yerr=[[row["loss"] - row["lo"]], [row["hi"] - row["loss"]]], fmt="D",
                        color=BAND_COLOR, capsize=4, label=f"{target_name}: final loss v{versions[-1]}, 95% interval")
        elif not band.empty:
            bx = _x(band, x)
            ax.fill_between(bx, band["lo"], band["hi"], color=BAND_COLOR, alpha=0.18, label=f"{target_name}: 95% band (newest)")
            ax.plot(bx, band["loss"], color=BAND_COLOR, lw=1.5, label=f"{target_name}: forecast v{versions[-1]} (newest)")
        if not data.actual.empty:
            ax.plot(_x(data.actual, x), data.actual["loss"], "k^", ms=5, label=f"{target_name}: actual")
        ax.set_xscale("log")
        ax.set_xlabel(X_LABELS[x])
        ax.set_ylabel(data.loss_label)
        ax.grid(alpha=0.3, which="both")
    ax_all.set_title("ladder, fits and target forecast")
    if ax_all.get_legend_handles_labels()[0]:
        ax_all.legend(fontsize=7, ncol=2)
    window = zoom_range(data, x)
    if window is not None:
        ax_zoom.set_xlim(*window)
        col = X_COLUMNS[x]
        vals = []
        for df, cols in ((drawn_band(data), ("lo", "hi")), (data.actual, ("loss",))):
            inside = df[(df[col] >= window[0]) & (df[col] <= window[1])] if not df.empty else df
            for c in cols:
                vals.extend(inside[c].dropna().tolist() if not inside.empty else [])
        if vals:
            pad = 0.05 * (max(vals) - min(vals) or 0.1)
            ax_zoom.set_ylim(min(vals) - pad, max(vals) + pad)
    ax_zoom.set_title(f"{target_name}: late curve (zoom)")

    hist = data.history
    if not hist.empty:
        v = hist["version"].to_numpy(int)
        y = hist["final_loss"].to_numpy(float)
        err = np.vstack([y - hist["final_loss_lo"].to_numpy(float), hist["final_loss_hi"].to_numpy(float) - y])
        ax_hist.errorbar(v, y, yerr=err, fmt="o", capsize=4, color=BAND_COLOR, label="final loss, 95% interval")
        for vi, yi, m, n in zip(v, y, hist["method"], hist["live_points"], strict=True):
            label = f"{m} ({int(n)} live evals)" if n else m
            ax_hist.annotate(f"{label}\n{yi:.3f}", (vi, yi), textcoords="offset points", xytext=(8, 0), fontsize=7, va="center")
        ax_hist.ticklabel_format(axis="y", useOffset=False)
        low, high = float(hist["final_loss_lo"].min()), float(hist["final_loss_hi"].max())
        if high - low < 2e-3 * abs(high):  # a band of nearly zero width: show it at a readable scale
            mid = 0.5 * (low + high)
            ax_hist.set_ylim(mid * (1 - 2e-3), mid * (1 + 2e-3))
        ax_hist.set_xticks(v)
        ax_hist.set_xlim(v.min() - 0.5, v.max() + 1.0)
        ax_hist.legend(fontsize=7)
    else:
        ax_hist.text(0.5, 0.5, "no stored forecast", ha="center", va="center", transform=ax_hist.transAxes)
    ax_hist.set_xlabel("forecast version (refits are new versions)")
    ax_hist.set_ylabel(f"predicted final {data.loss_label}")
    ax_hist.set_title("refit history: how the forecast moved")
    ax_hist.grid(alpha=0.3)

    res = data.residuals
    if not res.empty:
        newest = int(res["version"].max())
        for version, rows in res.groupby("version", sort=True):
            rows = rows.sort_values("step")
            ax_res.plot(_x(rows, x), 100 * rows["residual"], "o-", ms=3, lw=1, label=f"vs forecast v{version}",
                        color=BAND_COLOR if version == newest else None, alpha=1.0 if version == newest else 0.6)
        rows = res[res["version"] == newest].sort_values("step")
        ax_res.fill_between(_x(rows, x), 100 * (rows["lo"] / rows["predicted"] - 1), 100 * (rows["hi"] / rows["predicted"] - 1),
                            color=BAND_COLOR, alpha=0.15, label=f"v{newest} 95% band")
        ax_res.axhline(0, color="k", lw=0.8)
        ax_res.set_xscale("log")
        ax_res.legend(fontsize=7)
    else:
        ax_res.text(0.5, 0.5, "no actual points with a forecast yet", ha="center", va="center", transform=ax_res.transAxes)
    ax_res.set_xlabel(X_LABELS[x])
    ax_res.set_ylabel("actual / predicted - 1 (%)")
    ax_res.set_title(f"{target_name}: residuals")
    ax_res.grid(alpha=0.3, which="both")

    fig.suptitle(f"{data.title}\nmethod: {data.method or 'no forecast'}", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def marin_public_plot(out_path: str | Path, x: str = "compute") -> Path:
    """Render Marin's 535B ladder (rungs, hero band, hero's published first 10%) to a .png or .html file."""
    return render(marin_public_data(), out_path, x)


def render(data: PlotData, out_path: str | Path, x: str = "compute") -> Path:
    suffix = Path(out_path).suffix.lower()
    if suffix == ".png":
        return render_png(data, out_path, x)
    if suffix in (".html", ".htm"):
        from ladder.plot_html import render_html

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
