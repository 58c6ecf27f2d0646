"""Bad input gives a clear error or a warning with wide intervals, never a confident garbage number."""

import numpy as np
import pandas as pd
import pytest

from forecasting.api import TargetSpec, backtest, fit_ladder, forecast_target
from forecasting.fitting import FitError, fit_chinchilla, fit_compute_law
from forecasting.matched_progress import fit_profiled
from forecasting.table import TableError


def _surface_table(sizes, tokens, *, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for n in sizes:
        for d in tokens:
            loss = 1.8 + 400 / n**0.34 + 2000 / d**0.36
            rows.append({"run": f"n{n:.0e}_d{d:.0e}", "step": 1, "loss": loss * np.exp(noise * rng.normal()),
                         "params_active": n, "tokens": d, "flops": 6 * n * d, "fraction": 1.0})
    return pd.DataFrame(rows)


def _curve_table(n_rungs, fractions=np.arange(1, 21) * 0.05):
    rows = []
    for i in range(n_rungs):
        c_full = 1e19 * 8**i
        for g in fractions:
            rows.append({"run": f"rung{i}", "step": int(round(g * 1000)), "fraction": g, "flops": g * c_full,
                         "loss": 1.5 + 80 * (g * c_full) ** -0.09 + 0.05 * (1 - g)})
    return pd.DataFrame(rows)


def test_too_few_runs_for_any_law_is_an_error():
    t = _surface_table([1e8], [1e9, 2e9])
    with pytest.raises(FitError, match="cannot fit any law"):
        fit_ladder(t)


def test_one_model_size_for_the_chinchilla_surface_is_an_error():
    with pytest.raises(FitError, match="two model sizes"):
        fit_chinchilla(np.full(8, 1e8), np.geomspace(1e9, 1e11, 8), np.linspace(3, 2.5, 8))


def test_too_few_points_for_five_parameters_is_an_error():
    with pytest.raises(FitError, match="5 parameters"):
        fit_chinchilla(np.array([1e8, 2e8, 4e8]), np.array([1e9, 2e9, 4e9]), np.array([3.0, 2.8, 2.6]))


def test_compute_law_needs_three_budgets_for_a_fitted_asymptote():
    with pytest.raises(FitError, match="three distinct budgets"):
        fit_compute_law(np.array([1e18, 1e19]), np.array([3.0, 2.8]))
    with pytest.raises(FitError, match="not below every loss"):
        fit_compute_law(np.array([1e18, 1e19]), np.array([3.0, 2.8]), asymptote=2.9)


def test_matched_progress_needs_three_rungs_and_two_sizes():
    with pytest.raises(FitError, match="at least 3 rungs"):
        fit_profiled(_curve_table(2))
    same = _curve_table(3)
    same["flops"] = same["fraction"] * 1e20  # every rung the same compute
    with pytest.raises(FitError, match="same compute"):
        fit_profiled(same)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -2.0])
def test_nan_inf_negative_values_rejected_by_the_api(bad):
    t = _surface_table([1e8, 2e8, 4e8], [1e9, 4e9, 1.6e10])
    t.loc[3, "loss"] = bad
    with pytest.raises(TableError):
        fit_ladder(t)


def test_duplicated_runs_rejected_by_the_api():
    t = _surface_table([1e8, 2e8, 4e8], [1e9, 4e9, 1.6e10])
    t = pd.concat([t, t.iloc[[0]]])
    with pytest.raises(TableError, match="duplicated"):
        forecast_target(t, TargetSpec(name="x", params_active=1e9, tokens=2e10))


@pytest.mark.parametrize("n_bootstrap", [-3, 2.5, True])
def test_a_number_of_refits_that_is_not_one_is_named(n_bootstrap):
    """-3 used to reach numpy as `negative dimensions are not allowed`."""
    t = _surface_table([1e8, 2e8, 4e8], [1e9, 4e9, 1.6e10])
    with pytest.raises(ValueError, match=r"n_bootstrap is a number of refits, 0 or more; got"):
        forecast_target(t, TargetSpec(name="x", params_active=1e9, tokens=2e10), n_bootstrap=n_bootstrap)
    with pytest.raises(ValueError, match=r"n_bootstrap is a number of refits"):
        fit_ladder(t, n_bootstrap=n_bootstrap)


def test_a_fit_that_does_not_converge_is_an_error_not_a_number():
    rng = np.random.default_rng(0)
    n = np.repeat([1e8, 2e8, 4e8], 4)
    d = np.tile([1e9, 2e9, 4e9, 8e9], 3)
    t = pd.DataFrame({"run": [f"r{i}" for i in range(12)], "step": 1, "loss": np.exp(rng.normal(1, 0.3, 12)),
                      "params_active": n, "tokens": d})
    with pytest.raises(FitError, match="did not converge: its optimum lies outside the plausible region") as error:
        fit_ladder(t, law="chinchilla", n_bootstrap=5)
    assert "alpha" in str(error.value) and "the solver said" in str(error.value)


def test_far_extrapolation_from_a_noisy_small_ladder_gets_a_wide_band():
    t = _surface_table([1e7, 2e7, 4e7, 8e7], [2e8, 8e8, 3.2e9], noise=0.01, seed=3)
    f = forecast_target(t, TargetSpec(name="big", params_active=1e11, tokens=2e12), method="chinchilla", n_bootstrap=40)
    near = forecast_target(t, TargetSpec(name="near", params_active=8e7, tokens=3.2e9), method="chinchilla", n_bootstrap=40)
    width = (f.final_loss_hi - f.final_loss_lo) / f.final_loss
    width_near = (near.final_loss_hi - near.final_loss_lo) / near.final_loss
    assert width > 2 * width_near
    assert f.final_loss_lo < f.final_loss < f.final_loss_hi


def test_no_backtest_possible_warns_that_the_band_is_too_narrow():
    f = forecast_target(_curve_table(3), TargetSpec(name="t", params_active=1e10, tokens=1e12, num_steps=1000, total_flops=1e24), n_bootstrap=10)
    assert any("no compute backtest" in w for w in f.warnings)
    rep = backtest(_curve_table(3))
    assert rep.warnings and not any(r.kind == "compute" for r in rep.results)


def test_a_run_logged_twice_under_two_names_is_dropped_with_a_warning():
    t = _curve_table(4)
    copy = t[t["run"] == "rung1"].assign(run="rung1-again")
    fit = fit_ladder(pd.concat([t, copy]), n_bootstrap=10)
    assert fit.n_runs == 4
    assert any("identical runs" in w and "rung1-again" in w for w in fit.warnings)
    f = forecast_target(pd.concat([t, copy]), TargetSpec(name="t", params_active=1e10, tokens=1e12, num_steps=1000, total_flops=1e24), n_bootstrap=10)
    assert any("identical runs" in w for w in f.warnings)
