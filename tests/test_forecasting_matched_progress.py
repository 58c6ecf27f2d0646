"""Matched progress on a synthetic ladder with a known law, evals at an off-grid cadence."""

import numpy as np
import pandas as pd
import pytest

from forecasting.api import TargetSpec, forecast_target
from forecasting.matched_progress import fit_profiled, progress_grid


def _law(g, c_full):
    # a collapse-style family: E + A_g * (g*C)^-alpha_g with a curve shape that depends on g
    alpha = 0.08 + 0.01 * g
    return 1.9 + 60.0 * np.exp(-0.3 * g) * (g * c_full) ** -alpha


def _ladder(fractions):
    rows = []
    for i in range(5):
        c_full = 1e19 * 6**i
        steps = 1000 * (i + 1)
        for g in fractions:
            rows.append({"run": f"r{i}", "step": int(round(g * steps)), "fraction": round(g * steps) / steps,
                         "flops": round(g * steps) / steps * c_full, "loss": _law(round(g * steps) / steps, c_full)})
    return pd.DataFrame(rows)


def test_off_grid_evals_are_read_at_the_grid_by_interpolation():
    t = _ladder(np.arange(1, 15) * 0.07)  # evals every 7%: 7%, 14%, ..., 98%
    cells = progress_grid(t)
    r0 = cells[cells["run"] == "r0"]
    # a cell's loss is the run's loss at that exact fraction (to interpolation accuracy), not a neighbour's
    for g, y in zip(r0["g"], r0["loss"], strict=True):
        assert y == pytest.approx(_law(g, 1e19), rel=2e-3)
    snapped = progress_grid(t, mode="snap")
    assert not np.allclose(snapped[snapped["run"] == "r0"]["g"].to_numpy()[:3], r0["g"].to_numpy()[:3])


def test_profiled_asymptote_and_extrapolation_on_a_known_ladder():
    t = _ladder(np.arange(1, 21) * 0.05)
    fit = fit_profiled(t)
    assert fit.E == pytest.approx(1.9, abs=0.15)
    c_target = 1e19 * 6**7  # 36x beyond the largest rung
    pred = fit.predict(np.array([0.5, 1.0]), c_target)
    truth = _law(np.array([0.5, 1.0]), c_target)
    assert np.all(np.abs(pred / truth - 1) < 0.01)
    f = forecast_target(t, TargetSpec(name="t", params_active=1e10, tokens=1e12, num_steps=20000, total_flops=c_target), n_bootstrap=20)
    assert f.final_loss_lo <= truth[1] <= f.final_loss_hi
    assert f.backtest[0].held_out == ["r3", "r4"]  # ordered: fit 3 smallest -> predict 4th, fit 4 -> predict 5th


def test_the_matched_progress_band_is_log_normal_like_every_other_law_s():
    """lo * hi = loss^2 at every step: the band is +-1.96 sigma in log space, as the final laws' and the blend's
    reading of it (a band symmetric in loss would put lo below zero once sigma passes 51%)."""
    from tests.forecasting_helpers import ladder_curves

    sizes = [2e4, 4e4, 8e4, 1.6e5, 3.2e5]
    table = ladder_curves(sizes, 8.0, evals=20)
    n = 1.28e6
    target = TargetSpec(name="hero", params_active=n, tokens=8 * n, num_steps=400, tokens_per_step=8 * n / 400)
    f = forecast_target(table, target, method="matched_progress", n_bootstrap=20)
    loss = np.array([p.loss for p in f.curve])
    lo, hi = np.array([p.lo for p in f.curve]), np.array([p.hi for p in f.curve])
    assert np.all(lo > 0) and np.all(hi > lo)
    np.testing.assert_allclose(lo * hi, loss**2, rtol=1e-9)
    assert np.log(f.final_loss_hi / f.final_loss_lo) / (2 * 1.959964) == pytest.approx(f.band_terms["total"], rel=1e-6)
