"""High-level forecasting API: what the orchestrator's CLI and fit step call.

Why a thin layer: users ask four questions (what law does my ladder follow, what will the target
reach, what does the live prefix change, how wrong is this method here), and each answer must carry
its intervals and its warnings, print as a table and serialise to JSON. The numerics live in the
modules below; this file picks a method, runs the bootstrap and the backtests, and composes bands.

Band composition (relative sigmas added in quadrature, band = +-1.96 sigma; final laws: see
forecasting.final_laws, the same terms in log space):
- bootstrap over runs (refit on run-level resamples, the spread of the prediction),
- extrapolation in compute: the method's own backtest error on this ladder, per decade of compute
  extrapolated (fit the smaller runs, predict the larger), times the target's distance in decades
  beyond the largest run. This is what lets a band admit that the ladder cannot see changes between
  the rungs and the target; it is measured, never a constant. A backtest's error already holds the fit's
  sampling spread (it refits on fewer runs), so of these two terms only the larger counts
  (`final_laws.band_total`); a prior rate in its place is added to the bootstrap,
- extrapolation below the first progress fraction the ladder logged (matched progress only): the
  extension rule's own error on the rungs, per unit of ln g, times the distance in ln g.

Methods: `matched_progress` (curves across rungs at matched training fractions), the final-loss laws of
`forecasting.final_laws` (`compute`, `chinchilla`, and the surfaces `overtrain`, `farseer`, `moe`,
`data_constrained`, each drawing the whole curve from the rungs' schedule offsets), and `multipower`
(CURVE's Multi-Power Law, for a target of a size the table already has curves of). `method="auto"` picks by
a backtest on the given table (`forecasting.selection`), blends the laws that backtest within 2x of the pick
(`forecasting.blend`), and records every candidate in `Forecast.selection`.

JSON documents for the CLI (`--json`), all plain dicts of str/float/list:
- `LadderFit.summary()`: law, formula, n_runs, params {name: {value, lo, hi, level}}, final_run,
  final_loss, final_loss_lo, final_loss_hi (the law's fit at the ladder's largest run, 95% bootstrap
  over runs), warnings.
- `Forecast.summary()`: target, method, version, final_loss, final_loss_lo, final_loss_hi, level, law,
  created_at, warnings; `Forecast.to_json()` is the full object (curve, params, backtest, band_terms).
- `BacktestReport.summary()`: method, results [BacktestResult...], final_run, final_loss,
  final_loss_lo, final_loss_hi (the compute backtest's prediction of its largest held-out run, +-1.96
  RMS backtest error), final_loss_actual, warnings.
Tables: `LadderFit.params_table()`, `LadderFit.residuals_table()`, `Forecast.curve_frame()`,
`BacktestReport.table()`.
"""

from __future__ import annotations

import math
import warnings as _warnings
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath

import fsspec
import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from forecasting import backtest as bt
from forecasting import blend
from forecasting import final_laws as fl
from forecasting.selection import backtest_matched_progress, matched_progress_refusal, n_curve_runs, select_method
from forecasting.bootstrap import Interval, percentile_interval, run_weights
from forecasting.fitting import FitError, MissingColumnsError, fit_chinchilla, fit_compute_law
from forecasting.forecast import Z95, BacktestResult, CurvePoint, Forecast, TargetSpec, fingerprint_table, log_sigma
from forecasting.matched_progress import early_extension_error, fit_profiled
from forecasting.refit import fit_curve, schedule_features
from forecasting.table import (
    TableError, best_of_sweeps, find_duplicate_runs, from_run_dirs, mixed_groups, read_table_file, select_rows, sweep_groups,
    validate_table,
)

METHODS = ("matched_progress", "chinchilla", "compute", "multipower", "overtrain", "farseer", "moe", "data_constrained")
EVAL_NOISE_FLOOR = 1e-3  # an eval's own noise is never taken as zero, even when a smooth prefix fits exactly
SAME_SIZE_RTOL = 0.02  # runs within 2% of the target's active parameters count as "the same model size"


