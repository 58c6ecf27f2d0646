"""How the ladder-only forecast (v1) of the local ladder's hero did against the hero's own evals.

Run `ladder demo --root ROOT` first (it trains the rungs and the hero), then

    .venv/bin/python bench/bench_local_forecast.py ROOT [--methods auto,matched_progress,compute]

Each method forecasts the hero from the four finished rungs alone (what the fit step stores as v1 before the
hero starts) and is scored on every eval the hero logged: the largest and the mean absolute relative error
along the curve, the share of evals inside the 95% band, the band's median half-width, and the final-loss
error. Nothing is trained; the numbers depend only on the run directories under ROOT.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from forecasting.api import forecast_target
from forecasting.table import from_run_dirs
from ladder.fitting import ladder_runs_for, table_from_steps, target_spec
from ladder.loader import load_experiment
from ladder.store import Store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", help="store root that `ladder demo --root` filled")
    ap.add_argument("--experiment", default="experiments/local_ladder.py")
    ap.add_argument("--target", default="hero")
    ap.add_argument("--methods", default="auto,matched_progress,compute")
    ap.add_argument("--n-bootstrap", type=int, default=100)
    args = ap.parse_args()
    exp = load_experiment(args.experiment)
    store = Store(args.root)
    table = table_from_steps(exp.dag, store, ladder_runs_for(exp.dag, args.target))
    target = target_spec(exp.dag[args.target])
    run_dir = store.url_of(store.run_dir(args.target, exp.dag.fingerprints[args.target]))
    hero = from_run_dirs([run_dir]).sort_values("step")
    rows = []
    for method in args.methods.split(","):
        f = forecast_target(table, target, method=method, n_bootstrap=args.n_bootstrap)
        bands = np.array([f.band_at(s) for s in hero["step"]])
        actual = hero["loss"].to_numpy(float)
        err = bands[:, 0] / actual - 1
        inside = (bands[:, 1] <= actual) & (actual <= bands[:, 2])
        rows.append({"method": method, "chosen": f.method, "evals": len(actual), "max_abs_err_pct": 100 * float(np.abs(err).max()),
                     "mae_pct": 100 * float(np.abs(err).mean()), "coverage_pct": 100 * float(inside.mean()),
                     "median_half_width_pct": 100 * float(np.median((bands[:, 2] - bands[:, 1]) / 2 / bands[:, 0])),
                     "final_err_pct": 100 * float(f.final_loss / actual[-1] - 1),
                     "final": [f.final_loss, f.final_loss_lo, f.final_loss_hi], "actual_final": float(actual[-1])})
    print("| method (chosen) | evals | max abs err % | MAE % | in band % | median half-width % | final err % |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} ({r['chosen']}) | {r['evals']} | {r['max_abs_err_pct']:.2f} | {r['mae_pct']:.2f} | "
              f"{r['coverage_pct']:.0f} | {r['median_half_width_pct']:.2f} | {r['final_err_pct']:+.2f} |")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
