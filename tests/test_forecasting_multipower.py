"""Tests of the schedule-aware loss-curve laws (forecasting/multipower.py) on public data and exact formulas."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest

from forecasting.multipower import (
    CurveBands,
    CurveData,
    ModelError,
    LRAnnealingLaw,
    MultiPowerLaw,
    binned,
    bootstrap_multipower,
    calibrate_model_error,
    curve_from_table,
    fit_lr_annealing,
    fit_multipower,
    load_multipowerlaw_dir,
    mean_abs_rel_error,
    multipower_bands,
    multipowerlaw_schedule,
)

from forecasting.public_data import data_dir

DATA = data_dir() / "multipowerlaw"
TRAIN = ("cosine_24000", "constant_24000", "wsdcon_9")


def needs_data(test):
    """The public data ships inside the package (forecasting/data/); its absence is a setup error, not a skip."""
    return test

PAPER_LIKE = MultiPowerLaw(L0=2.78, A=0.60, alpha=0.45, B=440.0, C=2.1, beta=0.6, gamma=0.65)


def brute_force_mpl(law: MultiPowerLaw, lr: np.ndarray, t: int) -> float:
    """The paper's formula written out literally (1-based steps, warmup excluded from the drop sum)."""
    eta = np.r_[np.nan, lr]  # eta[k] = LR of step k
    rising = 1
    while rising < len(lr) and eta[rising + 1] > eta[rising]:
        rising += 1
    drop = 0.0
    for k in range(rising + 1, t + 1):
        s_k = eta[k : t + 1].sum()
        g = 1.0 - (law.C * eta[k] ** (-law.gamma) * s_k + 1.0) ** (-law.beta)
        drop += (eta[k - 1] - eta[k]) * g
    return law.L0 + law.A * eta[1 : t + 1].sum() ** (-law.alpha) - law.B * drop


def test_vectorised_prediction_equals_the_literal_formula():
    lr = np.r_[np.linspace(1e-5, 3e-4, 20), np.full(30, 3e-4), np.linspace(3e-4, 3e-5, 40), np.full(10, 1e-4)]
    steps = np.array([5, 20, 21, 50, 51, 70, 90, 95, 100])
    exact = [brute_force_mpl(PAPER_LIKE, lr, t) for t in steps]
    np.testing.assert_allclose(PAPER_LIKE.predict(lr, steps), exact, rtol=1e-12)


def test_constant_lr_has_no_drop_and_a_cooldown_lowers_the_loss():
    const = np.full(5000, 3e-4)
    cooled = const.copy()
    cooled[4000:] = np.linspace(3e-4, 3e-5, 1000)
    steps = np.array([3000, 4000, 5000])
    p_const, p_cooled = PAPER_LIKE.predict(const, steps), PAPER_LIKE.predict(cooled, steps)
    np.testing.assert_allclose(p_const, PAPER_LIKE.L0 + PAPER_LIKE.A * (steps * 3e-4) ** -PAPER_LIKE.alpha)
    assert p_cooled[0] == pytest.approx(p_const[0]) and p_cooled[1] == pytest.approx(p_const[1])
    assert p_cooled[2] < p_const[2] - 0.02  # a 10x cooldown buys several hundredths of loss


@pytest.mark.parametrize("name", ["cosine_72000", "wsd_20000_24000"])
def test_grouped_decay_steps_change_predictions_by_less_than_2e5(name):
    lr = multipowerlaw_schedule(name)
    steps = np.arange(2160, lr.size + 1, 128)
    exact = PAPER_LIKE.predict(lr, steps)
    grouped = PAPER_LIKE.predict(lr, steps, group=16)
    assert np.max(np.abs(grouped / exact - 1)) < 2e-5


