"""Each final-loss surface recovers its own parameters from data it generated, and refuses what it cannot identify."""

import numpy as np
import pandas as pd
import pytest

from forecasting.fitting import FitError
from forecasting.surfaces import SURFACES, effective_tokens, fit_surface


def _grid(n_sizes=6, ratios=(5.0, 20.0, 80.0, 320.0)):
    n = np.repeat(np.geomspace(3e7, 1e9, n_sizes), len(ratios))
    d = n * np.tile(ratios, n_sizes)
    return n, d


def _frame(n, d, loss, **extra):
    return pd.DataFrame({"run": [f"r{i}" for i in range(len(n))], "params_active": n, "tokens": d, "loss": loss, **extra})


@pytest.mark.parametrize("name, truth", [
    ("overtrain", {"E": 1.7, "A": 300.0, "B": 900.0, "eta": 0.31}),
    ("farseer", {"E": 1.7, "A": 300.0, "B": 900.0, "alpha": 0.33, "beta0": 0.30, "beta1": -0.015}),
])
def test_dense_surfaces_recover_their_parameters(name, truth):
    n, d = _grid()
    loss = SURFACES[name].predict_fn({"params_active": n, "tokens": d}, truth)
    fit = fit_surface(name, _frame(n, d, loss))
    for k, v in truth.items():
        assert fit.params[k] == pytest.approx(v, rel=0.02, abs=2e-3), k
    far = {"params_active": np.array([7e10]), "tokens": np.array([1.4e13])}
    assert fit.predict(far)[0] == pytest.approx(SURFACES[name].predict_fn(far, truth)[0], rel=1e-3)


def test_a_fit_on_a_bound_of_its_parameters_says_so():
    n, d = _grid()
    truth = {"E": 1.7, "A": 300.0, "B": 900.0, "alpha": 0.33, "beta0": 0.30, "beta1": -0.015}
    clean = fit_surface("farseer", _frame(n, d, SURFACES["farseer"].predict_fn({"params_active": n, "tokens": d}, truth)))
    assert clean.at_bounds == ()
    # ten runs at two D/N ratios (public steplaw data): B runs to the box's 1e12 edge
    from forecasting import final_laws as fl
    from forecasting import suite

    final = fl.final_points(suite.splits_steplaw_dense_overtrained()[0].train)
    edge = fit_surface("farseer", final)
    assert edge.at_bounds == ("B",) and edge.params["B"] == pytest.approx(1e12, rel=1e-3)


def test_moe_surface_finds_how_much_total_parameters_count():
    n, d = _grid(ratios=(20.0, 80.0))
    sparsity = np.tile([1.0, 4.0, 16.0, 2.0, 8.0, 32.0], 2)[: len(n)]
    truth = {"E": 1.7, "A": 300.0, "B": 900.0, "alpha": 0.33, "beta": 0.29, "kappa": 0.35}
    x = {"params_active": n, "tokens": d, "params_total": n * sparsity}
    fit = fit_surface("moe", _frame(n, d, SURFACES["moe"].predict_fn(x, truth), params_total=n * sparsity))
    assert fit.params["kappa"] == pytest.approx(0.35, abs=0.02)
    with pytest.raises(FitError, match="does not vary sparsity"):
        fit_surface("moe", _frame(n, d, SURFACES["moe"].predict_fn(x, truth), params_total=n * 4.0))
    # one total size for every run (Step Law's MoE ladder): N_eff is a power of N alone, kappa one with alpha
    one_total = np.full(len(n), 2e10)
    with pytest.raises(FitError, match=r"follow its active ones \(one total size\)"):
        fit_surface("moe", _frame(n, d, SURFACES["moe"].predict_fn({**x, "params_total": one_total}, truth), params_total=one_total))
    with pytest.raises(FitError, match=r"growing as active\^0.5"):
        fit_surface("moe", _frame(n, d, np.full(len(n), 3.0), params_total=3e5 * np.sqrt(n)))


