"""The public backtest suite: every forecasting method on every public data set the package ships.

Why a suite and not one backtest: a method tuned on one ladder (Marin's, say) can fail quietly on
another; `auto` must be judged on the whole table, never on one row. So this module turns each
shipped data set into tables of runs (the forecasting.table contract) and deterministic
leave-largest-out splits (fit on the smaller runs, predict the largest ones the fit never saw), runs
every method through the public API (`forecasting.api.forecast_target` / `refit_forecast`; the
method list is read from `forecasting.api.METHODS` at run time, plus "auto"), and scores every
held-out point: relative error, whether the 95% band covers it, and the band's relative half-width.
Two data sets are over-training splits of others (`*_overtrained`: fit the runs near compute-optimal, predict
the over-trained ones), because a hero trained far beyond its ladder's tokens per parameter extrapolates in
D/N, which a leave-largest-out split does not test. Five are two-step splits of others (`*_far`: the runs one
step below the largest, a size or a budget, are in neither the fit nor the targets), because a hero sits further
beyond its ladder than one step: Marin's is 2.5 decades of compute beyond its largest rung, where a
leave-largest-out split predicts 0.3 to 0.7 decades out, and a law or a band that holds one step out can fail two.

Scoring, per held-out point (step s, actual loss y), with (p, lo, hi) the forecast there:
    rel error  = p / y - 1
    covered    = lo <= y <= hi
    half-width = (hi - lo) / 2 / p
p, lo, hi are `Forecast.band_at(s)` when the forecast carries a curve (>= 2 curve points); a
final-only forecast (one curve point, e.g. chinchilla or compute) scores only a point at the target's
planned end, with (final_loss, final_loss_lo, final_loss_hi). "final" points are each target's last
held-out point; "curve" points are every held-out eval of targets with more than one (final included),
for forecasts that carry a curve.
Per (data set, method, kind): MAE %, signed mean %, coverage %, median half-width %, points; all
splits of a data set are pooled so each data set counts once.

Calibration beyond the 95% count (`band_z`, `metrics`, `check_auto`): a data set holds 2 to 87 final targets, and
on ten targets a calibrated 95% band covers all ten 60% of the time, so "100%" alone cannot say a band is too
wide. Each point's band is also read as a log-normal one (its half on the actual's side: a percentile band may be
lopsided), giving z = log(y / p) / sigma with |z| <= 1.96 exactly when covered; the 50% and 80% coverages and the
median |z| (0.67 when calibrated) then measure width on few targets, and the count covered is checked against the
range of a calibrated 95% band on that many targets (final points only: a curve's points are not separate draws).
Targets of one split share a fit, and so part of their error: the range is simulated with the share of z's variance
the splits' targets share on the data (`intraclass_correlation`, `clustered_coverage_range`); the binomial range of
independent targets is shown beside it.

Caps (so the whole suite runs in minutes on 2 cores): at most MAX_TARGETS held-out targets per split,
chosen evenly over the held-out runs sorted by compute (the largest always kept); at most
MAX_CURVE_POINTS scored points per curve target, evenly by index (its last point always kept).

A method that raises FitError/ValueError on a target is "n/a" with the one-line reason; any other
exception is "error" with its type; a call over `timeout_s` is "timeout" (the method's remaining
targets in that data set are skipped); past `budget_s` seconds on one data set a method's remaining
targets are "budget" (skipped), so a slow method cannot hold the whole suite up. Nothing here imports ladder/.
"""

from __future__ import annotations

import math
import signal
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from forecasting import api
from forecasting.backtest import run_compute
from forecasting.fitting import FitError
from forecasting.forecast import Z95, Forecast, TargetSpec, log_band_z
from forecasting.multipower import curve_from_table, multipowerlaw_schedule
from forecasting.public_data import chinchilla_points, data_dir, marin_ladder
from forecasting.table import validate_table

MAX_TARGETS = 10
MAX_CURVE_POINTS = 200
# Zero LRs in a target's schedule (a decay to exactly zero) become the schedule's smallest positive LR: the curve laws
# need eta > 0 at every step. Only zeros change: a floor on every step would bend the warmup ramp, which the
# Multi-Power Law detects as a strictly increasing prefix (a floor at 1e-3 * peak made it read the warmup as a re-warm).
LIVE_ONLY = "live_only"  # refit splits only: refit_forecast with a flat prior (the live prefix alone)
REFIT_PREFIXES = (0.1, 0.2, 0.4)

DATASETS = (
    "chinchilla", "chinchilla_overtrained", "steplaw_dense", "steplaw_dense_overtrained", "steplaw_moe", "multipower",
    "marin", "porian", "hh_datablations", "hh_opt", "hh_olmo", "hh_k2",
    "chinchilla_far", "steplaw_dense_far", "steplaw_moe_far", "marin_far", "porian_far",
)
# Over-training splits (Gadre et al. 2024's setup): fit the runs at up to OVERTRAIN_FIT_MAX tokens per parameter,
# predict every run at OVERTRAIN_PREDICT_MIN or more: an extrapolation in D/N alone, the one an over-trained hero needs.
OVERTRAIN_FIT_MAX = 60.0
OVERTRAIN_PREDICT_MIN = 90.0


# ---------------------------------------------------------------- splits


@dataclass(frozen=True)
class HeldOut:
    """One held-out target: what the forecaster is told (target), what it must predict (points)."""

    run: str
    target: TargetSpec
    points: pd.DataFrame  # columns step, loss: the actual held-out evals to score, sorted by step
    live: pd.DataFrame | None = None  # refit splits: the target's live prefix (a table of runs)


@dataclass(frozen=True)
class Split:
    dataset: str
    name: str
    train: pd.DataFrame | None  # the ladder the methods fit; None when the data set has no other runs
    targets: tuple[HeldOut, ...]
    group: str = ""  # sub-grouping kept in the JSON (Porian's configuration, a Multi-Power size, ...)

    @property
    def kind(self) -> str:
        return "refit" if any(t.live is not None for t in self.targets) else "forecast"


def _spread(items: Sequence, cap: int) -> list:
    """At most `cap` of `items` (already sorted), evenly spaced, the last one always kept."""
    if len(items) <= cap:
        return list(items)
    idx = np.unique(np.round(np.linspace(0, len(items) - 1, cap)).astype(int))
    return [items[i] for i in idx]


def _thin(points: pd.DataFrame, cap: int = MAX_CURVE_POINTS) -> pd.DataFrame:
    points = points.sort_values("step").reset_index(drop=True)
    if len(points) <= cap:
        return points
    idx = np.unique(np.round(np.linspace(0, len(points) - 1, cap)).astype(int))
    return points.iloc[idx].reset_index(drop=True)


def _target_lr(table: pd.DataFrame, run: str, num_steps: int) -> list[float] | None:
    """The run's logged LR interpolated to every step 1..num_steps (multipower.curve_from_table's rule), zeros lifted."""
    if "lr" not in table.columns:
        return None
    return _positive(curve_from_table(table, run, num_steps=num_steps).lr[:num_steps]).tolist()


def _positive(lr: np.ndarray) -> np.ndarray:
    lr = np.asarray(lr, dtype=float)
    return np.where(lr > 0, lr, lr[lr > 0].min()) if (lr > 0).any() else lr


def _target_from_run(table: pd.DataFrame, run: str, *, lr: bool = True) -> TargetSpec:
    """The TargetSpec a user would write for `run` before it started: size, plan (steps, tokens, FLOPs), schedule."""
    rows = table[table["run"] == run].sort_values("step")
    last = rows.iloc[-1]
    get = lambda k: float(last[k]) if k in rows.columns and pd.notna(last[k]) else None  # noqa: E731
    num_steps = int(get("num_steps")) if get("num_steps") else None
    tps = get("tokens_per_step")
    frac = get("fraction") or 1.0
    tokens = float(num_steps * tps) if num_steps and tps else float(last["tokens"] / frac)
    total_flops = float(last["flops"] / frac) if "flops" in rows.columns else None
    # run-level facts the table carries and the target schema knows (unique_tokens, flops_per_token, ...)
    extra = {k: get(k) for k in TargetSpec.model_fields if k not in _TARGET_SET and k in rows.columns and get(k)}
    return TargetSpec(
        name=str(run), params_active=float(last["params_active"]), params_total=get("params_total"),
        tokens=tokens, num_steps=num_steps, tokens_per_step=tps, total_flops=total_flops,
        lr=_target_lr(table, run, num_steps) if lr and num_steps else None, **extra,
    )