@needs_data
def test_rebuilt_schedules_match_the_logged_learning_rates():
    curves = load_multipowerlaw_dir(DATA / "csv_25")  # raises if any logged LR differs from the rebuilt one
    assert set(curves) >= set(TRAIN) and len(curves) == 9
    wsdcon = curves["wsdcon_9"]
    assert wsdcon.lr[7998] == 3e-4 and wsdcon.lr[7999] == pytest.approx(9e-5)  # step 8000 is the first at 9e-5


@needs_data
@pytest.mark.parametrize("size", ["csv_25", "csv_100", "csv_400"])
def test_backtest_fit_three_schedules_predict_the_other_six(size):
    curves = load_multipowerlaw_dir(DATA / size)
    law = fit_multipower([curves[n] for n in TRAIN], n_starts=2, seed=0)
    errors = {n: mean_abs_rel_error(law, c)[0] for n, c in curves.items() if n not in TRAIN}
    assert len(errors) == 6
    assert np.mean(list(errors.values())) <= 0.005, errors
    assert max(errors.values()) <= 0.01, errors  # no single held-out schedule is off by 1% on average
    assert 0.3 < law.alpha < 0.7 and law.L0 < min(c.loss.min() for c in curves.values())


def test_fit_recovers_a_known_law_and_predicts_an_unseen_schedule():
    truth = PAPER_LIKE
    cosine = multipowerlaw_schedule("cosine_24000")
    constant = multipowerlaw_schedule("constant_24000")
    wsdcon = multipowerlaw_schedule("wsdcon_9")
    steps = np.arange(2200, 23900, 256)
    train = [
        CurveData("cos", cosine, steps, truth.predict(cosine, steps)),
        CurveData("const", constant, steps, truth.predict(constant, steps)),
        CurveData("wsdcon", wsdcon, steps[steps < 16000], truth.predict(wsdcon, steps[steps < 16000])),
    ]
    law = fit_multipower(train, n_starts=3)
    wsd = multipowerlaw_schedule("wsd_20000_24000")
    rel = law.predict(wsd, steps) / truth.predict(wsd, steps) - 1
    assert np.max(np.abs(rel)) < 5e-4


def test_round_trip_and_formula():
    again = MultiPowerLaw.from_dict(PAPER_LIKE.to_dict())
    assert again == PAPER_LIKE
    assert "S_W" in PAPER_LIKE.formula() and "2.78" in PAPER_LIKE.formula()
    tissue = LRAnnealingLaw(L0=2.8, A=0.6, alpha=0.45, C=0.5)
    assert LRAnnealingLaw.from_dict(tissue.to_dict()) == tissue
    with pytest.raises(ValueError, match="expected a multi_power law"):
        MultiPowerLaw.from_dict(tissue.to_dict())


def test_bad_inputs_give_clear_errors():
    lr = np.full(100, 1e-3)
    with pytest.raises(ValueError, match="non-positive learning rate at step 51"):
        CurveData("x", np.r_[lr[:50], 0.0, lr[51:]], np.arange(1, 11), np.ones(10))
    with pytest.raises(ValueError, match="mismatched lengths"):
        CurveData("x", lr, np.arange(1, 11), np.ones(9))
    with pytest.raises(ValueError, match="1..100"):
        CurveData("x", lr, np.arange(95, 106), np.ones(11))
    with pytest.raises(ValueError, match="non-positive"):
        PAPER_LIKE.predict(np.r_[lr, -1e-4], np.array([5]))
    flat = CurveData("flat", lr, np.arange(1, 101), 3.0 + 1.0 / np.arange(1, 101) ** 0.5)
    with pytest.raises(ValueError, match="no curve has any LR change"):
        fit_multipower([flat])
    with pytest.raises(ValueError, match="no curve has any LR change"):
        fit_lr_annealing([flat])


def test_single_curve_fit_warns():
    lr = multipowerlaw_schedule("cosine_24000")
    steps = np.arange(2200, 23900, 512)
    curve = CurveData("cos", lr, steps, PAPER_LIKE.predict(lr, steps))
    with pytest.warns(UserWarning, match="single curve"):
        fit_multipower([curve], n_starts=1)


