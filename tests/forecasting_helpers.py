"""Ladders drawn from a known scaling law, for the forecasting tests that need whole curves (shared so that each
test file does not grow its own copy of the generator)."""

import math

import numpy as np
import pandas as pd


def known_law(n, d):
    """L(N, D) = 1.8 + 400 / N^0.34 + 400 / D^0.28."""
    return 1.8 + 400.0 / np.asarray(n) ** 0.34 + 400.0 / np.asarray(d) ** 0.28


def ladder_curves(sizes, tokens_per_param, evals, steps=400, noise=0.002, seed=0) -> pd.DataFrame:
    """Rungs with whole curves: the law at the tokens seen plus a schedule offset that vanishes at the end."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, n in enumerate(sizes):
        d_full = n * tokens_per_param
        for s in np.unique(np.linspace(steps / evals, steps, evals).round().astype(int)):
            g = s / steps
            loss = known_law(n, g * d_full) * (1 + 0.03 * (1 - g)) * math.exp(rng.normal(0, noise))
            rows.append({"run": f"r{i}", "step": int(s), "loss": loss, "params_active": float(n), "tokens": g * d_full,
                         "flops": 6 * n * g * d_full, "fraction": g, "num_steps": steps, "tokens_per_step": d_full / steps})
    return pd.DataFrame(rows)
