"""Speed bench: one final-law forecast whose backtests refit the same splits, with and without the split-fit cache.

A final law's forecast backtests it twice on the same expanding splits: on the held-out runs' final points and on
their whole curves. Both refit the law on the same fit parts; `final_laws._split_fit` caches each part's fit (and
its failure). The case timed is the one that showed it: Chinchilla on the public Multi-Power cross-size split (fit
the 25M and 100M curves' runs, forecast 400M), where the fits fail and each failure runs BFGS to its 5,000-iteration
limit. The baseline, measured in the same process, is the same forecast with every split fitted afresh (the code
before the cache); the in-memory caches are emptied before each timing, and both must give the same forecast.

Run: .venv/bin/python bench/bench_forecast_time.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from forecasting import final_laws as fl
from forecasting import suite
from forecasting.api import forecast_target


def _uncached_split_fit(law, part):
    return fl.fit_final(law, part)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    split = next(s for s in suite.splits_multipower(cap=1) if s.group == "cross_size")
    target = split.targets[0].target
    cached_fit = fl._split_fit
    times: dict[str, list[float]] = {"every split fitted afresh (before)": [], "split fits cached": []}
    finals: dict[str, set[float]] = {k: set() for k in times}
    for _ in range(args.repeats):  # alternate, so a drift in the machine's speed hits both alike
        for mode in times:
            fl._CACHE.clear()
            fl._split_fit = _uncached_split_fit if mode.startswith("every") else cached_fit
            t0 = time.perf_counter()
            f = forecast_target(split.train, target, method="chinchilla", n_bootstrap=10)
            times[mode].append(time.perf_counter() - t0)
            finals[mode].add(f.final_loss)
    fl._split_fit = cached_fit
    before, after = (statistics.median(v) for v in times.values())
    for mode, v in times.items():
        print(f"{mode}: median {statistics.median(v):.1f} s (min {min(v):.1f}, max {max(v):.1f}), final loss {sorted(finals[mode])}")
    print(f"ratio cached / before: {after / before:.2f} ({before / after:.2f}x faster); same forecast: "
          f"{finals['split fits cached'] == finals['every split fitted afresh (before)']}")


if __name__ == "__main__":
    main()