def test_data_constrained_surface_discounts_repeated_tokens():
    assert effective_tokens(np.array([1e9]), np.array([2e9]), 15.0)[0] == 1e9  # no repetition: D itself
    once_more = effective_tokens(np.array([2e9]), np.array([1e9]), 15.0)[0]
    assert 1.9e9 < once_more < 2e9  # one repetition is worth almost a fresh epoch (Muennighoff et al.)
    assert effective_tokens(np.array([1e12]), np.array([1e9]), 15.0)[0] < 16.1e9  # saturates at U (1 + R*)
    n, d = _grid(ratios=(20.0, 80.0, 320.0))
    unique = np.minimum(d, 20.0 * n / 4)  # every run sees at most 5x-epochs of a budget of 5 tokens/param
    truth = {"E": 1.7, "A": 300.0, "B": 900.0, "alpha": 0.33, "beta": 0.29, "R_star": 12.0}
    x = {"params_active": n, "tokens": d, "unique_tokens": unique}
    fit = fit_surface("data_constrained", _frame(n, d, SURFACES["data_constrained"].predict_fn(x, truth), unique_tokens=unique))
    assert fit.params["R_star"] == pytest.approx(12.0, rel=0.05)


def test_a_surface_says_why_it_cannot_be_fitted():
    n, d = _grid(n_sizes=2, ratios=(20.0,))
    with pytest.raises(FitError, match="at least 5 finished runs"):
        fit_surface("overtrain", _frame(n, d, np.full(len(n), 3.0)))
    n, d = _grid(n_sizes=2, ratios=(5.0, 20.0, 80.0, 320.0))
    with pytest.raises(FitError, match="three model sizes"):
        fit_surface("farseer", _frame(n, d, np.full(len(n), 3.0)))


def test_a_ladder_fit_of_a_surface_predicts_in_one_call():
    from forecasting.api import fit_ladder

    n, d = _grid()
    truth = {"E": 1.7, "A": 300.0, "B": 900.0, "eta": 0.31}
    loss = SURFACES["overtrain"].predict_fn({"params_active": n, "tokens": d}, truth)
    fit = fit_ladder(_frame(n, d, loss).assign(step=1), law="overtrain", n_bootstrap=5)
    assert fit.predict(7e10, 1.4e12) == pytest.approx(SURFACES["overtrain"].predict_fn(
        {"params_active": np.array(7e10), "tokens": np.array(1.4e12)}, truth), rel=1e-3)


def test_the_fit_finds_the_global_basin_of_the_data_constrained_form_on_the_c4_runs():
    from forecasting import final_laws as fl
    from forecasting import suite

    split = next(s for s in suite.splits_datablations() if s.name.startswith("c4"))
    final = fl.final_points(split.train)
    fit = fit_surface("data_constrained", final)
    # the starts near Chinchilla's fit alone stopped at 7.2e-7 on one machine (5.2x the optimum) and predicted the
    # held-out 8.7B runs' finals 5.4% off (mean) instead of 1.9%
    assert fit.objective < 1.5e-7
    errors = [fit.predict({"params_active": [h.target.params_active], "tokens": [h.target.tokens],
                           "unique_tokens": [h.target.unique_tokens]})[0] / h.points["loss"].iloc[-1] - 1 for h in split.targets]
    assert np.mean(np.abs(errors)) < 0.025


@pytest.mark.parametrize("name, params", [
    ("overtrain", {"E": 1.7, "A": 400.0, "B": 900.0, "eta": 0.3}),
    ("farseer", {"E": 1.7, "A": 400.0, "B": 900.0, "alpha": 0.3, "beta0": 0.28, "beta1": 0.02}),
    ("moe", {"E": 1.7, "A": 400.0, "B": 900.0, "alpha": 0.3, "beta": 0.28, "kappa": 0.4}),
    ("data_constrained", {"E": 1.7, "A": 400.0, "B": 900.0, "alpha": 0.3, "beta": 0.28, "R_star": 12.0}),
])
def test_each_surface_s_gradient_is_the_derivative_of_its_prediction(name, params):
    """The fit hands least_squares these derivatives as its Jacobian: a wrong one would stop it off the optimum."""
    rng = np.random.default_rng(0)
    n = np.geomspace(1e7, 1e10, 30)
    x = {"params_active": n, "tokens": np.geomspace(1e9, 1e12, 30)[rng.permutation(30)],
         "params_total": n * rng.uniform(1, 30, 30)}
    x["unique_tokens"] = x["tokens"] / rng.uniform(0.5, 20, 30)  # some runs repeat their data, some do not
    surface = SURFACES[name]
    grad = surface.grad_fn(x, params)
    for k in surface.names:
        h = 1e-6 * abs(params[k])
        central = (surface.predict_fn(x, {**params, k: params[k] + h}) - surface.predict_fn(x, {**params, k: params[k] - h})) / (2 * h)
        np.testing.assert_allclose(grad[k], central, rtol=1e-6, err_msg=k)


