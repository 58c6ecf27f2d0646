"""A run's intermediate evals as final losses of shorter runs: more points for the final-loss laws.

Why: a ladder's curves hold the loss at many token counts per model size, and a final-loss law fitted to the
last point of each run throws that away (the Hitchhiker's Guide, Choshen et al. 2025, finds that fits using
intermediate checkpoints predict better). But an eval in the middle of a run is not the loss a run trained to
that many tokens ends at: its LR has not decayed yet. On the public Multi-Power Law curves the eval near step
24k of a 72k-step cosine run sits 1.1-2.2% above the final loss of the 24k-step cosine run of the same size, a
bias as large as the errors the laws are judged on. So each checkpoint is converted, with the run's own
schedule, to the final loss of the run the recipe would have trained to that step.

How, per run (`annealed_checkpoints`):
1. fit the LR-annealing law of Tissue et al. 2024 (`forecasting.multipower.fit_lr_annealing`:
   L(s) = L0 + A S1(s)^-alpha - C S2(s), S1 the LR area, S2 the annealing area) to the run's own evals from
   FIT_FROM of the run on (before that, warmup transients, not the law's regime);
2. for an eval at step s, the shorter run is the run's schedule shape compressed to s steps (the LR at step i is
   the run's LR at fraction i/s: warmup, decay and floor at the same fractions); its final loss is
   observed(s) + law(compressed schedule, s) - law(run's schedule, s): the law carries only the schedule's
   difference, the eval keeps its own noise.
Measured on the Multi-Power pairs above (fit on the 72k cosine curve, convert its eval near 24k, compare with the
24k run's final): +0.08%, -0.03%, +0.00% for 25M, 100M, 400M (raw evals +1.1% to +2.2%); on runs of our local
ladder's recipe against the same widths trained to half and a third of the tokens, -0.08% to +1.26% (raw evals
-2.6% to -5.0%: on runs of a few hundred steps stopping early costs more LR area than the decay gives back). Both
in tests/test_forecasting_checkpoints.py and bench/bench_checkpoints.py. The Multi-Power Law itself, fitted on one curve, converts worse (+0.9% to +3.8%): its seven parameters are not pinned
by one schedule.

Which runs and evals: a logged LR that decays after its warmup (without a decay the annealing term cannot be
identified), at least MIN_EVALS evals from FIT_FROM on, a fit within MAX_FIT_RMS of them with an annealing
term C > 0; evals at MIN_FRACTION to MAX_FRACTION of the run (nearer the end the eval is almost the final one;
much earlier the correction is large and the law's extrapolation carries it), at most PER_RUN per run, evenly
spaced in log tokens. Whether a law's fit on them predicts better than on final points alone is not assumed:
`forecasting.final_laws.checkpoint_choice` decides it by backtest on each ladder.
Pure numerics on a table of runs; nothing here imports ladder/.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from forecasting.multipower import CurveData, LRAnnealingLaw, curve_from_table, fit_lr_annealing

FIT_FROM = 0.05
MIN_EVALS = 8
MAX_FIT_RMS = 0.01
MIN_FRACTION = 0.3
MAX_FRACTION = 0.95
PER_RUN = 8


def compressed_schedule(lr: np.ndarray, steps: int) -> np.ndarray:
    """The per-step LR of `lr`'s schedule shape over `steps` steps (step i takes the LR at fraction i / steps)."""
    lr = np.asarray(lr, dtype=float)
    at = np.arange(1, steps + 1, dtype=float) * (len(lr) / steps)
    return np.interp(at, np.arange(1, len(lr) + 1, dtype=float), lr)


def equivalent_final(law: LRAnnealingLaw, curve: CurveData, index: int) -> float:
    """The final loss of the run `curve`'s schedule compressed to the step of its eval `index` (see the docstring)."""
    s = int(curve.steps[index])
    shorter = law.predict(compressed_schedule(curve.lr, s), np.array([s]))[0]
    here = law.predict(curve.lr, np.array([s]))[0]
    return float(curve.loss[index] + shorter - here)


def annealing_fit(curve: CurveData) -> tuple[LRAnnealingLaw, float] | None:
    """(law, RMS log residual) of the LR-annealing law on the curve's evals from FIT_FROM on; None when the curve
    cannot identify it (no decay, too few evals)."""
    keep = np.nonzero(curve.steps >= FIT_FROM * len(curve.lr))[0]
    if len(keep) < MIN_EVALS or not curve.has_decay:
        return None
    part = curve.subset(keep)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fitting one curve is the point here; the single-curve warning is not news
        try:
            law = fit_lr_annealing([part])
        except ValueError:
            return None
    rms = float(np.sqrt(np.mean(np.log(law.predict(part.lr, part.steps) / part.loss) ** 2)))
    return law, rms


def annealed_checkpoints(table: pd.DataFrame) -> pd.DataFrame:
    """One row per converted checkpoint, shaped like a finished run's last point (the columns of the table's eval
    row, loss = the equivalent final loss, fraction = 1, num_steps = the eval's step) plus `loss_observed` and
    `source_fraction`; its `run` is the run it came from. Empty (no rows) when no run qualifies."""
    rows: list[dict] = []
    if "lr" not in table.columns or "fraction" not in table.columns:
        return pd.DataFrame(rows)
    for run, c in table.sort_values("step").groupby("run", sort=True):
        c = c.dropna(subset=["loss"])
        if len(c) < MIN_EVALS or c["lr"].notna().sum() < 2 or c["step"].duplicated().any():
            continue
        try:
            curve = curve_from_table(c, run)
        except ValueError:
            continue
        fitted = annealing_fit(curve)
        if fitted is None or fitted[1] > MAX_FIT_RMS or fitted[0].C <= 0:
            continue
        law = fitted[0]
        by_step = c.set_index("step")
        frac = curve.steps / len(curve.lr)
        picks = np.nonzero((frac >= MIN_FRACTION) & (frac <= MAX_FRACTION))[0]
        if len(picks) > PER_RUN:
            want = np.geomspace(curve.steps[picks[0]], curve.steps[picks[-1]], PER_RUN)
            picks = np.unique([picks[np.argmin(np.abs(np.log(curve.steps[picks] / w)))] for w in want])
        for i in picks:
            s = int(curve.steps[i])
            row = by_step.loc[s].to_dict()
            row.update(run=run, step=s, loss=equivalent_final(law, curve, i), loss_observed=float(curve.loss[i]),
                       source_fraction=float(frac[i]), fraction=1.0, num_steps=s)
            rows.append(row)
    return pd.DataFrame(rows)
