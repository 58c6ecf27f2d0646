"""Matched-progress forecasting across ladder rungs (Marin's method, and our profiled-asymptote variant).

Why: rungs of a ladder share the recipe's schedule shape (warmup, decay, data-mix switch at fixed
fractions), so the loss of every rung at the same training fraction g has seen the same schedule
state. Fitting across rungs at each g and predicting the target at the same g sidesteps modelling
the schedule; the per-g fits chain into a whole predicted curve.

- `marin_baseline` reproduces Marin's `plot_scaling_ladder.py` (commit d23e6e9c) exactly: fractions
  snapped to a 5% grid (a later eval overwrites an earlier one in the same cell, as Marin's dict
  does), a crashed rung extended by a line through its last five grid points plus Marin's +0.005,
  and per-g OLS of log(L - 1.5) on log C. On forecasting/data/marin_535b_ladder it gives 2.0388 at g = 1.
  Its constants (1.5, +0.005) are Marin's choices and are kept only to reproduce the baseline.
- `fit_profiled` is our variant: one asymptote E shared by every fraction and chosen by profiling
  (the E that minimises the total log-space residual over all fractions: the fitted L0 of
  scaling-collapse analyses), no ad-hoc extension of crashed rungs (a fraction uses the rungs that
  reached it), and a continuous curve in g: log(L - E) interpolated linearly in log g between grid
  fractions and extended below the first grid fraction by the log-log slope of the first grid cells.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from forecasting.fitting import FitError

MARIN_ASYMPTOTE = 1.5
MARIN_CRASH_CORRECTION = 0.005


class ProgressFit(BaseModel):
    """Per-fraction fits log(L_g - E) = log A_g - alpha_g log C_g, sharing one asymptote E."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: str = Field("matched_progress", description="Law identifier.")
    E: float = Field(description="Shared asymptote.")
    asymptote_mode: str = Field(description="'fixed' (Marin: 1.5) or 'profiled' (fitted over all fractions).")
    fractions: list[float] = Field(description="Grid fractions g with a fit.")
    log_A: list[float] = Field(description="log A_g per fraction.")
    alpha: list[float] = Field(description="alpha_g per fraction.")
    n_runs: list[int] = Field(description="Rungs used at each fraction.")
    sse: float = Field(description="Total squared log residual over all fractions.")

    def predict_at_grid(self, flops_full: float) -> np.ndarray:
        """Prediction at each grid fraction for a run of total compute `flops_full`."""
        g = np.asarray(self.fractions)
        return self.E + np.exp(np.asarray(self.log_A) - np.asarray(self.alpha) * np.log(g * flops_full))

    def predict(self, fraction: np.ndarray | float, flops_full: float) -> np.ndarray:
        """Loss at any fraction in (0, 1] for a target of total compute `flops_full`."""
        g = np.atleast_1d(np.asarray(fraction, dtype=float))
        grid = np.asarray(self.fractions)
        y = np.log(self.predict_at_grid(flops_full) - self.E)
        lg, lgrid = np.log(g), np.log(grid)
        out = np.interp(lg, lgrid, y)
        below = lg < lgrid[0]
        if np.any(below):
            k = min(3, len(grid))
            slope = np.polyfit(lgrid[:k], y[:k], 1)[0] if k >= 2 else 0.0
            out[below] = y[0] + slope * (lg[below] - lgrid[0])
        return self.E + np.exp(out)

    def formula(self) -> str:
        a_last = self.alpha[-1]
        return (
            f"L_g(C) = {self.E:.4g} + A_g*C^-alpha_g at each fraction g ({len(self.fractions)} fractions, "
            f"E {self.asymptote_mode}; alpha_g from {min(self.alpha):.4g} to {max(self.alpha):.4g}, "
            f"alpha at g={self.fractions[-1]:.2f}: {a_last:.4g})"
        )