def test_a_ladder_at_one_tokens_per_param_ratio_fits_without_chinchilla_s_start():
    """At one D/N, Chinchilla's alpha and beta are one direction: its fit is not a start (it walked a flat valley for
    thousands of BFGS iterations per replicate), and the form's own grid start still finds the data's parameters."""
    n = np.geomspace(1e7, 4e8, 8)
    truth = {"E": 1.8, "A": 300.0, "B": 900.0, "eta": 0.3}
    loss = SURFACES["overtrain"].predict_fn({"params_active": n, "tokens": 20 * n}, truth)
    from unittest import mock

    from forecasting import surfaces

    with mock.patch.object(surfaces, "fit_chinchilla", side_effect=AssertionError("Chinchilla fitted at one ratio")):
        fit = fit_surface("overtrain", _frame(n, 20 * n, loss))
    assert fit.converged
    far = {"params_active": np.array([4e9]), "tokens": np.array([8e10])}
    assert fit.predict(far)[0] == pytest.approx(SURFACES["overtrain"].predict_fn(far, truth)[0], rel=1e-3)


@pytest.mark.parametrize("name", ["overtrain", "farseer"])
def test_a_warm_started_bootstrap_refit_finds_what_every_start_finds(name):
    """Bootstrap refits start from the full fit's optimum alone (4-17x faster): on resampled noisy runs they must
    land where the cold multi-start lands."""
    n, d = _grid()
    truth = {"overtrain": {"E": 1.7, "A": 300.0, "B": 900.0, "eta": 0.31},
             "farseer": {"E": 1.7, "A": 300.0, "B": 900.0, "alpha": 0.33, "beta0": 0.30, "beta1": -0.015}}[name]
    rng = np.random.default_rng(1)
    loss = SURFACES[name].predict_fn({"params_active": n, "tokens": d}, truth) * np.exp(rng.normal(0, 0.01, len(n)))
    frame = _frame(n, d, loss)
    full = fit_surface(name, frame)
    far = {"params_active": np.array([7e10]), "tokens": np.array([1.4e13])}
    for _ in range(5):
        w = np.bincount(rng.integers(0, len(n), len(n)), minlength=len(n)).astype(float)
        warm, cold = fit_surface(name, frame, weights=w, start=full.params), fit_surface(name, frame, weights=w)
        assert warm.objective == pytest.approx(cold.objective, rel=1e-6, abs=1e-12)
        assert warm.predict(far)[0] == pytest.approx(cold.predict(far)[0], rel=1e-6)


def test_a_bootstrap_refit_along_a_flat_valley_converges_where_tight_tolerances_ran_out(monkeypatch):
    """Porian's first configuration, Farseer, the first of 100 stratified resamples: at the full fit's tolerances
    the warm-started refit walked a flat valley to the evaluation limit, and the replicate was dropped (6 of 100 on
    this table); at REFIT_TOL it converges, and predicts the target as the unconverged walk's best point does."""
    from forecasting import final_laws as fl
    from forecasting import suite, surfaces
    from forecasting.table import validate_table

    split = suite.splits_porian(cap=1)[0]
    final = fl.final_points(validate_table(split.train))
    full = fit_surface("farseer", final)
    weights = fl.stratified_run_weights(final["run"], final["params_active"], 100, 0)[0]
    at_target = fl.target_point(split.targets[0].target)
    refit = fit_surface("farseer", final, weights=weights, start=full.params)
    monkeypatch.setattr(surfaces, "REFIT_TOL", surfaces.FIT_TOL)
    walked = fit_surface("farseer", final, weights=weights, start=full.params)
    assert refit.converged and not walked.converged
    assert refit.objective == pytest.approx(walked.objective, rel=1e-4)
    assert refit.predict(at_target)[0] == pytest.approx(walked.predict(at_target)[0], rel=1e-3)