class LadderFit(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    law: str = Field(description="Law name: chinchilla, compute or matched_progress.")
    formula: str = Field(description="The fitted law, readable.")
    params: dict[str, Interval] = Field(description="Parameters with 95% bootstrap-over-runs intervals.")
    residuals: list[dict] = Field(description="Per run: run, loss, predicted, rel_error (final points).")
    n_runs: int
    n_points: int
    n_bootstrap: int = Field(description="Bootstrap refits that succeeded.")
    objective: float | None = Field(None, description="Huber objective at the optimum (chinchilla).")
    final_run: str = Field(description="The ladder's largest-compute run: final_loss* are the law's fit there.")
    final_loss: float = Field(description="The law's fitted final loss of final_run.")
    final_loss_lo: float = Field(description="Lower 95% bootstrap-over-runs bound of final_loss.")
    final_loss_hi: float = Field(description="Upper 95% bootstrap-over-runs bound of final_loss.")
    warnings: list[str] = Field(default_factory=list)

    def to_json(self, **kw) -> str:
        return self.model_dump_json(**kw)

    def summary(self) -> dict:
        """Flat dict for --json: law, formula, parameters with intervals, final-loss keys, warnings."""
        return {
            "law": self.law, "formula": self.formula, "n_runs": self.n_runs,
            "params": {k: v.model_dump() for k, v in self.params.items()},
            "final_run": self.final_run, "final_loss": self.final_loss,
            "final_loss_lo": self.final_loss_lo, "final_loss_hi": self.final_loss_hi, "warnings": list(self.warnings),
        }

    def params_table(self) -> pd.DataFrame:
        return pd.DataFrame([{"param": k, **v.model_dump()} for k, v in self.params.items()])

    def residuals_table(self) -> pd.DataFrame:
        return pd.DataFrame(self.residuals)

    # notebook views and one-call questions (the law at its full-data point estimates)

    def predict(self, params_active=None, tokens=None, *, flops=None, params_total=None, unique_tokens=None):
        """The law's final loss: L(N, D) for a chinchilla fit or a surface of forecasting.surfaces (params_active,
        tokens; moe also params_total, data_constrained unique_tokens); L(C) for a compute or matched-progress fit
        (flops, on the ladder's own FLOP axis). Scalars or arrays."""
        from forecasting.surfaces import SURFACES

        p = {k: v.value for k, v in self.params.items()}
        if self.law in SURFACES:
            if params_active is None or tokens is None:
                raise ValueError(f"a {self.law} fit predicts L(N, D): give params_active and tokens")
            x = {"params_active": params_active, "tokens": tokens, "params_total": params_total, "unique_tokens": unique_tokens}
            missing = [k for k in SURFACES[self.law].needs if x[k] is None]
            if missing:
                raise ValueError(f"a {self.law} fit also needs {', '.join(missing)}")
            x = {k: np.asarray(v, dtype=float) for k, v in x.items() if v is not None}
            return SURFACES[self.law].predict_fn(x, p)
        if self.law == "chinchilla":
            if params_active is None or tokens is None:
                raise ValueError("a chinchilla fit predicts L(N, D): give params_active and tokens")
            n, d = np.asarray(params_active, dtype=float), np.asarray(tokens, dtype=float)
            return p["E"] + p["A"] / n ** p["alpha"] + p["B"] / d ** p["beta"]
        if flops is None:
            raise ValueError(f"a {self.law} fit predicts L(C): give flops= (on the FLOP axis of the ladder's table)")
        c = np.asarray(flops, dtype=float)
        if self.law == "compute":
            return p["E"] + p["A"] * c ** (-p["alpha"])
        if self.law == "matched_progress":
            return p["E"] + np.exp(p["log_A_final"] - p["alpha_final"] * np.log(c))
        raise ValueError(f"cannot predict with a {self.law!r} fit")

    def compute_optimal(self, flops) -> dict:
        """The loss-minimising split of a compute budget C = 6*N*D under a chinchilla fit: params_active,
        tokens, tokens_per_param and loss at the optimum (Hoffmann et al. eq. 4), floats for a scalar budget."""
        from forecasting.laws import ChinchillaLaw, compute_optimal_allocation

        if self.law != "chinchilla":
            raise ValueError(f"the compute-optimal allocation needs a chinchilla fit L(N, D); this is a {self.law} fit "
                             "(fit with law='chinchilla' on runs that vary both N and D)")
        law = ChinchillaLaw(**{k: self.params[k].value for k in ("E", "A", "B", "alpha", "beta")})
        out = compute_optimal_allocation(law, flops)
        result = {"flops": out["flops"], "params_active": out["params_opt"], "tokens": out["tokens_opt"],
                  "tokens_per_param": out["tokens_per_param"], "loss": out["loss_opt"]}
        return {k: float(v) if np.ndim(v) == 0 else v for k, v in result.items()}

    def __repr__(self) -> str:
        formula = self.formula if len(self.formula) <= 150 else self.formula[:147] + "..."
        return (f"LadderFit({self.law} on {self.n_runs} runs: {formula}; {self.final_run} "
                f"{self.final_loss:.4f} [{self.final_loss_lo:.4f}, {self.final_loss_hi:.4f}])")

    __str__ = __repr__

    def _repr_html_(self) -> str:
        from forecasting.forecast import html_table

        rows = [("law", f"{self.law} on {self.n_runs} runs / {self.n_points} points"), ("formula", self.formula)]
        rows += [(k, f"{v.value:.5g} [{v.lo:.5g}, {v.hi:.5g}]") for k, v in self.params.items()]
        rows += [(f"fit at {self.final_run}", f"{self.final_loss:.4f} [{self.final_loss_lo:.4f}, {self.final_loss_hi:.4f}]")]
        rows += [("warning", w) for w in self.warnings]
        return html_table("LadderFit", rows)

    def to_frame(self) -> pd.DataFrame:
        """One row per run: run, loss, predicted, rel_error (the residuals of the fit)."""
        return pd.DataFrame(self.residuals, columns=["run", "loss", "predicted", "rel_error"])

    def plot(self, ax=None):
        """Observed final loss of each run against the law's prediction (the diagonal is a perfect fit)."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(5, 5))
        frame = self.to_frame()
        ax.scatter(frame["predicted"], frame["loss"])
        for _, row in frame.iterrows():
            ax.annotate(str(row["run"]), (row["predicted"], row["loss"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        edges = [min(frame["predicted"].min(), frame["loss"].min()), max(frame["predicted"].max(), frame["loss"].max())]
        ax.plot(edges, edges, "--", color="gray", label="perfect fit")
        ax.set_xlabel(f"predicted ({self.law})")
        ax.set_ylabel("observed final loss")
        ax.legend()
        return ax


class BacktestReport(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    method: str
    results: list[BacktestResult]
    warnings: list[str] = Field(default_factory=list)

    def to_json(self, **kw) -> str:
        return self.model_dump_json(**kw)

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([r.model_dump() for r in self.results])

    def __repr__(self) -> str:
        parts = ", ".join(f"{r.kind} rms {r.rms_rel_error:.2%} over {r.distance:.2f}" for r in self.results[:4])
        return f"BacktestReport({self.method}: {len(self.results)} backtest(s){': ' + parts if parts else ''})"

    __str__ = __repr__

    def _repr_html_(self) -> str:
        from forecasting.forecast import html_table

        rows = [("method", self.method)]
        rows += [(f"{r.kind} ({', '.join(r.held_out)[:80]})", f"rms {r.rms_rel_error:.2%}, worst {r.max_abs_rel_error:.2%}, "
                  f"distance {r.distance:.2f}, per unit {r.rate:.2%}") for r in self.results]
        rows += [("warning", w) for w in self.warnings]
        return html_table("BacktestReport", rows)

    def to_frame(self) -> pd.DataFrame:
        """One row per backtest (kind, held_out, errors, distance, rate, ...)."""
        return pd.DataFrame([r.model_dump() for r in self.results], columns=list(BacktestResult.model_fields))

    def plot(self, ax=None):
        """RMS relative error of each backtest against its extrapolation distance (how error grows with distance)."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(5, 4))
        for r in self.results:
            ax.scatter([r.distance], [r.rms_rel_error * 100], label=f"{r.kind}: {r.rms_rel_error:.2%}")
        ax.set_xlabel("extrapolation distance (decades of compute, or ln step ratio)")
        ax.set_ylabel("RMS relative error (%)")
        ax.set_title(f"backtests of {self.method}")
        if self.results:
            ax.legend()
        return ax

    def summary(self) -> dict:
        """Flat dict for --json. final_loss*: the compute backtest's prediction of its largest held-out run
        (at its last point) with a +-1.96 * RMS-backtest-error band in log space; final_loss_actual: what it reached."""
        out = {"method": self.method, "results": [r.model_dump() for r in self.results], "warnings": list(self.warnings)}
        comp = next((r for r in self.results if r.kind == "compute" and r.final_predicted is not None), None)
        out["final_run"] = comp.final_run if comp else None
        out["final_loss"] = comp.final_predicted if comp else None
        out["final_loss_lo"] = comp.final_predicted * math.exp(-Z95 * comp.rms_rel_error) if comp else None
        out["final_loss_hi"] = comp.final_predicted * math.exp(Z95 * comp.rms_rel_error) if comp else None
        out["final_loss_actual"] = comp.final_actual if comp else None
        return out


# ---------------------------------------------------------------- loading


def load_table(path_or_dirs: str | Sequence[str] | pd.DataFrame, *, where: Mapping[str, str | float] | None = None,
               best_of_sweep: bool = False) -> pd.DataFrame:
    """A CSV/parquet file, a run directory, a directory of run directories, or a list of run directories; with
    `where`, only the rows whose columns equal those values (`forecasting.table.select_rows`); with `best_of_sweep`,
    only the best run of each size and token count whose runs differ in a hyperparameter
    (`forecasting.table.best_of_sweeps`: the tuned loss a scaling law describes)."""
    table = _load_table(path_or_dirs)
    table = validate_table(select_rows(table, where)) if where else table
    return best_of_sweeps(table)[0] if best_of_sweep else table


def _load_table(path_or_dirs: str | Sequence[str] | pd.DataFrame) -> pd.DataFrame:
    if isinstance(path_or_dirs, pd.DataFrame):
        return validate_table(path_or_dirs)
    if isinstance(path_or_dirs, (list, tuple)):
        return from_run_dirs([str(p) for p in path_or_dirs])
    path = str(path_or_dirs)
    if PurePosixPath(path).suffix.lower() in (".csv", ".parquet", ".pq", ".tsv"):
        return read_table_file(path)
    fs, p = fsspec.core.url_to_fs(path)
    if fs.exists(p.rstrip("/") + "/spec.json"):
        return from_run_dirs([path])
    if fs.isdir(p):
        proto = path.split("://")[0] + "://" if "://" in path else ""
        subdirs = sorted(
            proto + d for d in fs.ls(p, detail=False) if fs.exists(d.rstrip("/") + "/spec.json")
        )
        if subdirs:
            return from_run_dirs(subdirs)
    raise TableError(f"{path}: not a .csv/.parquet table, a run directory or a directory of run directories")


# ---------------------------------------------------------------- method choice


def _n_grid_runs(table: pd.DataFrame) -> int:
    if not {"fraction", "flops"} <= set(table.columns):
        return 0
    counts = table.groupby("run")["fraction"].nunique()
    return int((counts >= 2).sum())


def choose_method(table: pd.DataFrame) -> str:
    """matched_progress for ladders of whole curves, else chinchilla (N, D vary), else compute; the data-constrained
    or MoE law instead of any of them where the ladder varies unique tokens or total parameters among runs that law
    cannot tell apart (`final_laws.hidden_column_blind_spot`) and the reading law can be fitted."""
    try:
        final = fl.final_points(table)
    except MissingColumnsError:
        # neither flops nor sizes: no law can be fitted, and the compute law's fit says which columns it lacks; a
        # backtest can still score the runs' curves against their own prefixes (steps and losses are all it reads)
        return "compute"
    if _n_grid_runs(table) >= 3:
        law = "matched_progress"
    elif {"params_active", "tokens"} <= set(final.columns) and len(final) >= 6 and final["params_active"].nunique() >= 2:
        # one D/N: alpha and beta cannot be told apart, one shared exponent can
        law = "overtrain" if fl.tokens_per_param_spread(final) < fl.MIN_RATIO_SPREAD else "chinchilla"
    elif len(final) >= 3:
        law = "compute"
    else:
        raise FitError(
            f"cannot fit any law: {table['run'].nunique()} run(s); need >= 3 runs with curves (matched progress), "
            ">= 6 finished runs over >= 2 sizes (chinchilla) or >= 3 finished runs (compute law)"
        )
    try:
        finished = fl.final_points(table)  # with each run's planned compute, which matched progress reads
    except FitError:
        return law
    for col, (_, reader) in fl.HIDDEN_COLUMNS.items():
        if len(finished) and fl.applicable(reader, finished) is None and fl.hidden_column_blind_spot(law, finished, {col}):
            return reader  # matched progress on the data-constrained runs' curves gave every epoch count one loss
    return law


def _final_table(table: pd.DataFrame, warn: list[str]) -> pd.DataFrame:
    final = fl.final_points(table)
    fl.note_unfinished(table, final, warn)
    return final


def _run_compute_final(final: pd.DataFrame) -> np.ndarray:
    if "flops" in final.columns:
        return final["flops"].to_numpy(float)
    return 6 * final["params_active"].to_numpy(float) * final["tokens"].to_numpy(float)


# ---------------------------------------------------------------- fit_ladder


def _check_n_bootstrap(n_bootstrap: int) -> None:
    if not isinstance(n_bootstrap, (int, np.integer)) or isinstance(n_bootstrap, bool) or n_bootstrap < 0:
        raise ValueError(f"n_bootstrap is a number of refits, 0 or more; got {n_bootstrap!r}")


def fit_ladder(table: pd.DataFrame, *, law: str = "auto", n_bootstrap: int = 200, seed: int = 0) -> LadderFit:
    """Fit a law to the ladder with bootstrap-over-runs intervals on every parameter."""
    _check_n_bootstrap(n_bootstrap)
    table = validate_table(table)
    warn: list[str] = []
    table = _screened_runs(table, warn)
    law = choose_method(table) if law == "auto" else law
    if law in ("overtrain", "farseer", "moe", "data_constrained") or (
        law == "chinchilla" and fl.tokens_per_param_spread(fl.final_points(table)) < fl.MIN_RATIO_SPREAD
    ):
        return _fit_ladder_surface(table, law, n_bootstrap, seed, warn)
    if law == "chinchilla":
        final = _final_table(table, warn)
        n, d, y = (final[c].to_numpy(float) for c in ("params_active", "tokens", "loss"))
        fit, diag = fit_chinchilla(n, d, y)
        if not diag.converged:
            raise FitError(f"the Chinchilla fit did not converge: {diag.message}")
        names = ("E", "A", "B", "alpha", "beta")
        samples: dict[str, list[float]] = {k: [] for k in names}
        top = int(np.argmax(n * d))
        top_preds = []
        start = np.array([math.log(fit.A), math.log(fit.B), math.log(fit.E), fit.alpha, fit.beta])
        for w in run_weights(final["run"], n_bootstrap, seed, min_distinct=6):
            try:
                b, bd = fit_chinchilla(n, d, y, weights=w, n_polish=1, start=start, candidate_radius=0.1)
            except FitError:
                continue
            if bd.converged:
                for k in names:
                    samples[k].append(getattr(b, k))
                top_preds.append(float(b.predict(n[top], d[top])))
        params = {k: percentile_interval(np.array(samples[k]), getattr(fit, k)) for k in names}
        pred = fit.predict(n, d)
        n_ok = len(samples["E"])
        _warn_boot(n_ok, n_bootstrap, warn)
        return LadderFit(
            law="chinchilla", formula=fit.formula(), params=params, residuals=_residuals(final, pred),
            n_runs=len(final), n_points=len(final), n_bootstrap=n_ok, objective=diag.objective,
            **_final_fields(str(final["run"].iloc[top]), float(pred[top]), top_preds), warnings=warn,
        )
    if law == "compute":
        final = _final_table(table, warn)
        c, y = _run_compute_final(final), final["loss"].to_numpy(float)
        fit = fit_compute_law(c, y)
        samples = {k: [] for k in ("E", "A", "alpha")}
        top = int(np.argmax(c))
        top_preds = []
        for w in run_weights(final["run"], n_bootstrap, seed, min_distinct=3):
            try:
                b = fit_compute_law(c, y, weights=w)
            except FitError:
                continue
            for k in samples:
                samples[k].append(getattr(b, k))
            top_preds.append(float(b.predict(c[top])))
        params = {k: percentile_interval(np.array(v), getattr(fit, k)) for k, v in samples.items()}
        _warn_boot(len(samples["E"]), n_bootstrap, warn)
        return LadderFit(
            law="compute", formula=fit.formula(), params=params, residuals=_residuals(final, fit.predict(c)),
            n_runs=len(final), n_points=len(final), n_bootstrap=len(samples["E"]),
            **_final_fields(str(final["run"].iloc[top]), float(fit.predict(c[top])), top_preds), warnings=warn,
        )
    if law == "matched_progress":
        fit = fit_profiled(table)
        samples = {k: [] for k in ("E", "alpha_final", "log_A_final")}
        runs = sorted(table["run"].unique())
        last = table.sort_values("step").groupby("run").tail(1)
        comp = (last["flops"] / last["fraction"]).to_numpy()
        top = int(np.argmax(comp))
        top_g, top_c = float(last["fraction"].iloc[top]), float(comp[top])
        top_preds = []
        for w in run_weights(runs, n_bootstrap, seed, min_distinct=3):
            try:
                b = fit_profiled(table, weights=dict(zip(runs, w, strict=True)))
            except FitError:
                continue
            samples["E"].append(b.E)
            samples["alpha_final"].append(b.alpha[-1])
            samples["log_A_final"].append(b.log_A[-1])
            top_preds.append(float(b.predict(top_g, top_c)[0]))
        point = {"E": fit.E, "alpha_final": fit.alpha[-1], "log_A_final": fit.log_A[-1]}
        params = {k: percentile_interval(np.array(v), point[k]) for k, v in samples.items()}
        _warn_boot(len(samples["E"]), n_bootstrap, warn)
        if len(runs) < 5:
            warn.append(f"only {len(runs)} rungs: run-level bootstrap intervals are coarse")
        pred = np.array([fit.predict(f, c)[0] for f, c in zip(last["fraction"], comp, strict=True)])
        return LadderFit(
            law="matched_progress", formula=fit.formula(), params=params, residuals=_residuals(last, pred),
            n_runs=len(runs), n_points=len(table), n_bootstrap=len(samples["E"]),
            **_final_fields(str(last["run"].iloc[top]), float(pred[top]), top_preds), warnings=warn,
        )
    raise ValueError(f"unknown law {law!r}; choose from {METHODS} or 'auto'")


def _fit_ladder_surface(table: pd.DataFrame, law: str, n_bootstrap: int, seed: int, warn: list[str]) -> LadderFit:
    """fit_ladder for the surfaces of forecasting.surfaces (and Chinchilla's, refused when D/N never varies)."""
    final = fl.fit_frame(law, table, warn=warn)
    reason = fl.applicable(law, final)
    if reason:
        raise FitError(f"the {law} law cannot be fitted to this ladder: {reason}")
    model = fl.fit_final(law, final)
    pts = fl.points_of(fl.runs_of(final))
    top = len(fl.runs_of(final)) - 1  # final_points sorts by compute
    reps, kind = fl.replicates(law, final, model, n_bootstrap, seed)
    params = {k: percentile_interval(np.array([r.params[k] for r in reps]), v) for k, v in model.params.items()}
    top_preds = [float(r.predict({k: v[top:top + 1] for k, v in pts.items()})[0]) for r in reps]
    _warn_boot(len(reps), n_bootstrap, warn)
    if kind.startswith("parametric"):
        warn.append(f"intervals from a {kind}")
    if fl.tokens_per_param_spread(final) < fl.MIN_RATIO_SPREAD:
        warn.append("tokens per parameter do not vary across the runs: the data exponent is not identified separately "
                    "from the size exponent (the over-training form ties them)")
    pred = model.predict(pts)
    runs = fl.runs_of(final)
    return LadderFit(
        law=law, formula=model.formula, params=params, residuals=_residuals(runs, pred), n_runs=len(runs),
        n_points=len(final), n_bootstrap=len(reps), **_final_fields(str(runs["run"].iloc[top]), float(pred[top]), top_preds),
        warnings=warn,
    )


def _final_fields(run: str, value: float, boot: list[float]) -> dict:
    iv = percentile_interval(np.array(boot), value) if boot else _no_interval(value)
    return {"final_run": run, "final_loss": iv.value, "final_loss_lo": iv.lo, "final_loss_hi": iv.hi}


def _screened_runs(table: pd.DataFrame, warn: list[str]) -> pd.DataFrame:
    """The table without runs logged twice under two names, and warnings for a column that splits it into ladders no
    law tells apart (`forecasting.table.mixed_groups`) and for a hyperparameter sweep (`forecasting.table.sweep_groups`)."""
    pairs = find_duplicate_runs(table)
    if pairs:
        warn.append(f"identical runs under different names (kept the first, dropped the copy): {pairs}")
        table = table[~table["run"].isin([dup for _, dup in pairs])].reset_index(drop=True)
    warn.extend(mixed_groups_warning(group) for group in mixed_groups(table))
    sweep = sweep_groups(table)
    if sweep:
        warn.append(sweep_warning(sweep))
    return table


def sweep_warning(sweep: dict) -> str:
    """One line for a `forecasting.table.sweep_groups` result: what varies, how far the average is from the best."""
    return (f"{sweep['runs']} runs at {sweep['points']} sizes and token counts differ in {', '.join(sweep['columns'])} (a "
            f"hyperparameter sweep, up to {sweep['largest']} runs at one point); their losses lie a median "
            f"{sweep['median_gap']:.1%} above the best of each, and the laws fit them all, so the forecast is of an "
            "average setting, not a tuned one; to forecast the tuned loss keep the best run of each point "
            "(`--best-of-sweep`, or forecasting.table.best_of_sweeps)")


def mixed_groups_warning(group: dict) -> str:
    """One line for a `forecasting.table.mixed_groups` item: what splits the table, by how much, and how to pick one."""
    runs = ", ".join(f"{value}: {n} runs" for value, n in list(group["runs"].items())[:6])
    more = f" and {len(group['runs']) - 6} more values" if len(group["runs"]) > 6 else ""
    column = group["column"]
    also = "".join(f" and {c!r}" for c in group.get("same_split", []))
    return (f"the runs differ in {column!r}{also} ({runs}{more}), and at equal size and tokens their final losses differ by "
            f"{group['median_gap']:.1%} (median over {group['matched']} matched sizes): no law reads {column!r}, so they are "
            f"fitted as one ladder and the forecast is of none of them; forecast one at a time (`--where {column}=VALUE`, "
            "or forecasting.table.select_rows)")


def _residuals(final: pd.DataFrame, pred: np.ndarray) -> list[dict]:
    return [
        {"run": str(r), "loss": float(y), "predicted": float(p), "rel_error": float(p / y - 1)}
        for r, y, p in zip(final["run"], final["loss"], pred, strict=True)
    ]


def _warn_boot(n_ok: int, n_req: int, warn: list[str]) -> None:
    if n_req and n_ok < 0.9 * n_req:
        warn.append(f"{n_req - n_ok} of {n_req} bootstrap refits failed or did not converge; intervals are less reliable")
    if n_req and n_ok < 10:
        warn.append("fewer than 10 bootstrap refits: intervals are not meaningful")


# ---------------------------------------------------------------- forecasts


def _curve_steps(num_steps: int, extra_fractions: Sequence[float] = ()) -> np.ndarray:
    if num_steps <= 1:
        return np.array([1])
    geo = np.geomspace(max(1.0, num_steps / 1000.0), num_steps, 160)
    lin = np.linspace(num_steps / 50, num_steps, 50)
    fr = np.asarray(extra_fractions, dtype=float) * num_steps
    return np.unique(np.clip(np.round(np.r_[geo, lin, fr]), 1, num_steps).astype(int))


def _band(pred: np.ndarray, rel_sigmas: dict[str, np.ndarray], *, fit: str | None = None,
          backtest: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo, hi, total sigma): the terms in quadrature, the `fit` and `backtest` ones as `final_laws.band_total` counts them,
    +-Z95 sigma in log space as the final laws' bands (a wide band stays positive)."""
    total = fl.band_total(rel_sigmas, fit=fit, backtest=backtest)
    return pred * np.exp(-Z95 * total), pred * np.exp(Z95 * total), total


def _curve(steps, pred, lo, hi, target: TargetSpec) -> list[CurvePoint]:
    tps = target.tokens_per_step or (target.tokens / target.steps() if target.num_steps else None)
    fpt = target.planned_flops() / target.tokens
    out = []
    for s, p, a, b in zip(steps, pred, lo, hi, strict=True):
        tok = float(s * tps) if tps else None
        out.append(CurvePoint(step=int(s), tokens=tok, flops=float(tok * fpt) if tok else None, loss=float(p), lo=float(a), hi=float(b)))
    return out


def forecast_target(
    table: pd.DataFrame, target: TargetSpec, *, method: str = "auto", n_bootstrap: int = 200, seed: int = 0
) -> Forecast:
    """Forecast the target's loss curve (with bands) and final loss (with interval) from the ladder alone."""
    _check_n_bootstrap(n_bootstrap)
    table = validate_table(table)
    dup_warn: list[str] = []
    table = _screened_runs(table, dup_warn)
    selection: list[dict] = []
    if method != "auto":
        f = _forecast_with(table, target, method, n_bootstrap, seed)
    else:
        method, selection, sel_warn = select_method(table, target, same_size_runs=_same_size_runs(table, target))
        dup_warn += sel_warn
        # the winner of the backtest may still fail on the whole table (no convergence): the next best then
        order = [method] + [c["method"] for c in sorted((c for c in selection if c.get("expected_error") is not None
                                                          and not c.get("excluded") and c["method"] != method),
                                                         key=lambda c: c["expected_error"])]
        for i, candidate in enumerate(order):
            try:
                f = _forecast_with(table, target, candidate, n_bootstrap, seed)
                break
            except FitError as error:
                if i == len(order) - 1:
                    raise
                dup_warn.append(f"{candidate} won the backtest but failed on the whole table ({error}); "
                                f"the next best, {order[i + 1]}, is used")
                for c in selection:
                    c["chosen"] = c["method"] == order[i + 1] or None
        f = _blend_close_candidates(table, target, f, selection, n_bootstrap, seed, dup_warn)
    used = [c["method"] for c in selection if c.get("blend_weight")] or [f.method]  # a blend's members, or the one law
    recipe = [learning_rate_mismatch(table, target), sparsity_outside_ladder(table, target, used)]
    f.warnings = dup_warn + f.warnings + [w for w in recipe if w]
    f.selection = selection
    return f


SPARSITY_SLACK = 1.25  # as fl.DN_SLACK for D/N: a target within x/÷ 1.25 of the runs' sparsities does not extrapolate in it


def sparsity_outside_ladder(table: pd.DataFrame, target: TargetSpec, used: Sequence[str]) -> str | None:
    """A warning when the target's sparsity (total / active parameters; 1 for a dense run or a table without
    params_total) lies more than SPARSITY_SLACK outside the runs', else None. `used`: the methods the forecast is
    made of (a blend's members).

    Why: the band counts those decades (`final_laws.at_distance`), but only the moe law reads total parameters, and
    no backtest within the ladder's sparsities measured what another sparsity does; the other laws forecast the
    target as if it had the ladder's. On the public suite's Step Law MoE split two steps out (rungs at 9.3-11.4
    total/active, targets at 1.7: eight experts of which three are active, where the rungs route to one or two of
    88-89 finer ones) every law that could be fitted missed by -4.6% to -8.3%, outside auto's band, with no word of
    why.
    """
    if "params_active" not in table.columns:
        return None
    runs = table.groupby("run").agg(n=("params_active", "first"),
                                    total=("params_total" if "params_total" in table.columns else "params_active", "first"))
    runs["total"] = runs["total"].fillna(runs["n"])
    ratios = (runs["total"] / runs["n"]).to_numpy(float)
    ratios = ratios[np.isfinite(ratios) & (ratios > 0)]
    if len(ratios) == 0:
        return None
    ratio = (target.params_total or target.params_active) / target.params_active
    lo, hi = float(ratios.min()), float(ratios.max())
    if lo / SPARSITY_SLACK <= ratio <= hi * SPARSITY_SLACK:
        return None
    decades = math.log10(ratio / hi) if ratio > hi else math.log10(lo / ratio)
    where = f"{lo:.3g}" if math.isclose(lo, hi, rel_tol=1e-3) else f"{lo:.3g}-{hi:.3g}"
    head = (f"the target's sparsity (total / active parameters) {ratio:.3g} lies {decades:.2f} decades outside the runs' "
            f"{where}: ")
    if "moe" in used:
        return head + ("the moe law extrapolates its total-parameter term (kappa) there, which no run of the ladder "
                       f"tested; the band counts those decades at {fl.PRIOR_RATE:.0%} each (the public suite's rate for "
                       "what a ladder cannot test), or at the backtest's rate where that is higher")
    verbs = ("does", "forecasts") if len(used) == 1 else ("do", "forecast")
    return head + (f"{', '.join(used)} {verbs[0]} not read total parameters and {verbs[1]} the target as if it had the "
                   "ladder's sparsity (only the moe law reads them, fitted on runs whose total parameters vary apart from "
                   f"their active ones); the band counts those decades at {fl.PRIOR_RATE:.0%} each (the public suite's "
                   "rate for what a ladder cannot test: no run here measured extrapolation along sparsity), or at the "
                   "backtest's rate where that is higher")


LR_MISMATCH = 2.0  # a target whose peak LR is 2x off the rungs' trend is on another recipe


def learning_rate_mismatch(table: pd.DataFrame, target: TargetSpec) -> str | None:
    """A warning when the target's peak LR is LR_MISMATCH times or more off what the rungs' peak LRs give at its size
    (their trend in log N, or their mean when they share one size), else None; a schedule normalised to peak 1 is
    not compared.

    Why: every method here assumes the rungs and the target share a recipe, and the LR is the part of a recipe
    that moves the shape of a curve most (a lower peak LR anneals less); a ladder cannot see what the target's
    other LR will do, so the forecast says so. Marin's 535B hero ran at a peak LR about 4x below its rungs'.
    """
    if target.lr is None or "lr" not in table.columns or "params_active" not in table.columns:
        return None
    runs = table.groupby("run").agg(lr=("lr", "max"), n=("params_active", "first")).dropna()
    runs = runs[runs["lr"] > 0]
    peak = float(np.max(target.lr))
    if len(runs) < 2 or peak <= 0 or math.isclose(peak, 1.0):  # a schedule normalised to peak 1 carries its shape only
        return None
    x, y = np.log(runs["n"].to_numpy(float)), np.log(runs["lr"].to_numpy(float))
    expected = float(np.exp(np.polyval(np.polyfit(x, y, 1), math.log(target.params_active)))) if np.ptp(x) > 0 else float(np.exp(y.mean()))
    ratio = peak / expected
    if 1 / LR_MISMATCH < ratio < LR_MISMATCH:
        return None
    return (f"the target's peak LR {peak:.3g} is {max(ratio, 1 / ratio):.1f}x {'below' if ratio < 1 else 'above'} what the "
            f"rungs' peak LRs ({runs['lr'].min():.3g}-{runs['lr'].max():.3g}) give at its size ({expected:.3g}): the forecast assumes "
            "one recipe, and another LR moves the curve's shape (and its end) by more than the band counts")


def _blend_close_candidates(table: pd.DataFrame, target: TargetSpec, chosen: Forecast, selection: list[dict], n_boot: int,
                            seed: int, warn: list[str]) -> Forecast:
    """`auto`'s forecast: the chosen law alone, or its blend with the laws the backtest could not tell from it
    (`forecasting.blend`); each blended candidate's weight is recorded in the selection."""
    weights = blend.members(selection, chosen.method)
    band_weights = blend.members(selection, chosen.method, band=True)
    forecasts = {chosen.method: chosen}
    for m in {**weights, **band_weights}:
        if m in forecasts:
            continue
        try:
            forecasts[m] = _forecast_with(table, target, m, n_boot, seed)
        except FitError as error:
            why = "had no backtest either" if any(c.get("no_evidence") for c in selection) else f"backtested within {blend.WITHIN:g}x of {chosen.method}"
            warn.append(f"{m} {why} but failed on the whole table ({error}): left out of the blend")
    weights = {m: w for m, w in weights.items() if m in forecasts}
    band_weights = {m: w for m, w in band_weights.items() if m in forecasts}
    for c in selection:
        if c["method"] in weights and len(weights) > 1:
            c["blend_weight"] = weights[c["method"]] / sum(weights.values())
        if c["method"] in band_weights and len(band_weights) > 1:
            c["band_weight"] = band_weights[c["method"]] / sum(band_weights.values())
    return blend.blend(forecasts, weights, band_weights)


def _forecast_with(table: pd.DataFrame, target: TargetSpec, method: str, n_boot: int, seed: int) -> Forecast:
    if method == "multipower":
        return _forecast_multipower(table, target, n_boot, seed)
    if method == "matched_progress":
        return _forecast_matched_progress(table, target, n_boot, seed)
    if method in fl.FINAL_LAWS:
        return fl.forecast_final(table, target, method, n_boot, seed)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS} or 'auto'")


