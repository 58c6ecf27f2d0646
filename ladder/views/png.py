"""The PNG view of `ladder plot` (matplotlib): the same four panels as the HTML page, from the same PlotData."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ladder.views.common import BAND_COLOR, FIRST_BAND_COLOR, X_COLUMNS, X_LABELS, PlotData, _x, drawn_band, zoom_range


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
