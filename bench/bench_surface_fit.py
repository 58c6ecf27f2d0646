"""Speed bench: an `auto` forecast whose candidates are the final-loss surfaces, timed as a user runs it.

Five ladders: `one_ratio`, eight sizes at 20 tokens per parameter (the shape most ladders have: every rung at one
D/N), `steplaw`, the public Step Law dense ladder's first leave-largest-out split (sizes and D/N both vary),
`steplaw_moe`, Step Law's MoE split (12 runs), `porian`, Porian et al.'s first configuration (107 IsoFLOP runs),
and `datablations`, the data-constrained C4 split (16 runs of 1-44 epochs, whole curves). The forecast is
`forecast_target(..., method="auto", n_bootstrap=20)` (`--n-bootstrap`: `ladder forecast` uses 200): every
candidate's backtest, bootstrap and band. It prints the forecast so that a run against the code before a change shows
the same numbers.

The baseline is the code before the change, from a git worktree of that commit, run by the same interpreter in turn
with this one (farm-bench pairs them); the command is in BENCHMARKS.md:

    git worktree add /tmp/base_wt <commit>
    farm-bench -n 3 --timeout 1200 -- .venv/bin/python bench/bench_surface_fit.py one_ratio \\
        --vs "sh -c 'cd /tmp/base_wt && PYTHONPATH=. /work/main/.venv/bin/python /work/main/bench/bench_surface_fit.py one_ratio'"
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from forecasting import suite
from forecasting.api import forecast_target
from forecasting.forecast import TargetSpec


def one_ratio_ladder() -> tuple[pd.DataFrame, TargetSpec]:
    """Eight sizes from 10M to 400M at 20 tokens per parameter on a known Chinchilla-like surface, 0.5% noise."""
    rng = np.random.default_rng(0)
    n = np.geomspace(1e7, 4e8, 8)
    d = 20.0 * n
    loss = (1.8 + 400.0 / n**0.34 + 900.0 / d**0.28) * np.exp(rng.normal(0, 0.005, len(n)))
    table = pd.DataFrame({"run": [f"r{i}" for i in range(len(n))], "params_active": n, "tokens": d, "loss": loss,
                          "step": 1000, "fraction": 1.0})
    return table, TargetSpec(name="hero", params_active=1e9, tokens=2e10)


def steplaw_ladder() -> tuple[pd.DataFrame, TargetSpec]:
    split = suite.splits_steplaw_dense()[0]
    return split.train, split.targets[0].target


def steplaw_moe_ladder() -> tuple[pd.DataFrame, TargetSpec]:
    split = suite.splits_steplaw_moe()[0]
    return split.train, split.targets[-1].target


def porian_ladder() -> tuple[pd.DataFrame, TargetSpec]:
    split = suite.splits_porian(cap=1)[0]
    return split.train, split.targets[0].target


def datablations_ladder() -> tuple[pd.DataFrame, TargetSpec]:
    split = suite.splits_datablations(cap=1)[0]
    return split.train, split.targets[0].target


CASES = {"one_ratio": one_ratio_ladder, "steplaw": steplaw_ladder, "steplaw_moe": steplaw_moe_ladder,
         "porian": porian_ladder, "datablations": datablations_ladder}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--n-bootstrap", type=int, default=20, help="20 as in the suite; `ladder forecast` uses 200")
    args = ap.parse_args()
    table, target = CASES[args.case]()
    start = time.perf_counter()
    f = forecast_target(table, target, method="auto", n_bootstrap=args.n_bootstrap)
    print(f"{args.case}: {f.method} {f.final_loss:.5f} [{f.final_loss_lo:.5f}, {f.final_loss_hi:.5f}] "
          f"in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