def _forecast_matched_progress(table: pd.DataFrame, target: TargetSpec, n_boot: int, seed: int) -> Forecast:
    warn: list[str] = []
    refusal = matched_progress_refusal(table, target)
    if refusal:
        raise FitError(f"matched progress refused: {refusal}")
    if target.num_steps is None and target.tokens_per_step is None:
        warn.append("target has no num_steps/tokens_per_step: only the final loss (fraction 1) is forecast")
    fit = fit_profiled(table)
    c_target = target.planned_flops()
    T = target.steps()
    steps = _curve_steps(T, fit.fractions)
    g = steps / T
    pred = fit.predict(g, c_target)
    runs = sorted(table["run"].unique())
    boot = []
    for w in run_weights(runs, n_boot, seed, min_distinct=3):
        try:
            b = fit_profiled(table, weights=dict(zip(runs, w, strict=True)))
        except FitError:
            continue
        boot.append((b.predict(g, c_target), b.E, b.alpha[-1]))
    _warn_boot(len(boot), n_boot, warn)
    sig: dict[str, np.ndarray] = {}
    if boot:
        curves = np.array([x[0] for x in boot])
        q_lo, q_hi = np.quantile(curves, [0.025, 0.975], axis=0)
        sig["bootstrap"] = (q_hi - q_lo) / (2 * Z95) / pred
    comp = bt.run_compute(table)
    backtests: list[BacktestResult] = []
    decades = max(0.0, math.log10(c_target / float(comp.max())))
    d_sparsity = float(fl.sparsity_distance(fl.target_point(target), fl.points_of(bt.last_points(table)))[0])
    try:
        res = bt.backtest_matched_progress(table)
        backtests.append(res)
        try:
            rate_g = bt.matched_progress_rate_by_fraction(table, g)
        except FitError:
            rate_g = np.full_like(pred, res.rate)
        sig["compute_extrapolation"] = fl.at_distance(rate_g, decades + d_sparsity, d_sparsity, 0.0,
                                                      fl.small_sample_factor(fl.independent_errors(res)))
    except FitError as e:
        sig["compute_extrapolation_prior"] = np.full_like(pred, fl.PRIOR_RATE * max(decades + d_sparsity, fl.MIN_DISTANCE))
        warn.append(f"no compute backtest possible ({e}); the extrapolation term is the public suite's "
                    f"{fl.PRIOR_RATE:.0%} per decade ({decades + d_sparsity:.2f} decades here)")
    rate_g = early_extension_error(table, fit)
    below = np.maximum(0.0, np.log(fit.fractions[0] / g))
    if np.any(below > 0):
        if np.isfinite(rate_g):
            sig["below_first_fraction"] = rate_g * below
        else:
            warn.append("the early curve (below the ladder's first logged fraction) has no backtest; band there too narrow")
    lo, hi, total = _band(pred, sig, fit="bootstrap", backtest="compute_extrapolation")
    final = float(pred[-1])
    params = {
        "E": percentile_interval(np.array([x[1] for x in boot]), fit.E) if boot else _no_interval(fit.E),
        "alpha_final": percentile_interval(np.array([x[2] for x in boot]), fit.alpha[-1]) if boot else _no_interval(fit.alpha[-1]),
    }
    return Forecast(
        target=target, method="matched_progress", inputs_fingerprint=fingerprint_table(table),
        curve=_curve(steps, pred, lo, hi, target), final_loss=final, final_loss_lo=float(lo[-1]), final_loss_hi=float(hi[-1]),
        law=fit.formula(), params=params, backtest=backtests,
        band_terms={k: float(v[-1]) for k, v in sig.items()} | {"total": float(total[-1])}, warnings=warn,
    )


