"""The PNG view of `ladder plot` (matplotlib): the same four panels as the HTML page, from the same PlotData.

Why the legends sit outside the plot areas: a legend placed "best" inside a panel still lands on a band or
on points as soon as a ladder fills the panel, and then the figure is wrong at a glance. The top two panels
share one legend in a strip of its own between the rows; the residuals' legend sits under its axis. Only
what is drawn gets an entry (a rung with one eval has no fitted line, so no "fitted law").

Why tick labels are thinned after layout: on a log axis spanning under a decade matplotlib labels minor
ticks (2x10^22, 3x10^22, 4x10^22 ...) that run into each other; the only reliable test is the labels'
measured extents, so labels that would touch a kept one are hidden (major ticks first).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from ladder.views.common import (
    BAND_COLOR, CLIP_LABEL, FIRST_BAND_COLOR, FIT_LABEL, LAW_LABEL, RUNG_COLORS, X_COLUMNS, X_LABELS, PlotData, _x, band_from, clip_marks, drawn_band,
    drawn_line, y_limits, zoom_range,
)

DPI = 100


def _inside(df: pd.DataFrame, col: str, window: tuple[float, float] | None) -> pd.DataFrame:
    if df.empty or window is None:
        return df
    return df[(df[col] >= window[0]) & (df[col] <= window[1])]


def _wrap(label: str, width: int = 46) -> str:
    return "\n".join(textwrap.wrap(label, width)) if len(label) > width else label


def _curves_panel(ax, data: PlotData, x: str, window: tuple[float, float] | None) -> None:
    """Rungs, fits, the forecast bands and the target's curve on one axis; y follows the data (see band_from)."""
    col = X_COLUMNS[x]
    target_name = data.target or "(no target)"
    runs = data.runs()
    run_colors = {run: RUNG_COLORS[i % len(RUNG_COLORS)] for i, run in enumerate(runs)}
    versions = sorted(int(v) for v in data.bands["version"].unique()) if not data.bands.empty else []
    for run in runs:
        rows = data.rungs[data.rungs["run"] == run]
        ax.plot(_x(rows, x), rows["loss"], "o", ms=3, color=run_colors[run], label=f"rung {run}")
    fit_runs = [r for r in runs if r in set(data.fits["run"])] + sorted(set(data.fits["run"]) - set(runs))
    labelled: set[str] = set()
    for run in fit_runs:
        rows = data.fits[data.fits["run"] == run]
        if not drawn_line(rows, col):
            continue
        label = FIT_LABEL if run in run_colors else LAW_LABEL
        ax.plot(_x(rows, x), rows["loss"], "-", lw=1, alpha=0.7, color=run_colors.get(run, "0.35"),
                label=label if label not in labelled else "_nolegend_")
        labelled.add(label)
    first = drawn_band(data, versions[0]) if len(versions) > 1 else pd.DataFrame(columns=data.band.columns)
    if len(first) > 1:
        ax.plot(_x(first, x), first["loss"], "--", color=FIRST_BAND_COLOR, lw=1, label=f"{target_name}: forecast v{versions[0]} (first), 95% band dotted")
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
    if window is not None:
        ax.set_xlim(*window)

    start = band_from(data, x)
    data_values = [*_inside(data.rungs, col, window)["loss"], *_inside(data.actual, col, window)["loss"]]
    for run in fit_runs:
        rows = _inside(data.fits[data.fits["run"] == run], col, window)
        data_values += list(rows["loss"]) if drawn_line(data.fits[data.fits["run"] == run], col) else []
    band_values: list[float] = []
    for frame in (first, band):
        rows = _inside(frame, col, window)
        if len(frame) > 1:
            rows = rows[rows[col] >= start]
        for c in ("loss", "lo", "hi"):
            band_values += list(rows[c]) if not rows.empty else []
    limits = y_limits(data_values, band_values)
    if limits is None:
        return
    ax.set_ylim(*limits)
    marked = False
    for frame, color in ((first, FIRST_BAND_COLOR), (band, BAND_COLOR)):
        rows = _inside(frame, col, window)
        if len(frame) <= 1 or rows.empty:
            continue
        for edge, values, above, marker in ((limits[1], rows["hi"], True, "^"), (limits[0], rows["lo"], False, "v")):
            xs = clip_marks(rows[col], values, edge, above)
            if xs:
                ax.plot(xs, [edge] * len(xs), marker=marker, ls="none", ms=7, color=color, clip_on=False, zorder=5,
                        label=CLIP_LABEL if not marked else "_nolegend_")
                marked = True


