"""Backtests by ordered extrapolation: how wrong a method is on this very ladder.

Why ordered and not cross-validated: a forecast extrapolates (to a larger run, to the end of a curve),
so a backtest must too. Two kinds:
- compute: sort runs by planned compute; fit on the smaller ones, predict the larger ones they did not
  see. Error per decade of compute extrapolated (`rate`) is what forecasts use to widen their bands.
- prefix: fit each run's curve prefix (no ladder prior), predict the rest of that run. Error per unit
  of ln(step / last prefix step) widens refit bands.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from forecasting.fitting import FitError, MissingColumnsError
from forecasting.forecast import BacktestResult, HeldOutRun
from forecasting.matched_progress import fit_profiled
from forecasting.refit import fit_curve, lr_per_step, schedule_features


def last_points(table: pd.DataFrame) -> pd.DataFrame:
    """The last logged point of every run, finished or not, with its planned compute `run_flops` (flops, else 6*N*D,
    over the fraction reached) and planned tokens `run_tokens`, sorted by planned compute, runs of one compute by
    name: the order decides which runs a backtest split holds out, and numpy's (vectorised, CPU-specific) quicksort
    left ties in one order on an Intel host and in another on an AMD one: one table, two backtests."""
    last = table.sort_values("step").groupby("run").tail(1).copy()
    frac = last["fraction"] if "fraction" in last.columns else 1.0
    if "flops" in last.columns:
        last["run_flops"] = last["flops"] / frac
    elif {"params_active", "tokens"} <= set(last.columns):
        last["run_flops"] = 6 * last["params_active"] * last["tokens"] / frac
    else:
        missing = tuple(c for c in ("flops", "params_active", "tokens") if c not in last.columns)
        raise MissingColumnsError(f"a ladder's laws need flops, or params_active and tokens, per run; the table has no "
                                  f"{', '.join(map(repr, missing))}")
    if "tokens" in last.columns:
        last["run_tokens"] = last["tokens"] / frac
    return last.sort_values(["run_flops", "run"], kind="stable").reset_index(drop=True)


def run_compute(table: pd.DataFrame) -> pd.Series:
    """Planned total compute per run (`last_points`' rule and order), indexed by run."""
    return last_points(table).set_index("run")["run_flops"].rename(None)


def held_out_run(run, fitted_on: str, distance: float, predicted: np.ndarray, actual: np.ndarray) -> HeldOutRun | None:
    """One held-out run from its predicted and observed losses over the points scored (None when none is finite)."""
    errors = np.asarray(predicted, dtype=float) / np.asarray(actual, dtype=float) - 1
    ok = np.flatnonzero(np.isfinite(errors))
    if not len(ok):
        return None
    last = ok[-1]
    return HeldOutRun(run=str(run), fitted_on=fitted_on, distance=float(distance), predicted=float(predicted[last]),
                      actual=float(actual[last]), error=float(errors[last]),
                      rms_error=float(np.sqrt(np.mean(errors[ok] ** 2))), n_points=int(len(ok)))


def _summarise(
    method: str, kind: str, held: list[str], rel: list[float], dist: list[float], final: tuple | None = None,
    per_run: list[HeldOutRun | None] | None = None,
) -> BacktestResult:
    r = np.asarray(rel, dtype=float)
    d = np.asarray(dist, dtype=float)
    ok = np.isfinite(r) & (d > 0)
    if not ok.any():
        raise FitError(f"backtest of {method}: nothing could be scored")
    r, d = r[ok], d[ok]
    return BacktestResult(
        method=method,
        kind=kind,
        held_out=held,
        mean_rel_error=float(r.mean()),
        rms_rel_error=float(np.sqrt(np.mean(r**2))),
        max_abs_rel_error=float(np.abs(r).max()),
        distance=float(d.mean()),
        rate=float(np.sqrt(np.mean(r**2)) / d.mean()),
        n_points=int(len(r)),
        final_run=None if final is None else str(final[0]),
        final_predicted=None if final is None else float(final[1]),
        final_actual=None if final is None else float(final[2]),
        runs=[r for r in per_run or [] if r is not None],
    )


def backtest_matched_progress(table: pd.DataFrame, *, min_runs: int = 3) -> BacktestResult:
    """Fit the profiled matched-progress law on the k smallest runs, predict run k+1 (every k >= min_runs)."""
    comp = run_compute(table)
    runs = list(comp.index)
    if len(runs) < min_runs + 1:
        raise FitError(f"a compute backtest of matched progress needs at least {min_runs + 1} runs; got {len(runs)}")
    held, rel, dist, per_run = [], [], [], []
    for k in range(min_runs, len(runs)):
        fit = fit_profiled(table[table["run"].isin(runs[:k])], min_runs=min_runs)
        target = table[table["run"] == runs[k]]
        pred = fit.predict(target["fraction"].to_numpy(), float(comp.iloc[k]))
        # only fractions the ladder spans: below-grid extension is backtested separately
        inside = target["fraction"].to_numpy() >= fit.fractions[0] - 1e-9
        rel.extend((pred / target["loss"].to_numpy() - 1)[inside])
        d = float(np.log10(comp.iloc[k] / comp.iloc[k - 1]))
        dist.extend([d] * int(inside.sum()))
        held.append(runs[k])
        per_run.append(held_out_run(runs[k], f"{k} runs", d, pred[inside], target["loss"].to_numpy()[inside]))
        final = (runs[k], float(pred[-1]), float(target["loss"].iloc[-1]))
    return _summarise("matched_progress", "compute", held, rel, dist, final, per_run)


def matched_progress_rate_by_fraction(table: pd.DataFrame, grid: np.ndarray, *, min_runs: int = 3) -> np.ndarray:
    """Error per decade of compute of matched progress at each fraction in `grid`, from the same backtest.

    Why per fraction: on a ladder whose rungs differ a lot in steps, matched progress can be right at the
    end and wrong mid-run (the small rungs' early curves are step-limited); one rate for the whole curve
    would make the mid-run band too narrow. Each held-out run's relative error is interpolated at the grid
    fractions it reached and pooled over a window around g (`rate_by_fraction`).
    """
    comp = run_compute(table)
    runs = list(comp.index)
    if len(runs) < min_runs + 1:
        raise FitError(f"a per-fraction backtest of matched progress needs at least {min_runs + 1} runs; got {len(runs)}")
    errors = []
    for k in range(min_runs, len(runs)):
        fit = fit_profiled(table[table["run"].isin(runs[:k])], min_runs=min_runs)
        target = table[table["run"] == runs[k]].sort_values("step")
        g = target["fraction"].to_numpy()
        rel = fit.predict(g, float(comp.iloc[k])) / target["loss"].to_numpy() - 1
        errors.append((g, rel, max(float(np.log10(comp.iloc[k] / comp.iloc[k - 1])), 0.05)))
    return rate_by_fraction(errors, grid)


RATE_WINDOW = 0.35  # half-width, in ln(fraction), of the window a per-fraction rate pools errors over
_WINDOW_SAMPLES = 29


def rate_by_fraction(errors: list[tuple[np.ndarray, np.ndarray, float]], grid: np.ndarray) -> np.ndarray:
    """Error per unit distance at each fraction of `grid` from held-out curves (fractions, relative errors, distance).

    Each curve's error, interpolated in log fraction, is pooled over a window of +-RATE_WINDOW in ln(fraction)
    around g (a factor of about 1.4 either side), narrowed near the ends of the fractions that curve logged so that
    it stays centred on g: the rate at g is sqrt(sum of the curves' mean e^2 in the window / sum d^2). Why a window
    of fixed width in ln(fraction) and not the grid cell: one held-out curve crosses zero by luck somewhere, and a
    rate read at one fraction then makes a band that pinches there and flares beside it; and a window counted in
    grid cells would change with the caller's grid. Why centred: at the end of a run the error has a trend of its
    own (the anneal pins the last point), and a one-sided window would read mid-run errors into the final
    point's. A fraction no held-out curve logged takes the rate of the whole curves.
    """
    lgrid = np.log(np.clip(np.asarray(grid, dtype=float), 1e-9, None))
    unit = np.linspace(-1.0, 1.0, _WINDOW_SAMPLES)
    num, den = np.zeros(len(lgrid)), np.zeros(len(lgrid))
    all_e, all_d = [], []
    for g, rel, d in errors:
        ok = np.isfinite(rel) & (g > 0)
        if not ok.any():
            continue
        lg, e = np.log(g[ok]), rel[ok]
        order = np.argsort(lg)
        lg, e = lg[order], e[order]
        inside = (lgrid >= lg.min() - 1e-9) & (lgrid <= lg.max() + 1e-9)
        centre = lgrid[inside]
        half = np.clip(np.minimum(centre - lg.min(), lg.max() - centre), 0.0, RATE_WINDOW)
        num[inside] += np.mean(np.interp(centre[:, None] + half[:, None] * unit[None, :], lg, e) ** 2, axis=1)
        den[inside] += d**2
        all_e.extend(e)
        all_d.extend([d] * len(e))
    if not all_e:
        raise FitError("no held-out curve with a finite error to measure a per-fraction rate on")
    whole = float(np.sqrt(np.sum(np.square(all_e)) / np.sum(np.square(all_d))))
    return np.where(den > 0, np.sqrt(num / np.maximum(den, 1e-300)), whole)


FINISHED = 0.99  # a run whose last logged point is at 99% of its planned steps counts as finished


def backtest_prefix(
    table: pd.DataFrame,
    *,
    prefix_fraction: float = 0.4,
    lr_of: Callable[[str, int], np.ndarray | None] | None = None,
) -> BacktestResult:
    """Fit each run's first `prefix_fraction` of evals (the live-curve law, no prior), predict the rest."""
    held, rel, dist, per_run = [], [], [], []
    for run, c in table.sort_values("step").groupby("run"):
        steps = c["step"].to_numpy()
        n_pre = int(np.floor(prefix_fraction * len(steps)))
        if n_pre < 4 or n_pre >= len(steps):
            continue
        num_steps = int(c["num_steps"].iloc[0]) if "num_steps" in c.columns else int(steps.max())
        lr = lr_of(run, num_steps) if lr_of is not None else None
        if lr is None and "lr" in c.columns:
            lr = lr_per_step(steps, c["lr"].to_numpy(), num_steps)
        s1, s2 = schedule_features(lr, max(num_steps, int(steps.max())))
        try:
            model, _ = fit_curve(steps[:n_pre], c["loss"].to_numpy()[:n_pre], s1, s2)
        except FitError:
            continue
        future = steps[n_pre:]
        predicted, actual = model.predict(future), c["loss"].to_numpy()[n_pre:]
        rel.extend(predicted / actual - 1)
        dist.extend(np.log(future / steps[n_pre - 1]))
        held.append(str(run))
        per_run.append(held_out_run(run, f"its first {n_pre} of {len(steps)} evals", float(np.log(future[-1] / steps[n_pre - 1])),
                                     predicted, actual))
    if not held:
        raise FitError("prefix backtest: no run had enough evals (>= 4 in its prefix)")
    return _summarise("refit", "prefix", held, rel, dist, per_run=per_run)