def _same_size_runs(table: pd.DataFrame, target: TargetSpec) -> list[str]:
    """Runs of the target's model size with a logged LR: what a schedule-aware curve law can learn from."""
    if target.lr is None or "lr" not in table.columns or "params_active" not in table.columns:
        return []
    first = table.groupby("run")["params_active"].first()
    same = first[np.abs(first / target.params_active - 1) <= SAME_SIZE_RTOL]
    counts = table[table["run"].isin(same.index)].groupby("run")["step"].nunique()
    return sorted(counts[counts >= 8].index)


def _forecast_multipower(table: pd.DataFrame, target: TargetSpec, n_boot: int, seed: int) -> Forecast:
    """Schedule-aware whole curve (CURVE's Multi-Power Law) from runs of the target's own size.

    The band is CURVE's: bootstrap over curves, training residuals, and a model error calibrated by
    leave-one-curve-out and time backtests on these very runs.
    """
    from forecasting import multipower as mpl  # CURVE's module; imported here so the rest never depends on it

    runs = _same_size_runs(table, target)
    if not runs:
        raise FitError(
            "the multipower method needs the target's LR schedule and runs of the same model size "
            f"(active params within {SAME_SIZE_RTOL:.0%}) with logged lr in the table"
        )
    if target.lr is None:
        raise FitError("the multipower method needs the target's per-step LR schedule")
    warn: list[str] = []
    curves = [mpl.curve_from_table(table, r) for r in runs]
    bands = mpl.multipower_bands(curves, n_boot=max(2, min(n_boot, 50)), seed=seed)
    lr = np.asarray(target.lr, dtype=float)
    T = len(lr)
    steps = _curve_steps(T, np.arange(1, 21) * 0.05)
    pred, lo, hi = bands.predict_band(lr, steps)
    point = bands.point.to_dict()
    params = {}
    for k, v in point.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            reps = np.array([r.to_dict().get(k, np.nan) for r in bands.replicates], dtype=float)
            params[k] = percentile_interval(reps, float(v))
    if len(runs) < 3:
        warn.append(f"only {len(runs)} curve(s) of this size: the schedule-aware fit is weakly constrained")
    return Forecast(
        target=target, method="multipower", inputs_fingerprint=fingerprint_table(table[table["run"].isin(runs)]),
        curve=_curve(steps, pred, lo, hi, target), final_loss=float(pred[-1]), final_loss_lo=float(lo[-1]),
        final_loss_hi=float(hi[-1]), law=bands.point.formula(), params=params,
        band_terms={"total": float((hi[-1] - lo[-1]) / (2 * Z95) / pred[-1])}, warnings=warn,
    )


