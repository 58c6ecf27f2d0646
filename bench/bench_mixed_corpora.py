"""What a table that mixes two corpora does to a forecast, and what selecting one (`--where`) gives back.

    .venv/bin/python bench/bench_mixed_corpora.py [--n-bootstrap 10]

Porian et al. 2024's IsoFLOP runs (forecasting/data/porian2024) hold the same configurations trained on two corpora,
OpenWebText2 and RefinedWeb. For two such pairs, each configuration's runs at the largest budget are forecast
(`auto`) from the smaller budgets of that configuration alone (the public suite's split) and from the smaller
budgets of both corpora together (a table exported from both sweeps), which `forecasting.table.mixed_groups`
reports. Printed per configuration and table: mean absolute error, mean signed error, band coverage and median
half-width, and whether the forecast warned about the mix.
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np
import pandas as pd

from forecasting import api, suite

PAIRS = (("owt2_base_short_chinchilla_standard_val", "rw_base_short_chinchilla_standard_val"),
         ("owt2_base_short_kaplan_standard_val", "rw_base_short_kaplan_standard_val"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-bootstrap", type=int, default=10)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    print("| configuration | fitted on | targets | MAE % | mean error % | in band % | median half-width % | warned about the mix |")
    print("|---|---|---|---|---|---|---|---|")
    for pair in PAIRS:
        splits = suite.splits_porian(configs=list(pair))
        both = pd.concat([split.train for split in splits], ignore_index=True)
        for split in splits:
            for label, train in (("its own corpus", split.train), ("both corpora", both)):
                errors, inside, half, warned = [], [], [], False
                for held in split.targets:
                    f = api.forecast_target(train, held.target, method="auto", n_bootstrap=args.n_bootstrap, seed=0)
                    actual = float(held.points["loss"].iloc[-1])
                    errors.append(f.final_loss / actual - 1)
                    inside.append(f.final_loss_lo <= actual <= f.final_loss_hi)
                    half.append((f.final_loss_hi - f.final_loss_lo) / 2 / f.final_loss)
                    warned |= any("fitted as one ladder" in w for w in f.warnings)
                e = np.array(errors)
                print(f"| {split.name} | {label} | {len(e)} | {100 * np.abs(e).mean():.2f} | {100 * e.mean():+.2f} | "
                      f"{100 * np.mean(inside):.0f} | {100 * np.median(half):.1f} | {'yes' if warned else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
