"""Marin 535B ladder (forecasting/data/marin_535b_ladder): baseline reproduced, hero forecast, mid-run refit."""

import numpy as np
import pytest

from forecasting.api import TargetSpec, forecast_target, refit_forecast
from forecasting.forecast import Forecast
from forecasting.matched_progress import marin_baseline
from forecasting.public_data import data_dir, linear_decay_schedule, marin_ladder

DATA = data_dir()


@pytest.fixture(scope="module")
def marin():
    table, hero, observed = marin_ladder(DATA / "marin_535b_ladder")
    target = TargetSpec(
        name="d6144",
        params_active=hero["params_active"],
        params_total=hero["params_total"],
        tokens=hero["tokens"],
        num_steps=hero["num_steps"],
        tokens_per_step=hero["tokens_per_step"],
        total_flops=hero["total_flops"],
        lr=linear_decay_schedule(hero["num_steps"]).tolist(),
    )
    return table, hero, observed, target


@pytest.fixture(scope="module")
def ladder_forecast(marin):
    table, _, _, target = marin
    return forecast_target(table, target, n_bootstrap=60, seed=0)


def _rel_errors(forecast: Forecast, observed):
    pred = np.array([forecast.band_at(s)[0] for s in observed["step"]])
    return pred / observed["loss"].to_numpy() - 1


def test_matched_progress_baseline_reproduces_marin_exactly(marin):
    table, hero, observed, _ = marin
    fit = marin_baseline(table)
    grid_pred = fit.predict_at_grid(hero["total_flops"])
    assert round(float(grid_pred[-1]), 4) == 2.0388
    assert float(grid_pred[0]) == pytest.approx(2.3921, abs=1e-4)  # 5%
    assert float(grid_pred[1]) == pytest.approx(2.3261, abs=1e-4)  # 10%
    assert fit.alpha[0] == pytest.approx(0.081, abs=5e-4) and fit.alpha[-1] == pytest.approx(0.090, abs=5e-4)
    # the baseline is +2.4% .. +3.5% over the hero's published 5-10% evals
    late = observed[observed["step"] >= 17999]
    err = fit.predict(late["fraction"].to_numpy(), hero["total_flops"]) / late["loss"].to_numpy() - 1
    assert 0.02 < err.min() and err.max() < 0.036


def test_hero_forecast_from_rungs_beats_baseline_and_band_covers(marin, ladder_forecast):
    table, hero, observed, _ = marin
    f = ladder_forecast
    # d2048 crashed at 80%: its evals score the compute law as well as matched progress, and the compute law drew
    # them closer (0.31% RMS against 0.64%), so it leads the blend
    assert f.method == "blend"
    weights = {c["method"]: c.get("blend_weight", 0.0) for c in f.selection}
    assert weights["compute"] > weights["matched_progress"] > 0
    err = _rel_errors(f, observed)
    base = marin_baseline(table)
    base_err = base.predict(observed["fraction"].to_numpy(), hero["total_flops"]) / observed["loss"].to_numpy() - 1
    # on the ladder's own fraction range (>= 5%: steps >= 18k) we beat the baseline at every eval
    inside = observed["step"].to_numpy() >= 17999
    assert np.all(np.abs(err[inside]) < np.abs(base_err[inside]))
    assert np.abs(err[inside]).max() < 0.02
    # over all published evals (3k-39k) the mean error is below the baseline's
    assert np.abs(err).mean() < np.abs(base_err).mean()
    # the stated 95% band covers every published value, 3k-39k
    for s, y in zip(observed["step"], observed["loss"], strict=True):
        _, lo, hi = f.band_at(s)
        assert lo <= y <= hi, (s, y, lo, hi)
    # every member's band carries a measured extrapolation term from the ladder's own backtest on d2048
    assert {b.method for b in f.backtest} == {"compute", "matched_progress"}
    assert all(b.held_out == ["d2048"] for b in f.backtest)
    assert not any("public suite" in w for w in f.warnings)
    assert f.final_loss_lo < f.final_loss < f.final_loss_hi


def test_refit_with_hero_prefix_to_18k_within_half_percent(marin, ladder_forecast):
    table, _, observed, target = marin
    live = observed[observed["step"] <= 18000]
    r = refit_forecast(table, target, live, prior=ladder_forecast)
    future = observed[observed["step"] >= 21000]
    err = _rel_errors(r, future)
    assert np.abs(err).max() <= 0.005, err
    for s, y in zip(future["step"], future["loss"], strict=True):
        _, lo, hi = r.band_at(s)
        assert lo <= y <= hi
    # the refit tightens the band at the prefix's horizon relative to the ladder-only forecast
    s = 38999
    assert (r.band_at(s)[2] - r.band_at(s)[1]) < (ladder_forecast.band_at(s)[2] - ladder_forecast.band_at(s)[1])
    assert r.method == "refit" and r.inputs_fingerprint != ladder_forecast.inputs_fingerprint


def test_refit_band_tightens_as_the_live_prefix_grows(marin, ladder_forecast):
    table, _, observed, target = marin
    width = {}
    for last in (18000, 30000):
        r = refit_forecast(table, target, observed[observed["step"] <= last], prior=ladder_forecast)
        _, lo, hi = r.band_at(38999)
        width[last] = hi - lo
        assert lo <= float(observed.loc[observed["step"] == 38999, "loss"].iloc[0]) <= hi
    _, lo, hi = ladder_forecast.band_at(38999)
    assert width[30000] < width[18000] < hi - lo


def test_forecast_json_round_trip(ladder_forecast):
    text = ladder_forecast.to_json()
    back = Forecast.from_json(text)
    assert back == ladder_forecast
    assert back.band_at(20999) == ladder_forecast.band_at(20999)
    summary = back.summary()
    assert {"final_loss", "final_loss_lo", "final_loss_hi"} <= set(summary)


def test_a_hero_on_another_learning_rate_than_its_rungs_is_named():
    from forecasting.suite import load_marin

    table, target, _ = load_marin()  # the hero's schedule at its own peak LR, 0.0033 (the rungs ran at 0.013-0.016)
    warning = next(w for w in forecast_target(table, target, n_bootstrap=10).warnings if "peak LR" in w)
    assert "3.5x below" in warning, warning
    on_trend = target.model_copy(update={"lr": list(np.asarray(target.lr) * 0.0115 / max(target.lr))})
    assert not any("peak LR" in w for w in forecast_target(table, on_trend, n_bootstrap=10).warnings)