def _history_panel(ax, data: PlotData) -> None:
    hist = data.history
    if hist.empty:
        ax.text(0.5, 0.5, "no stored forecast", ha="center", va="center", transform=ax.transAxes)
    else:
        v = hist["version"].to_numpy(int)
        y = hist["final_loss"].to_numpy(float)
        err = np.vstack([y - hist["final_loss_lo"].to_numpy(float), hist["final_loss_hi"].to_numpy(float) - y])
        ax.errorbar(v, y, yerr=err, fmt="o", capsize=4, color=BAND_COLOR)
        for vi, yi, m, n in zip(v, y, hist["method"], hist["live_points"], strict=True):
            label = f"{m} ({int(n)} live evals)" if n else m
            ax.annotate(f"{label}\n{yi:.3f}", (vi, yi), textcoords="offset points", xytext=(8, 0), fontsize=7, va="center")
        ax.ticklabel_format(axis="y", useOffset=False)
        low, high = float(hist["final_loss_lo"].min()), float(hist["final_loss_hi"].max())
        if high - low < 2e-3 * abs(high):  # a band of nearly zero width: show it at a readable scale
            mid = 0.5 * (low + high)
            ax.set_ylim(mid * (1 - 2e-3), mid * (1 + 2e-3))
        ax.set_xticks(v)
        ax.set_xlim(v.min() - 0.5, v.max() + 1.0)
    ax.set_xlabel("forecast version (refits are new versions)")
    ax.set_ylabel(_wrap(f"predicted final {data.loss_label}"))
    ax.set_title("refit history: predicted final loss, 95% interval")
    ax.grid(alpha=0.3)


def _residuals_panel(ax, data: PlotData, x: str) -> None:
    target_name = data.target or "(no target)"
    res = data.residuals
    if res.empty:
        ax.text(0.5, 0.5, "no actual points with a forecast yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        newest = int(res["version"].max())
        for i, (version, rows) in enumerate(res.groupby("version", sort=True)):
            rows = rows.sort_values("step")
            color = BAND_COLOR if version == newest else RUNG_COLORS[i % len(RUNG_COLORS)]
            ax.plot(_x(rows, x), 100 * rows["residual"], "o-", ms=3, lw=1, label=f"vs forecast v{version}",
                    color=color, alpha=1.0 if version == newest else 0.6)
        rows = res[res["version"] == newest].sort_values("step")
        ax.fill_between(_x(rows, x), 100 * (rows["lo"] / rows["predicted"] - 1), 100 * (rows["hi"] / rows["predicted"] - 1),
                        color=BAND_COLOR, alpha=0.15, label=f"v{newest} 95% band")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)
    ax.set_xlabel(X_LABELS[x])
    ax.set_ylabel("actual / predicted - 1 (%)")
    ax.set_title(f"{target_name}: residuals")
    ax.grid(alpha=0.3, which="both")


def _ticks(ax):
    """(axis, tick) of both axes, major ticks first: the order in which labels are kept."""
    for which in ("major", "minor"):
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis.get_major_ticks() if which == "major" else axis.get_minor_ticks():
                yield axis, tick


def _shown(axis, tick) -> bool:
    """Whether matplotlib draws this tick's label: visible, not empty, its location inside the view."""
    label, loc = tick.label1, tick.get_loc()
    if not (label.get_visible() and label.get_text()) or loc is None:
        return False
    lo, hi = sorted(axis.get_view_interval())
    return lo - 1e-9 * (hi - lo) <= loc <= hi + 1e-9 * (hi - lo)


def tick_labels_drawn(ax) -> list:
    """The tick labels an axes shows."""
    return [tick.label1 for axis, tick in _ticks(ax) if _shown(axis, tick)]


def thin_tick_labels(fig, gap_px: float = 4.0) -> int:
    """Hide tick labels that would touch a kept one (measured after layout; major ticks keep priority; x and y
    together, since the two axes' first labels meet at the corner). Returns how many were hidden."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    hidden = 0
    for ax in fig.axes:
        kept = []
        for axis, tick in _ticks(ax):
            if not _shown(axis, tick):
                continue
            box = tick.label1.get_window_extent(renderer).padded(gap_px / 2)
            if any(box.overlaps(k) for k in kept):
                tick.label1.set_visible(False)
                hidden += 1
            else:
                kept.append(box)
    return hidden


def figure(data: PlotData, x: str = "compute"):
    """The four panels as a matplotlib Figure, laid out and with tick labels thinned (render_png saves it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target_name = data.target or "(no target)"
    fig = plt.figure(figsize=(13, 9), dpi=DPI)
    grid = fig.add_gridspec(3, 2, height_ratios=[1.0, 0.16, 1.0])
    ax_all, ax_zoom = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax_legend = fig.add_subplot(grid[1, :])
    ax_hist, ax_res = fig.add_subplot(grid[2, 0]), fig.add_subplot(grid[2, 1])
    _curves_panel(ax_all, data, x, None)
    _curves_panel(ax_zoom, data, x, zoom_range(data, x))
    for ax in (ax_all, ax_zoom):
        ax.set_xlabel(X_LABELS[x])
        ax.set_ylabel(_wrap(data.loss_label))
        ax.grid(alpha=0.3, which="both")
    ax_all.set_title("ladder, fits and target forecast")
    ax_zoom.set_title(f"{target_name}: late curve (zoom)")
    handles: dict[str, object] = {}
    for ax in (ax_all, ax_zoom):
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    ax_legend.axis("off")
    if handles:
        ax_legend.legend(list(handles.values()), list(handles), loc="center", ncol=min(4, len(handles)), fontsize=8, frameon=False)
    _history_panel(ax_hist, data)
    _residuals_panel(ax_res, data, x)
    fig.suptitle(f"{data.title}\nmethod: {data.method or 'no forecast'}", fontsize=11)
    fig.tight_layout()
    thin_tick_labels(fig)
    return fig


def render_png(data: PlotData, out: str | Path, x: str = "compute") -> Path:
    import matplotlib.pyplot as plt

    out = Path(out)
    fig = figure(data, x)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out