def progress_grid(table: pd.DataFrame, grid_step: float = 0.05, *, mode: str = "interpolate") -> pd.DataFrame:
    """One row per (run, grid fraction): the run's loss at that fraction and the run's total compute.

    Needs columns run, step, loss, fraction, flops.
    mode="snap" (Marin's rule, for the baseline): each eval goes to the nearest grid cell, a later eval
    overwrites an earlier one in the same cell. Right only when evals sit on the grid.
    mode="interpolate" (default): each run's loss is interpolated linearly in (log g, log loss) at the
    grid fractions inside its logged range (a cell within 1% of the range's ends takes the end value),
    so evals at any cadence give the loss at the same progress.
    """
    need = [c for c in ("run", "step", "loss", "fraction", "flops") if c not in table.columns]
    if need:
        raise FitError(f"matched progress needs columns {need} in the table of runs")
    t = table.sort_values(["run", "step"])
    t = t[t["fraction"] > 0]
    n_cells = round(1.0 / grid_step)
    grid = np.round(np.arange(1, n_cells + 1) * grid_step, 6)
    full = (t["flops"] / t["fraction"]).groupby(t["run"]).median()
    if mode == "snap":
        g = np.round(np.round(t["fraction"].to_numpy() / grid_step) * grid_step, 6)
        out = pd.DataFrame({"run": t["run"].to_numpy(), "g": g, "loss": t["loss"].to_numpy()})
        out = out[(out["g"] > 0) & (np.round(out["g"] / grid_step) <= n_cells)]
        out = out.groupby(["run", "g"], sort=True).last().reset_index()
    elif mode == "interpolate":
        parts = []
        for run, c in t.groupby("run", sort=True):
            c = c.groupby("fraction", as_index=False)["loss"].last()
            lg, ly = np.log(c["fraction"].to_numpy()), np.log(c["loss"].to_numpy())
            cells = grid[(grid >= np.exp(lg[0]) * 0.99) & (grid <= np.exp(lg[-1]) * 1.01)]
            if len(cells) == 0:
                continue
            parts.append(pd.DataFrame({"run": run, "g": cells, "loss": np.exp(np.interp(np.log(cells), lg, ly))}))
        if not parts:
            raise FitError("no run's logged fractions reach a grid cell")
        out = pd.concat(parts, ignore_index=True)
    else:
        raise ValueError(f"mode must be 'snap' or 'interpolate'; got {mode!r}")
    out["flops_full"] = out["run"].map(full)
    return out


def _extend_crashed(cells: pd.DataFrame, grid: np.ndarray, window: int, correction: float) -> pd.DataFrame:
    rows = [cells]
    for run, c in cells.groupby("run"):
        have = c.sort_values("g")
        missing = grid[grid > have["g"].max() + 1e-9]
        if len(missing) == 0 or len(have) < window:
            continue
        w = have.tail(window)
        slope, icpt = np.polyfit(w["g"].to_numpy(), w["loss"].to_numpy(), 1)
        rows.append(
            pd.DataFrame(
                {"run": run, "g": missing, "loss": slope * missing + icpt + correction, "flops_full": have["flops_full"].iloc[0]}
            )
        )
    return pd.concat(rows, ignore_index=True)


def _per_fraction(cells: pd.DataFrame, e: float, min_runs: int) -> tuple[list, list, list, list, float]:
    fr, la, al, nr, sse = _per_fraction_many(cells, np.array([e]), min_runs)
    return fr, [v[0] for v in la], [v[0] for v in al], nr, float(sse[0])


def _per_fraction_many(
    cells: pd.DataFrame, e_values: np.ndarray, min_runs: int
) -> tuple[list, list, list, list, np.ndarray]:
    """Weighted OLS of log(L - E) on log C at every fraction, for many E at once (closed form)."""
    fr, la, al, nr = [], [], [], []
    sse = np.zeros(len(e_values))
    w_all = cells["w"].to_numpy() if "w" in cells.columns else np.ones(len(cells))
    for g, idx in cells.groupby("g", sort=True).indices.items():
        c = cells.iloc[idx]
        if c["run"].nunique() < min_runs:
            continue
        w = w_all[idx]
        x = np.log(c["flops_full"].to_numpy() * g)
        y = np.log(np.maximum(c["loss"].to_numpy()[None, :] - e_values[:, None], 1e-300))  # nE x k
        sw = w.sum()
        xm = (w * x).sum() / sw
        ym = (y * w).sum(1) / sw
        sxx = (w * (x - xm) ** 2).sum()
        slope = ((y - ym[:, None]) * (w * (x - xm))).sum(1) / sxx
        icpt = ym - slope * xm
        resid = y - (icpt[:, None] + slope[:, None] * x[None, :])
        sse += (w * resid**2).sum(1)
        fr.append(float(g))
        la.append(icpt)
        al.append(-slope)
        nr.append(int(c["run"].nunique()))
    return fr, la, al, nr, sse


