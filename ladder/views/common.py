"""What every view of a ladder shares: the plot tables (`PlotData`), colours, axis names and the band helpers.

Why a module of its own: the PNG renderer (views.png), the offline SVG/HTML plotter (views.html), the report
and the live server all draw the same tables the same way; each imports this and none imports another's
renderer for a constant, so the views form no import circle.

PlotData's tables:
- rungs:     the ladder's curves (run, step, tokens, flops, loss),
- fits:      the fitted law's curve for each rung (matched progress when the ladder holds whole curves,
             else the compute law L(C) through the rungs' final points),
- band:      the newest stored forecast of the target (step, tokens, flops, loss, lo, hi); bands: every version's,
- history:   one row per stored forecast version (final loss and its interval): how the forecast moved,
- actual:    the target's own curve so far (partially finished runs included),
- residuals: actual / predicted - 1 at every actual point, for every forecast version.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

X_COLUMNS = {"compute": "flops", "tokens": "tokens"}
BAND_COLOR, FIRST_BAND_COLOR = "#6a3d9a", "#999999"
X_LABELS = {"compute": "training compute (FLOPs)", "tokens": "training tokens"}
CLIP_LABEL = "band leaves the frame (it continues beyond the mark)"
FIT_LABEL = "fitted law (each rung)"
LAW_LABEL = "compute law L(C) through the final points"
RUNG_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
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
    """Everything a plot shows, as plain tables (the module docstring says what each holds)."""

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
    rung_order: list[str] = field(default_factory=list)  # smallest first (order_runs); empty: natural name order

    def runs(self) -> list[str]:
        """The rungs in the order every view lists them: by size, smallest first."""
        present = [str(r) for r in self.rungs["run"].unique()] if not self.rungs.empty else []
        ordered = [r for r in self.rung_order if r in present]
        return ordered + sorted((r for r in present if r not in ordered), key=natural_key)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: every table as a list of row dicts (NaN -> None)."""

        def rows(df: pd.DataFrame) -> list[dict]:
            clean = df.astype(object).where(pd.notna(df), None)
            return [{k: _plain(v) for k, v in row.items()} for row in clean.to_dict(orient="records")]

        return {
            "title": self.title, "target": self.target, "method": self.method, "loss_label": self.loss_label,
            "warnings": list(self.warnings), "rung_order": self.runs(),
            **{name: rows(getattr(self, name)) for name in ("rungs", "fits", "band", "bands", "history", "actual", "residuals")},
        }


def _plain(v: Any) -> Any:
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        return float(v) if math.isfinite(float(v)) else None
    return v


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


# ---------------------------------------------------------------- order, axis ranges and clip marks


def natural_key(name: str) -> tuple:
    """d768 before d1024: digit runs compare as numbers."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.findall(r"\d+|\D+", str(name)))


def order_runs(table: pd.DataFrame) -> list[str]:
    """Runs smallest first: by active parameters, else planned compute (flops / fraction), else the compute
    reached so far, else by name in natural order; a tie keeps the natural name order."""
    if table.empty or "run" not in table.columns:
        return []
    rows = table.assign(run=table["run"].astype(str))
    keys: dict[str, list[float]] = {}
    for run, group in rows.groupby("run", sort=False):
        key = []
        for column in ("params_active",):
            key.append(float(group[column].max()) if column in group.columns and group[column].notna().any() else math.inf)
        if {"flops", "fraction"} <= set(group.columns):
            planned = (group["flops"] / group["fraction"]).replace([np.inf, -np.inf], np.nan)
            key.append(float(planned.max()) if planned.notna().any() else math.inf)
        else:
            key.append(math.inf)
        key.append(float(group["flops"].max()) if "flops" in group.columns and group["flops"].notna().any() else math.inf)
        keys[run] = key
    return sorted(keys, key=lambda run: (*keys[run], natural_key(run)))


def band_from(data: PlotData, x: str) -> float:
    """Where a forecast band starts to count for the y axis: the target's first eval, else the largest rung's
    reach. Before it the band is the law extrapolated backwards to tiny fractions of training (forecast v1 of the
    local ladder spans 0.6-5 nats there); it is drawn, clipped with a mark, but does not set the axis."""
    col = X_COLUMNS[x]
    for frame in (data.actual, data.rungs):
        if not frame.empty and frame[col].notna().any():
            return float(frame[col].min() if frame is data.actual else frame[col].max())
    return -math.inf


def y_limits(data_values, band_values, pad: float = 0.06) -> tuple[float, float] | None:
    """Axis limits around the data and the part of the bands that counts (see band_from), padded by `pad` of the span."""
    values = np.asarray([v for v in (*data_values, *band_values) if v is not None and np.isfinite(v)], dtype=float)
    if values.size == 0:
        return None
    lo, hi = float(values.min()), float(values.max())
    margin = max((hi - lo) * pad, max(abs(lo), abs(hi)) * 1e-3, 1e-9)
    return lo - margin, hi + margin


def clip_marks(x, values, limit: float, above: bool) -> list[float]:
    """The x positions where a band edge leaves the frame (lies beyond `limit`): one mark on each point outside
    the frame that neighbours a point inside it; a band edge wholly outside gets one mark at its first point."""
    x = np.asarray(x, dtype=float)
    v = np.asarray(values, dtype=float)
    ok = np.isfinite(x) & np.isfinite(v)
    x, v = x[ok], v[ok]
    if x.size == 0:
        return []
    order = np.argsort(x)
    x, v = x[order], v[order]
    out = v > limit if above else v < limit
    if out.all():
        return [float(x[0])]
    marks = []
    for i in range(1, len(x)):
        if out[i] and not out[i - 1]:
            marks.append(float(x[i]))
        elif out[i - 1] and not out[i]:
            marks.append(float(x[i - 1]))
    return sorted(set(marks))  # a lone point outside borders inside points on both sides: one mark


def drawn_line(rows: pd.DataFrame, col: str) -> bool:
    """A fitted curve is drawn as a line only where it spans more than one x (a rung with one eval is a point)."""
    xs = rows[col].to_numpy(float) if not rows.empty else np.array([])
    xs = xs[np.isfinite(xs) & np.isfinite(rows["loss"].to_numpy(float))] if xs.size else xs
    return xs.size >= 2 and float(xs.max()) > float(xs.min()) * (1 + 1e-9)