_TARGET_SET = ("name", "params_active", "params_total", "tokens", "num_steps", "tokens_per_step", "total_flops", "lr")


def _held_out(table: pd.DataFrame, runs: Sequence[str], *, lr: bool = True, cap: int = MAX_TARGETS) -> tuple[HeldOut, ...]:
    compute = run_compute(table)
    comp = sorted(runs, key=lambda r: (compute[r], str(r)))
    out = []
    for r in _spread(comp, cap):
        rows = table[table["run"] == r]
        out.append(HeldOut(run=str(r), target=_target_from_run(table, r, lr=lr), points=_thin(rows[["step", "loss"]])))
    return tuple(out)


def _leave_out(dataset: str, name: str, table: pd.DataFrame, held: Sequence[str], *, group: str = "", lr: bool = True,
               cap: int = MAX_TARGETS) -> Split:
    held = set(map(str, held))
    train = table[~table["run"].isin(held)].reset_index(drop=True)
    return Split(dataset, name, validate_table(train), _held_out(table, sorted(held), lr=lr, cap=cap), group)


def leave_largest_out(table: pd.DataFrame, n_held: int = 1, *, skip: int = 0, dataset: str = "this table") -> Split:
    """A user's own ladder as a suite split: its `n_held` largest finished runs by compute held out, the `skip`
    finished runs just below them in neither the fit nor the targets, the rest the ladder. What `ladder backtest TABLE
    --forecast-largest N [--skip K]` scores: each method's whole forecast, band included, of runs the user has the
    answer to, made as it would have been made one rung (or N) earlier, and with `skip` from K rungs further back, as
    a hero sits further beyond its ladder than one rung (the public suite's `*_far` splits)."""
    from forecasting.final_laws import final_points

    table = validate_table(table)
    finished = final_points(table)
    compute = run_compute(table)
    order = sorted(finished["run"].astype(str), key=lambda r: (compute[r], r))
    if n_held < 1 or skip < 0 or len(order) - n_held - skip < 3:
        raise ValueError(f"holding out the {n_held} largest of {len(order)} finished run(s)"
                         f"{f' and leaving out the {skip} below them' if skip else ''} leaves fewer than three to fit: "
                         "give numbers whose sum is at most the finished runs minus three")
    held, skipped = order[-n_held:], order[len(order) - n_held - skip:len(order) - n_held]
    kept = table[~table["run"].isin(skipped)]
    name = f"fit {len(order) - n_held - skip} run(s), predict the {n_held} largest" + (f" ({skip} between left out)" if skip else "")
    return _leave_out(dataset, name, kept, held, cap=n_held)


# ---------------------------------------------------------------- loaders


def load_chinchilla() -> pd.DataFrame:
    """Epoch AI's Chinchilla points (Fig. 4 extraction): 240 finished runs, one row each (5 highest losses dropped,
    as Epoch do). Units as given: N = `Model Size` params, C = `Training FLOP`; tokens D = C / (6N)."""
    return chinchilla_points(data_dir() / "chinchilla_svg_extracted_data.csv")


def _steplaw_common(raw: pd.DataFrame, prefix: str) -> pd.DataFrame:
    return pd.DataFrame({
        "run": prefix + raw["exp_name"].astype(str),
        "step": 1,
        "fraction": 1.0,
        "loss": raw["smooth loss"].astype(float),
        "loss_raw": raw["loss"].astype(float),
        "tokens": raw["D"].astype(float),
        "lr": raw["lr"].astype(float),
        "batch_seqs": raw["bs"].astype(float),
        "iters": raw["ti"].astype(float),
    })


def load_steplaw_dense() -> pd.DataFrame:
    """Step Law's 1,911 dense runs (17 (N, D) pairs x an LR x batch grid), one final point each.

    Columns of `steplaw/dense_lr_bs_loss.csv`: N = non-embedding params, D = tokens, lr, bs = batch in sequences
    of 2,048 tokens (bs * ti * 2048 = D), ti = iterations, `loss` = last train loss, `smooth loss` = its smoothed
    value. loss here is the smoothed final loss (less step noise; the raw one is kept as loss_raw);
    flops = 6 N D (the files give no FLOPs per token for dense runs).
    """
    raw = pd.read_csv(data_dir() / "steplaw" / "dense_lr_bs_loss.csv")
    out = _steplaw_common(raw, "dense/")
    out["params_active"] = raw["N"].astype(float)
    out["params_total"] = raw["N"].astype(float)
    out["flops"] = 6.0 * out["params_active"] * out["tokens"]
    return validate_table(out)


def load_steplaw_moe() -> pd.DataFrame:
    """Step Law's 708 MoE runs (16 configurations x LR x batch grids), one final point each.

    `steplaw/moe_lr_bs_loss.csv`: N = total params (~2.15B), Na = active params, M = training FLOPs per token
    (DeepSeek's convention, attention included: C = M * D; M ~ 6 Na + attention), D = tokens, topk, nume =
    experts. params_active = Na, params_total = N, flops = M * D, loss = `smooth loss` (raw kept as loss_raw).
    """
    raw = pd.read_csv(data_dir() / "steplaw" / "moe_lr_bs_loss.csv")
    out = _steplaw_common(raw, "moe/")
    out["params_active"] = raw["Na"].astype(float)
    out["params_total"] = raw["N"].astype(float)
    out["flops"] = raw["M"].astype(float) * raw["D"].astype(float)
    out["flops_per_token"] = raw["M"].astype(float)
    out["topk"] = raw["topk"].astype(int)
    out["experts"] = raw["nume"].astype(int)
    return validate_table(out)