def _no_interval(v: float) -> Interval:
    return Interval(value=float(v), lo=float("-inf"), hi=float("inf"))


def optimal_allocation(table: pd.DataFrame, target: TargetSpec, *, n_bootstrap: int = 50, seed: int = 0) -> dict:
    """The loss-optimal N and D for the target's compute (with intervals) and how far the target sits from it;
    see forecasting.final_laws.optimal_allocation. {"available": False, "reason": ...} when no (N, D) law fits."""
    return fl.optimal_allocation(validate_table(table), target, n_boot=n_bootstrap, seed=seed)


# ---------------------------------------------------------------- refits


def refit_forecast(
    table: pd.DataFrame,
    target: TargetSpec,
    live: pd.DataFrame,
    *,
    prior: Forecast | None = None,
    n_bootstrap: int = 200,
    seed: int = 0,
) -> Forecast:
    """A new forecast from the ladder prior plus the target's live prefix (see forecasting.refit)."""
    table = validate_table(table)
    live = validate_table(live)
    warn: list[str] = []
    if prior is None:
        prior = forecast_target(table, target, n_bootstrap=n_bootstrap, seed=seed)
    T = target.steps()
    s1, s2 = schedule_features(np.asarray(target.lr) if target.lr is not None else None, T)
    if target.lr is None:
        warn.append("no LR schedule for the target: the live curve is a power law in steps (no annealing term)")
    st = live["step"].to_numpy(int)
    y = live["loss"].to_numpy(float)
    last = int(st.max())
    if last >= T:
        warn.append("the live run reached its planned steps; the refit only smooths observed points")
    model, live_rms = fit_curve(st, y, s1, s2)
    steps = _curve_steps(T, np.arange(1, 21) * 0.05)
    steps = np.unique(np.r_[steps, st])
    live_pred = model.predict(steps)
    live_sig = {"posterior": model.log_sigma(steps), "eval_noise": np.full(len(steps), max(live_rms, EVAL_NOISE_FLOOR))}
    backtests = list(prior.backtest)
    try:
        pb = bt.backtest_prefix(table)
        backtests.append(pb)
        live_sig["beyond_prefix"] = pb.rate * np.log(np.maximum(steps, last) / last)
    except FitError as e:
        warn.append(f"no prefix backtest possible ({e}); the live curve's band beyond the prefix is too narrow")
    sig_live = np.sqrt(sum(np.square(v) for v in live_sig.values()))
    p_loss, p_lo, p_hi = (np.array([prior.band_at(s)[k] for s in steps]) for k in range(3))
    sig_prior = log_sigma(p_lo, p_hi)
    if np.any(sig_prior < fl.NOISE_FLOOR):
        warn.append(f"the ladder forecast's band is narrower than an eval's own noise ({fl.NOISE_FLOOR:.1%}) at some steps; "
                    "the refit reads it as that wide")
        sig_prior = np.maximum(sig_prior, fl.NOISE_FLOOR)
    # Gaussian product of the two forecasts at each step, written with variances (no reciprocal of a tiny sigma)
    var_live, var_prior = np.square(sig_live), np.square(sig_prior)
    w_live = var_prior / (var_live + var_prior)
    pred = w_live * live_pred + (1 - w_live) * p_loss
    sig = {"combined": np.sqrt(var_live * var_prior / (var_live + var_prior))}
    lo, hi, total = _band(pred, sig)
    weight_live_final = float(w_live[-1])
    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore")
        params = {
            name: Interval(value=float(v), lo=float(v - Z95 * math.sqrt(max(model.cov[i, i], 0))), hi=float(v + Z95 * math.sqrt(max(model.cov[i, i], 0))))
            for i, (name, v) in enumerate(zip(("E", "log_B", "b", "C"), model.theta, strict=True))
        }
    return Forecast(
        target=target, method="refit", inputs_fingerprint=fingerprint_table(table, live),
        curve=_curve(steps, pred, lo, hi, target), final_loss=float(pred[-1]), final_loss_lo=float(lo[-1]),
        final_loss_hi=float(hi[-1]),
        law=f"inverse-variance blend of the live curve [{model.formula()}] and the ladder forecast [{prior.law}]",
        params=params, backtest=backtests,
        band_terms={f"live_{k}": float(v[-1]) for k, v in live_sig.items()}
        | {"prior": float(sig_prior[-1]), "total": float(total[-1]), "live_weight_final": weight_live_final, "live_points": float(len(st))},
        warnings=warn + [w for w in prior.warnings if w not in warn],
    )


