"""A table that holds hyperparameter sweeps (several runs at one size and token count, differing in peak LR or batch):
the forecast says the laws fit the sweep's average, and `--best-of-sweep` / `best_of_sweeps` forecasts the tuned loss;
seeds and schedules of one peak LR are not sweeps."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from forecasting import api
from forecasting.forecast import TargetSpec
from forecasting.suite import load_multipower
from forecasting.table import best_of_sweeps, sweep_groups
from ladder.cli import app

SIZES = (2e7, 4e7, 8e7, 1.6e8, 3.2e8)
RATIOS = (10, 20, 40)
LR_STEPS = (1 / 9, 1 / 3, 1, 3)  # the grid around each size's optimum
TARGET = TargetSpec(name="big", params_active=1.28e9, tokens=1.28e9 * 20)


def _tuned(n: float, d: float) -> float:
    return 1.8 + 400.0 / n**0.34 + 2000.0 / d**0.36


def _best_lr(n: float) -> float:
    return 3e-3 * (1e8 / n) ** 0.3


def _lr_penalty(n: float, lr: float) -> float:
    """How far a run at `lr` ends above the tuned loss: quadratic in log LR around an optimum that falls with size."""
    return 0.04 * np.log(lr / _best_lr(n)) ** 2


def _sweep_ladder(*, noise: float = 0.002, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for n in SIZES:
        for ratio in RATIOS:
            d = n * ratio
            for lr in (_best_lr(n) * step for step in LR_STEPS):
                loss = _tuned(n, d) * (1 + _lr_penalty(n, lr)) * (1 + noise * rng.standard_normal())
                rows.append({"run": f"N={n:.3g}/D={d:.3g}/lr={lr:.3g}", "step": 1, "loss": loss, "params_active": n,
                             "tokens": d, "flops": 6 * n * d, "lr": lr, "batch": 64})
    return pd.DataFrame(rows)


def test_an_lr_sweep_is_named_and_its_best_runs_forecast_the_tuned_loss():
    table = _sweep_ladder()
    sweep = sweep_groups(table)
    assert sweep["columns"] == ["peak lr"] and sweep["points"] == len(SIZES) * len(RATIOS)
    assert sweep["runs"] == len(table) and sweep["largest"] == len(LR_STEPS) and sweep["median_gap"] > 0.05

    raw = api.forecast_target(table, TARGET, method="chinchilla", n_bootstrap=20)
    warning = next(w for w in raw.warnings if "hyperparameter sweep" in w)
    assert f"{len(table)} runs at {sweep['points']} sizes and token counts differ in peak lr" in warning
    assert "--best-of-sweep" in warning

    best, dropped = best_of_sweeps(table)
    assert len(best) == sweep["points"] and len(dropped) == len(table) - sweep["points"]
    # each point keeps its lowest loss
    assert (best.groupby(["params_active", "tokens"])["loss"].min().to_numpy()
            == table.groupby(["params_active", "tokens"])["loss"].min().to_numpy()).all()
    assert sweep_groups(best) is None
    tuned = api.forecast_target(best, TARGET, method="chinchilla", n_bootstrap=20)
    assert not any("hyperparameter sweep" in w for w in tuned.warnings)
    truth = _tuned(TARGET.params_active, TARGET.tokens)
    assert abs(tuned.final_loss / truth - 1) < 0.015
    assert raw.final_loss / truth - 1 > 3 * abs(tuned.final_loss / truth - 1)  # the average setting is worse
    assert set(api.load_table(table, best_of_sweep=True)["run"]) == set(best["run"])


def test_seeds_schedules_of_one_peak_and_a_batch_sweep_are_told_apart():
    table = _sweep_ladder()
    one_lr = table[np.isclose(table["lr"], [_best_lr(n) for n in table["params_active"]])].reset_index(drop=True)
    # replicas of one setting, told apart by a seed column: not a sweep, nothing dropped
    seeds = pd.concat([one_lr.assign(seed=s, run=one_lr["run"] + f"/seed={s}",
                                     loss=one_lr["loss"] * (1 + 0.003 * np.random.default_rng(s).standard_normal(len(one_lr))))
                       for s in range(3)], ignore_index=True)
    assert sweep_groups(seeds) is None and best_of_sweeps(seeds)[1] == []
    # one point per size and tokens: nothing to compare
    assert sweep_groups(one_lr) is None
    # the public Multi-Power curves: several schedules at one size and budget, one peak LR (the curve laws read lr)
    assert sweep_groups(load_multipower()) is None
    # a batch sweep at one LR, with a logged outcome column that must not count as a setting
    batches = pd.concat([one_lr.assign(batch=b, run=one_lr["run"] + f"/bs={b}", loss=one_lr["loss"] * (1 + 0.02 * i),
                                       loss_raw=one_lr["loss"] * (1.01 + 0.02 * i))
                         for i, b in enumerate((32, 64, 128))], ignore_index=True)
    assert sweep_groups(batches)["columns"] == ["batch"]
    assert set(best_of_sweeps(batches)[0]["batch"]) == {32}
    # a setting whose name holds an outcome word's letters is still a setting
    assert sweep_groups(batches.rename(columns={"batch": "grad_accum"}))["columns"] == ["grad_accum"]


def test_cli_best_of_sweep_forecasts_the_tuned_loss_and_refuses_an_experiment(tmp_path):
    path = tmp_path / "sweep.csv"
    _sweep_ladder().to_csv(path, index=False)
    runner = CliRunner()
    base = ["forecast", str(path), "--params-active", "1.28e9", "--tokens", "2.56e10", "--method", "chinchilla",
            "--n-bootstrap", "20", "--json"]
    raw = json.loads(runner.invoke(app, base).stdout)
    assert any("hyperparameter sweep" in w for w in raw["warnings"])
    picked = runner.invoke(app, [*base, "--best-of-sweep"])
    assert picked.exit_code == 0, picked.output
    tuned = json.loads(picked.stdout)
    expected = api.forecast_target(best_of_sweeps(api.load_table(str(path)))[0], TARGET, method="chinchilla", n_bootstrap=20)
    assert tuned["final_loss"] == pytest.approx(expected.final_loss, rel=1e-9)
    assert not any("hyperparameter sweep" in w for w in tuned["warnings"]) and tuned["final_loss"] < raw["final_loss"]
    fitted = runner.invoke(app, ["fit", str(path), "--law", "chinchilla", "--n-bootstrap", "10", "--best-of-sweep", "--json"])
    assert fitted.exit_code == 0 and json.loads(fitted.stdout)["n_runs"] == len(SIZES) * len(RATIOS)
    experiment = runner.invoke(app, ["backtest", "experiments/readme_example.py", "--best-of-sweep"])
    assert experiment.exit_code == 2 and "--best-of-sweep picks runs of a table of runs" in experiment.output