@needs_data
def test_curve_from_table_rebuilds_the_schedule_from_logged_points():
    raw = pd.read_csv(DATA / "csv_100" / "cosine_24000.csv")
    table = raw.assign(run="cos24k", num_steps=24000)
    curve = curve_from_table(table, "cos24k")
    exact = multipowerlaw_schedule("cosine_24000")
    assert curve.lr.size == 24000
    # linear warmup from 0 and interpolation between logged points: the LR area differs by < 0.1%
    np.testing.assert_allclose(np.cumsum(curve.lr)[curve.steps - 1], np.cumsum(exact)[curve.steps - 1], rtol=1e-3)
    np.testing.assert_allclose(PAPER_LIKE.predict(curve.lr, curve.steps), PAPER_LIKE.predict(exact, curve.steps), rtol=2e-4)
    with pytest.raises(ValueError, match="no rows"):
        curve_from_table(table, "missing")


@needs_data
def test_bootstrap_gives_bands_that_contain_the_point_and_widen_with_extrapolation():
    curves = load_multipowerlaw_dir(DATA / "csv_400")
    train = [curves[n] for n in TRAIN]
    point = fit_multipower(train, n_starts=2, max_points_per_curve=60)
    reps = bootstrap_multipower(train, n_boot=6, seed=1, point=point, group=32)
    assert len(reps) >= 3 and all(isinstance(r, MultiPowerLaw) for r in reps)
    assert len({round(r.A, 6) for r in reps}) > 1  # the replicates differ
    bands = CurveBands(point=point, replicates=reps, model_error=ModelError(sigma_schedule=1e-3, kappa=3e-3, area_seen=6.9))
    target = curves["cosine_72000"].subset(np.arange(0, curves["cosine_72000"].steps.size, 6))
    mid, lo, hi = bands.predict_band(target.lr, target.steps, q=(0.05, 0.95))
    assert np.all(lo < mid) and np.all(mid < hi)
    width = (hi - lo) / mid
    assert width[-1] > 1.5 * width[0]  # 3x the training horizon: the band opens up
    bare_mid, bare_lo, bare_hi = bands.predict_band(target.lr, target.steps, q=(0.05, 0.95), include_model_error=False)
    assert np.all(bare_hi - bare_lo <= hi - lo + 1e-12)
    with pytest.raises(ValueError, match="increasing"):
        bands.predict_band(target.lr, target.steps, q=(0.9, 0.1))


@needs_data
def test_model_error_calibration_measures_schedule_transfer_and_time_extrapolation():
    curves = load_multipowerlaw_dir(DATA / "csv_100")
    train = [curves[n] for n in TRAIN]
    point = fit_multipower(train, n_starts=1, max_points_per_curve=80)

    def quick_fit(part):
        return fit_multipower(part, n_starts=1, init=point, max_points_per_curve=80, group=32)

    error = calibrate_model_error(train, quick_fit)
    assert 1e-4 < error.sigma_schedule < 0.02 and 1e-4 < error.kappa < 0.05
    assert error.area_seen == pytest.approx(np.cumsum(curves["constant_24000"].lr)[23935])
    assert error.sigma(np.array([1.0, error.area_seen]))[0] == pytest.approx(error.sigma_schedule)
    assert error.sigma(np.array([3 * error.area_seen]))[0] > error.sigma_schedule


@needs_data
def test_lr_annealing_law_backtest_is_within_half_a_percent():
    curves = load_multipowerlaw_dir(DATA / "csv_100")
    law = fit_lr_annealing([curves[n] for n in TRAIN])
    errors = [mean_abs_rel_error(law, c)[0] for n, c in curves.items() if n not in TRAIN]
    assert np.mean(errors) <= 0.005


