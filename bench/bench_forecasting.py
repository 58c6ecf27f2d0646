"""Speed bench: Chinchilla approach-3 fit + 1,000 bootstrap refits on Epoch's 240 points.

Ours: forecasting.fitting.fit_chinchilla (variable projection over an (alpha, beta) grid, closed-form
linear part, BFGS polish of the best candidates; bootstrap refits warm-started from the full fit).
Baseline, measured in the same run: a plain scipy multi-start L-BFGS-B loop on the same Huber(1e-3)
log objective with the same analytic gradient and tight tolerances (ftol 1e-15, gtol 1e-10), started
from a 243-point grid (alpha, beta in {0.1, 0.5, 1.0}, e in {-1, 0, 1}, a, b in {0, 10, 20}; a thinned
version of Hoffmann's 4,500-start grid). The baseline runs the full fit plus BASELINE_BOOTS bootstrap
refits (same resamples as ours) and its time is scaled to 1,000 refits; the scaling is printed.
A second competitor, warm-started L-BFGS-B (one start per refit at the full-fit optimum, like ours),
is timed on 100 refits and scaled: it shows how much of the gain is the start strategy and how much
the Newton polish.

Run: .venv/bin/python bench/bench_forecasting.py [--boots 1000] [--baseline-boots 3]
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
from scipy.optimize import minimize

from forecasting.bootstrap import run_weights
from forecasting.fitting import chinchilla_log_params, chinchilla_objective, fit_chinchilla
from forecasting.public_data import chinchilla_points, data_dir


def baseline_fit(log_n, log_d, log_l, w, starts):
    best = None
    bounds = [(-30, 60), (-30, 60), (-10, 10), (0.0, 3.0), (0.0, 3.0)]
    for s0 in starts:
        r = minimize(
            chinchilla_objective, s0, args=(log_n, log_d, log_l, w), jac=True, method="L-BFGS-B",
            bounds=bounds, options={"ftol": 1e-15, "gtol": 1e-10, "maxiter": 5000},
        )
        if best is None or r.fun < best.fun:
            best = r
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--boots", type=int, default=1000)
    ap.add_argument("--baseline-boots", type=int, default=3)
    args = ap.parse_args()
    data = data_dir()
    t = chinchilla_points(data / "chinchilla_svg_extracted_data.csv")
    n, d, y = (t[c].to_numpy(float) for c in ("params_active", "tokens", "loss"))
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(y)
    weights = run_weights(t["run"], args.boots, seed=0)

    t0 = time.perf_counter()
    law, diag = fit_chinchilla(n, d, y)
    start = chinchilla_log_params(law)
    ours_obj = [diag.objective]
    boot_laws = []
    for w in weights:
        b, bd = fit_chinchilla(n, d, y, weights=w, n_polish=1, start=start, candidate_radius=0.1)
        boot_laws.append(b)
        ours_obj.append(bd.objective)
    ours_time = time.perf_counter() - t0

    starts = [
        np.array([a, b, e, al, be])
        for al, be, e, a, b in itertools.product((0.1, 0.5, 1.0), (0.1, 0.5, 1.0), (-1, 0, 1), (0, 10, 20), (0, 10, 20))
    ]
    t0 = time.perf_counter()
    base_full = baseline_fit(log_n, log_d, log_l, np.ones_like(y), starts)
    base_obj = [base_full.fun * 1e-3]
    for w in weights[: args.baseline_boots]:
        base_obj.append(baseline_fit(log_n, log_d, log_l, w, starts).fun * 1e-3)
    base_time = time.perf_counter() - t0
    base_scaled = base_time / (1 + args.baseline_boots) * (1 + args.boots)

    # A second, stronger plain-scipy competitor: the same warm start as ours (the full-fit optimum),
    # one L-BFGS-B run per bootstrap refit, on the first WARM_BOOTS resamples, scaled.
    warm_boots = min(args.boots, 100)
    t0 = time.perf_counter()
    warm_obj = [
        baseline_fit(log_n, log_d, log_l, w, [start]).fun * 1e-3 for w in weights[:warm_boots]
    ]
    warm_time = (time.perf_counter() - t0) / warm_boots * args.boots + base_time / (1 + args.baseline_boots)
    warm_diff = np.array(ours_obj[1 : 1 + warm_boots]) - np.array(warm_obj)

    k = 1 + args.baseline_boots
    diff = np.array(ours_obj[:k]) - np.array(base_obj)
    alphas = np.array([b.alpha for b in boot_laws])
    print(f"full fit (ours):  {law.formula()}  Huber objective {diag.objective:.10g}")
    print(f"full fit (base):  objective {base_obj[0]:.10g}  (alpha {base_full.x[3]:.5f}, beta {base_full.x[4]:.5f})")
    print(
        f"objective ours - baseline on the {k} shared fits: max {diff.max():+.3e} "
        f"(relative {diff.max() / base_obj[0]:+.1e}; <= 0 or ~1e-14 relative means equal or better)"
    )
    print(f"ours:     1 fit + {args.boots} bootstrap refits in {ours_time:.2f} s")
    print(
        f"baseline: 1 fit + {args.baseline_boots} refits ({len(starts)} starts each) in {base_time:.2f} s, "
        f"scaled to 1 + {args.boots}: {base_scaled:.1f} s"
    )
    print(f"speedup vs multi-start baseline: {base_scaled / ours_time:.1f}x")
    print(
        f"warm-started L-BFGS-B (1 start per refit, {warm_boots} refits scaled to {args.boots}, plus the baseline's "
        f"full fit): {warm_time:.1f} s; speedup {warm_time / ours_time:.1f}x; objective ours - it: "
        f"max {warm_diff.max():+.3e}, min {warm_diff.min():+.3e}"
    )
    print(f"bootstrap 95% interval of alpha: {np.quantile(alphas, 0.025):.4f} - {np.quantile(alphas, 0.975):.4f}")


if __name__ == "__main__":
    main()