# ---------------------------------------------------------------- backtests


def backtest(table: pd.DataFrame, *, method: str = "auto") -> BacktestReport:
    """Ordered-extrapolation backtests of a method on this ladder, on the splits `auto` scores its candidates on
    (`final_laws.backtest_law`: the k smallest runs fit, every larger run predicted, over up to five k), scored
    on every eval of the held-out runs when three or more runs have curves (as for a target with a curve), else
    on their final losses; plus a prefix backtest of each curve when runs have curves.
    A method blind to what this ladder varies (the compute law at one budget over several sizes, a law that
    cannot read unique tokens or total parameters the ladder varies) is still scored, with a warning: its
    backtest cannot show that blind spot."""
    table = validate_table(table)
    results, warn = [], []
    table = _screened_runs(table, warn)
    method = choose_method(table) if method == "auto" else method
    if method != "matched_progress" and method not in fl.FINAL_LAWS:
        raise ValueError(f"unknown method {method!r}; one of matched_progress, {', '.join(fl.FINAL_LAWS)}")
    # as `auto` scores its candidates for a target with a curve: every eval of the held-out runs, when runs have curves
    curves = n_curve_runs(table) >= 3 and {"params_active", "tokens"} <= set(table.columns)
    try:
        final = fl.final_points(table)
        blind = fl.compute_law_blind_spot(final) if method == "compute" else None
        blind = blind or fl.hidden_column_blind_spot(method, final)
        if blind:
            warn.append(f"{blind}: its backtest cannot show that")
        if method == "matched_progress":
            results.append(backtest_matched_progress(table, curves=curves))
        elif curves:
            results.append(fl.backtest_law_curves(method, table))
        else:
            results.append(fl.backtest_law(method, fl.fit_frame(method, table, warn=warn)))
    except FitError as e:
        warn.append(f"{method} backtest not possible: {e}")
    if table.groupby("run")["step"].nunique().max() >= 8:
        try:
            results.append(bt.backtest_prefix(table))
        except FitError as e:
            warn.append(f"prefix backtest not possible: {e}")
    return BacktestReport(method=method, results=results, warnings=warn)
