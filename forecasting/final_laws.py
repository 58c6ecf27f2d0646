"""Final-loss laws as forecasting methods: one interface to fit, backtest and draw a whole curve.

Why one interface: `auto` must compare laws on the evidence of the table it is given, so every law
(Chinchilla's, the compute law, and the surfaces of `forecasting.surfaces`) is fitted, backtested and
turned into a forecast the same way; only the formula differs.

- Backtest (`backtest_law`): expanding splits by compute. The runs are sorted by planned compute; each
  split fits the smaller runs and predicts every larger one. The distance of a prediction is the
  decades of compute (or of model size, whichever is further) beyond the largest fitted run PLUS the
  decades of tokens per parameter outside the fitted runs' range, so a law that cannot extrapolate in
  D/N is charged for it. Its `rate` is the RMS error per unit of that distance (never less than
  `MIN_BACKTEST_DISTANCE` per prediction); a forecast's extrapolation term is rate x its own distance,
  widened by a t quantile for how few independent errors (held-out model sizes) the backtest measured.
  The rate is measured on the splits that fit the most runs (the last `LATE_SPLITS`, and earlier ones until they
  hold out `MIN_LATE_SIZES` model sizes; every split when there are no more), the ones most like the forecast,
  which fits every run: a law's error depends on how many runs it was fitted on, and a flexible law fitted on half
  a ladder misses by more than the same law fitted on all of it (on Porian et al.'s configurations Farseer's six
  parameters are the worst law on the first splits and the best on the held-out largest budget). Judged on the
  public suite as a whole (BENCHMARKS.md): Porian's auto 2.66% -> 2.48% MAE with the band's median half-width
  13.3% -> 6.5% at 100% coverage, Chinchilla 1.15% -> 1.13%, every other data set the same; pooled final points
  2.00% -> 1.90%. Without the size minimum, Step Law's dense over-trained split went 0.19% -> 0.80%: its last two
  splits held three points, and their rate chose the compute law. Every point is still reported in the errors.
  When the target's D/N lies outside the runs' range (an over-trained hero), the backtest also splits along D/N
  (`_dn_splits`: fit the runs up to a D/N cut, predict those beyond it), so a law is judged on the extrapolation
  the target needs, not only on one in compute at the ladder's own ratios. Scored on curves, it also holds out the
  runs not finished beyond the finished ones (a crashed rung, one still training: `unfinished_ahead`), predicted
  from every finished run along their evals so far; where that is the only split (Marin's three finished rungs and
  d2048, crashed at 80%), its error is the law's extrapolation term too.
- Uncertainty of the fit: bootstrap over runs when there are at least two runs more than parameters
  (within each model size when every size has several runs, so no redraw loses a size); otherwise a parametric bootstrap (refits on the losses perturbed by the fit's residual scatter, never
  less than `NOISE_FLOOR`, the seed-to-seed spread of a final eval), because resampling three runs
  only redraws the same three runs. With a backtest, the band takes the larger of this spread and the
  backtest's term, not both (`band_total`: the backtest's refits on fewer runs already hold it).
- Repetition: on a ladder that repeats its data, the backtest's error is read from the held-out runs at about the
  target's epochs (`at_repetition`): a law's error there is a matter of how often the data repeats, not of distance.
- Nothing backtestable (too few runs): the extrapolation term is `PRIOR_RATE` per unit distance, the
  error per decade measured for final laws on the public backtest suite (BENCHMARKS.md), and the
  forecast says so.
- Curves: a final law predicts fully trained runs; the shape of the curve before the end comes from the rungs'
  own curves, as a scaling collapse (Qiu et al. 2025): the reducible loss L(g) - E at progress g, divided by
  the run's own final reducible loss, is one curve for runs of one recipe, so the target's loss at g is
  E + (law's final - E) times the rungs' ratio at g (`ScheduleOffsets`). E is the law's own irreducible term, or the
  floor at which the rungs' curves collapse best (`collapse_floor`) where the curve backtest drew the held-out rungs'
  curves better with it (by more than `PREFER_LAW_FLOOR`): a law's E is a final-point fit, and where the final
  points do not pin it (the data-constrained ladder's two sizes: A on its bound 0, E = 2.77 against losses of 2.9-3.1)
  the ratios above it are far from one shape. So
  the final loss stays the law's and the curve inherits the recipe's schedule, and the law is never asked
  about the tokens seen early in a run, far below the ladder's tokens per parameter (evaluating a surface
  there, as an earlier version did, drew Chinchilla's Multi-Power cross-size curves 61% off on average and
  the data-constrained law's curves 11%; BENCHMARKS.md). Its band adds the ratios' spread across rungs, and its
  extrapolation term at progress g is never less than the law's backtest error on the held-out rungs' own
  curves at g (`curve_rate_by_fraction`): how well it drew their early curves, not only their final points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from forecasting.backtest import FINISHED, held_out_run, last_points, rate_by_fraction
from forecasting.bootstrap import percentile_interval, robust_sigma, run_weights, stratified_run_weights
from forecasting.checkpoints import annealed_checkpoints
from forecasting.fitting import FitError, fit_chinchilla, fit_compute_law
from forecasting.forecast import Z95, BacktestResult, HeldOutRun, TargetSpec
from forecasting.surfaces import MIN_RATIO_SPREAD, SURFACES, fit_surface

FINAL_LAWS = ("compute", "overtrain", "chinchilla", "farseer", "moe", "data_constrained")  # simplest first
N_PARAMS = {"compute": 3, "overtrain": 4, "chinchilla": 5, "farseer": 6, "moe": 6, "data_constrained": 6}
# A final eval's seed-to-seed spread, the least a run's residual is taken to be: OLMo's ladder 0.09-1.8% (seed CV of
# task loss); the local ladder's r64 and hero 1.1% and 1.2% (experiments/local_ladder_seeds.py), a quarter of which
# shows as jitter of a run's own evals, so no run measures it alone.
NOISE_FLOOR = 0.004
WARN_ERROR = 0.03  # a backtest that missed by more than this (RMS) is named in a warning: the band is wide for it
PRIOR_RATE = 0.04
MIN_DISTANCE = 0.05
# A backtest prediction is never credited with less than a quarter decade of distance when its error is turned
# into a rate: an expanding split's next run is at least a size step away (2-4x in compute on real ladders), and
# a run predicted at "no distance" that the law still misses (the 44-epoch runs of the data-constrained ladder)
# measured a misspecification, not an error that grows 13-fold by the target's 0.65 decades.
MIN_BACKTEST_DISTANCE = 0.25
LATE_SPLITS = 2  # the rate is measured on the compute splits that fit the most runs (module docstring) ...
MIN_LATE_SIZES = 4  # ... as many as hold out this many model sizes between them (an RMS of fewer is noise)
DN_SPLIT = -1  # the split index of a point scored by a D/N split
DN_SLACK = 1.25  # a target within x/÷ 1.25 of the runs' D/N range does not extrapolate in D/N
ISOFLOP_TOLERANCE = 0.02  # runs whose planned compute is within 2% share a budget ...
ISOFLOP_SIZE_RATIO = 1.1  # ... and are of distinct sizes when 10% apart ...
ISOFLOP_LOSS_SPREAD = 0.01  # ... with losses told apart when 1% apart (2.5x the seed-to-seed NOISE_FLOOR)
DN_BIN = 0.1  # decades of D/N that count as one level when the backtest splits along D/N
# held-out runs within x/÷ 2 of the target's epochs share its repetition regime (in ln, with 1% of slack: a run's
# tokens are whole steps, and 7 epochs of a ladder logs as 6.99994)
REPETITION_WINDOW = math.log(2.0) + 0.01
GIVE_UNIQUE_TOKENS = "TargetSpec.unique_tokens; `ladder forecast TABLE --unique-tokens U`"  # how a user says them
# Laws in (N, D) that may be fitted on the runs' converted checkpoints too (`with_checkpoints`); the compute law may
# not: a checkpoint is a run at fewer tokens per parameter than the ladder's, which a law of compute alone cannot tell.
CHECKPOINT_LAWS = ("overtrain", "chinchilla", "farseer", "moe", "data_constrained")
CHECKPOINT_MIN_RUNS = 3  # a checkpoint fit still needs runs (sizes) for the size terms; points it has plenty of


@dataclass
class FinalModel:
    """A fitted final-loss law with one `predict(points)` over dicts of arrays."""

    law: str
    obj: object
    params: dict[str, float]
    formula: str

    def predict(self, pts: dict[str, np.ndarray]) -> np.ndarray:
        if self.law == "compute":
            return np.asarray(self.obj.predict(pts["flops"]), dtype=float)
        if self.law == "chinchilla":
            return np.asarray(self.obj.predict(pts["params_active"], pts["tokens"]), dtype=float)
        return self.obj.predict(pts)


# ---------------------------------------------------------------- points


def final_points(table: pd.DataFrame, warn: list[str] | None = None) -> pd.DataFrame:
    """`last_points` of the finished runs (fraction >= FINISHED when known); the runs left out are named in `warn`."""
    last = last_points(table)
    if "fraction" in last.columns:
        last = last[last["fraction"] >= FINISHED].reset_index(drop=True)
    if warn is not None:
        note_unfinished(table, last, warn)
    return last


def note_unfinished(table: pd.DataFrame, final: pd.DataFrame, warn: list[str]) -> None:
    dropped = sorted(set(table["run"]) - set(final["run"]))
    if dropped:
        warn.append(f"runs not finished (fraction < {FINISHED}) left out of the final-loss fit: {dropped}")


def points_of(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    out = {"flops": frame["run_flops"].to_numpy(float) if "run_flops" in frame.columns else frame["flops"].to_numpy(float)}
    for c in ("params_active", "tokens", "params_total", "unique_tokens"):
        if c in frame.columns:
            out[c] = frame[c].to_numpy(float)
    if "params_total" not in out and "params_active" in out:
        out["params_total"] = out["params_active"]
    return out


def target_point(target: TargetSpec) -> dict[str, np.ndarray]:
    pt = {"params_active": target.params_active, "tokens": target.tokens,
          "params_total": target.params_total or target.params_active, "flops": target.planned_flops()}
    if target.unique_tokens is not None:
        pt["unique_tokens"] = target.unique_tokens
    return {k: np.atleast_1d(np.asarray(v, dtype=float)) for k, v in pt.items()}


def _log_m(pts: dict) -> np.ndarray | None:
    if "params_active" in pts and "tokens" in pts:
        return np.log10(pts["tokens"] / pts["params_active"])
    return None


def _log_sparsity(pts: dict) -> np.ndarray | None:
    if "params_active" in pts and "params_total" in pts:
        return np.log10(pts["params_total"] / pts["params_active"])
    return None


def distance(pts: dict, fit_pts: dict) -> np.ndarray:
    """Extrapolation distance of `pts` from the fitted runs: decades beyond the fitted runs in compute or in model
    size, whichever is further (a larger model on fewer tokens is a size extrapolation at no extra compute),
    plus the decades of D/N outside the fitted range, plus the decades of sparsity (total / active parameters)
    outside it: an MoE target sparser or denser than every fitted run is an extrapolation of its own, which a law
    that does not read total parameters makes silently and a backtest within the ladder's sparsities does not
    measure. (A dense table is at sparsity 1 throughout, and adds nothing.)"""
    d = np.maximum(np.log10(pts["flops"] / float(np.max(fit_pts["flops"]))), 0.0)
    if "params_active" in pts and "params_active" in fit_pts:
        d = np.maximum(d, np.log10(pts["params_active"] / float(np.max(fit_pts["params_active"]))))
    for x, fitted in ((_log_m(pts), _log_m(fit_pts)), (_log_sparsity(pts), _log_sparsity(fit_pts))):
        if x is not None and fitted is not None:
            d = d + _outside(x, fitted)
    return np.maximum(d, MIN_DISTANCE)


def _outside(x: np.ndarray, fitted: np.ndarray) -> np.ndarray:
    return np.maximum(x - fitted.max(), 0.0) + np.maximum(fitted.min() - x, 0.0)


def sparsity_distance(pts: dict, fit_pts: dict) -> np.ndarray:
    """The part of `distance` in sparsity: decades of total / active parameters outside the fitted runs' range (0 on
    a dense table, or where the table does not give total parameters)."""
    x, fitted = _log_sparsity(pts), _log_sparsity(fit_pts)
    if x is None or fitted is None:
        return np.zeros(len(pts["flops"]))
    return _outside(x, fitted)


def at_distance(rate: np.ndarray | float, d_target: float, d_sparsity: float, d_rate: float, factor: float) -> np.ndarray | float:
    """A backtest's rate per unit distance carried to the target: over the distance it measured (never below its own
    points' `d_rate`) at that rate, widened by `factor` (`small_sample_factor`); over the decades of sparsity outside
    the runs (`sparsity_distance`) at no less than PRIOR_RATE.

    Why the prior for sparsity: no backtest split extrapolates along it (the ladder's own sparsities bound every
    split), so the rate measured in compute says nothing about it, and a ladder whose compute splits backtest well
    would count a denser or sparser target as nearly free. PRIOR_RATE is the public suite's error per unit distance
    for final laws, the rate a forecast uses for what its ladder cannot test. On the suite's Step Law MoE splits
    (rungs at 3.6-11.4 total / active, targets at 1.7: 0.32 and 0.73 decades denser) auto missed by 0.7-1.5% and
    7.8-8.4%, against bands of +-1.5% and +-4.7% that counted those decades at the compute rate.
    """
    return rate * factor * max(d_target - d_sparsity, d_rate) + np.maximum(rate * factor, PRIOR_RATE) * d_sparsity


def tokens_per_param_spread(final: pd.DataFrame) -> float:
    """Decades spanned by D/N over the finished runs (0 when the ladder keeps one ratio)."""
    if not {"params_active", "tokens"} <= set(final.columns) or len(final) < 2:
        return 0.0
    return float(np.ptp(np.log10(final["tokens"].to_numpy(float) / final["params_active"].to_numpy(float))))


def _widest_unread_spread(final: pd.DataFrame, reads: tuple[str, ...], unread: str) -> tuple[float, int, int] | None:
    """(loss spread, runs, first run's row) of the group of runs that agree on every column of `reads` (each within
    ISOFLOP_TOLERANCE above the group's first run) but whose `unread` column differs by ISOFLOP_SIZE_RATIO, with the
    widest loss spread above ISOFLOP_LOSS_SPREAD; None when there is none. Runs missing a value are left out."""
    if len(final) < 2 or not {*reads, unread, "loss"} <= set(final.columns):
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.log(final[list(reads)].to_numpy(float))
    h, y = final[unread].to_numpy(float), final["loss"].to_numpy(float)
    known = np.flatnonzero(np.all(np.isfinite(x), axis=1) & np.isfinite(h) & (h > 0) & np.isfinite(y))
    x, h, y = x[known], h[known], y[known]
    tol = math.log1p(ISOFLOP_TOLERANCE)
    worst = None
    for i in range(len(x)):
        same = np.all((x >= x[i]) & (x <= x[i] + tol), axis=1)
        if h[same].max() > h[same].min() * ISOFLOP_SIZE_RATIO and y[same].max() > y[same].min() * (1 + ISOFLOP_LOSS_SPREAD):
            spread = float(y[same].max() / y[same].min() - 1)
            if worst is None or spread > worst[0]:
                worst = (spread, int(same.sum()), int(known[i]))
    return worst


def compute_law_blind_spot(final: pd.DataFrame) -> str | None:
    """Why a law of compute alone cannot describe this ladder, or None.

    The compute law gives every run of one budget one loss. An IsoFLOP ladder (several model sizes per budget)
    shows directly that they differ: fitted through such a grid, the law predicts the grid's average at each
    budget, and it answers the same loss for every size a user might choose at the target's compute. `auto`
    does not offer it as a candidate then; asked for by name it still runs, with this as a warning.
    """
    worst = _widest_unread_spread(final, ("run_flops",), "params_active")
    if worst is None:
        return None
    budget = float(final["run_flops"].iloc[worst[2]])
    return (f"the ladder holds several model sizes at one compute budget ({worst[1]} runs at {budget:.3g} FLOPs, "
            f"their losses {worst[0]:.1%} apart): a law of compute alone gives them one loss")


# What each method's formula reads of a run besides its loss (matched progress: the rung's compute, and its
# progress along the run). A ladder that varies a column a method does not read, where everything it reads agrees,
# shows the method a spread it has no term for.
READS = {
    "compute": ("run_flops",), "matched_progress": ("run_flops",),
    "chinchilla": ("params_active", "tokens"), "overtrain": ("params_active", "tokens"), "farseer": ("params_active", "tokens"),
    "moe": ("params_active", "params_total", "tokens"), "data_constrained": ("params_active", "tokens", "unique_tokens"),
}
# the columns only one law reads: what they are, and that law
HIDDEN_COLUMNS = {"unique_tokens": ("unique tokens (data repeated for several epochs)", "data_constrained"),
                  "params_total": ("total parameters (sparsity)", "moe")}


def readable_hidden_columns(reasons: dict[str, str | None]) -> set[str]:
    """The hidden columns whose reading law is applicable (`reasons`: each law's refusal, None when applicable):
    the ones a blind law may be ruled out for."""
    return {col for col, (_, reader) in HIDDEN_COLUMNS.items() if reader in reasons and reasons[reader] is None}


def hidden_column_blind_spot(method: str, final: pd.DataFrame, readers: set[str] | frozenset[str] = frozenset(HIDDEN_COLUMNS)) -> str | None:
    """Why `method` cannot describe this ladder, or None: it holds runs that differ in unique tokens or total
    parameters (by ISOFLOP_SIZE_RATIO) and agree on everything else the method and the law reading that column read
    (within ISOFLOP_TOLERANCE), their losses told apart (ISOFLOP_LOSS_SPREAD). Only the hidden columns in `readers`
    count (those an applicable law reads): a spread nothing can model is the ladder's noise, not one law's blind
    spot. Agreeing on the reading law's other inputs too keeps a column that only moves with them (total parameters
    along a dense ladder's sizes) from being blamed for what those inputs explain.

    The data-constrained ladder is the case: every 8.7B run there trains on 178B tokens, from 1 to 44 epochs of
    unique data, losses 2.83 to 3.99; a law of (N, D) fitted through it predicts one loss for all of them (the
    epochs' average), and the backtest cannot see that when its held-out runs have the same spread of epochs.
    """
    found = []
    for col, (what, reader) in HIDDEN_COLUMNS.items():
        if col not in readers or col in READS[method]:
            continue
        agree = tuple(dict.fromkeys(READS[method] + tuple(c for c in READS[reader] if c != col)))
        worst = _widest_unread_spread(final, agree, col)
        if worst is not None:
            found.append((worst, what, reader, agree))
    if not found:
        return None
    (spread, n_runs, _), what, reader, agree = max(found, key=lambda item: item[0][0])
    return (f"the ladder varies {what} among runs that agree on {', '.join(agree)} ({n_runs} runs, their losses "
            f"{spread:.1%} apart): {method} gives them one loss (the {reader} law reads that column)")


# ---------------------------------------------------------------- fit


def applicable(law: str, final: pd.DataFrame) -> str | None:
    """None when `law` can be fitted to these final points (and checkpoints, `with_checkpoints`), else why not."""
    checkpoints = "checkpoint" in final.columns
    if law == "compute":
        if checkpoints:
            return "the compute law is fitted on final points only (a checkpoint is a run at another tokens per parameter)"
        return None if final["run_flops"].nunique() >= 3 else "the compute law needs at least three distinct budgets"
    need = N_PARAMS[law] + 1
    if not {"params_active", "tokens"} <= set(final.columns):
        return "needs params_active and tokens per run"
    if checkpoints and (n_runs := len(runs_of(final))) < CHECKPOINT_MIN_RUNS:
        return f"a fit on checkpoints still needs at least {CHECKPOINT_MIN_RUNS} finished runs; got {n_runs}"
    if law == "chinchilla":
        if len(final) < max(need, 6):
            return f"needs at least {max(need, 6)} finished runs; got {len(final)}"
        if final["params_active"].nunique() < 2:
            return "needs at least two model sizes"
        if tokens_per_param_spread(final) < MIN_RATIO_SPREAD:
            return ("tokens per parameter do not vary across the runs: alpha and beta cannot be told apart "
                    "(the over-training form with one exponent is identifiable)")
        return None
    return SURFACES[law].applicable(final)


def fit_final(law: str, final: pd.DataFrame, *, weights: np.ndarray | None = None, start: dict | None = None,
              loss: np.ndarray | None = None) -> FinalModel:
    """Fit `law` to final points; `loss` replaces the observed losses (parametric bootstrap)."""
    reason = applicable(law, final)
    if reason:
        raise FitError(f"the {law} law cannot be fitted here: {reason}")
    y = final["loss"].to_numpy(float) if loss is None else np.asarray(loss, dtype=float)
    weights = _checkpoint_weights(final, weights)
    if law == "compute":
        fit = fit_compute_law(final["run_flops"].to_numpy(float), y, weights=weights)
        return FinalModel(law, fit, {"E": fit.E, "A": fit.A, "alpha": fit.alpha}, fit.formula())
    if law == "chinchilla":
        kw = {}
        if start is not None:
            kw = {"start": np.array([math.log(start["A"]), math.log(start["B"]), math.log(start["E"]), start["alpha"], start["beta"]]),
                  "n_polish": 1, "candidate_radius": 0.1}
        fit, diag = fit_chinchilla(final["params_active"], final["tokens"], y, weights=weights, **kw)
        if not diag.converged:
            raise FitError(f"the Chinchilla fit did not converge: {diag.message}")
        return FinalModel(law, fit, {k: getattr(fit, k) for k in ("E", "A", "B", "alpha", "beta")}, fit.formula())
    frame = final if loss is None else final.assign(loss=y)
    sf = fit_surface(law, frame, weights=weights, start=start)
    if not sf.converged:
        raise FitError(f"the {law} law did not converge")
    return FinalModel(law, sf, sf.params, sf.formula())


# ---------------------------------------------------------------- checkpoints

# A run's converted checkpoints together weigh as much as its final point: they add the run's loss along D, not
# more say for that run against the others (a run with 200 evals would otherwise outvote one with 20).
CHECKPOINT_WEIGHT = 1.0


def runs_of(frame: pd.DataFrame) -> pd.DataFrame:
    """The finished runs' final points of a fit frame, without the checkpoints `with_checkpoints` added."""
    if "checkpoint" not in frame.columns:
        return frame
    return frame[~frame["checkpoint"].to_numpy(bool)].reset_index(drop=True)


def with_checkpoints(final: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame | None:
    """`final` and the converted checkpoints of its runs (`forecasting.checkpoints`), told apart by a boolean
    `checkpoint` column; None when none of its runs has one."""
    ck = _cached(("checkpoints", _key(table)), lambda: annealed_checkpoints(table))
    if ck.empty:
        return None
    ck = ck[ck["run"].isin(final["run"])]
    if ck.empty:
        return None
    flops = ck["flops"] if "flops" in ck.columns else 6 * ck["params_active"] * ck["tokens"]
    ck = ck.assign(run_flops=flops.astype(float), run_tokens=ck["tokens"].astype(float), checkpoint=True)
    return pd.concat([final.assign(checkpoint=False), ck[[c for c in ck.columns if c in final.columns or c == "checkpoint"]]],
                     ignore_index=True)


def _checkpoint_weights(frame: pd.DataFrame, weights: np.ndarray | None) -> np.ndarray | None:
    """Per-row fit weights: the given (bootstrap) weights times CHECKPOINT_WEIGHT / (the run's checkpoints) on each
    checkpoint row; `weights` unchanged for a frame of final points."""
    if "checkpoint" not in frame.columns:
        return weights
    ck = frame["checkpoint"].to_numpy(bool)
    per_run = frame["run"].map(frame.loc[ck, "run"].value_counts()).fillna(1.0).to_numpy(float)
    base = np.where(ck, CHECKPOINT_WEIGHT / per_run, 1.0)
    return base if weights is None else base * np.asarray(weights, dtype=float)


def checkpoint_choice(law: str, table: pd.DataFrame, dn: str | None = None) -> dict:
    """Whether `law` is fitted on the runs' converted checkpoints as well as their final points, and the evidence.

    Decided by the law's own backtest on this ladder (the same splits of runs; a fit part keeps its runs'
    checkpoints, a held-out run is scored on its final point): with checkpoints when that backtest's error rate
    is below the final points' by more than the rate's own uncertainty (`small_sample_factor` of the independent
    errors it measured: 1.6x with one held-out model size, 1.1x with ten), or when final points alone cannot be
    backtested and the checkpoint fit's rate, so widened, is below the prior rate the band would otherwise
    assume. On the public Multi-Power cross-size split Chinchilla's rate is 4.3% with checkpoints and 5.1%
    without, from two held-out sizes (x1.42): not evidence enough, and its held-out 400M runs were indeed
    predicted worse with them (final MAE 1.33% against 0.96%). Returns {"use": bool,
    "rate": rate with checkpoints or None, "rate_final_only": ... or None, "points": checkpoints, "runs": runs
    they came from, "reason": one line}; {"use": False, ...} for a law not in CHECKPOINT_LAWS or no checkpoint.
    """
    return _cached(("checkpoint_choice", law, _key(table), dn), lambda: _checkpoint_choice(law, table, dn))


def _checkpoint_choice(law: str, table: pd.DataFrame, dn: str | None) -> dict:
    final = final_points(table)
    aug = with_checkpoints(final, table) if law in CHECKPOINT_LAWS and len(final) else None
    if aug is None:
        return {"use": False, "rate": None, "rate_final_only": None, "points": 0, "runs": 0,
                "reason": "no run has checkpoints to convert" if law in CHECKPOINT_LAWS else "final points only"}
    ck = aug[aug["checkpoint"].to_numpy(bool)]
    info = {"points": int(len(ck)), "runs": int(ck["run"].nunique())}
    results = {}
    for name, frame in (("rate", aug), ("rate_final_only", final)):
        try:
            results[name] = backtest_law(law, frame, dn=dn) if not applicable(law, frame) else None
        except FitError:
            results[name] = None
    rates = {k: None if r is None else float(r.rate) for k, r in results.items()}
    with_ck, without = rates["rate"], rates["rate_final_only"]
    if with_ck is None:
        use, why = False, "the checkpoint fit could not be backtested"
    else:
        margin = small_sample_factor(independent_errors(results["rate"]))
        if without is None:
            use = with_ck * margin < PRIOR_RATE
            why = (f"final points alone cannot be backtested; with checkpoints {with_ck:.2%} per unit distance "
                   f"(x{margin:.2f} for how few sizes measured it), {'below' if use else 'not below'} the {PRIOR_RATE:.0%} prior")
        else:
            use = with_ck * margin < without
            why = (f"backtest error per unit distance {with_ck:.2%} with checkpoints against {without:.2%} on final points "
                   f"alone, measured on {independent_errors(results['rate'])} held-out size(s): "
                   f"{'a gain beyond' if use else 'within'} the x{margin:.2f} such a rate is uncertain by")
    return {"use": bool(use), **rates, **info, "reason": why}


def fit_frame(law: str, table: pd.DataFrame, dn: str | None = None, warn: list[str] | None = None) -> pd.DataFrame:
    """What `law` is fitted on for this table: its finished runs' final points, plus their converted checkpoints
    when `checkpoint_choice` says so (named in `warn`)."""
    final = final_points(table, warn)
    choice = checkpoint_choice(law, table, dn)
    if not choice["use"]:
        return final
    if warn is not None:
        warn.append(f"the {law} law is fitted on {choice['points']} converted checkpoints of {choice['runs']} runs as well "
                    f"as the final points ({choice['reason']})")
    return with_checkpoints(final, table)


# ---------------------------------------------------------------- backtest


def _splits(n_runs: int, min_fit: int, max_splits: int = 5) -> list[int]:
    """Fit-set sizes of the expanding splits (the k smallest runs fit, every larger one is predicted)."""
    lo = max(min_fit, (n_runs + 1) // 2)
    if lo > n_runs - 1:
        return []
    ks = np.unique(np.linspace(lo, n_runs - 1, min(max_splits, n_runs - lo)).round().astype(int))
    return [int(k) for k in ks]


def tokens_per_param_direction(final: pd.DataFrame, target: TargetSpec) -> str | None:
    """"up" / "down" when the target's D/N lies above / below the finished runs' range (x/÷ 1.25), else None: the
    direction the backtest must also extrapolate in (`_dn_splits`)."""
    if not {"params_active", "tokens"} <= set(final.columns) or not target.params_active:
        return None
    m = (final["tokens"] / final["params_active"]).to_numpy(float)
    m_t = target.tokens / target.params_active
    if m_t > m.max() * DN_SLACK:
        return "up"
    if m_t < m.min() / DN_SLACK:
        return "down"
    return None


def backtest_law(law: str, final: pd.DataFrame, *, max_splits: int = 5, dn: str | None = None,
                 epochs: float | None = None) -> BacktestResult:
    """Expanding-split backtest of a final law on these finished runs (see the module docstring); with `dn`, also
    the splits along tokens per parameter in that direction (`_dn_splits`); with `epochs` (a target's), scored on
    the held-out runs at about that repetition only (`at_repetition`); cached."""
    return _cached(("backtest", law, _key(final), max_splits, dn, epochs),
                   lambda: _summarise_points(law, at_repetition(_final_backtest_points(law, final, max_splits, dn), epochs)))


def _final_backtest_points(law: str, final: pd.DataFrame, max_splits: int, dn: str | None) -> dict:
    return _cached(("backtest_points", law, _key(final), max_splits, dn), lambda: _backtest_points(law, final, max_splits, None, dn))


def _summarise_points(law: str, pts: dict) -> BacktestResult:
    res = summarise(law, pts["held"], pts["rel"], pts["dist"], pts["last"], pts["sizes"], dn_points=pts["dn_points"],
                    point_split=pts["point_split"], held_split=pts["held_split"], per_run=pts["per_run"])
    if pts.get("repetition") is not None:
        res = res.model_copy(update={"repetition_epochs": pts["repetition"]})
    return res


# ---------------------------------------------------------------- repetition (epochs of the unique data)


def run_epochs(frame: pd.DataFrame) -> np.ndarray | None:
    """How many times each run saw its unique data (tokens / unique tokens, at least 1; 1 where unique tokens are
    not given), or None when the table has no unique tokens."""
    if not {"tokens", "unique_tokens"} <= set(frame.columns):
        return None
    epochs = frame["tokens"].to_numpy(float) / frame["unique_tokens"].to_numpy(float)
    return np.where(np.isfinite(epochs), np.maximum(epochs, 1.0), 1.0)


def target_epochs(target: TargetSpec) -> float | None:
    """The target's epochs of its unique data (at least 1), or None when it does not say."""
    if target.unique_tokens is None or not target.unique_tokens > 0:
        return None
    return max(target.tokens / target.unique_tokens, 1.0)


def repetition_levels(epochs: np.ndarray, target: float) -> np.ndarray:
    """Of these held-out runs' epochs, the ones at about the target's repetition: within x/÷ 2 of its epochs
    (REPETITION_WINDOW); when none is, the nearest level below it and the nearest above (those it lies between)."""
    x, t = np.log(epochs), math.log(target)
    near = np.abs(x - t) <= REPETITION_WINDOW
    if near.any():
        return np.unique(epochs[near])
    below, above = epochs[x < t], epochs[x > t]
    return np.array(([below.max()] if below.size else []) + ([above.min()] if above.size else []), dtype=float)


def at_repetition(pts: dict, epochs: float | None) -> dict:
    """A backtest's scored points restricted to the held-out runs trained at about the target's repetition
    (`repetition_levels`); all of them when the target or the table does not say how often data repeats, or
    when every held-out run is at the target's repetition.

    Why: a law's error depends on how often the data repeats, and not by distance. On the data-constrained
    ladder (Muennighoff et al. 2023: runs of one size at 1 to 44 epochs) the data-constrained law predicts the
    held-out runs of 1 to 7 epochs within 0.3% on OSCAR and misses the 44-epoch run by 13%: one RMS over all
    of them made every target's band +-66%, the 4-epoch target's as wide as the 44-epoch one's. The band of a
    target at 4 epochs is the error measured at about 4 epochs, and at 44 epochs the error measured there.
    """
    if epochs is None or not pts["held_epochs"]:
        return pts
    held_epochs = np.asarray(pts["held_epochs"], dtype=float)
    levels = repetition_levels(held_epochs, epochs)
    held = np.isin(held_epochs, levels)
    if held.all():
        return pts
    point = np.isin(np.asarray(pts["point_epochs"], dtype=float), levels)
    out = dict(pts)
    for key, mask in (("rel", point), ("dist", point), ("point_split", point), ("point_epochs", point),
                      ("held", held), ("held_split", held), ("held_epochs", held), ("per_run", held)):
        out[key] = [v for v, keep in zip(pts[key], mask, strict=True) if keep]
    for key in ("sizes", "curves"):
        if len(pts[key]) == len(held):
            out[key] = [v for v, keep in zip(pts[key], held, strict=True) if keep]
    out["dn_points"] = int(sum(split == DN_SPLIT for split in out["point_split"]))
    out["repetition"] = [float(v) for v in levels]
    return out


def _dn_splits(final: pd.DataFrame, dn: str, min_fit: int, max_splits: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(fit mask, predict mask) pairs that extrapolate in D/N: the runs are grouped by D/N (DN_BIN decades), and
    each split fits every group up to a cut and predicts every group beyond it (in `dn`'s direction), so what is
    predicted lies outside the fitted D/N range, as the target does. Cuts whose fit part holds fewer than half the
    runs, fewer than `min_fit`, or one D/N level only (a law's D/N dependence is then not identified: the split
    would measure that, not how the law extrapolates) are skipped."""
    if not {"params_active", "tokens"} <= set(final.columns):
        return []
    group = np.round(np.log10(final["tokens"].to_numpy(float) / final["params_active"].to_numpy(float)) / DN_BIN)
    levels = np.unique(group) if dn == "up" else np.unique(group)[::-1]
    cuts = []
    for j, level in enumerate(levels[:-1]):
        fit = group <= level if dn == "up" else group >= level
        if j >= 1 and fit.sum() >= max(min_fit, (len(final) + 1) // 2):
            cuts.append((fit, ~fit))
    if not cuts:
        return []
    keep = np.unique(np.linspace(0, len(cuts) - 1, min(max_splits, len(cuts))).round().astype(int))
    return [cuts[i] for i in keep]


def _backtest_points(law: str, final: pd.DataFrame, max_splits: int, table: pd.DataFrame | None,
                     dn: str | None = None, floor_mode: str = "law") -> dict:
    """Every scored point of the expanding splits (relative error, distance) and, scoring curves, each held-out
    run's (fractions, errors, distance); `dn_points` counts those scored by the D/N splits."""
    out: dict = {"held": [], "rel": [], "dist": [], "curves": [], "sizes": [], "last": None, "dn_points": 0,
                 "point_split": [], "held_split": [], "point_epochs": [], "held_epochs": [], "per_run": []}
    runs = runs_of(final)  # splits are of runs; a fit part keeps its runs' checkpoints, a predicted run is its final
    min_fit = CHECKPOINT_MIN_RUNS if "checkpoint" in final.columns else N_PARAMS[law]

    def rows_of(part: pd.DataFrame) -> pd.DataFrame:
        return final[final["run"].isin(part["run"])]

    splits = [(rows_of(runs.iloc[:k]), runs.iloc[k:]) for k in _splits(len(runs), min_fit, max_splits)]
    kinds = ["compute"] * len(splits)
    ahead = unfinished_ahead(table, runs) if table is not None and len(runs) >= min_fit else None
    if ahead is not None:  # scored on their curves so far: the split that fits every finished run
        splits.append((final, ahead))
        kinds.append("unfinished")
    n_compute = len(splits)
    if dn is not None:
        dn_splits = _dn_splits(runs, dn, min_fit + 1, max_splits)
        splits += [(rows_of(runs[f]), runs[p]) for f, p in dn_splits]
        kinds += ["dn"] * len(dn_splits)
    for i, ((fit_part, pred_part), kind) in enumerate(zip(splits, kinds, strict=True)):
        try:
            model = _split_fit(law, fit_part)
        except FitError:
            continue
        before, held_before = len(out["rel"]), len(out["held"])
        _score_split(model, fit_part, pred_part, table, out, along_compute=kind == "compute", floor_mode=floor_mode)
        split = i if i < n_compute else DN_SPLIT  # compute splits by how many runs they fit; D/N splits apart
        out["point_split"].extend([split] * (len(out["rel"]) - before))
        out["held_split"].extend([split] * (len(out["held"]) - held_before))
        if kind == "dn":
            out["dn_points"] += len(out["rel"]) - before
    return out


MIN_UNFINISHED_EVALS = 3


def unfinished_ahead(table: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame | None:
    """The runs not finished (a crashed rung, one still training) whose planned compute lies beyond every finished
    run's, with at least MIN_UNFINISHED_EVALS evals after the start, as held-out rows for the curve backtest: planned
    compute and tokens, fraction 1 (`run_target` reads the planned run from them); None when there are none.

    Why: a final law's splits are of finished runs, but a rung that crashed (Marin's d2048, at 80%) or is still
    training is evidence too. The law fitted on every finished run draws its curve, and its evals so far score it,
    as they already score matched progress. Without it a ladder of three finished rungs and a crashed fourth left
    every final law untested, and auto took matched progress alone for being the only law it could test. Only runs
    beyond the finished ones: the split is an extrapolation, as the others are.
    """
    if "fraction" not in table.columns or runs.empty:
        return None
    last = last_points(table)
    evals = last["run"].map(table[table["fraction"] > 0].groupby("run").size()).fillna(0)
    ahead = last[(last["fraction"] < FINISHED) & (last["run_flops"] > float(runs["run_flops"].max()))
                 & (evals >= MIN_UNFINISHED_EVALS)]
    if ahead.empty:
        return None
    planned = ahead.assign(fraction=1.0)
    if "run_tokens" in planned.columns:
        planned = planned.assign(tokens=planned["run_tokens"])
    return planned.reset_index(drop=True)


def _split_fit(law: str, part: pd.DataFrame) -> FinalModel:
    """`fit_final` on a backtest split's fit part, cached with its failure: the final-point and curve backtests of
    one law refit the same parts (Chinchilla's forecast on the Multi-Power cross-size split fitted each part twice,
    each failing fit running BFGS to its 5,000-iteration limit: 36.4 s, 19.7 s with this cache;
    bench/bench_forecast_time.py)."""
    def fit() -> FinalModel | FitError:
        try:
            return fit_final(law, part)
        except FitError as error:
            return error

    model = _cached(("split_fit", law, _key(part)), fit)
    if isinstance(model, FitError):
        raise FitError(str(model))  # a fresh one: re-raising the cached one would grow its traceback each time
    return model


def _score_split(model: FinalModel, fit_part: pd.DataFrame, pred_part: pd.DataFrame, table: pd.DataFrame | None,
                 out: dict, *, along_compute: bool, floor_mode: str = "law") -> None:
    pts = points_of(pred_part)
    fit_pts = points_of(runs_of(fit_part))
    points_per_run = np.ones(len(pred_part), dtype=int)
    fitted_on = f"{fit_part['run'].nunique()} runs"
    if table is None:
        pred = model.predict(pts)
        out["rel"].extend(pred / pred_part["loss"].to_numpy(float) - 1)
        out["dist"].extend(distance(pts, fit_pts))
        out["per_run"].extend(held_out_run(run, fitted_on, d, [p], [y]) for run, d, p, y in zip(
            pred_part["run"], distance(pts, fit_pts), pred, pred_part["loss"].to_numpy(float), strict=True))
    else:  # every eval of each held-out run, its curve drawn from the fitted runs' schedule offsets
        fit_rows = table[table["run"].isin(fit_part["run"])]
        floor = collapse_floor(fit_rows, float(model.params.get("E", 0.0))) if floor_mode == "collapse" else None
        for i, ((_, row), d) in enumerate(zip(pred_part.iterrows(), distance(pts, fit_pts), strict=True)):
            curve = table[table["run"] == row["run"]].sort_values("step")
            points_per_run[i] = len(curve)
            target = run_target(curve, row)
            offsets = schedule_offsets(fit_rows, model, target_flops=float(row["run_flops"]), floor=floor)
            p, _ = curve_prediction(model, target, curve["step"].to_numpy(), offsets)
            errors = p / curve["loss"].to_numpy(float) - 1
            out["rel"].extend(errors)
            out["dist"].extend([d] * len(curve))
            out["curves"].append((curve["step"].to_numpy(float) / target.steps(), errors, float(d)))
            out["per_run"].append(held_out_run(row["run"], fitted_on, d, p, curve["loss"].to_numpy(float)))
        pred = model.predict(pts)
    out["held"].extend(str(r) for r in pred_part["run"])
    epochs = run_epochs(pred_part)
    if epochs is not None:
        out["held_epochs"].extend(epochs)
        out["point_epochs"].extend(np.repeat(epochs, points_per_run))
    if "params_active" in pred_part.columns:
        out["sizes"].extend(pred_part["params_active"].astype(float))
    if along_compute:  # the largest held-out run is reported from the compute splits
        out["last"] = (str(pred_part["run"].iloc[-1]), float(pred[-1]), float(pred_part["loss"].iloc[-1]))


def _curve_backtest_points(law: str, table: pd.DataFrame, max_splits: int, dn: str | None = None) -> dict:
    """The curve backtest's points, with the collapse's floor (`floor_mode`) that drew the held-out rungs' curves
    better: the law's own E, or the E at which the fitted rungs' curves collapse best (`collapse_floor`) where that
    missed them by less than 1 / PREFER_LAW_FLOOR of the law's E's RMS error."""
    final = fit_frame(law, table, dn)

    def points(mode: str) -> dict:
        return _cached(("backtest_curve_points", law, _key(table), max_splits, dn, mode),
                       lambda: _backtest_points(law, final, max_splits, table, dn, floor_mode=mode) | {"floor_mode": mode})

    own = points("law")
    if not own["curves"]:
        return own
    collapsed = points("collapse")
    return collapsed if _rms(collapsed["rel"]) * PREFER_LAW_FLOOR < _rms(own["rel"]) else own


PREFER_LAW_FLOOR = 1.10


def _rms(rel: list[float]) -> float:
    r = np.asarray(rel, dtype=float)
    r = r[np.isfinite(r)]
    return float(np.sqrt(np.mean(r**2))) if len(r) else np.inf


def curve_floor(law: str, table: pd.DataFrame, model: FinalModel, dn: str | None = None) -> float | None:
    """The floor the forecast's curve collapses above: None (the law's E) unless the curve backtest chose the rungs'
    collapse floor (`_curve_backtest_points`), or when nothing could be backtested."""
    try:
        mode = _curve_backtest_points(law, table, 5, dn).get("floor_mode", "law")
    except FitError:
        return None
    return collapse_floor(table, float(model.params.get("E", 0.0))) if mode == "collapse" else None


def _unfinished_curve_backtest(law: str, table: pd.DataFrame, final: pd.DataFrame, dn: str | None,
                               epochs: float | None) -> BacktestResult | None:
    """The curve backtest where a run not finished (`unfinished_ahead`) gives it a split; None where none does."""
    if unfinished_ahead(table, runs_of(final)) is None:
        return None
    try:
        return backtest_law_curves(law, table, dn=dn, epochs=epochs)
    except FitError:
        return None


def backtest_law_curves(law: str, table: pd.DataFrame, *, max_splits: int = 5, dn: str | None = None,
                        epochs: float | None = None) -> BacktestResult:
    """The same splits, scored on every eval of each held-out run's curve (final laws draw curves from the rungs'
    schedule offsets); with `epochs`, on the held-out runs at about that repetition (`at_repetition`); cached."""
    pts = at_repetition(_curve_backtest_points(law, table, max_splits, dn), epochs)
    return _summarise_points(law, pts)


def curve_rate_by_fraction(law: str, table: pd.DataFrame, grid: np.ndarray, *, max_splits: int = 5, dn: str | None = None,
                           epochs: float | None = None) -> np.ndarray:
    """Error per unit distance of the law's curves at each fraction in `grid`, from the curve backtest.

    Why per fraction: a law can predict the held-out rungs' final losses well and their early curves badly (the
    schedule offsets change along the ladder); one rate for the whole curve would make the early band too narrow.
    How: `forecasting.backtest.rate_by_fraction`, as for matched progress.
    """
    pts = at_repetition(_curve_backtest_points(law, table, max_splits, dn), epochs)
    if not pts["curves"]:
        raise FitError(f"curve backtest of {law}: no held-out run with a curve")
    return rate_by_fraction([(g, rel, max(d, MIN_BACKTEST_DISTANCE)) for g, rel, d in pts["curves"]], grid)


def run_target(curve: pd.DataFrame, last: pd.Series) -> TargetSpec:
    """A finished run of the table as a TargetSpec (for backtests that redraw its curve)."""
    num_steps = int(curve["num_steps"].iloc[0]) if "num_steps" in curve.columns else int(round(curve["step"].iloc[-1] / curve["fraction"].iloc[-1]))
    frac = float(last["fraction"]) if "fraction" in last.index else 1.0
    return TargetSpec(name=str(last["run"]), params_active=float(last["params_active"]), tokens=float(last["tokens"]) / frac,
                      params_total=float(last["params_total"]) if "params_total" in last.index else None,
                      num_steps=max(num_steps, 1), total_flops=float(last["run_flops"]),
                      unique_tokens=float(last["unique_tokens"]) if "unique_tokens" in last.index else None)


def band_total(rel: dict[str, np.ndarray], *, fit: str | None, backtest: str | None) -> np.ndarray:
    """The band's total relative sigma: its terms in quadrature, except the fit's own spread and the backtest's
    measured error, of which only the larger counts.

    Why not both: the backtest refits the law on fewer runs and measures how far off it was, so its error already
    holds the fit's sampling spread (at a smaller ladder than the forecast's); adding the bootstrap on top counts
    that spread twice. With no backtest (a prior rate in its place) the two are independent and both count.
    """
    terms = dict(rel)
    if fit in terms and backtest in terms:
        terms[backtest] = np.maximum(terms.pop(fit), terms[backtest])
    return np.sqrt(sum(np.square(v) for v in terms.values()))


def small_sample_factor(n_held_out: int) -> float:
    """t_{0.975}(n + 2) / 1.96: an error scale measured on n held-out runs (plus two pseudo-runs of prior) is itself
    uncertain; with 1 run this widens the extrapolation term 1.6x, with 10 runs 1.1x, with 100 not at all."""
    from scipy.stats import t

    return float(t.ppf(0.975, max(n_held_out, 0) + 2) / Z95)


def independent_errors(res: BacktestResult) -> int:
    """How many independent errors a backtest measured: its held-out model sizes when known, else its runs."""
    return res.held_out_sizes if res.held_out_sizes is not None else len(res.held_out)


def late_splits(splits: list[int], held_split: list[int], held_keys: list) -> set[int]:
    """Of the compute splits that scored a point (their indices, in order of how many runs they fit), the ones that fit
    the most runs: the last LATE_SPLITS, and earlier ones too until they hold out MIN_LATE_SIZES distinct model sizes
    (`held_keys`: each held-out run's size, or its name) between them; every split when there are no more. D/N
    splits are apart."""
    compute = sorted({k for k in splits if k != DN_SPLIT}, reverse=True)
    chosen: set[int] = set()
    held: set = set()
    for k in compute:
        chosen.add(k)
        held |= {key for key, split in zip(held_keys, held_split, strict=True) if split == k}
        if len(chosen) >= LATE_SPLITS and len(held) >= MIN_LATE_SIZES:
            break
    return chosen


def summarise(method: str, held: list[str], rel: list[float], dist: list[float], last: tuple | None,
              held_sizes: list[float] | None = None, *, dn_points: int = 0, point_split: list[int] | None = None,
              held_split: list[int] | None = None, per_run: list[HeldOutRun | None] | None = None) -> BacktestResult:
    """A BacktestResult of these scored points. The errors and distance are reported over every point; the rate (and
    its distance and the independent held-out sizes it is read with) comes from the late compute splits and every
    D/N split (`late_splits`: see the module docstring) when the points' splits are given. `per_run`: each held-out
    run of each split (`forecasting.backtest.held_out_run`; None where none of its points had a finite error)."""
    r, d = np.asarray(rel, dtype=float), np.asarray(dist, dtype=float)
    ok = np.isfinite(r) & np.isfinite(d)
    if not ok.any():
        raise FitError(f"backtest of {method}: no split could be fitted and scored")
    sizes = np.asarray(held_sizes if held_sizes else [], dtype=float)
    in_rate = ok.copy()
    if point_split is not None and held_split is not None:
        keys = [round(math.log(x), 6) for x in sizes] if len(sizes) == len(held_split) else list(held)
        late = late_splits(np.asarray(point_split)[ok].tolist(), held_split, keys) | {DN_SPLIT}
        in_rate &= np.isin(point_split, list(late))
        if len(sizes) == len(held_split):
            sizes = sizes[np.isin(held_split, list(late))]
    rr, dr = r[in_rate], np.maximum(d[in_rate], MIN_BACKTEST_DISTANCE)
    r, d = r[ok], np.maximum(d[ok], MIN_BACKTEST_DISTANCE)
    rms = float(np.sqrt(np.mean(r**2)))
    return BacktestResult(
        method=method, kind="compute", held_out=sorted(set(held)), mean_rel_error=float(r.mean()), rms_rel_error=rms,
        max_abs_rel_error=float(np.abs(r).max()), distance=float(d.mean()),
        rate=float(np.sqrt(np.sum(rr**2) / np.sum(dr**2))), n_points=int(len(r)),
        rate_points=None if len(rr) == len(r) else int(len(rr)), rate_distance=None if len(rr) == len(r) else float(dr.mean()),
        final_run=None if last is None else last[0], final_predicted=None if last is None else last[1],
        final_actual=None if last is None else last[2],
        held_out_sizes=None if not len(sizes) else len({round(math.log(x), 6) for x in sizes}),
        tokens_per_param_points=dn_points,
        runs=[r for r in per_run or [] if r is not None],
    )


# ---------------------------------------------------------------- uncertainty of the fit


_CACHE: dict[tuple, object] = {}
_CACHE_MAX = 1024


def _cached(key: tuple, make):
    """Backtests and bootstrap replicates depend on the table alone, not on the target: compute them once."""
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = make()
    return _CACHE[key]


def _key(final: pd.DataFrame) -> str:
    from forecasting.forecast import fingerprint_table

    return fingerprint_table(final)


def replicates(law: str, final: pd.DataFrame, model: FinalModel, n_boot: int, seed: int) -> tuple[list[FinalModel], str]:
    """Refits that measure the fit's spread: bootstrap over runs when there are at least two runs more than
    parameters, else a parametric bootstrap (losses perturbed by the residual scatter, >= NOISE_FLOOR)."""
    n_runs = final["run"].nunique()
    sizes = runs_of(final).groupby("params_active")["run"].nunique() if "params_active" in final.columns else None
    if n_runs >= N_PARAMS[law] + 2 and sizes is not None and len(sizes) >= 2 and sizes.min() >= 2:
        kind = "bootstrap over runs within each model size"
        weights = stratified_run_weights(final["run"], final["params_active"], n_boot, seed)
        draws = [dict(weights=w) for w in weights]
    elif n_runs >= N_PARAMS[law] + 2:
        kind = "bootstrap over runs"
        weights = run_weights(final["run"], n_boot, seed, min_distinct=min(n_runs, N_PARAMS[law] + 1))
        draws = [dict(weights=w) for w in weights]
    else:
        kind = "parametric bootstrap (too few runs to resample them)"
        y = final["loss"].to_numpy(float)
        resid = np.log(model.predict(points_of(final))) - np.log(y)
        dof = max(len(y) - N_PARAMS[law], 1)
        sigma = max(float(np.sqrt(np.sum(resid**2) / dof)), NOISE_FLOOR)
        rng = np.random.default_rng(seed)
        run_code = pd.factorize(final["run"])[0]  # one draw per run, shared by its checkpoints: a seed moves the whole run
        draws = [dict(loss=y * np.exp(rng.normal(0.0, sigma, n_runs)[run_code])) for _ in range(n_boot)]
    out = []
    for kw in draws:
        try:
            out.append(fit_final(law, final, start=model.params if law != "compute" else None, **kw))
        except (FitError, ValueError, FloatingPointError, np.linalg.LinAlgError):
            continue
    return out, kind


def fit_spread(law: str, final: pd.DataFrame, model: FinalModel, pts: dict, n_boot: int, seed: int) -> tuple[np.ndarray, dict, str]:
    """(predictions at `pts` per replicate, parameter samples, kind of bootstrap)."""
    reps, kind = _cached(("replicates", law, _key(final), n_boot, seed), lambda: replicates(law, final, model, n_boot, seed))
    preds, samples = [], {k: [] for k in model.params}
    for b in reps:
        p = b.predict(pts)
        if not np.all(np.isfinite(p)):
            continue
        preds.append(p)
        for k in samples:
            samples[k].append(b.params[k])
    return np.array(preds), samples, kind


# ---------------------------------------------------------------- curves


@dataclass
class ScheduleOffsets:
    """log(L(g) - E) - log(L(1) - E) per rung (the collapsed reducible loss), on a grid of fractions g."""

    grid: np.ndarray
    mean: np.ndarray
    spread: np.ndarray
    n_runs: np.ndarray
    floor: float = 0.0  # E: the irreducible loss the ratios are taken above

    def at(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lg = np.log(np.clip(g, 1e-6, 1.0))
        lgrid = np.log(self.grid)
        mean = np.interp(lg, lgrid, self.mean)
        spread = np.interp(lg, lgrid, self.spread)
        below = lg < lgrid[0]
        if np.any(below):
            # before the rungs' first eval nothing was measured: hold the first offset (a slope extrapolated
            # from the first cells blew up to 5x the loss on Marin's hero) and widen by that offset per unit ln g
            dist = lgrid[0] - lg[below]
            mean[below] = self.mean[0]
            spread[below] = self.spread[0] + np.abs(self.mean[0]) * dist
        return mean, spread


OFFSET_SCALE_DECADES = 0.25
MIN_REDUCIBLE = 0.01  # a point at or below the law's E counts as 1% of its loss above it (E is a fit, not a bound)


def _reducible(loss: np.ndarray, floor: float) -> np.ndarray:
    return np.maximum(loss - floor, MIN_REDUCIBLE * loss)


COLLAPSE_GRID = 60


def _collapse_curves(table: pd.DataFrame, min_points: int = 3) -> list[pd.DataFrame]:
    """The finished rungs' curves (evals after the start), sorted by step, with at least `min_points` evals."""
    curves = [c[c["fraction"] > 0] for _, c in table.sort_values("step").groupby("run")]
    return [c for c in curves if len(c) >= min_points and c["fraction"].iloc[-1] >= FINISHED]


def collapse_floor(table: pd.DataFrame, law_floor: float) -> float:
    """The floor E at which the rungs' curves collapse best: of the law's own E and a grid from 0 to just below the
    lowest loss any rung reached, the one that leaves the least variance across rungs of log(L(g) - E) -
    log(L(1) - E), averaged over the fractions every rung covers; the law's E with fewer than two rungs."""
    curves = _collapse_curves(table) if {"fraction", "tokens"} <= set(table.columns) else []
    if len(curves) < 2:
        return law_floor
    logs = [np.log(c["fraction"].to_numpy(float)) for c in curves]
    losses = [c["loss"].to_numpy(float) for c in curves]
    grid = np.linspace(max(lg[0] for lg in logs), 0.0, 30)
    lowest = min(float(v.min()) for v in losses)
    best, best_floor = np.inf, law_floor
    for floor in np.r_[law_floor, np.linspace(0.0, 0.98 * lowest, COLLAPSE_GRID)]:
        if floor >= lowest:
            continue
        ratios = [np.interp(grid, lg, np.log(_reducible(v, floor))) - np.log(_reducible(v[-1:], floor))[0]
                  for lg, v in zip(logs, losses, strict=True)]
        dispersion = float(np.mean(np.var(np.array(ratios), axis=0, ddof=1)))
        if dispersion < best - 1e-12:
            best, best_floor = dispersion, float(floor)
    return best_floor


def schedule_offsets(table: pd.DataFrame, model: FinalModel, *, target_flops: float | None = None,
                     min_points: int = 3, floor: float | None = None) -> ScheduleOffsets | None:
    """Collapsed curves of the rungs (runs with >= min_points evals and a fraction column), or None.

    The target's ratio is the rungs' mean weighted by nearness in compute (exp(-decades / OFFSET_SCALE_DECADES)):
    where the collapse is imperfect the shape drifts along a ladder, and the nearest rungs carry the target's best;
    the spread is the plain spread across all rungs (how much the shape moves along the ladder), so the band says
    how much that choice could be off. Why a quarter of a decade: on every public curve set with several sizes and
    on the local ladder, a nearer weighting drew the target's curve closer (scales 1.0 / 0.5 / 0.25 / 0.1, auto's
    curve MAE: Multi-Power cross-size 0.76 / 0.75 / 0.75 / 0.76%, Marin 1.00 / 0.94 / 0.91 / 0.91%, OPT 1.63 / 1.37 /
    1.17 / 1.01%, Marin two steps out 3.37 / 3.31 / 3.26 / 3.26%; the data-constrained curves 5.87% at 0.5, 5.90% at
    0.25); 0.25 beat 0.5 on all but that one and the compute law alone two steps out on Marin (2.04 -> 2.08%), while
    0.1 against 0.25 was better on some and worse on others (BENCHMARKS.md, the local-ladder section).
    """
    if not {"fraction", "tokens"} <= set(table.columns):
        return None
    floor = float(model.params.get("E", 0.0)) if floor is None else floor
    per_run, run_flops = [], []
    for c in _collapse_curves(table, min_points):
        reducible = np.log(_reducible(c["loss"].to_numpy(float), floor))
        per_run.append((np.log(c["fraction"].to_numpy(float)), reducible - reducible[-1]))
        last = c.iloc[-1]
        flops = last["flops"] if "flops" in c.columns else 6 * last["params_active"] * last["tokens"]
        run_flops.append(float(flops / last["fraction"]))
    if not per_run:
        return None
    if target_flops is None:
        w = np.ones(len(per_run))
    else:
        w = np.exp(-np.abs(np.log10(target_flops / np.array(run_flops))) / OFFSET_SCALE_DECADES)
    lo = min(lg[0] for lg, _ in per_run)
    grid = np.unique(np.r_[np.linspace(lo, 0.0, 40), [lg[0] for lg, _ in per_run]])
    vals = np.full((len(per_run), len(grid)), np.nan)
    for i, (lg, off) in enumerate(per_run):
        inside = (grid >= lg[0] - 1e-9) & (grid <= lg[-1] + 1e-9)
        vals[i, inside] = np.interp(grid[inside], lg, off)
    n = np.sum(np.isfinite(vals), axis=0)
    wv = np.where(np.isfinite(vals), w[:, None], 0.0)
    mean = np.nansum(np.nan_to_num(vals) * wv, axis=0) / np.maximum(wv.sum(axis=0), 1e-300)
    std = np.zeros(len(grid))
    several = n >= 2  # a fraction only one rung reached has no spread to measure (nanstd would warn there)
    if several.any():
        std[several] = np.nanstd(vals[:, several], axis=0, ddof=1)
    spread = np.where(several, std, np.abs(mean) * 0.5)
    spread = np.nan_to_num(spread, nan=0.0)
    keep = n > 0
    return ScheduleOffsets(grid=np.exp(grid[keep]), mean=mean[keep], spread=spread[keep], n_runs=n[keep], floor=floor)


def curve_prediction(model: FinalModel, target: TargetSpec, steps: np.ndarray, offsets: ScheduleOffsets | None) -> tuple[np.ndarray, np.ndarray]:
    """(predicted loss, extra relative sigma of the shape) at `steps` of the target: E + (the law's final - E)
    times the rungs' collapsed ratio at that progress (1 at the final step); the law's final alone without
    rung curves."""
    g = np.asarray(steps, dtype=float) / target.steps()
    final = float(model.predict(target_point(target))[0])
    if offsets is None:
        return np.full(len(g), final), np.zeros(len(g))
    off, spread = offsets.at(g)
    reducible = _reducible(np.array([final]), offsets.floor)[0]
    pred = final - reducible + reducible * np.exp(off)
    # the ratios' spread is in log reducible loss; the band is in log loss: d log L = (L - E) / L d log(L - E)
    return pred, spread * (pred - (final - reducible)) / pred


# ---------------------------------------------------------------- the forecast


def _extrapolation_term(res: BacktestResult, d_target: float, d_sparsity: float = 0.0) -> float:
    """The band's extrapolation sigma: the backtest's error per unit distance at the target's distance, never below
    its own distances' nor the eval noise, widened by a t quantile for how few independent runs it held out; the
    decades of sparsity outside the runs at no less than PRIOR_RATE (`at_distance`)."""
    factor = small_sample_factor(independent_errors(res))
    return max(float(at_distance(res.rate, d_target, d_sparsity, res.distance_of_rate, factor)), NOISE_FLOOR * factor)


def forecast_final(table: pd.DataFrame, target: TargetSpec, law: str, n_boot: int, seed: int):
    """A Forecast from a final-loss law: final loss with its band, and the whole curve when rungs have curves."""
    from forecasting import api  # curve steps and band helpers (api imports this module at its top)
    from forecasting.forecast import Forecast, fingerprint_table

    if "unique_tokens" in READS[law] and target.unique_tokens is None:
        raise FitError(f"the {law} law needs the target's unique tokens ({GIVE_UNIQUE_TOKENS}): the ladder's runs repeat "
                       "their data, and how often the target repeats its own sets its loss")
    warn: list[str] = []
    dn = tokens_per_param_direction(final_points(table), target)
    final = fit_frame(law, table, dn, warn)
    model = _cached(("fit", law, _key(final)), lambda: fit_final(law, final))
    at_bounds = getattr(model.obj, "at_bounds", ())
    if at_bounds:
        warn.append(f"the {law} fit sits on a bound of {', '.join(at_bounds)} "
                    f"({', '.join(f'{k} = {model.params[k]:.4g}' for k in at_bounds)}): these runs do not pin that "
                    "parameter, and the form's extrapolation along it is not measured by the fit")
    blind = compute_law_blind_spot(final) if law == "compute" else None
    if blind:
        warn.append(f"{blind}: the forecast is that budget's loss along the ladder's mix of sizes, not this target's "
                    "(an (N, D) law such as chinchilla, overtrain or farseer tells the sizes apart)")
    hidden = hidden_column_blind_spot(law, final)
    if hidden:
        warn.append(f"{hidden}: the forecast is their average, not this target's")
    tp = target_point(target)
    point = float(model.predict(tp)[0])
    preds, samples, kind = fit_spread(law, final, model, tp, n_boot, seed)
    sig: dict[str, float] = {}
    if len(preds) >= 10:
        sig["fit"] = robust_sigma(np.log(np.clip(preds[:, 0], 1e-12, None)))
    else:
        warn.append(f"only {len(preds)} of {n_boot} refits ({kind}) succeeded: the fit term of the band is missing")
    if kind.startswith("parametric"):
        warn.append(f"{final['run'].nunique()} finished runs for {N_PARAMS[law]} parameters: the fit's spread comes from a "
                    f"parametric bootstrap (residual scatter, at least {NOISE_FLOOR:.1%}, one draw per run)")
    fit_pts = points_of(runs_of(final))
    d_target, d_sparsity = float(distance(tp, fit_pts)[0]), float(sparsity_distance(tp, fit_pts)[0])
    epochs = target_epochs(target)
    backtests = []
    try:
        res = backtest_law(law, final, dn=dn, epochs=epochs)
        backtests.append(res)
        if res.repetition_epochs is not None and res.rms_rel_error > WARN_ERROR:
            warn.append(f"the ladder's held-out runs at about the target's {epochs:.3g} epochs of its unique data "
                        f"({', '.join(f'{e:.3g}' for e in res.repetition_epochs)}) were missed by {res.rms_rel_error:.1%} "
                        f"RMS: {law} does not hold at that repetition here, and the band is that wide")
        sig["extrapolation"] = _extrapolation_term(res, d_target, d_sparsity)
    except FitError as e:
        res = _unfinished_curve_backtest(law, table, final, dn, epochs)
        if res is None:
            sig["extrapolation_prior"] = PRIOR_RATE * d_target
            warn.append(f"no backtest possible on this ladder ({e}); the extrapolation term is the public suite's "
                        f"{PRIOR_RATE:.0%} per decade of distance ({d_target:.2f} here)")
        else:  # no finished run to hold out, but an unfinished one beyond them: its evals so far are the evidence
            backtests.append(res)
            sig["extrapolation"] = _extrapolation_term(res, d_target, d_sparsity)
            warn.append(f"the final-loss backtest of {law} scored nothing ({e}); its extrapolation term is its error on "
                        f"the evals so far of the unfinished run(s) beyond the finished ones ({', '.join(res.held_out)}): "
                        f"{res.rms_rel_error:.1%} RMS over {res.n_points} evals")
    T = target.steps()
    offsets = schedule_offsets(table, model, target_flops=float(tp["flops"][0])) if T > 1 else None
    floor = curve_floor(law, table, model, dn) if offsets is not None and "extrapolation" in sig else None
    if floor is not None:
        offsets = schedule_offsets(table, model, target_flops=float(tp["flops"][0]), floor=floor)
    if offsets is None:
        steps = np.array([T])  # no rung curve to learn the schedule's shape from: the final point only
    else:
        first = max(float(offsets.grid[0]) / 2, 1.0 / T)  # no further below the rungs' first eval than half its fraction
        steps = api._curve_steps(T, np.arange(1, 21) * 0.05)
        steps = steps[steps >= first * T - 1e-9]
    pred, shape = curve_prediction(model, target, steps, offsets)
    rel = {k: np.full(len(steps), v) for k, v in sig.items()}
    rel["schedule_shape"] = shape
    if offsets is not None and "extrapolation" in rel:
        # along the curve, never narrower than the law's error on the held-out rungs' own curves at that fraction;
        # the final point keeps the final-loss backtest's term (measured on exactly those points)
        try:
            res_curves = backtest_law_curves(law, table, dn=dn, epochs=epochs)
            rate_g = curve_rate_by_fraction(law, table, steps / T, dn=dn, epochs=epochs)
            along = np.maximum(rel["extrapolation"], at_distance(rate_g, d_target, d_sparsity, res_curves.distance_of_rate,
                                                                 small_sample_factor(independent_errors(res_curves))))
            rel["extrapolation"] = np.where(steps < T, along, rel["extrapolation"])
        except FitError as e:
            warn.append(f"no curve backtest of {law} on this ladder ({e}): the curve band uses the final-loss backtest alone")
    total = band_total(rel, fit="fit", backtest="extrapolation")
    lo, hi = pred * np.exp(-Z95 * total), pred * np.exp(Z95 * total)  # in log space: a wide band stays positive
    if tokens_per_param_spread(final) < MIN_RATIO_SPREAD and {"params_active", "tokens"} <= set(final.columns):
        m_runs = float(np.median(final["tokens"] / final["params_active"]))
        m_target = target.tokens / target.params_active
        if not (m_runs / 1.25 <= m_target <= m_runs * 1.25):
            warn.append(f"tokens per parameter do not vary across the runs ({m_runs:.3g}) and the target has {m_target:.3g}: "
                        "the D/N direction is not identified by this ladder (the band's distance counts "
                        f"{abs(np.log10(m_target / m_runs)):.2f} decades of it)")
    params = {k: percentile_interval(np.array(v), model.params[k]) for k, v in samples.items()}
    return Forecast(
        target=target, method=law, inputs_fingerprint=fingerprint_table(table),
        curve=api._curve(steps, pred, lo, hi, target), final_loss=float(pred[-1]), final_loss_lo=float(lo[-1]),
        final_loss_hi=float(hi[-1]), law=model.formula, params=params, backtest=backtests,
        band_terms=sig | {"distance": d_target, "total": float(total[-1])} | ({} if floor is None else {"curve_floor": floor})
        | ({"sparsity_distance": d_sparsity} if d_sparsity > 0 else {}),
        warnings=warn,
    )


# ---------------------------------------------------------------- compute-optimal allocation

ALLOCATION_LAWS = ("overtrain", "chinchilla", "farseer", "moe", "data_constrained")


def _allocate(model: FinalModel, c6: float, sparsity: float, unique: float | None) -> dict:
    """Loss-optimal (N, D) at C = 6ND under `model`: a grid over tokens per parameter, refined around the best."""
    ratios = np.geomspace(0.5, 1e5, 600)
    for _ in range(2):
        n = np.sqrt(c6 / (6 * ratios))
        pts = {"params_active": n, "tokens": c6 / (6 * n), "params_total": n * sparsity, "flops": np.full_like(n, c6)}
        if unique is not None:
            pts["unique_tokens"] = np.full_like(n, unique)
        loss = model.predict(pts)
        i = int(np.nanargmin(loss))
        edge = i in (0, len(ratios) - 1)
        ratios = np.geomspace(ratios[max(i - 2, 0)], ratios[min(i + 2, len(ratios) - 1)], 200)
    return {"params_opt": float(n[i]), "tokens_opt": float(c6 / (6 * n[i])), "tokens_per_param": float(ratios[0] if edge else c6 / (6 * n[i]) / n[i]),
            "loss_opt": float(loss[i]), "at_grid_edge": bool(edge)}


def optimal_allocation(table: pd.DataFrame, target: TargetSpec, *, n_boot: int = 50, seed: int = 0) -> dict:
    """For the target's compute budget (6ND of its N and D), the loss-optimal N and D under the (N, D) law that
    backtests best on this ladder, with bootstrap intervals, and how far the declared target sits from it.

    Sparsity is held at the target's total/active ratio for that optimum (the moe law would always prefer more
    total parameters without a cost for them); when the ladder varies sparsity, `sparsity` lists the optimum and
    its loss at each total/active ratio (`sparsity_tradeoff`).

    With the target's unique tokens given, the data-constrained law is a candidate too, and the optimum is at that
    much unique data (Muennighoff et al. 2023's question: with U unique tokens and C FLOPs, how large a model and
    how many epochs); on a ladder that varies unique tokens at fixed N and D, the laws blind to them are not
    candidates (`hidden_column_blind_spot`), as in the method choice."""
    laws = [law for law in ALLOCATION_LAWS if law != "data_constrained" or "unique_tokens" in table.columns]
    frames = {law: fit_frame(law, table) for law in laws}  # final points, and checkpoints where they help
    reasons = {law: applicable(law, frame) for law, frame in frames.items()}
    readers = readable_hidden_columns(reasons)
    if readers:
        finished = final_points(table)
        reasons = {law: reason or hidden_column_blind_spot(law, finished, readers) for law, reason in reasons.items()}
    if reasons.get("data_constrained", "") is None and target.unique_tokens is None:
        reasons["data_constrained"] = f"the target's unique tokens are not given ({GIVE_UNIQUE_TOKENS})"
    scored = []
    for law, frame in frames.items():
        if reasons[law]:
            continue
        try:
            scored.append((backtest_law(law, frame).rate, law))
        except FitError:
            continue
    if not scored:
        usable = [law for law in frames if not reasons[law]]
        if not usable:
            why = "; ".join(f"{law}: {reason}" for law, reason in reasons.items())
            return {"available": False, "reason": f"no law in N and D can be fitted to this ladder ({why})"}
        scored = [(float("nan"), usable[0])]
    rate, law = min(scored, key=lambda x: (np.nan_to_num(x[0], nan=np.inf), ALLOCATION_LAWS.index(x[1])))
    final = frames[law]
    model = _cached(("fit", law, _key(final)), lambda: fit_final(law, final))
    c6 = 6.0 * target.params_active * target.tokens
    sparsity = (target.params_total or target.params_active) / target.params_active
    best = _allocate(model, c6, sparsity, target.unique_tokens)
    reps, kind = _cached(("replicates", law, _key(final), n_boot, seed), lambda: replicates(law, final, model, n_boot, seed))
    draws = [_allocate(r, c6, sparsity, target.unique_tokens) for r in reps]
    intervals = {}
    for k in ("params_opt", "tokens_opt", "tokens_per_param", "loss_opt"):
        v = np.array([d[k] for d in draws], dtype=float)
        intervals[k] = percentile_interval(v, best[k]).model_dump() if len(v) >= 10 else None
    at_target = float(model.predict(target_point(target))[0])
    warn = []
    spread = tokens_per_param_spread(final)
    m_opt = best["tokens_per_param"]
    m_lo = float(np.min(final["tokens"] / final["params_active"]))
    m_hi = float(np.max(final["tokens"] / final["params_active"]))
    if law == "overtrain":
        warn.append("the over-training law ties the two exponents, so its optimal tokens per parameter is the same at "
                    "every budget")
    if spread < 0.3:
        warn.append(f"the ladder spans {spread:.2f} decades of tokens per parameter ({m_lo:.3g}-{m_hi:.3g}): the optimum "
                    "comes from the law's form, not from runs near it")
    elif not (m_lo <= m_opt <= m_hi):
        warn.append(f"the optimum ({m_opt:.3g} tokens/param) lies outside the ladder's {m_lo:.3g}-{m_hi:.3g}")
    if best["at_grid_edge"]:
        warn.append("the optimum is at the edge of the searched tokens-per-parameter range (0.5-1e5): the law has no interior optimum")
    if law == "data_constrained":
        epochs_opt, epochs_max = best["tokens_opt"] / target.unique_tokens, float(run_epochs(final).max())
        if math.log(epochs_opt / epochs_max) > REPETITION_WINDOW:  # no run at about the optimum's repetition
            warn.append(f"the optimum repeats the target's unique data {epochs_opt:.3g} times and the ladder's runs at most "
                        f"{epochs_max:.3g}: the law's repetition term is extrapolated there")
    sparsity = sparsity_tradeoff(table, target, n_boot=n_boot, seed=seed)
    moe_ladder = "params_total" in final.columns and bool((final["params_total"] > 1.01 * final["params_active"]).any())
    if sparsity is None and (moe_ladder or (target.params_total or 0) > 1.01 * target.params_active):
        warn.append(f"no loss-optimal sparsity: the moe law cannot be fitted here: {reasons['moe']}")
    return {
        "available": True, "law": law, "formula": model.formula, "backtest_rate": None if not np.isfinite(rate) else float(rate),
        "flops_6nd": c6, **best, "intervals": intervals, "n_bootstrap": len(reps), "bootstrap": kind,
        "unique_tokens": target.unique_tokens if law == "data_constrained" else None,
        "checkpoints": int(final["checkpoint"].sum()) if "checkpoint" in final.columns else 0,
        "target": {"params_active": target.params_active, "tokens": target.tokens,
                   "tokens_per_param": target.tokens / target.params_active, "predicted_loss": at_target,
                   "params_vs_opt": target.params_active / best["params_opt"], "loss_above_opt": at_target / best["loss_opt"] - 1},
        "sparsity": sparsity,
        "warnings": warn,
    }


SPARSITY_SWEEP = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


def sparsity_tradeoff(table: pd.DataFrame, target: TargetSpec, *, n_boot: int = 50, seed: int = 0) -> dict | None:
    """For the target's compute budget, the loss-optimal split at each total/active ratio of SPARSITY_SWEEP (and the
    target's own), under the moe law with bootstrap intervals; None when the moe law cannot be fitted to the ladder
    (`applicable`: among other reasons, a ladder whose total parameters do not vary apart from its active ones).

    Why a list and not one optimum: at a fixed active compute the moe law's effective size N (N_total/N)^kappa grows
    with every expert added, so more total parameters always lower its loss; what bounds sparsity is memory and
    serving, which the law does not see. A planner needs the price of each step instead: how much loss a 2x larger
    expert pool buys at this budget, and how sure the ladder is of it (beyond the ladder's own sparsities it is
    kappa's extrapolation, and the rows say so)."""
    frame = fit_frame("moe", table)
    if applicable("moe", frame):
        return None
    model = _cached(("fit", "moe", _key(frame)), lambda: fit_final("moe", frame))
    reps, _ = _cached(("replicates", "moe", _key(frame), n_boot, seed), lambda: replicates("moe", frame, model, n_boot, seed))
    try:
        rate = float(backtest_law("moe", frame).rate)
    except FitError:
        rate = None
    runs = runs_of(frame)
    ladder = (runs["params_total"] / runs["params_active"]).to_numpy(float)
    own = (target.params_total or target.params_active) / target.params_active
    c6 = 6.0 * target.params_active * target.tokens
    rows = []
    for ratio in sorted(set(SPARSITY_SWEEP) | {round(own, 6)}):
        best = _allocate(model, c6, ratio, target.unique_tokens)
        losses = np.array([_allocate(r, c6, ratio, target.unique_tokens)["loss_opt"] for r in reps], dtype=float)
        iv = percentile_interval(losses, best["loss_opt"]) if len(losses) >= 10 else None
        rows.append({"sparsity": float(ratio), "params_active": best["params_opt"], "params_total": best["params_opt"] * ratio,
                     "tokens": best["tokens_opt"], "loss": best["loss_opt"], "loss_lo": None if iv is None else iv.lo,
                     "loss_hi": None if iv is None else iv.hi, "target": bool(abs(ratio - own) < 1e-6 * own),
                     "within_ladder": bool(ladder.min() / DN_SLACK <= ratio <= ladder.max() * DN_SLACK)})
    warn = []
    bounds = getattr(model.obj, "at_bounds", ())
    if bounds:
        warn.append(f"the moe fit sits on a bound of {', '.join(bounds)} (kappa = {model.params['kappa']:.3g}): the ladder does "
                    "not pin how total parameters help, so these losses are the form's, not the ladder's")
    if model.params["kappa"] < 0:
        warn.append(f"kappa = {model.params['kappa']:.3g} < 0: the ladder's runs with more total parameters for their active "
                    "ones did worse, which a law in sparsity alone cannot tell from what else differs between them (expert "
                    "count, granularity, LR)")
    return {"law": "moe", "kappa": model.params["kappa"], "backtest_rate": rate, "ladder_sparsity": [float(ladder.min()), float(ladder.max())],
            "rows": rows, "warnings": warn}
