"""A table that holds hyperparameter sweeps, forecast as it is and with the best run of each point
(`forecasting.table.best_of_sweeps`, `--best-of-sweep`).

Step Law's public LR x batch grids (dense: 1,911 runs at 17 sizes and token counts; MoE: 708 runs at 16 points) are
what an export of a lab's tuning sweeps looks like. The largest active size is held out; its best run at each token
count (the tuned loss, what the suite scores) is forecast by `auto` from the smaller sizes' runs: every run of the
grid (what a law fits when nobody picks), and the best run of each point. Both from the same code in one run.

    .venv/bin/python bench/bench_sweeps.py [--n-bootstrap 10]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from forecasting import api
from forecasting.suite import _target_from_run, load_steplaw_dense, load_steplaw_moe, steplaw_best
from forecasting.table import best_of_sweeps, sweep_groups


def _cases() -> list[tuple[str, pd.DataFrame, pd.DataFrame]]:
    """(name, the smaller sizes' every run, the largest size's best run per token count and configuration)."""
    out = []
    for name, raw, keys in (("steplaw dense", load_steplaw_dense(), ["params_active", "tokens"]),
                            ("steplaw MoE", load_steplaw_moe(), ["params_total", "params_active", "tokens", "topk", "experts"])):
        largest = raw["params_active"] == raw["params_active"].max()
        out.append((name, raw[~largest].reset_index(drop=True), steplaw_best(raw[largest], keys)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-bootstrap", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for name, train, targets in _cases():
        sweep = sweep_groups(train)
        best = best_of_sweeps(train)[0]
        print(f"{name}: {train['run'].nunique()} runs; sweep: {sweep}; best of each point keeps {best['run'].nunique()}")
        for fitted_on, table in (("every run of the grid", train), ("best run of each point", best)):
            errors, covered, widths, warned, seconds = [], [], [], [], time.perf_counter()
            for r in targets.itertuples():
                target = _target_from_run(targets, str(r.run), lr=False)  # as the suite writes it
                f = api.forecast_target(table, target, method="auto", n_bootstrap=args.n_bootstrap)
                errors.append(f.final_loss / r.loss - 1)
                covered.append(f.final_loss_lo <= r.loss <= f.final_loss_hi)
                widths.append((f.final_loss_hi - f.final_loss_lo) / 2 / f.final_loss)
                warned.append(any("hyperparameter sweep" in w for w in f.warnings))
            e = np.array(errors)
            rows.append((name, fitted_on, len(e), np.abs(e).mean() * 100, e.mean() * 100, np.mean(covered) * 100,
                         np.median(widths) * 100, all(warned), time.perf_counter() - seconds))
    print("\n| ladder | fitted on | targets | MAE % | mean error % | in band % | median half-width % | warned | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, on, n, mae, mean, cov, hw, warned, sec in rows:
        print(f"| {name} | {on} | {n} | {mae:.2f} | {mean:+.2f} | {cov:.0f} | {hw:.1f} | {'yes' if warned else 'no'} | {sec:.0f} |")


if __name__ == "__main__":
    main()
