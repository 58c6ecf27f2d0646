"""The compute-optimal allocation for a budget, with intervals, and where the declared target sits (a planner)."""

import numpy as np
import pytest
from typer.testing import CliRunner

from forecasting.api import TargetSpec, optimal_allocation
from forecasting.public_data import chinchilla_points, data_dir
from ladder.cli import app
from tests.test_forecasting_honest_bands import _final_table


def test_chinchilla_budget_optimum_and_the_declared_70b_next_to_it():
    table = chinchilla_points(data_dir() / "chinchilla_svg_extracted_data.csv")
    a = optimal_allocation(table, TargetSpec(name="70b", params_active=70e9, tokens=1.4e12), n_bootstrap=20)
    assert a["available"] and a["law"] in ("overtrain", "chinchilla", "farseer")
    assert 40e9 < a["params_opt"] < 100e9 and 12 < a["tokens_per_param"] < 40  # Epoch's replication: ~20-26 at this budget
    iv = a["intervals"]["params_opt"]
    assert iv["lo"] <= a["params_opt"] <= iv["hi"] and iv["hi"] > iv["lo"]
    assert abs(a["flops_6nd"] - 6 * 70e9 * 1.4e12) < 1e12
    assert 0 <= a["target"]["loss_above_opt"] < 0.01  # Chinchilla itself sits near its optimum
    over = optimal_allocation(table, TargetSpec(name="small", params_active=7e9, tokens=14e12), n_bootstrap=20)
    assert over["target"]["params_vs_opt"] < 0.5 and over["target"]["loss_above_opt"] > a["target"]["loss_above_opt"]


def test_a_ladder_at_one_ratio_says_the_optimum_comes_from_the_form():
    table = _final_table(np.geomspace(1e7, 4e8, 8), 20.0)
    a = optimal_allocation(table, TargetSpec(name="t", params_active=1e9, tokens=2e10), n_bootstrap=20)
    assert a["available"] and any("decades of tokens per parameter" in w for w in a["warnings"])
    few = optimal_allocation(_final_table([1e7, 3e7, 1e8], 20.0), TargetSpec(name="t", params_active=1e9, tokens=2e10))
    assert few["available"] is False and "no law in N and D" in few["reason"]