def steplaw_best(table: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """The best run (lowest loss over the LR x batch grid) of each configuration `keys`."""
    idx = table.groupby(list(keys))["loss"].idxmin()
    return table.loc[idx.to_numpy()].reset_index(drop=True)


MPL_SIZES = {"csv_25": 25e6, "csv_100": 100e6, "csv_400": 400e6}
MPL_TOKENS_PER_STEP = 0.5e6  # an assumption: the files log no batch size; scale-free laws do not depend on it


def load_multipower() -> pd.DataFrame:
    """The Multi-Power Law curves: 27 runs (25M/100M/400M x 9 LR schedules), every logged point (step, lr, loss).

    Files `multipowerlaw/csv_{25,100,400}/{schedule}.csv` log step, lr and loss every 128 steps after the
    2,160-step warmup. run = "{size}M/{schedule}"; params_active = the nominal size; num_steps = the schedule's
    length from its name (forecasting.multipower.multipowerlaw_schedule); tokens = step * 0.5M (assumed: the
    files carry no batch size; the laws used are scale-free in D, so predictions do not depend on it);
    flops = 6 N tokens.
    """
    frames = []
    root = data_dir() / "multipowerlaw"
    for folder, n in MPL_SIZES.items():
        for path in sorted((root / folder).glob("*.csv")):
            raw = pd.read_csv(path)
            T = len(multipowerlaw_schedule(path.stem))
            raw = raw[raw["step"] <= T]
            frames.append(pd.DataFrame({
                "run": f"{int(n / 1e6)}M/{path.stem}", "step": raw["step"].astype(int), "loss": raw["loss"].astype(float),
                "lr": raw["lr"].astype(float), "params_active": n, "params_total": n, "num_steps": T,
                "tokens_per_step": MPL_TOKENS_PER_STEP, "fraction": raw["step"] / T,
                "tokens": raw["step"] * MPL_TOKENS_PER_STEP, "flops": 6.0 * n * raw["step"] * MPL_TOKENS_PER_STEP,
                "size": folder, "schedule": path.stem,
            }))
    return validate_table(pd.concat(frames, ignore_index=True))


def load_marin() -> tuple[pd.DataFrame, TargetSpec, pd.DataFrame]:
    """(rung table, hero TargetSpec, hero observed table): forecasting.public_data.marin_ladder plus the hero's
    schedule (Marin's recipe shape: 1% warmup, linear decay to zero, peak from rungs.csv's note, the final zero lifted)."""
    from forecasting.public_data import linear_decay_schedule

    d = data_dir() / "marin_535b_ladder"
    table, hero, observed = marin_ladder(d)
    rungs = pd.read_csv(d / "rungs.csv").set_index("rung")
    peak = float(str(rungs.loc[hero["name"], "peak_lr_note"]).split()[0])
    lr = linear_decay_schedule(hero["num_steps"], peak=peak)
    target = TargetSpec(
        name=hero["name"], params_active=hero["params_active"], params_total=hero["params_total"], tokens=hero["tokens"],
        num_steps=hero["num_steps"], tokens_per_step=hero["tokens_per_step"], total_flops=hero["total_flops"],
        lr=_positive(lr).tolist(),
    )
    return table, target, observed


def load_porian() -> pd.DataFrame:
    """Porian et al. 2024: 1,745 IsoFLOP runs over 15 training configurations, one final point each.

    `porian2024/porian2024_isoflop_runs.csv`: flops = the IsoFLOP budget C (= 6 n t exactly, in the
    configuration's parameter-count convention), n = params, t = tokens, loss (train or val loss, per the
    configuration's `val` field). run = "{config}/C={flops}/N={n}"; config and its fields kept as columns.
    """
    raw = pd.read_csv(data_dir() / "porian2024" / "porian2024_isoflop_runs.csv")
    out = pd.DataFrame({
        "run": raw["config"] + "/C=" + raw["flops"].map("{:.4g}".format) + "/N=" + raw["n"].map("{:.6g}".format),
        "step": 1, "fraction": 1.0, "loss": raw["loss"].astype(float), "params_active": raw["n"].astype(float),
        "params_total": raw["n"].astype(float), "tokens": raw["t"].astype(float), "flops": raw["flops"].astype(float),
    })
    for c in ("config", "dataset", "hparams", "warmup", "decay", "param_count", "val"):
        out[c] = raw[c].astype(str)
    return validate_table(out)


DATABLATIONS_TOKENS_PER_STEP = 524_288  # 256 x 2,048: every token_num in the file is a whole multiple of it


def load_datablations() -> pd.DataFrame:
    """Muennighoff et al. 2023 data-constrained runs (via the Hitchhiker's collection): 48 curves, 9,261 points.

    `colpret_hitchhiker/datablations_losses.csv`: num_params "2.8B"/"4.2B"/"8.7B" (nominal params), data (c4 /
    oscar), epochs (repetitions of the unique data), token_num (tokens seen at the checkpoint), loss,
    tokens_per_epoch (unique tokens). run = "{N}/{data}/{epochs}ep"; step = token_num / 524,288;
    num_steps = the largest step of that model size (its budget: 55B / 84B / 178B tokens); flops = 6 N tokens
    (the file's flops column falls as 1/token_num and is not used); unique_tokens and epochs kept.
    """
    raw = pd.read_csv(data_dir() / "colpret_hitchhiker" / "datablations_losses.csv")
    n = _sizes(raw["num_params"])
    step = (raw["token_num"] / DATABLATIONS_TOKENS_PER_STEP).round().astype(int)
    out = pd.DataFrame({
        "run": raw["num_params"] + "/" + raw["data"] + "/" + raw["epochs"].astype(str) + "ep",
        "step": step, "loss": raw["loss"].astype(float), "tokens": raw["token_num"].astype(float),
        "params_active": n, "params_total": n, "tokens_per_step": float(DATABLATIONS_TOKENS_PER_STEP),
        "flops": 6.0 * n * raw["token_num"].astype(float), "data": raw["data"].astype(str),
        "epochs": raw["epochs"].astype(int), "unique_tokens": raw["tokens_per_epoch"].astype(float),
    })
    out["num_steps"] = out.groupby("params_active")["step"].transform("max")
    out["fraction"] = out["step"] / out["num_steps"]
    return validate_table(out)


def _sizes(names: pd.Series) -> np.ndarray:
    """Nominal sizes such as "125m", "1.3b", "7B" as parameter counts."""
    return np.array([float(s.strip()[:-1]) * {"m": 1e6, "b": 1e9}[s.strip()[-1].lower()] for s in names], dtype=float)


def load_opt() -> pd.DataFrame:
    """OPT 125M-175B perplexity trajectories (Hitchhiker's collection): 6 curves, 142 points.

    `colpret_hitchhiker/opt_trajectories.csv`: model_size (nominal), steps, num_token = log10(tokens), flops =
    log10(FLOPs) (= 6 N tokens), ppl = validation perplexity. loss = ln(ppl) (nats per token); tokens =
    10**num_token; flops = 10**flops; num_steps = the last logged step of each run (the plan is not in the file,
    so each run's last checkpoint counts as its end); tokens_per_step = tokens / steps (0.5M-4M, constant per run).
    """
    raw = pd.read_csv(data_dir() / "colpret_hitchhiker" / "opt_trajectories.csv")
    tokens = 10.0 ** raw["num_token"].astype(float)
    n = _sizes(raw["model_size"])
    out = pd.DataFrame({
        "run": "opt-" + raw["model_size"].astype(str), "step": raw["steps"].astype(int), "loss": np.log(raw["ppl"].astype(float)),
        "tokens": tokens, "flops": 10.0 ** raw["flops"].astype(float), "params_active": n, "params_total": n,
        "tokens_per_step": (tokens / raw["steps"]).round(),
    })
    out["num_steps"] = out.groupby("run")["step"].transform("max")
    out["fraction"] = out["step"] / out["num_steps"]
    return validate_table(out)


OLMO_TOKENS_PER_STEP = 2048 * 2048  # OLMo-1's batch (about 4M tokens); the file logs steps only
OLMO_LOSS = {  # the C4 validation cross-entropy each OLMo run logs (the 1B run logs it under the v2-small set)
    "OLMo-1B": "v2-small-c4_en-validation/CrossEntropyLoss",
    "OLMo-7B": "c4_en-validation/CrossEntropyLoss",
    "OLMo-7B-Twin-2T": "c4_en-validation/Perplexity",
}


def load_olmo() -> pd.DataFrame:
    """OLMo-1 (1B, 7B, 7B-Twin-2T) checkpoints every 1,000 steps (Hitchhiker's collection): 3 curves.

    `colpret_hitchhiker/olmo.csv`: Step, model_name, num_params ("1B"/"7B", nominal), and per-set validation
    losses. loss = C4 validation cross-entropy (nats): `v2-small-c4_en-validation/CrossEntropyLoss` for 1B,
    `c4_en-validation/CrossEntropyLoss` for 7B, ln(`c4_en-validation/Perplexity`) for 7B-Twin-2T (the 7B run
    logs both; they agree to 1e-7). tokens = step * 2048 * 2048 (OLMo-1's batch; an assumption, the file has no
    tokens); flops = 6 N tokens; num_steps = the last logged step. No LR is logged, so none is given.
    """
    raw = pd.read_csv(data_dir() / "colpret_hitchhiker" / "olmo.csv")
    raw["model_name"] = raw["model_name"].str.strip()  # the file spells one "OLMo-1B "
    frames = []
    for name, col in OLMO_LOSS.items():
        g = raw[(raw["model_name"] == name) & raw[col].notna()]
        loss = np.log(g[col].astype(float)) if col.endswith("Perplexity") else g[col].astype(float)
        n = _sizes(g["num_params"])
        frames.append(pd.DataFrame({
            "run": name, "step": g["Step"].astype(int), "loss": loss, "params_active": n, "params_total": n,
            "tokens_per_step": float(OLMO_TOKENS_PER_STEP), "tokens": g["Step"] * float(OLMO_TOKENS_PER_STEP),
            "flops": 6.0 * n * g["Step"] * float(OLMO_TOKENS_PER_STEP),
        }))
    out = pd.concat(frames, ignore_index=True)
    out["num_steps"] = out.groupby("run")["step"].transform("max")
    out["fraction"] = out["step"] / out["num_steps"]
    return validate_table(out)


def load_k2() -> pd.DataFrame:
    """LLM360 K2-65B's training loss (Hitchhiker's collection): one curve, 9,985 points.

    `colpret_hitchhiker/K2.csv`: `k2 training - lm loss` (train loss, nats) with tokens_seen (0 to 1.4T, linear
    in the row index) and flops (= 6 * 65e9 * tokens). The file's Step column is a plot axis (not monotonic),
    so step = the row index (1..9,985; the row at 0 tokens dropped); tokens_per_step = 1.4T / 9,985; the
    `training spikes` series is empty in this copy. No LR is logged.
    """
    raw = pd.read_csv(data_dir() / "colpret_hitchhiker" / "K2.csv")
    raw = raw[raw["tokens_seen"] > 0]
    step = raw["index"].astype(int)
    tokens = raw["tokens_seen"].astype(float)
    out = pd.DataFrame({
        "run": "K2-65B", "step": step, "loss": raw["k2 training - lm loss"].astype(float), "tokens": tokens,
        "flops": raw["flops"].astype(float), "params_active": 65e9, "params_total": 65e9,
        "num_steps": int(step.max()), "tokens_per_step": float(tokens.iloc[-1] / step.iloc[-1]),
    })
    out["fraction"] = out["step"] / out["num_steps"]
    return validate_table(out)


# ---------------------------------------------------------------- splits per data set


def _distinct_sizes(n: pd.Series) -> pd.Series:
    """Model sizes grouped: Epoch's extraction gives one model slightly different N's (to 1e-6 relative)."""
    return n.map(lambda v: float(f"{v:.3g}"))


def splits_chinchilla(cap: int = MAX_TARGETS) -> list[Split]:
    """Fit the runs of the smaller ~80% of distinct model sizes; predict the runs of the largest ~20%."""
    t = load_chinchilla()
    size = _distinct_sizes(t["params_active"])
    sizes = np.sort(size.unique())
    cut = sizes[-max(1, int(math.ceil(0.2 * len(sizes))))]
    return [_leave_out("chinchilla", "largest 20% of sizes", t, t.loc[size >= cut, "run"], cap=cap)]


def splits_steplaw_dense(cap: int = MAX_TARGETS) -> list[Split]:
    """Best run per (N, D) (17); fit the four smaller N, predict the largest N's runs."""
    t = steplaw_best(load_steplaw_dense(), ["params_active", "tokens"])
    return [_leave_out("steplaw_dense", "largest N", t, t.loc[t["params_active"] == t["params_active"].max(), "run"], cap=cap)]


def splits_overtrained(dataset: str, table: pd.DataFrame, cap: int = MAX_TARGETS) -> list[Split]:
    """Fit the runs at <= OVERTRAIN_FIT_MAX tokens per parameter, predict those at >= OVERTRAIN_PREDICT_MIN (the runs
    in between are in neither: a target must lie beyond the fitted range, not next to it)."""
    m = table.groupby("run")["tokens"].transform("max") / table["params_active"]
    fit = table[m <= OVERTRAIN_FIT_MAX]
    held = table.loc[m >= OVERTRAIN_PREDICT_MIN, "run"].unique()
    both = pd.concat([fit, table[table["run"].isin(held)]], ignore_index=True)
    name = f"fit <= {OVERTRAIN_FIT_MAX:g} tokens/param, predict >= {OVERTRAIN_PREDICT_MIN:g}"
    return [_leave_out(dataset, name, both, held, cap=cap)]


def splits_chinchilla_overtrained(cap: int = MAX_TARGETS) -> list[Split]:
    return splits_overtrained("chinchilla_overtrained", load_chinchilla(), cap=cap)


def splits_steplaw_dense_overtrained(cap: int = MAX_TARGETS) -> list[Split]:
    """Best run per (N, D): the five sizes at 19 and 53 tokens/param fit; the runs at 93-466 are predicted."""
    return splits_overtrained("steplaw_dense_overtrained", steplaw_best(load_steplaw_dense(), ["params_active", "tokens"]), cap=cap)


def splits_steplaw_moe(cap: int = MAX_TARGETS) -> list[Split]:
    """Best run per (N, Na, D, top-k, experts) (16); fit the smaller active sizes, predict the largest Na's runs."""
    t = steplaw_best(load_steplaw_moe(), ["params_total", "params_active", "tokens", "topk", "experts"])
    return [_leave_out("steplaw_moe", "largest Na", t, t.loc[t["params_active"] == t["params_active"].max(), "run"], cap=cap)]


def _two_steps_out(dataset: str, name: str, table: pd.DataFrame, step: pd.Series, *, group: str = "",
                   cap: int = MAX_TARGETS) -> Split:
    """Fit the runs below the second-largest value of `step` (a size or a budget per run), predict the runs at the
    largest; the runs at the second-largest are in neither."""
    levels = np.sort(step.unique())
    if len(levels) < 3:
        raise ValueError(f"{dataset} {name}: a two-step split needs at least 3 levels (the lowest to fit); got {len(levels)}")
    kept = table[step != levels[-2]]
    return _leave_out(dataset, name, kept, kept.loc[step[kept.index] == levels[-1], "run"], group=group, cap=cap)


def splits_chinchilla_far(cap: int = MAX_TARGETS) -> list[Split]:
    """The Chinchilla split two steps out: fit the smallest ~60% of distinct sizes, predict the largest ~20% (the
    sizes between are in neither)."""
    t = load_chinchilla()
    size = _distinct_sizes(t["params_active"])
    sizes = np.sort(size.unique())
    top, middle = sizes[-max(1, int(math.ceil(0.2 * len(sizes))))], sizes[-max(2, int(math.ceil(0.4 * len(sizes))))]
    band = pd.Series(np.where(size >= top, 2, np.where(size >= middle, 1, 0)), index=t.index)
    return [_two_steps_out("chinchilla_far", "fit the smallest 60% of sizes, predict the largest 20%", t, band, cap=cap)]


def splits_steplaw_dense_far(cap: int = MAX_TARGETS) -> list[Split]:
    """Best run per (N, D); fit the three smaller N, predict the largest N's runs (the second largest in neither)."""
    t = steplaw_best(load_steplaw_dense(), ["params_active", "tokens"])
    return [_two_steps_out("steplaw_dense_far", "fit all but the two largest N, predict the largest", t, t["params_active"], cap=cap)]


def splits_steplaw_moe_far(cap: int = MAX_TARGETS) -> list[Split]:
    """Best run per configuration; fit the two smaller active sizes, predict the largest Na's runs."""
    t = steplaw_best(load_steplaw_moe(), ["params_total", "params_active", "tokens", "topk", "experts"])
    return [_two_steps_out("steplaw_moe_far", "fit all but the two largest Na, predict the largest", t, t["params_active"], cap=cap)]


MPL_TRAIN = ("cosine_24000", "constant_24000", "wsdcon_9")


def splits_multipower(cap: int = MAX_TARGETS, sizes: Sequence[str] = tuple(MPL_SIZES), cross_size: bool = True) -> list[Split]:
    """Per size the paper's split (fit cosine_24000, constant_24000, wsdcon_9; predict the other six curves at every
    logged step, each given its own LR schedule), and a cross-size split (fit every 25M and 100M curve, predict 400M's)."""
    t = load_multipower()
    out = []
    for s in sizes:
        rows = t[t["size"] == s]
        held = rows.loc[~rows["schedule"].isin(MPL_TRAIN), "run"].unique()
        out.append(_leave_out("multipower", f"{s}: fit {'+'.join(MPL_TRAIN)}", rows, held, group=s, cap=cap))
    if cross_size:
        held = t.loc[t["size"] == "csv_400", "run"].unique()
        out.append(_leave_out("multipower", "fit 25M+100M, predict 400M", t, held, group="cross_size", cap=cap))
    return out


def _marin_hero() -> tuple[pd.DataFrame, HeldOut]:
    """Marin's rung table and its hero as a held-out target (its logged evals)."""
    table, hero_target, observed = load_marin()
    return table, HeldOut(run=hero_target.name, target=hero_target, points=_thin(observed[["step", "loss"]]))


def splits_marin(hero: bool = True) -> list[Split]:
    """Fit d768/d1024/d1536, predict d2048's curve (crashed at 80%); fit all four, predict the hero's logged evals."""
    table, h = _marin_hero()
    out = [_leave_out("marin", "fit d768-d1536, predict d2048", table, ["d2048"])]
    if hero:
        out.append(Split("marin", "fit all rungs, predict the hero", table, (h,)))
    return out


def splits_marin_far() -> list[Split]:
    """Fit d768/d1024/d1536 (d2048 in neither), predict the hero's logged evals."""
    table, h = _marin_hero()
    return [Split("marin_far", "fit d768-d1536, predict the hero", validate_table(table[table["run"] != "d2048"].reset_index(drop=True)), (h,))]


def splits_porian_far(cap: int = MAX_TARGETS, configs: Sequence[str] | None = None) -> list[Split]:
    """Per configuration: fit the runs of every budget below the second largest, predict the runs at the largest."""
    t = load_porian()
    return [_two_steps_out("porian_far", cfg, rows, rows["flops"], group=cfg, cap=cap)
            for cfg, rows in ((c, t[t["config"] == c]) for c in (sorted(t["config"].unique()) if configs is None else configs))]


def splits_porian(cap: int = MAX_TARGETS, configs: Sequence[str] | None = None) -> list[Split]:
    """Per configuration: fit the runs of every budget below the largest, predict the runs at the largest budget."""
    t = load_porian()
    out = []
    for cfg in sorted(t["config"].unique()) if configs is None else configs:
        rows = t[t["config"] == cfg]
        held = rows.loc[rows["flops"] == rows["flops"].max(), "run"]
        out.append(_leave_out("porian", cfg, rows, held, group=cfg, cap=cap))
    return out


def splits_datablations(cap: int = MAX_TARGETS, data: Sequence[str] = ("c4", "oscar")) -> list[Split]:
    """Per data set (c4, oscar): fit every 2.8B and 4.2B run (all epoch counts), predict the 8.7B runs along their curves."""
    t = load_datablations()
    out = []
    for d in data:
        rows = t[t["data"] == d]
        held = rows.loc[rows["params_active"] == rows["params_active"].max(), "run"].unique()
        out.append(_leave_out("hh_datablations", f"{d}: fit 2.8B+4.2B, predict 8.7B", rows, held, group=d, cap=cap))
    return out


def splits_opt(cap: int = MAX_TARGETS) -> list[Split]:
    """Fit OPT 125M-13B, predict 30B's and 175B's curves."""
    t = load_opt()
    held = t.loc[t["params_active"] >= 30e9, "run"].unique()
    return [_leave_out("hh_opt", "fit 125M-13B, predict 30B+175B", t, held, cap=cap)]


def _refit_splits(dataset: str, table: pd.DataFrame, runs: Sequence[str], prefixes: Sequence[float]) -> list[Split]:
    """Per run and prefix p: the live prefix is the run's evals up to p * its last step; predict the rest.
    The ladder is the runs of other sizes, when there are any."""
    out = []
    for run in runs:
        rows = table[table["run"] == run].sort_values("step")
        size = float(rows["params_active"].iloc[0])
        others = table[(table["run"] != run) & (np.abs(table["params_active"] / size - 1) > 0.02)]
        train = validate_table(others.reset_index(drop=True)) if len(others) else None
        target = _target_from_run(table, run, lr=False)
        last = int(rows["step"].max())
        for p in prefixes:
            live = rows[rows["step"] <= p * last]
            rest = rows[rows["step"] > p * last]
            h = HeldOut(run=str(run), target=target, points=_thin(rest[["step", "loss"]]), live=validate_table(live.reset_index(drop=True)))
            out.append(Split(dataset, f"{run}: live first {p:.0%}", train, (h,), group=str(run)))
    return out


def splits_olmo(runs: Sequence[str] = tuple(OLMO_LOSS), prefixes: Sequence[float] = REFIT_PREFIXES) -> list[Split]:
    return _refit_splits("hh_olmo", load_olmo(), runs, prefixes)


def splits_k2(prefixes: Sequence[float] = REFIT_PREFIXES) -> list[Split]:
    return _refit_splits("hh_k2", load_k2(), ["K2-65B"], prefixes)


def all_splits(datasets: Sequence[str] = DATASETS, *, quick: bool = False) -> list[Split]:
    """Every split of the named data sets. quick: a small subset (one split per data set, one target per split)."""
    unknown = sorted(set(datasets) - set(DATASETS))
    if unknown:
        raise ValueError(f"unknown data set(s) {unknown}; choose from {list(DATASETS)}")
    cap = 1 if quick else MAX_TARGETS
    build: dict[str, Callable[[], list[Split]]] = {
        "chinchilla": lambda: splits_chinchilla(cap=cap),
        "chinchilla_overtrained": lambda: splits_chinchilla_overtrained(cap=cap),
        "steplaw_dense": lambda: splits_steplaw_dense(cap=cap),
        "steplaw_dense_overtrained": lambda: splits_steplaw_dense_overtrained(cap=cap),
        "steplaw_moe": lambda: splits_steplaw_moe(cap=cap),
        "multipower": lambda: splits_multipower(cap=cap, sizes=(), cross_size=True) if quick else splits_multipower(),
        "marin": lambda: splits_marin(hero=not quick),
        "porian": lambda: splits_porian(cap=cap, configs=["rw_base_short_kaplan_standard_val"]) if quick else splits_porian(),
        "hh_datablations": lambda: splits_datablations(cap=cap, data=("c4",)) if quick else splits_datablations(),
        "hh_opt": lambda: splits_opt(cap=cap),
        "hh_olmo": lambda: splits_olmo(runs=["OLMo-7B"], prefixes=(0.2,)) if quick else splits_olmo(),
        "hh_k2": lambda: splits_k2(prefixes=(0.2,)) if quick else splits_k2(),
        "chinchilla_far": lambda: splits_chinchilla_far(cap=cap),
        "steplaw_dense_far": lambda: splits_steplaw_dense_far(cap=cap),
        "steplaw_moe_far": lambda: splits_steplaw_moe_far(cap=cap),
        "marin_far": splits_marin_far,
        "porian_far": lambda: splits_porian_far(cap=cap, configs=["rw_base_short_kaplan_standard_val"]) if quick else splits_porian_far(),
    }
    out: list[Split] = []
    for d in DATASETS:
        if d in datasets:
            out.extend(build[d]())
    return out


# ---------------------------------------------------------------- running


class SuiteTimeout(BaseException):
    """A method call ran past its time limit (BaseException so a method's `except Exception` cannot swallow it)."""


def _call_with_timeout(fn: Callable[[], Forecast], timeout_s: float | None) -> Forecast:
    use_alarm = timeout_s and hasattr(signal, "SIGALRM")
    if use_alarm:
        try:
            def on_alarm(signum, frame):  # noqa: ARG001
                raise SuiteTimeout()

            old = signal.signal(signal.SIGALRM, on_alarm)
        except ValueError:  # not the main thread: no timeout
            use_alarm = False
    if not use_alarm:
        return fn()
    signal.setitimer(signal.ITIMER_REAL, float(timeout_s))
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def flat_prior(target: TargetSpec, live: pd.DataFrame) -> Forecast:
    """A prior that says nothing (band 1e-100x to 1e100x the last live loss, a log-normal sigma of 117):
    refit_forecast then follows the live prefix alone (the prior's weight is below 1e-5 wherever the live sigma is
    under 0.37). What the live_only column scores on refit splits."""
    y = float(live.sort_values("step")["loss"].iloc[-1])
    return Forecast(
        target=target, method="flat_prior", inputs_fingerprint="none", curve=[], final_loss=y,
        final_loss_lo=y * 1e-100, final_loss_hi=y * 1e100, law="flat prior (no ladder)",
    )


def _forecast(split: Split, h: HeldOut, method: str, n_bootstrap: int, seed: int) -> tuple[Forecast, str]:
    """(forecast, method that produced it: for refits the prior's method)."""
    if h.live is None:
        f = api.forecast_target(split.train, h.target, method=method, n_bootstrap=n_bootstrap, seed=seed)
        return f, _made_by(f)
    if method == LIVE_ONLY:
        prior = flat_prior(h.target, h.live)
        table = split.train if split.train is not None else h.live
    else:
        if split.train is None:
            raise FitError("no other model sizes in this data set: no ladder to fit a prior on")
        prior = api.forecast_target(split.train, h.target, method=method, n_bootstrap=n_bootstrap, seed=seed)
        table = split.train
    f = api.refit_forecast(table, h.target, h.live, prior=prior, n_bootstrap=n_bootstrap, seed=seed)
    return f, _made_by(prior)


def _made_by(f: Forecast) -> str:
    """The method that made `f`; a blend names its members ("blend(overtrain+farseer)", heaviest first)."""
    weights = sorted(((c["blend_weight"], c["method"]) for c in f.selection if c.get("blend_weight")), reverse=True)
    return f"blend({'+'.join(m for _, m in weights)})" if f.method == "blend" and weights else f.method


def score_forecast(f: Forecast, h: HeldOut) -> pd.DataFrame:
    """One row per held-out point: step, actual, pred, lo, hi, rel_error, covered, half_width, final (bool).

    Points a final-only forecast cannot speak to (before the target's planned end) are left out.
    """
    pts = h.points.sort_values("step").reset_index(drop=True)
    steps, actual = pts["step"].to_numpy(int), pts["loss"].to_numpy(float)
    if len(f.curve) >= 2:
        band = np.array([f.band_at(int(s)) for s in steps], dtype=float).reshape(-1, 3)
        keep = np.ones(len(steps), bool)
    else:
        keep = steps >= h.target.steps()
        band = np.tile([f.final_loss, f.final_loss_lo, f.final_loss_hi], (len(steps), 1)).astype(float)
    final = np.zeros(len(steps), bool)
    final[-1] = True
    p, lo, hi = band[:, 0], band[:, 1], band[:, 2]
    out = pd.DataFrame({
        "step": steps, "actual": actual, "pred": p, "lo": lo, "hi": hi, "rel_error": p / actual - 1,
        "covered": (lo <= actual) & (actual <= hi), "half_width": (hi - lo) / 2 / p, "final": final,
    })
    return out[keep].reset_index(drop=True)


def suite_methods(methods: Sequence[str] | None = None) -> list[str]:
    """Every method of forecasting.api.METHODS (read now, so new methods show up) plus auto, or the ones asked for."""
    known = list(api.METHODS) + ["auto", LIVE_ONLY]
    if methods is None:
        return list(api.METHODS) + ["auto"]
    bad = [m for m in methods if m not in known]
    if bad:
        raise ValueError(f"unknown method(s) {bad}; choose from {known}")
    return list(methods)


@dataclass
class SuiteResult:
    points: pd.DataFrame  # one row per scored point (dataset, split, group, method, run, step, ...)
    statuses: pd.DataFrame  # one row per (split, method, target): status ok / n/a / error / timeout, reason, picked
    methods: list[str]
    n_bootstrap: int
    wall_s: float
    quick: bool = False
    splits: list[dict] = field(default_factory=list)
    timeout_s: float | None = None
    budget_s: float | None = None


def run_suite(
    splits: Sequence[Split], methods: Sequence[str] | None = None, *, n_bootstrap: int = 20, seed: int = 0,
    timeout_s: float | None = 120.0, budget_s: float | None = None, progress: Callable[[str], None] | None = None,
    quick: bool = False,
) -> SuiteResult:
    """Run every method on every split; never raises for a method's failure (see the module docstring).

    budget_s: total seconds one method may spend on one data set; targets after that are "budget" (skipped).
    """
    methods = suite_methods(methods)
    if any(s.kind == "refit" for s in splits) and LIVE_ONLY not in methods:
        methods = methods + [LIVE_ONLY]
    t_start = time.perf_counter()
    pts, stats = [], []
    timed_out: set[tuple[str, str]] = set()  # (data set, method) that ran past timeout_s once
    spent: dict[tuple[str, str], float] = {}
    for split in splits:
        for m in methods:
            if m == LIVE_ONLY and split.kind != "refit":
                continue
            for h in split.targets:
                row = {"dataset": split.dataset, "split": split.name, "group": split.group, "method": m, "run": h.run,
                       "picked": None, "reason": "", "seconds": 0.0}
                if (split.dataset, m) in timed_out:
                    stats.append(row | {"status": "timeout", "reason": "skipped after a timeout on this data set"})
                    continue
                if budget_s is not None and spent.get((split.dataset, m), 0.0) > budget_s:
                    stats.append(row | {"status": "budget", "reason": f"skipped: over {budget_s:g} s on this data set"})
                    continue
                t0 = time.perf_counter()
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        f, picked = _call_with_timeout(lambda: _forecast(split, h, m, n_bootstrap, seed), timeout_s)
                    scored = score_forecast(f, h)
                    if not np.all(np.isfinite(scored[["pred", "lo", "hi"]].to_numpy(float))):
                        raise FitError("non-finite prediction or band")
                    if scored.empty:
                        raise FitError("a final-only forecast, and the target has no point at its planned end")
                    row |= {"status": "ok", "picked": picked}
                    scored = scored.assign(dataset=split.dataset, split=split.name, group=split.group, method=m, run=h.run,
                                           curve_target=len(h.points) > 1, has_curve=len(f.curve) >= 2)
                    pts.append(scored)
                except SuiteTimeout:
                    timed_out.add((split.dataset, m))
                    row |= {"status": "timeout", "reason": f"over {timeout_s:g} s"}
                except (FitError, ValueError) as e:
                    row |= {"status": "n/a", "reason": _one_line(e)}
                except Exception as e:  # noqa: BLE001 - a method's bug must not stop the suite; it is reported
                    row |= {"status": "error", "reason": f"{type(e).__name__}: {_one_line(e)}"}
                row["seconds"] = time.perf_counter() - t0
                spent[(split.dataset, m)] = spent.get((split.dataset, m), 0.0) + row["seconds"]
                stats.append(row)
                if progress:
                    progress(f"{split.dataset} | {split.name} | {m} | {h.run}: {row['status']} ({row['seconds']:.1f} s)")
    cols = ["dataset", "split", "group", "method", "run", "step", "actual", "pred", "lo", "hi", "rel_error", "covered",
            "half_width", "final", "curve_target", "has_curve"]
    points = pd.concat(pts, ignore_index=True)[cols] if pts else pd.DataFrame(columns=cols)
    info = [{"dataset": s.dataset, "split": s.name, "group": s.group, "kind": s.kind,
             "train_runs": 0 if s.train is None else int(s.train["run"].nunique()),
             "targets": [h.run for h in s.targets], "points": int(sum(len(h.points) for h in s.targets))} for s in splits]
    return SuiteResult(points, pd.DataFrame(stats), methods, n_bootstrap, time.perf_counter() - t_start, quick, info,
                       timeout_s, budget_s)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


# ---------------------------------------------------------------- aggregation


Z50, Z80 = 0.6744897501960817, 1.2815515655446004  # the 50% and 80% two-sided normal quantiles (Z95: forecast)


def band_z(points: pd.DataFrame) -> np.ndarray:
    """Each point's error in units of its band's sigma (`forecasting.forecast.log_band_z`: the 95% band read as
    log-normal, the half on the actual's side; |z| <= 1.96 exactly when the band covers the actual)."""
    return log_band_z(points["actual"], points["pred"], points["lo"], points["hi"])


def metrics(points: pd.DataFrame) -> dict:
    """MAE %, signed mean %, 95% coverage %, median half-width %, n, over the given points; and the calibration read
    from the same bands (`band_z`): the share within the 50% and 80% bands and the median |z| (0.67 when
    calibrated)."""
    if len(points) == 0:
        return {"mae": None, "bias": None, "coverage": None, "half_width": None, "n": 0, "coverage_50": None,
                "coverage_80": None, "median_abs_z": None, "covered": 0}
    r = points["rel_error"].to_numpy(float)
    z = np.abs(band_z(points)) if {"actual", "pred", "lo", "hi"} <= set(points.columns) else None
    covered = points["covered"].to_numpy(bool)
    return {
        "mae": float(100 * np.mean(np.abs(r))), "bias": float(100 * np.mean(r)),
        "coverage": float(100 * np.mean(covered)),
        "half_width": float(100 * np.median(points["half_width"].to_numpy(float))), "n": int(len(r)),
        "coverage_50": None if z is None else float(100 * np.mean(z <= Z50)),
        "coverage_80": None if z is None else float(100 * np.mean(z <= Z80)),
        "median_abs_z": None if z is None else float(np.median(z)), "covered": int(covered.sum()),
    }


def coverage_range(n: int, level: float = 0.95, alpha: float = 0.05) -> tuple[int, int]:
    """The counts of n independent targets a calibrated `level` band covers with probability 1 - alpha (the central
    range of Binomial(n, level)): (8, 10) for 10 targets, (78, 86) for 87, where 87 of 87 is too many."""
    from scipy.stats import binom

    return int(binom.ppf(alpha / 2, n, level)), int(binom.isf(alpha / 2, n, level))


def intraclass_correlation(groups: Sequence, values: np.ndarray) -> float:
    """The share of the values' variance that their group shares (one-way random-effects ANOVA estimator, clipped to
    [0, 1]; non-finite values left out); 0 when it cannot be estimated (one group, or every group of one value)."""
    frame = pd.DataFrame({"g": list(groups), "v": np.asarray(values, dtype=float)})
    frame = frame[np.isfinite(frame["v"])]
    sizes, means = frame.groupby("g")["v"].size(), frame.groupby("g")["v"].mean()
    n, k = len(frame), len(sizes)
    if k < 2 or n <= k:
        return 0.0
    between = float(np.sum(sizes * (means - frame["v"].mean()) ** 2) / (k - 1))
    within = float(np.sum((frame["v"] - frame["g"].map(means)) ** 2) / (n - k))
    n0 = (n - float(np.sum(sizes**2)) / n) / (k - 1)
    if between + (n0 - 1) * within <= 0:
        return 0.0
    return float(np.clip((between - within) / (between + (n0 - 1) * within), 0.0, 1.0))


def clustered_coverage_range(sizes: Sequence[int], rho: float, level: float = 0.95, alpha: float = 0.05,
                             draws: int = 20_000, seed: int = 0) -> tuple[int, int]:
    """The counts a calibrated `level` band covers with probability 1 - alpha when targets come in clusters of these
    sizes whose errors share a fraction `rho` of their variance (z = sqrt(rho) u_cluster + sqrt(1 - rho) e, N(0, 1)
    for each target): the central range of the simulated count. With rho = 0, `coverage_range`.

    Why: the targets of one split are forecast from one fit, so their errors move together (Porian's 87 targets are
    15 splits whose mean z runs from -0.9 to +0.9); the binomial range counts them as 87 independent draws and says
    87 of 87 is too many, where with clustered errors it is a common outcome of a calibrated band."""
    sizes = np.asarray(sizes, dtype=int)
    if rho <= 0 or len(sizes) < 2:
        return coverage_range(int(sizes.sum()), level, alpha)
    from scipy.stats import norm

    rng = np.random.default_rng(seed)
    shared = np.repeat(rng.standard_normal((draws, len(sizes))), sizes, axis=1)
    z = math.sqrt(rho) * shared + math.sqrt(1 - rho) * rng.standard_normal((draws, int(sizes.sum())))
    counts = np.sum(np.abs(z) <= norm.ppf(0.5 + level / 2), axis=1)
    lo, hi = np.quantile(counts, [alpha / 2, 1 - alpha / 2], method="inverted_cdf")
    return int(lo), int(hi)


def _kind_points(p: pd.DataFrame, kind: str) -> pd.DataFrame:
    return p[p["final"]] if kind == "final" else p[p["curve_target"] & p["has_curve"]]


def summarise(res: SuiteResult, by: Sequence[str] = ("dataset",)) -> list[dict]:
    """Rows per (by..., method): final and curve metrics, status (ok / partial / n/a ...) and, for auto, its picks."""
    rows = []
    by = list(by)
    for key, st in res.statuses.groupby(by + ["method"], sort=False):
        key = key if isinstance(key, tuple) else (key,)
        sel = np.ones(len(res.points), bool)
        for col, val in zip(by + ["method"], key, strict=True):
            sel &= (res.points[col] == val).to_numpy()
        p = res.points[sel]
        n_ok, n_all = int((st["status"] == "ok").sum()), len(st)
        if n_ok == n_all:
            status = "ok"
        elif n_ok:
            bad = st[st["status"] != "ok"]
            status = f"partial ({n_ok}/{n_all} targets; first other: {bad['status'].iloc[0]}: {bad['reason'].iloc[0]})"
        else:
            bad = st[st["status"] != "ok"]
            status = f"{bad['status'].iloc[0]}: {bad['reason'].iloc[0]}"
        picks = st["picked"].dropna().value_counts().to_dict()
        rows.append(dict(zip(by, key[:-1], strict=True)) | {
            "method": key[-1], "status": status, "targets_ok": n_ok, "targets": n_all,
            "final": metrics(_kind_points(p, "final")), "curve": metrics(_kind_points(p, "curve")),
            "picked": {str(k): int(v) for k, v in picks.items()}, "seconds": float(st["seconds"].sum()),
        })
    return rows


def check_auto(res: SuiteResult, *, margin: float = 0.5, band: tuple[float, float] = (88.0, 98.0)) -> list[dict]:
    """Issue 13's bar per data set and kind: auto's MAE within `margin` points of the best single method that ran on
    every target, and auto's 95% coverage inside `band`. Only where auto and a complete single method both scored."""
    rows = summarise(res)
    out = []
    singles = [m for m in res.methods if m not in ("auto", LIVE_ONLY)]
    for d in dict.fromkeys(r["dataset"] for r in rows):
        cell = {r["method"]: r for r in rows if r["dataset"] == d}
        for kind in ("final", "curve"):
            a = cell.get("auto")
            if a is None or a[kind]["mae"] is None:
                continue
            full = {m: cell[m][kind]["mae"] for m in singles + [LIVE_ONLY]
                    if m in cell and cell[m]["status"] == "ok" and cell[m][kind]["mae"] is not None}
            best = min(full, key=full.get) if full else None
            gap = a[kind]["mae"] - full[best] if best else None
            cov = a[kind]["coverage"]
            pts = res.points[(res.points["dataset"] == d) & (res.points["method"] == "auto")]
            out.append({
                "dataset": d, "kind": kind, "auto_mae": a[kind]["mae"], "best": best,
                "best_mae": full[best] if best else None, "gap": gap, "auto_coverage": cov,
                "auto_half_width": a[kind]["half_width"], "auto_status": a["status"],
                "mae_ok": gap is None or gap <= margin, "coverage_ok": band[0] <= cov <= band[1],
            } | _calibration(a[kind], kind, _kind_points(pts, kind)))
    return out


def _calibration(m: dict, kind: str, points: pd.DataFrame) -> dict:
    """auto's 50/80% coverages and median |z| in a check row, and for final points whether the count covered lies in
    the range of a calibrated 95% band (None for curve points, whose errors along one curve are not separate draws):
    `covered_range` is the binomial range of independent targets; in `covered_range_clustered` the targets of one
    split (one fit) share the part `icc` of their errors' variance that their `band_z` shows they share
    (`intraclass_correlation`, `clustered_coverage_range`), and the verdict reads it."""
    out = {k: m[k] for k in ("coverage_50", "coverage_80", "median_abs_z")} | {"n": m["n"], "covered": m["covered"]}
    if kind != "final" or not m["n"]:
        return out | {"covered_range": None, "covered_range_clustered": None, "icc": None, "n_splits": None,
                      "coverage_consistent": None}
    splits = list(zip(points["dataset"], points["split"], strict=True))
    icc = intraclass_correlation(splits, band_z(points)) if {"actual", "pred", "lo", "hi"} <= set(points.columns) else 0.0
    sizes = pd.Series(splits).value_counts().to_numpy()
    clustered = clustered_coverage_range(sizes, icc)
    return out | {"covered_range": coverage_range(m["n"]), "covered_range_clustered": clustered, "icc": icc,
                  "n_splits": len(sizes), "coverage_consistent": clustered[0] <= m["covered"] <= clustered[1]}


def pooled_calibration(res: SuiteResult, method: str = "auto") -> list[dict]:
    """`method`'s metrics over every data set's points pooled, per kind (each target counts once, so the data sets
    with many targets weigh more: the per-data-set rows are the fair comparison, these the overall calibration)."""
    p = res.points[res.points["method"] == method]
    out = []
    for kind in ("final", "curve"):
        m = metrics(_kind_points(p, kind))
        if m["n"]:
            out.append({"kind": kind} | m | _calibration(m, kind, _kind_points(p, kind)))
    return out


def _cell(r: dict | None, kind: str) -> str:
    if r is None:
        return "—"
    m = r[kind]
    if m["mae"] is None:
        return "n/a" if r["status"] != "ok" else "—"
    s = f"{m['mae']:.2f} / {m['coverage']:.0f} / {m['half_width']:.2f}"
    return s + "*" if r["status"] != "ok" else s


def markdown_table(res: SuiteResult, kind: str = "final") -> str:
    """Rows = data sets, columns = methods; cells 'MAE% / cov% / hw%' (* = not every target ran), plus the mean
    over data sets (each data set counts once) and auto's picks."""
    rows = summarise(res)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = [m for m in res.methods if any(r["method"] == m for r in rows)]
    lines = ["| data set | " + " | ".join(methods) + " | auto picked |", "|---" * (len(methods) + 2) + "|"]
    for d in datasets:
        cell = {r["method"]: r for r in rows if r["dataset"] == d}
        if not any(cell[m][kind]["n"] for m in cell):
            continue
        picks = cell.get("auto", {}).get("picked", {})
        lines.append(f"| {d} | " + " | ".join(_cell(cell.get(m), kind) for m in methods) + " | "
                     + ", ".join(f"{k} x{v}" for k, v in picks.items()) + " |")
    means = []
    for m in methods:
        vals = [r[kind] for r in rows if r["method"] == m and r[kind]["mae"] is not None]
        if vals:
            means.append(f"{np.mean([v['mae'] for v in vals]):.2f} / {np.mean([v['coverage'] for v in vals]):.0f} / "
                         f"{np.mean([v['half_width'] for v in vals]):.2f} ({len(vals)})")
        else:
            means.append("—")
    lines.append("| **mean over data sets** (n) | " + " | ".join(means) + " | |")
    return "\n".join(lines)


def failures_table(res: SuiteResult) -> str:
    """One line per (data set, method) that did not run on every target: its status and first reason."""
    lines = ["| data set | method | status |", "|---|---|---|"]
    for r in summarise(res):
        if r["status"] != "ok":
            lines.append(f"| {r['dataset']} | {r['method']} | {r['status'].replace('|', '/')} |")
    return "\n".join(lines)


def to_json(res: SuiteResult) -> dict:
    """The whole result as plain data: per data set, per split, per group (Porian's configurations) and the check."""
    return {
        "methods": res.methods, "n_bootstrap": res.n_bootstrap, "wall_s": res.wall_s, "quick": res.quick,
        "timeout_s": res.timeout_s, "budget_s": res.budget_s,
        "caps": {"max_targets_per_split": MAX_TARGETS, "max_curve_points_per_target": MAX_CURVE_POINTS},
        "splits": res.splits,
        "datasets": summarise(res, ("dataset",)),
        "by_split": summarise(res, ("dataset", "split")),
        "by_group": summarise(res, ("dataset", "group")),
        "check": check_auto(res),
        "calibration": pooled_calibration(res),
        "statuses": res.statuses.to_dict(orient="records"),
    }


def data_files() -> list[Path]:
    """The shipped files the suite reads (all under data_dir())."""
    d = data_dir()
    return [d / "chinchilla_svg_extracted_data.csv", d / "steplaw", d / "multipowerlaw", d / "marin_535b_ladder",
            d / "porian2024", d / "colpret_hitchhiker"]


def check_table(res: SuiteResult) -> str:
    """Issue 13's bar, one line per (data set, kind) where auto scored."""
    lines = ["| data set | kind | auto MAE % | best single (MAE %) | gap (pts) | within 0.5 | auto cov % | in 88-98 | auto median hw % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in check_auto(res):
        best = f"{c['best']} ({c['best_mae']:.2f})" if c["best"] else "none ran on every target"
        gap = f"{c['gap']:+.2f}" if c["gap"] is not None else "—"
        star = "" if c["auto_status"] == "ok" else "*"
        lines.append(f"| {c['dataset']} | {c['kind']} | {c['auto_mae']:.2f}{star} | {best} | {gap} | "
                     f"{'yes' if c['mae_ok'] else 'NO'} | {c['auto_coverage']:.0f} | {'yes' if c['coverage_ok'] else 'NO'} | "
                     f"{c['auto_half_width']:.2f} |")
    return "\n".join(lines)


def _calibration_row(name: str, c: dict, coverage: float) -> str:
    rng, clustered = c["covered_range"], c["covered_range_clustered"]
    verdict = "—" if rng is None else (
        f"{c['covered']} of {c['n']} (calibrated: {rng[0]}-{rng[1]} independent"
        + (f"; {clustered[0]}-{clustered[1]} in {c['n_splits']} splits sharing {c['icc']:.2f} of the variance"
           if clustered != rng else "") + f"): {'yes' if c['coverage_consistent'] else 'NO'}")
    z = "—" if c["median_abs_z"] is None else f"{c['median_abs_z']:.2f}"
    cov = "—" if c["coverage_50"] is None else f"{c['coverage_50']:.0f} / {c['coverage_80']:.0f}"
    return f"| {name} | {c['kind']} | {c['n']} | {cov} | {coverage:.0f} | {z} | {verdict} |"


def calibration_table(res: SuiteResult) -> str:
    """auto's bands read at three levels per (data set, kind), and pooled over every data set."""
    lines = ["| data set | kind | points | cov 50 / 80 % | cov 95 % | median abs z | 95% count consistent with a calibrated band |",
             "|---|---|---|---|---|---|---|"]
    lines += [_calibration_row(c["dataset"], c, c["auto_coverage"]) for c in check_auto(res)]
    lines += [_calibration_row("**pooled**", c, c["coverage"]) for c in pooled_calibration(res)]
    return "\n".join(lines)


def picks_table(res: SuiteResult) -> str:
    """Which method auto used on each split (for refits: the prior's method)."""
    st = res.statuses[res.statuses["method"] == "auto"]
    lines = ["| data set | split | auto picked | not ok |", "|---|---|---|---|"]
    for (d, sp), g in st.groupby(["dataset", "split"], sort=False):
        picks = g["picked"].dropna().value_counts().to_dict()
        bad = g[g["status"] != "ok"]
        lines.append(f"| {d} | {sp} | " + ", ".join(f"{k} x{v}" for k, v in picks.items()) + " | "
                     + (f"{len(bad)} ({bad['status'].iloc[0]})" if len(bad) else "") + " |")
    return "\n".join(lines)


def render_markdown(res: SuiteResult, command: str = "") -> str:
    """The suite's report: settings, the final and curve tables, the check, auto's picks and every failure."""
    n_targets = int(res.statuses.groupby(["dataset", "split", "run"]).ngroups) if len(res.statuses) else 0
    head = [
        "Cells: MAE % / 95% coverage % / median relative half-width % of held-out points; `*` = the method ran on",
        "only some targets of that data set (see the failures); `n/a` = it ran on none; `—` = nothing of that kind to",
        "score (a final-only method on curve points, or a column that does not apply). The last row averages the data",
        f"sets each method ran on (each data set counts once; n = how many). Methods: {', '.join(res.methods)}.",
        f"Settings: n_bootstrap = {res.n_bootstrap}, at most {1 if res.quick else MAX_TARGETS} target(s) per split, at most {MAX_CURVE_POINTS} "
        f"scored points per curve target, {'no' if res.timeout_s is None else f'{res.timeout_s:g} s'} limit per call, "
        f"{'no budget' if res.budget_s is None else f'{res.budget_s:g} s budget'} per method and data set"
        f"{' (quick subset: one split per data set)' if res.quick else ''}; {len(res.splits)} splits, {n_targets} "
        f"held-out targets; wall time {res.wall_s:.0f} s.",
    ]
    if command:
        head.insert(0, f"Command: `{command}`\n")
    return "\n".join([
        *head, "", "### Final points (each target's last held-out point)", "", markdown_table(res, "final"), "",
        "### Curve points (every held-out eval of curve targets)", "", markdown_table(res, "curve"), "",
        "### auto against issue 13's bar", "", check_table(res), "",
        "### Calibration of auto's bands", "",
        "Each band read as log-normal (`suite.band_z`): the share of points within its 50% and 80% bands (50 and 80",
        "when calibrated), the median |z| (0.67 when calibrated; smaller = too wide), and for final points whether the",
        "count inside the 95% band lies in the range a calibrated band gives that many targets: independent (the",
        "binomial range), and with the targets of one split sharing the part of their errors' variance they share",
        "here (intraclass correlation of z by split; the verdict reads this range).", "",
        calibration_table(res), "", "### What auto picked", "", picks_table(res), "",
        "### Methods that did not run on every target", "", failures_table(res), "",
    ])
