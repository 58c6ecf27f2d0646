"""`method="auto"`: the law chosen from evidence, by a backtest on the table it is given.

Why a backtest and not rules on columns: which law extrapolates best depends on the ladder (its spread
in tokens per parameter, its sparsity, its schedule), and the only evidence a user has is how each law
predicted the ladder's own larger runs. Every applicable candidate is backtested on the same expanding
splits (fit the smaller runs by compute, predict every larger one, and a rung that stopped beyond the finished
ones along its evals so far; `forecasting.final_laws`), scored by
its error per unit of extrapolation distance (decades of compute or model size beyond the fitted runs,
plus decades of tokens per parameter and of sparsity outside them: `final_laws.distance`) on the splits that fit the most runs (`final_laws.LATE_SPLITS`:
the ones most like the forecast, which fits every run), and the candidate with the smallest expected error at the
target's own distance wins. The expected error carries the same small-sample factor as the band's extrapolation
term (`final_laws.small_sample_factor` of the independent errors the backtest measured, 1.62x for one held-out
size, 1.11x for ten): a law whose larger fits leave it a single held-out size to be scored on (Chinchilla's five
parameters on a short ladder) is not preferred for one lucky point over a law scored on ten sizes. A simpler law
within 10% of the best is preferred (fewer parameters, less luck). When the target's tokens per parameter lie
outside the runs' range, the backtest also extrapolates along D/N (`final_laws._dn_splits`), and a law the
ladder cannot test that way (too few runs below the cut for its parameters) is not compared with those it can.
On a ladder that repeats its data, a candidate is scored on the held-out runs at about the target's epochs
(`final_laws.at_repetition`), as its band is: a law can hold at 4 epochs and fail at 44.

Rules that are not backtests:
- `multipower` when the table holds curves of the target's own size with logged LR and the target's
  schedule is known: that is a schedule transfer, not a size extrapolation, and CURVE's law is
  calibrated on those very curves.
- `matched_progress` is a same-recipe method: refused, with the reason, when the target's tokens per
  parameter lie outside the rungs' range (x/÷ `final_laws.DN_SLACK`, the slack the D/N backtest uses too).
- A law is not a candidate where the ladder varies a column it does not read while everything else agrees,
  and an applicable law reads that column (`final_laws.hidden_column_blind_spot`): on a data-constrained ladder
  (runs of one size and token count at 1 to 44 epochs) only the data-constrained law tells them apart; on a
  ladder of MoE runs of one active size at several total sizes, only the MoE law. A backtest cannot show the
  blind law's flaw when the held-out runs repeat the fitted runs' spread: it predicts their average, and scores
  about as well as a law that tells them apart (on the public suite's data-constrained ladder, overtrain 6.3%
  against 6.4% RMS, and auto blended them).
- `compute` is not a candidate on an IsoFLOP ladder (several model sizes at one budget, their losses apart:
  `final_laws.compute_law_blind_spot`): a law of compute alone gives every size at the target's budget one loss.
- Nothing can be backtested (too few runs): the first applicable of matched_progress, chinchilla,
  overtrain, compute, data_constrained, moe is the reference, every applicable one of them is marked
  `no_evidence`, and `forecasting.blend` averages those with equal weights (nothing tells them apart), with a
  warning.

The choice is the law `auto` is built around; `forecasting.blend` then decides whether the forecast is that law's
alone or its blend with the laws whose expected errors the backtest could not tell from it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from forecasting import final_laws as fl
from forecasting.backtest import held_out_run, last_points
from forecasting.fitting import FitError, MissingColumnsError
from forecasting.forecast import TargetSpec
from forecasting.matched_progress import fit_profiled

PREFER_SIMPLER = 1.10
SIMPLICITY = {"matched_progress": 0, "compute": 1, "overtrain": 2, "chinchilla": 3, "farseer": 4, "moe": 4, "data_constrained": 4}


def n_curve_runs(table: pd.DataFrame) -> int:
    if not {"fraction", "flops"} <= set(table.columns):
        return 0
    return int((table.groupby("run")["fraction"].nunique() >= 2).sum())


def matched_progress_refusal(table: pd.DataFrame, target: TargetSpec | None) -> str | None:
    """Why matched progress must not forecast this target (None when it may)."""
    if n_curve_runs(table) < 3:
        return "needs at least three rungs with whole curves (fraction and flops columns)"
    if target is None or not {"params_active", "tokens"} <= set(table.columns):
        return None
    last = last_points(table)
    m = (last["run_tokens"] / last["params_active"]).to_numpy(float)
    m_t = target.tokens / target.params_active
    if not (m.min() / fl.DN_SLACK <= m_t <= m.max() * fl.DN_SLACK):
        return (f"the target's {m_t:.3g} tokens per parameter lie outside the rungs' {m.min():.3g}-{m.max():.3g}: "
                "matched progress assumes rungs and target share tokens-per-parameter scaling")
    return None


def backtest_matched_progress(table: pd.DataFrame, *, max_splits: int = 5, curves: bool = False):
    """Matched progress on the same expanding splits as the final laws, scored on each held-out run's last point
    (or, with `curves`, on every eval of each held-out run)."""
    last = last_points(table)
    held, rel, dist, final = [], [], [], None
    sizes: list[float] = []  # of the held-out runs, counted as the final laws' backtests count them
    point_split: list[int] = []  # each point's split and each held run's, as the final laws' backtests record them
    held_split: list[int] = []
    per_run = []
    for i, k in enumerate(fl._splits(len(last), 3, max_splits)):
        fit_runs = list(last["run"].iloc[:k])
        try:
            fit = fit_profiled(table[table["run"].isin(fit_runs)], min_runs=3)
        except FitError:
            continue
        part = last.iloc[k:]
        pred = np.array([fit.predict(g, c)[0] for g, c in zip(part["fraction"], part["run_flops"], strict=True)])
        d = fl.distance(fl.points_of(part), fl.points_of(last.iloc[:k]))
        if curves:
            for (_, row), d_run in zip(part.iterrows(), d, strict=True):
                curve = table[table["run"] == row["run"]].sort_values("step")
                p = fit.predict(curve["fraction"].to_numpy(float), float(row["run_flops"]))
                rel.extend(p / curve["loss"].to_numpy(float) - 1)
                dist.extend([d_run] * len(curve))
                per_run.append(held_out_run(row["run"], f"{k} runs", d_run, p, curve["loss"].to_numpy(float)))
        else:
            rel.extend(pred / part["loss"].to_numpy(float) - 1)
            dist.extend(d)
            per_run.extend(held_out_run(run, f"{k} runs", d_run, [p], [y])
                           for run, d_run, p, y in zip(part["run"], d, pred, part["loss"].to_numpy(float), strict=True))
        point_split.extend([i] * (len(rel) - len(point_split)))
        held.extend(part["run"].astype(str))
        held_split.extend([i] * len(part))
        if "params_active" in part.columns:
            sizes.extend(part["params_active"].astype(float))
        final = (str(part["run"].iloc[-1]), float(pred[-1]), float(part["loss"].iloc[-1]))
    return fl.summarise("matched_progress", held, rel, dist, final, sizes, point_split=point_split, held_split=held_split,
                        per_run=per_run)


def select_method(table: pd.DataFrame, target: TargetSpec, *, same_size_runs: list[str]) -> tuple[str, list[dict], list[str]]:
    """(chosen method, every candidate with its evidence, warnings)."""
    warn: list[str] = []
    cands: list[dict] = []
    if same_size_runs and target.lr is not None:
        cands.append({"method": "multipower", "chosen": True,
                      "reason": f"{len(same_size_runs)} curve(s) of the target's own size with logged LR: schedule transfer"})
        return "multipower", cands, warn
    try:
        final = fl.final_points(table)
    except MissingColumnsError:
        raise  # no flops and no sizes: no candidate can be fitted, and the columns are what to say
    except FitError:
        final = None
    tp = fl.target_point(target)
    ref = _all_runs(table)
    # a target with a curve is judged on the held-out runs' whole curves, when the rungs have curves to score
    curves = target.steps() > 1 and n_curve_runs(table) >= 3 and {"params_active", "tokens"} <= set(table.columns)
    dn = None if final is None or len(final) == 0 else fl.tokens_per_param_direction(final, target)
    epochs = fl.target_epochs(target)  # on a ladder that repeats its data, judged on the runs at about the target's
    frames: dict[str, pd.DataFrame] = {}
    reasons: dict[str, str | None] = {}
    for law in fl.FINAL_LAWS:
        if final is None or len(final) == 0:
            reasons[law] = "no finished run"
            continue
        frames[law] = frame = fl.fit_frame(law, table, dn)  # final points, and checkpoints where they backtest better
        reasons[law] = fl.applicable(law, frame)
    # a column only some applicable law reads (unique tokens, total parameters) rules out the laws blind to it
    # where the ladder varies it at fixed inputs: their backtest cannot show it when the held-out runs vary it alike
    readers = fl.readable_hidden_columns(reasons)
    blind = {m: fl.hidden_column_blind_spot(m, final, readers) for m in ("matched_progress", *fl.FINAL_LAWS)} if readers else {}
    mp_refusal = matched_progress_refusal(table, target) or blind.get("matched_progress")
    if mp_refusal:
        cands.append({"method": "matched_progress", "applicable": False, "reason": mp_refusal})
    else:
        key = ("mp_backtest", fl._key(table), curves)
        cands.append(_evidence("matched_progress", lambda: fl._cached(key, lambda: backtest_matched_progress(table, curves=curves)), tp, ref))
    for law in fl.FINAL_LAWS:
        if law not in frames:
            cands.append({"method": law, "applicable": False, "reason": reasons[law]})
            continue
        frame = frames[law]
        reason = reasons[law] or blind.get(law)
        if not reason and law == "compute":
            reason = fl.compute_law_blind_spot(final)
        if reason:
            cands.append({"method": law, "applicable": False, "reason": reason})
        elif curves:
            cands.append(_evidence(law, lambda law=law: fl.backtest_law_curves(law, table, dn=dn, epochs=epochs), tp, ref))
        else:
            cands.append(_evidence(law, lambda law=law, frame=frame: fl.backtest_law(law, frame, dn=dn, epochs=epochs), tp, ref))
        choice = fl.checkpoint_choice(law, table, dn)
        if choice["points"]:
            cands[-1]["checkpoints"] = choice
    for c in cands:
        c["scored_on"] = "every eval of the held-out runs" if curves else "the held-out runs' final losses"
    scored = [c for c in cands if c.get("expected_error") is not None]
    for c in scored:  # reported, not used to choose (BENCHMARKS.md: excluding them measured worse as a whole)
        bounds = _fit_at_bounds(c["method"], frames.get(c["method"]))
        if bounds:
            c["fit_at_bounds"] = bounds
    if dn is not None and any(c.get("tokens_per_param_points") for c in scored):
        # the target extrapolates in D/N: a law the ladder could not test that way is not compared with one it could
        for c in scored:
            if not c.get("tokens_per_param_points"):
                c["excluded"] = (f"not backtested along tokens per parameter ({'above' if dn == 'up' else 'below'} the "
                                 "fitted runs, where the target lies): no D/N cut left it enough runs to fit, or its fits there failed")
        scored = [c for c in scored if c.get("tokens_per_param_points")]
    elif dn is not None and scored:
        m = (final["tokens"] / final["params_active"]).to_numpy(float)
        warn.append(f"the target's {target.tokens / target.params_active:.3g} tokens per parameter lie outside the runs' "
                    f"{m.min():.3g}-{m.max():.3g} and no law could be backtested along D/N on this ladder (it needs "
                    "runs at two or more D/N ratios below a cut and more beyond it): the choice rests on splits in "
                    "compute alone, and the band counts the D/N decades at the rate those splits measured")
    if scored:
        best = min(scored, key=lambda c: c["expected_error"])
        simpler = [c for c in scored if c["expected_error"] <= best["expected_error"] * PREFER_SIMPLER]
        choice = min(simpler, key=lambda c: (SIMPLICITY[c["method"]], c["expected_error"]))
        if choice["expected_error"] > fl.WARN_ERROR:
            warn.append(poor_backtest_warning(choice, best))
    else:
        order = ["matched_progress", "chinchilla", "overtrain", "compute", "data_constrained", "moe"]
        usable = [c for c in cands if c.get("applicable", True) and c["method"] in order]
        if not usable:
            raise FitError(
                f"cannot fit any law: {table['run'].nunique()} run(s); need >= 3 runs with curves (matched progress), "
                ">= 6 finished runs over >= 2 sizes (chinchilla) or >= 3 finished runs (compute law)"
            )
        usable.sort(key=lambda c: order.index(c["method"]))
        choice = usable[0]
        for c in usable:
            c["no_evidence"] = True
        if len(usable) == 1:
            warn.append(f"no candidate could be backtested on {table['run'].nunique()} run(s); {choice['method']} chosen by rule, "
                        "its band uses the public suite's error rate")
        else:
            warn.append(f"no candidate could be backtested on {table['run'].nunique()} run(s): nothing tells "
                        f"{', '.join(c['method'] for c in usable)} apart, so they are averaged with equal weights; the band "
                        "uses the public suite's error rates and widens where they disagree")
    choice["chosen"] = True
    return choice["method"], cands, warn


def poor_backtest_warning(choice: dict, best: dict) -> str:
    """The warning for a ladder on which even the chosen law backtests poorly; it says whether that law is the best
    or the simpler one preferred within PREFER_SIMPLER of it (and names the best then)."""
    chosen_as = "the best" if choice["method"] == best["method"] else (
        f"the simplest within {PREFER_SIMPLER - 1:.0%} of the best ({best['method']}, {best['expected_error']:.1%} expected)")
    return (f"no method backtests well on this ladder: {chosen_as}, {choice['method']}, missed the ladder's own larger runs "
            f"by {choice['backtest_rms']:.1%} RMS, {choice['expected_error']:.1%} expected at the target's distance; the band "
            "is wide for that reason")


def _fit_at_bounds(method: str, final: pd.DataFrame | None) -> list[str]:
    """Parameters a surface law's fit on every finished run (and its checkpoints, when the law uses them) sits on a
    bound of (the same cached fit the forecast uses); [] for the other methods or when the fit fails (the forecast
    then reports that)."""
    if method not in fl.SURFACES or final is None:
        return []
    try:
        model = fl._cached(("fit", method, fl._key(final)), lambda: fl.fit_final(method, final))
    except FitError:
        return []
    return list(getattr(model.obj, "at_bounds", ()))


def _evidence(method: str, run_backtest, tp: dict, ref: dict | None) -> dict:
    out: dict = {"method": method, "applicable": True}
    try:
        res = run_backtest()
    except (FitError, ValueError) as e:
        out["reason"] = f"no backtest: {e}"
        return out
    d_target = float(fl.distance(tp, ref)[0]) if ref is not None else float("nan")
    n_independent = fl.independent_errors(res)
    factor = fl.small_sample_factor(n_independent)
    raw = float(res.rate * d_target) if np.isfinite(d_target) else res.rms_rel_error
    out.update(backtest_rms=res.rms_rel_error, backtest_mean=res.mean_rel_error, rate=res.rate,
               backtest_points=res.n_points, rate_points=res.rate_points or res.n_points, tokens_per_param_points=res.tokens_per_param_points, target_distance=d_target,
               independent_errors=n_independent, small_sample_factor=factor, expected_error=raw * factor)
    if res.repetition_epochs is not None:
        out["repetition_epochs"] = res.repetition_epochs
    return out


def _all_runs(table: pd.DataFrame) -> dict | None:
    """Planned size, tokens and compute of every run (finished or not): the reference for the target's distance."""
    try:
        last = last_points(table)
    except FitError:
        return None
    return fl.points_of(last.assign(tokens=last["run_tokens"]) if "run_tokens" in last.columns else last)
