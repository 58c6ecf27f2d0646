"""Final-loss laws on public data: Epoch's Chinchilla replication, compute law, allocation, isoFLOP."""

import numpy as np
import pytest

from forecasting.api import fit_ladder
from forecasting.fitting import fit_chinchilla, fit_compute_law
from forecasting.laws import ChinchillaLaw, compute_optimal_allocation, isoflop_optimum
from forecasting.public_data import chinchilla_points, data_dir

DATA = data_dir()


def needs_data(test):
    return test

EPOCH_95 = {"E": (1.769, 1.871), "A": (285, 744), "B": (1042, 5810), "alpha": (0.317, 0.373), "beta": (0.331, 0.415)}


@pytest.fixture(scope="module")
def chinchilla():
    return chinchilla_points(DATA / "chinchilla_svg_extracted_data.csv")


@needs_data
def test_epoch_replication_every_parameter_inside_epoch_intervals(chinchilla):
    assert len(chinchilla) == 240
    law, diag = fit_chinchilla(chinchilla["params_active"], chinchilla["tokens"], chinchilla["loss"])
    assert diag.converged
    for name, (lo, hi) in EPOCH_95.items():
        assert lo <= getattr(law, name) <= hi, (name, getattr(law, name))
    # Epoch's grid-stage result, reproduced to 3 significant figures
    assert law.E == pytest.approx(1.8172, abs=2e-3)
    assert law.alpha == pytest.approx(0.3473, abs=2e-3)


@needs_data
def test_fit_ladder_chinchilla_bootstrap_intervals_overlap_epoch(chinchilla):
    fit = fit_ladder(chinchilla, law="chinchilla", n_bootstrap=60, seed=1)
    assert fit.law == "chinchilla" and fit.n_runs == 240
    for name, (lo, hi) in EPOCH_95.items():
        iv = fit.params[name]
        assert iv.lo <= iv.value <= iv.hi
        assert iv.lo < hi and iv.hi > lo  # our interval overlaps Epoch's
        assert iv.hi > iv.lo  # a real interval, not a point
    assert fit.n_bootstrap >= 55


def test_compute_optimal_allocation_matches_closed_form():
    law = ChinchillaLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
    out = compute_optimal_allocation(law, np.array([5.76e23]))
    n, d = out["params_opt"][0], out["tokens_opt"][0]
    assert 6 * n * d == pytest.approx(5.76e23, rel=1e-9)
    # the optimum is a minimum of L along the iso-compute line
    for k in (0.8, 1.25):
        assert law.predict(n * k, d / k) > law.predict(n, d)


def test_isoflop_recovers_allocation_exponent_on_a_synthetic_surface():
    law = ChinchillaLaw(E=1.8, A=400.0, B=400.0, alpha=0.34, beta=0.34)  # alpha = beta -> a = 0.5
    flops, params, loss = [], [], []
    for c in (1e19, 1e20, 1e21, 1e22):
        n_opt, _ = law.compute_optimal(c)
        for k in np.geomspace(0.25, 4, 9):
            n = n_opt * k
            flops.append(c)
            params.append(n)
            loss.append(float(law.predict(n, c / (6 * n))))
    res = isoflop_optimum(flops, params, loss)
    assert res.exponent_a == pytest.approx(0.5, abs=0.02)
    assert res.exponent_a + res.exponent_b == pytest.approx(1.0, abs=1e-6)


def test_compute_law_fixed_profiled_free_recover_a_known_law():
    c = np.geomspace(1e18, 1e22, 8)
    y = 1.7 + 60.0 * c**-0.08
    fixed = fit_compute_law(c, y, asymptote=1.7)
    assert fixed.alpha == pytest.approx(0.08, rel=1e-6) and fixed.asymptote_mode == "fixed"
    prof = fit_compute_law(c, y, asymptote="profiled")
    assert prof.E == pytest.approx(1.7, abs=0.02)
    free = fit_compute_law(c, y, asymptote="free")
    assert free.predict(1e23) == pytest.approx(1.7 + 60.0 * 1e23**-0.08, rel=1e-3)
    assert "E free" in free.formula()
