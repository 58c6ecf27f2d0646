"""Figures for bench/RESULTS_forecasting.md: Epoch replication, Marin 535B hero forecast and refit.

Prints markdown tables and writes bench/figures/marin_hero_forecast.png.
Run: .venv/bin/python bench/results_forecasting.py [--boots 200]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from forecasting.api import TargetSpec, fit_ladder, forecast_target, refit_forecast
from forecasting.matched_progress import marin_baseline
from forecasting.public_data import chinchilla_points, data_dir, linear_decay_schedule, marin_ladder

EPOCH_95 = {"E": (1.769, 1.871), "A": (285, 744), "B": (1042, 5810), "alpha": (0.317, 0.373), "beta": (0.331, 0.415)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--boots", type=int, default=200)
    args = ap.parse_args()
    data = data_dir()

    chin = chinchilla_points(data / "chinchilla_svg_extracted_data.csv")
    fit = fit_ladder(chin, law="chinchilla", n_bootstrap=args.boots)
    print("## Epoch replication (240 points)\n")
    print("| param | ours | our 95% (bootstrap over runs) | Epoch 95% | inside |")
    print("|---|---|---|---|---|")
    for k, (lo, hi) in EPOCH_95.items():
        iv = fit.params[k]
        print(f"| {k} | {iv.value:.4g} | {iv.lo:.4g} - {iv.hi:.4g} | {lo} - {hi} | {lo <= iv.value <= hi} |")
    print(f"\nHuber objective {fit.objective:.10g}; bootstrap refits {fit.n_bootstrap}/{args.boots}\n")

    table, hero, observed = marin_ladder(data / "marin_535b_ladder")
    target = TargetSpec(
        name="d6144", params_active=hero["params_active"], params_total=hero["params_total"], tokens=hero["tokens"],
        num_steps=hero["num_steps"], tokens_per_step=hero["tokens_per_step"], total_flops=hero["total_flops"],
        lr=linear_decay_schedule(hero["num_steps"]).tolist(),
    )
    base = marin_baseline(table)
    f = forecast_target(table, target, n_bootstrap=args.boots)
    live = observed[observed["step"] <= 18000]
    r = refit_forecast(table, target, live, prior=f)
    print("## Marin 535B hero\n")
    print(f"baseline (matched progress, E=1.5) at g=1: {base.predict_at_grid(hero['total_flops'])[-1]:.6f}")
    print(f"ours (ladder only): final {f.final_loss:.4f} [{f.final_loss_lo:.4f}, {f.final_loss_hi:.4f}]; law {f.law}")
    print(f"band terms at the final step (relative sigma): {f.band_terms}")
    print(f"backtest: {[b.model_dump() for b in f.backtest]}")
    print(f"refit (prefix <= 18k): final {r.final_loss:.4f} [{r.final_loss_lo:.4f}, {r.final_loss_hi:.4f}]; terms {r.band_terms}\n")
    print("| step | observed | baseline | err | ours (rungs only) | err | 95% band | covered | refit@18k | err | band | covered |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for s, y, g in zip(observed["step"], observed["loss"], observed["fraction"], strict=True):
        b = float(base.predict(g, hero["total_flops"])[0])
        p, lo, hi = f.band_at(s)
        q, qlo, qhi = r.band_at(s)
        live_pt = s <= 18000
        rows.append((s, y, b, p, lo, hi, q, qlo, qhi))
        print(
            f"| {s} | {y:.4f} | {b:.4f} | {100 * (b / y - 1):+.2f}% | {p:.4f} | {100 * (p / y - 1):+.2f}% | "
            f"{lo:.4f}-{hi:.4f} | {lo <= y <= hi} | {q:.4f}{' (fit)' if live_pt else ''} | {100 * (q / y - 1):+.2f}% | "
            f"{qlo:.4f}-{qhi:.4f} | {qlo <= y <= qhi} |"
        )
    arr = np.array(rows)
    err_b = arr[:, 2] / arr[:, 1] - 1
    err_f = arr[:, 3] / arr[:, 1] - 1
    err_r = arr[:, 6] / arr[:, 1] - 1
    fut = arr[:, 0] >= 21000
    print(f"\nmean |err| 3k-39k: baseline {100 * np.abs(err_b).mean():.2f}%, ours {100 * np.abs(err_f).mean():.2f}%")
    print(f"mean |err| 18k-39k: baseline {100 * np.abs(err_b[arr[:, 0] >= 17999]).mean():.2f}%, ours {100 * np.abs(err_f[arr[:, 0] >= 17999]).mean():.2f}%")
    print(f"refit 21k-39k: max |err| {100 * np.abs(err_r[fut]).max():.2f}%, mean {100 * np.abs(err_r[fut]).mean():.2f}%")

    out = Path(__file__).parent / "figures"
    out.mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    cf, cr = f.curve_frame(), r.curve_frame()
    m = cf["step"] <= 60000
    ax.fill_between(cf["step"][m], cf["lo"][m], cf["hi"][m], color="C0", alpha=0.15, label="ours, rungs only: 95% band")
    ax.plot(cf["step"][m], cf["loss"][m], color="C0", label="ours, rungs only")
    mr = (cr["step"] <= 60000) & (cr["step"] >= 3000)
    ax.fill_between(cr["step"][mr], cr["lo"][mr], cr["hi"][mr], color="C2", alpha=0.2, label="refit on prefix <= 18k: 95% band")
    ax.plot(cr["step"][mr], cr["loss"][mr], color="C2", label="refit on prefix <= 18k")
    gs = np.linspace(0.005, 60000 / hero["num_steps"], 200)
    ax.plot(gs * hero["num_steps"], base.predict(gs, hero["total_flops"]), "--", color="C3", label="Marin baseline (E = 1.5)")
    ax.plot(observed["step"], observed["loss"], "ko", ms=4, label="hero, published")
    ax.set_ylim(2.1, 2.9)
    ax.set_xlabel("hero step")
    ax.set_ylabel("dropless Paloma macro loss")
    ax.set_title("Marin 535B-A23B hero: forecast from 4 rungs, and refit at 18k")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "marin_hero_forecast.png", dpi=110)
    print(f"\nwrote {out / 'marin_hero_forecast.png'}")


if __name__ == "__main__":
    main()