def test_curve_from_table_accepts_a_warmup_that_starts_at_zero_and_uses_the_split():
    steps = np.arange(0, 1001, 10)
    lr = np.minimum(steps / 100.0, 1.0) * 1e-3  # optax-style warmup from exactly 0
    table = pd.DataFrame({"run": "r", "step": steps, "lr": lr, "loss": 3.0 + 2.0 / (1 + steps) ** 0.3, "split": "train"})
    eval_rows = table.iloc[::10].assign(split="eval", lr=np.nan, loss=lambda d: d["loss"] + 0.01)
    both = pd.concat([table, eval_rows])
    curve = curve_from_table(both, "r", split="eval", num_steps=1200)
    assert curve.lr.size == 1200 and np.all(curve.lr > 0) and curve.lr[-1] == pytest.approx(1e-3)
    assert list(curve.steps) == list(range(100, 1001, 100))  # step 0 dropped, eval rows only
    with pytest.raises(ValueError, match="several losses at one step"):
        curve_from_table(both, "r")


def test_analytic_jacobian_matches_finite_differences():
    from forecasting import multipower as mp

    lr = multipowerlaw_schedule("wsd_20000_24000")
    curve = CurveData("wsd", lr, np.arange(2200, 24001, 400), np.full(55, 3.3))
    problem = mp._problem([curve], group=4)
    theta = PAPER_LIKE.as_vector()
    _, jac = mp._mpl_predict_all(problem, theta, True)
    for j in range(theta.size):
        h = 1e-6 * max(abs(theta[j]), 1e-3)
        up, down = theta.copy(), theta.copy()
        up[j] += h
        down[j] -= h
        numeric = (mp._mpl_predict_all(problem, up, False)[0] - mp._mpl_predict_all(problem, down, False)[0]) / (2 * h)
        np.testing.assert_allclose(jac[:, j], numeric, rtol=1e-5, atol=1e-9)


@needs_data
def test_bootstrap_resamples_curves_when_there_are_enough_and_bands_work_for_the_annealing_law():
    curves = load_multipowerlaw_dir(DATA / "csv_400")
    names = ("cosine_24000", "constant_24000", "wsdcon_9", "wsdcon_18")
    thin = [curves[n].subset(np.arange(0, curves[n].steps.size, 3)) for n in names]
    point = fit_multipower(thin, n_starts=1)
    reps = bootstrap_multipower(thin, n_boot=3, seed=0, point=point)
    assert len(reps) == 3 and len({r.L0 for r in reps}) == 3
    bands = multipower_bands(thin, n_boot=5, seed=0, law="lr_annealing")
    assert isinstance(bands.point, LRAnnealingLaw) and bands.model_error.sigma_schedule > 0
    target = curves["wsd_20000_24000"]
    mid, lo, hi = bands.predict_band(target.lr, target.steps)
    assert np.mean(np.abs(mid / target.loss - 1)) < 0.005
    assert np.mean((target.loss >= lo) & (target.loss <= hi)) > 0.8
    with pytest.raises(ValueError, match="law must be"):
        multipower_bands(thin, n_boot=2, law="chinchilla")


def test_long_noisy_per_step_curves_are_binned_and_fit_well():
    rng = np.random.default_rng(0)
    steps = np.arange(2200, 16001, 4)  # 3,450 points per curve, 1% noise each
    train = []
    for name in ("cosine_16000", "constant_16000", "wsdcon_9"):
        lr = multipowerlaw_schedule(name)
        train.append(CurveData(name, lr, steps, PAPER_LIKE.predict(lr, steps) * np.exp(rng.normal(0, 0.01, steps.size))))
    assert binned(train[0], 100).steps.size == 100 and binned(train[0], 10_000) is train[0]
    law = fit_multipower(train, n_starts=1)  # default: 400 bins per curve
    wsd = multipowerlaw_schedule("wsd_20000_24000")
    check = np.arange(2200, 24001, 200)
    truth = PAPER_LIKE.predict(wsd, check)
    assert np.mean(np.abs(law.predict(wsd, check) / truth - 1)) < 0.002
