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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

X_COLUMNS = {"compute": "flops", "tokens": "tokens"}
BAND_COLOR, FIRST_BAND_COLOR = "#6a3d9a", "#999999"
X_LABELS = {"compute": "training compute (FLOPs)", "tokens": "training tokens"}
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