def marin_baseline(table: pd.DataFrame, *, grid_step: float = 0.05) -> ProgressFit:
    """Marin's matched-progress fit, reproduced exactly (fixed asymptote 1.5, crashed-rung extension +0.005)."""
    cells = progress_grid(table, grid_step, mode="snap")
    grid = np.round(np.arange(1, round(1 / grid_step) + 1) * grid_step, 6)
    cells = _extend_crashed(cells, grid, window=5, correction=MARIN_CRASH_CORRECTION)
    if cells["run"].nunique() < 2:
        raise FitError("matched progress needs at least two rungs (runs of different compute)")
    fr, la, al, nr, sse = _per_fraction(cells, MARIN_ASYMPTOTE, min_runs=2)
    return ProgressFit(E=MARIN_ASYMPTOTE, asymptote_mode="fixed", fractions=fr, log_A=la, alpha=al, n_runs=nr, sse=sse)


def fit_profiled(table: pd.DataFrame, *, grid_step: float = 0.05, min_runs: int = 3, weights: dict[str, float] | None = None) -> ProgressFit:
    """Matched progress with one asymptote E shared by all fractions, chosen by profiling the total residual.

    min_runs: a fraction is fitted only where at least this many rungs reached it (3: two points
    always fit a line exactly, so they carry no evidence about the law).
    weights: optional per-run multiplicity (run-level bootstrap); a run with weight k counts k times.
    """
    cells = progress_grid(table, grid_step)
    if weights is not None:
        cells["w"] = cells["run"].map(lambda r: float(weights.get(r, 0.0)))
        cells = cells[cells["w"] > 0].reset_index(drop=True)
    n_runs = cells["run"].nunique()
    if n_runs < min_runs:
        raise FitError(
            f"matched progress with a fitted asymptote needs at least {min_runs} rungs of different compute; got {n_runs}"
        )
    if cells.groupby("run")["flops_full"].first().nunique() < 2:
        raise FitError("all rungs have the same compute: a law in C cannot be fitted from one model size")
    top = float(cells["loss"].min()) * (1 - 1e-3)
    e_grid = np.linspace(0.0, top, 241)
    fr, _, _, _, sse = _per_fraction_many(cells, e_grid, min_runs)
    if not fr:
        raise FitError(f"no training fraction was reached by {min_runs} or more rungs")
    i = int(np.argmin(sse))
    step = e_grid[1] - e_grid[0]
    fine = np.linspace(max(0.0, e_grid[i] - step), min(top, e_grid[i] + step), 81)
    _, _, _, _, sse_fine = _per_fraction_many(cells, fine, min_runs)
    e = float(fine[int(np.argmin(sse_fine))])
    fr, la, al, nr, sse_e = _per_fraction(cells, e, min_runs)
    return ProgressFit(E=e, asymptote_mode="profiled", fractions=fr, log_A=la, alpha=al, n_runs=nr, sse=sse_e)


def early_extension_error(table: pd.DataFrame, fit: ProgressFit, *, grid_step: float = 0.05, skip: int = 2) -> float:
    """Relative error per unit of log g of the below-grid extension rule, measured on the rungs themselves.

    For each rung: take its grid cells from index `skip`, extend down with the same rule `predict` uses
    (log-log slope of the first three cells), compare with the rung's own first `skip` cells. Returns
    the RMS of (relative error / log distance). This is how wrong the early-curve extension was on this
    ladder; forecasts scale it by their own distance below the first grid fraction.
    """
    cells = progress_grid(table, grid_step)
    rates = []
    for _, c in cells.groupby("run"):
        c = c.sort_values("g")
        if len(c) < skip + 3:
            continue
        lg = np.log(c["g"].to_numpy())
        y = np.log(np.maximum(c["loss"].to_numpy() - fit.E, 1e-12))
        slope, icpt = np.polyfit(lg[skip : skip + 3], y[skip : skip + 3], 1)
        pred = fit.E + np.exp(icpt + slope * lg[:skip])
        rel = pred / c["loss"].to_numpy()[:skip] - 1
        rates.extend(rel / (lg[skip] - lg[:skip]))
    if not rates:
        return float("nan")
    return float(np.sqrt(np.mean(np.square(rates))))
