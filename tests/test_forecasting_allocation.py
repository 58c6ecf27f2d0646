"""The compute-optimal allocation for a budget, with intervals, and where the declared target sits (a planner)."""

import numpy as np
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