def test_forecast_command_prints_the_planner(tmp_path):
    path = tmp_path / "chin.csv"
    chinchilla_points(data_dir() / "chinchilla_svg_extracted_data.csv").to_csv(path, index=False)
    result = CliRunner().invoke(app, ["forecast", str(path), "--params-active", "7e10", "--tokens", "1.4e12", "--n-bootstrap", "10"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "compute-optimal at" in text and "declared target: N 70B" in text and "chosen" in text


def _moe_table(kappa: float = 0.3) -> "pd.DataFrame":
    import pandas as pd

    from forecasting.surfaces import SURFACES

    truth = {"E": 1.7, "A": 300.0, "B": 900.0, "alpha": 0.33, "beta": 0.30, "kappa": kappa}
    rng = np.random.default_rng(0)
    rows = []
    for n in np.geomspace(2e7, 3e8, 4):
        for sparsity in (1.0, 4.0, 16.0):
            for m in (10.0, 40.0):
                x = {"params_active": np.array([n]), "tokens": np.array([n * m]), "params_total": np.array([n * sparsity])}
                loss = float(SURFACES["moe"].predict_fn(x, truth)[0]) * np.exp(rng.normal(0, 0.002))
                rows.append({"run": f"n{n:.2g}-s{sparsity:g}-m{m:g}", "step": 1000, "loss": loss, "params_active": n,
                             "params_total": n * sparsity, "tokens": n * m, "flops": 6 * n * n * m})
    return pd.DataFrame(rows)


def test_a_ladder_that_varies_sparsity_prices_each_total_active_ratio_at_the_budget():
    target = TargetSpec(name="moe", params_active=1e9, params_total=8e9, tokens=2e10)
    a = optimal_allocation(_moe_table(), target, n_bootstrap=10)
    sp = a["sparsity"]
    assert sp is not None and abs(sp["kappa"] - 0.3) < 0.1 and not sp["warnings"]
    losses = [r["loss"] for r in sp["rows"]]
    assert losses == sorted(losses, reverse=True)  # more experts, lower loss, at every step of the sweep
    assert [r["sparsity"] for r in sp["rows"] if r["target"]] == [8.0]
    assert {r["sparsity"]: r["within_ladder"] for r in sp["rows"]}[64.0] is False  # beyond the ladder's 1-16x
    assert all(r["loss_lo"] <= r["loss"] <= r["loss_hi"] for r in sp["rows"])


@pytest.mark.slow
def test_a_sparsity_law_the_ladder_cannot_pin_is_not_planned_with():  # about 25 s: every allocation law's backtest on real runs
    from forecasting import suite

    t = suite.steplaw_best(suite.load_steplaw_moe(), ["params_total", "params_active", "tokens", "topk", "experts"])
    a = optimal_allocation(t, TargetSpec(name="x", params_active=1.24e9, params_total=2.16e9, tokens=2e10), n_bootstrap=10)
    # Step Law's MoE grid: every configuration has 2.15B total parameters, so kappa is one with alpha (an earlier
    # version fitted it anyway: kappa on its bound -0.5, "sparsity hurts")
    assert a["sparsity"] is None
    assert any("no loss-optimal sparsity" in w and "one total size" in w for w in a["warnings"])
    assert optimal_allocation(_final_table(np.geomspace(1e7, 4e8, 8), 20.0), TargetSpec(name="t", params_active=1e9, tokens=2e10),
                              n_bootstrap=10)["sparsity"] is None


def _repeated_data_grid():
    """Four sizes x three tokens per parameter x 1, 4, 16 epochs of unique data, on the data-constrained law."""
    import pandas as pd

    from forecasting.surfaces import SURFACES

    truth = {"E": 1.7, "A": 300.0, "B": 900.0, "alpha": 0.33, "beta": 0.29, "R_star": 6.0}
    rng = np.random.default_rng(0)
    rows = []
    for n in np.geomspace(3e7, 3e8, 4):
        for m in (5.0, 20.0, 80.0):
            for epochs in (1.0, 4.0, 16.0):
                x = {"params_active": np.array([n]), "tokens": np.array([n * m]), "unique_tokens": np.array([n * m / epochs])}
                loss = float(SURFACES["data_constrained"].predict_fn(x, truth)[0]) * np.exp(rng.normal(0, 0.002))
                rows.append({"run": f"n{n:.2g}-m{m:g}-e{epochs:g}", "step": 1000, "loss": loss, "params_active": n,
                             "tokens": n * m, "unique_tokens": n * m / epochs, "flops": 6 * n * n * m})
    return pd.DataFrame(rows), truth


def test_with_little_unique_data_the_optimum_is_a_larger_model_under_the_data_constrained_law():
    """Muennighoff et al.'s question: with U unique tokens and C FLOPs, how large a model. The laws blind to unique
    tokens are not candidates on a ladder that varies them (an earlier version planned with the over-training law,
    the same optimum whatever U)."""
    from forecasting.surfaces import SURFACES

    table, truth = _repeated_data_grid()
    c6 = 6 * 1e9 * 4e10
    optimum = {}
    for unique in (2e11, 5e9):  # more unique tokens than the optimum trains on; an eighth of them
        a = optimal_allocation(table, TargetSpec(name="t", params_active=1e9, tokens=4e10, unique_tokens=unique), n_bootstrap=20)
        assert a["available"] and a["law"] == "data_constrained" and a["unique_tokens"] == unique
        n = np.geomspace(1e7, 1e11, 4000)
        loss = SURFACES["data_constrained"].predict_fn({"params_active": n, "tokens": c6 / (6 * n), "unique_tokens": np.full_like(n, unique)}, truth)
        assert a["params_opt"] == pytest.approx(n[np.argmin(loss)], rel=0.1)
        iv = a["intervals"]["params_opt"]
        assert iv["lo"] <= a["params_opt"] <= iv["hi"]
        optimum[unique] = a["params_opt"]
    assert optimum[5e9] > 2 * optimum[2e11]
    scarce = optimal_allocation(table, TargetSpec(name="t", params_active=1e9, tokens=4e10, unique_tokens=1e8), n_bootstrap=20)
    assert scarce["tokens_opt"] / 1e8 > 20 and any("the ladder's runs at most 16" in w for w in scarce["warnings"])
    # without the target's unique tokens there is nothing to plan the data-constrained law at: the blind laws are
    # not offered either, so the planner says so rather than answer for some other amount of data
    none = optimal_allocation(table, TargetSpec(name="t", params_active=1e9, tokens=4e10), n_bootstrap=20)
    assert none["available"] is False and "varies unique tokens" in none["reason"] and "--unique-tokens" in none["reason"]
