"""The CLI as scripts use it: exit codes, --json documents, clear one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from ladder.cli import app

runner = CliRunner()
README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _chinchilla_table(path) -> str:
    """Final points of 12 runs on a known law L = 1.8 + 400/N^0.34 + 2000/D^0.37, with 0.3% noise."""
    rng = np.random.default_rng(0)
    rows = []
    for n in (1e7, 3e7, 1e8, 3e8):
        for tpp in (10, 20, 40):
            d = n * tpp
            loss = (1.8 + 400 / n**0.34 + 2000 / d**0.37) * (1 + 0.003 * rng.standard_normal())
            rows.append({"run": f"n{n:.0e}-t{tpp}", "step": 1000, "loss": loss, "params_active": n, "tokens": d, "flops": 6 * n * d})
    pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


def test_fit_json_on_a_table(tmp_path):
    table = _chinchilla_table(tmp_path / "runs.csv")
    result = runner.invoke(app, ["fit", table, "--law", "chinchilla", "--n-bootstrap", "40", "--json"])
    assert result.exit_code == 0, result.output
    fit = json.loads(result.stdout)
    assert fit["law"] == "chinchilla" and fit["n_runs"] == 12
    e = fit["params"]["E"]
    assert e["lo"] <= e["value"] <= e["hi"] and abs(e["value"] - 1.8) < 0.15


def test_forecast_json_on_a_table_has_the_documented_keys(tmp_path):
    table = _chinchilla_table(tmp_path / "runs.csv")
    n, d = 1e9, 2e10
    result = runner.invoke(app, ["forecast", table, "--params-active", str(n), "--tokens", str(d), "--method", "chinchilla",
                                 "--n-bootstrap", "40", "--json"])
    assert result.exit_code == 0, result.output
    forecast = json.loads(result.stdout)
    truth = 1.8 + 400 / n**0.34 + 2000 / d**0.37
    assert forecast["final_loss_lo"] <= forecast["final_loss"] <= forecast["final_loss_hi"]
    assert forecast["final_loss_lo"] <= truth <= forecast["final_loss_hi"]
    assert abs(forecast["final_loss"] / truth - 1) < 0.02


def test_auto_on_an_over_trained_target_shows_its_backtest_along_tokens_per_param(tmp_path):
    table = _chinchilla_table(tmp_path / "runs.csv")
    n, d = 3e8, 400 * 3e8  # 10x the ladder's largest D/N
    result = runner.invoke(app, ["forecast", table, "--params-active", str(n), "--tokens", str(d), "--n-bootstrap", "20", "--json"])
    assert result.exit_code == 0, result.output
    forecast = json.loads(result.stdout)
    chosen = next(c for c in forecast["selection"] if c.get("chosen"))
    assert chosen["tokens_per_param_points"] > 0
    truth = 1.8 + 400 / n**0.34 + 2000 / d**0.37
    assert forecast["final_loss_lo"] <= truth <= forecast["final_loss_hi"]
    weights = [c["blend_weight"] for c in forecast["selection"] if c.get("blend_weight")]
    # on this ladder three surfaces backtest within 2x of each other along D/N: auto blends them
    assert forecast["method"] == "blend" and len(weights) >= 2 and abs(sum(weights) - 1) < 1e-9
    shown = runner.invoke(app, ["forecast", table, "--params-active", str(n), "--tokens", str(d), "--n-bootstrap", "20"])
    assert shown.exit_code == 0 and "blend weight" in shown.output and f"by {forecast['method']}" in shown.output
    for c in forecast["selection"]:  # each blended law's own backtest is shown under its name
        if c.get("blend_weight"):
            assert f"backtest of {c['method']} (compute)" in shown.output


def test_method_help_lists_every_forecasting_method():
    from forecasting.api import METHODS
    from ladder.cli import METHOD_HELP

    assert all(m in METHOD_HELP for m in METHODS)


def test_a_run_the_reader_left_out_is_named_on_the_command_line(tmp_path):
    path = tmp_path / "runs.csv"
    frame = pd.read_csv(_chinchilla_table(tmp_path / "whole.csv"))
    frame.loc[frame["run"] == "n3e+07-t10", "loss"] = np.nan
    frame.to_csv(path, index=False)
    result = runner.invoke(app, ["fit", str(path), "--law", "chinchilla", "--n-bootstrap", "5"])
    assert result.exit_code == 0, result.output
    assert "warning: runs: run(s) 'n3e+07-t10' hold no loss value in any row: left out" in result.output


def test_a_negative_number_of_refits_is_refused_by_every_command_that_takes_one(tmp_path):
    table = _chinchilla_table(tmp_path / "runs.csv")
    for args in (["fit", table], ["forecast", table, "--params-active", "1e9", "--tokens", "2e10"],
                 ["backtest", table, "--forecast-largest", "1"]):
        result = runner.invoke(app, args + ["--n-bootstrap", "-3"])
        assert result.exit_code == 2 and "--n-bootstrap" in result.output, result.output


def test_forecast_on_a_table_needs_a_target_description(tmp_path):
    table = _chinchilla_table(tmp_path / "runs.csv")
    result = runner.invoke(app, ["forecast", table])
    assert result.exit_code == 2 and "--params-active N --tokens D" in result.output


def test_bad_table_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.csv"
    pd.DataFrame({"run": ["a", "b"], "step": [1, 1], "loss": [float("nan"), 2.0]}).to_csv(path, index=False)
    result = runner.invoke(app, ["fit", str(path)])
    assert result.exit_code in (1, 2) and "error:" in result.output and "Traceback" not in result.output


def test_bad_experiment_exits_2_and_writes_nothing(tmp_path):
    exp = tmp_path / "bad.py"
    exp.write_text(
        "from ladder import ExperimentSpec, TrainStep\n"
        "from tests.ladder_helpers import tiny_spec\n"
        "d = tiny_spec().model_dump(); d['model']['moe']['top_k'] = 9\n"
        "step = TrainStep(name='x', spec=ExperimentSpec.model_validate(d))\n"
    )
    root = tmp_path / "root"
    result = runner.invoke(app, ["submit", str(exp), "--root", str(root)])
    assert result.exit_code == 2
    assert "top_k=9 exceeds moe.num_experts=4" in result.output
    assert not root.exists()


def test_unknown_step_is_named(tmp_path):
    result = runner.invoke(app, ["submit", "experiments/readme_example.py", "nope", "--root", str(tmp_path)])
    assert result.exit_code == 2 and "no step named 'nope'" in result.output


def test_plan_json_has_derived_numbers_and_writes_nothing(tmp_path):
    root = tmp_path / "root"
    result = runner.invoke(app, ["plan", "experiments/readme_example.py", "--root", str(root), "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    names = [s["name"] for s in plan["steps"]]
    assert names == ["r32", "r48", "r64", "fit", "hero"]
    hero = plan["steps"][-1]
    assert hero["state"] == "pending" and hero["waits_for"] == ["fit"]
    assert hero["derived"]["total_flops"] == pytest.approx(3 * hero["derived"]["flops_per_token"] * hero["derived"]["tokens"])
    assert not root.exists()


def test_readme_example_is_the_file_we_test():
    text = open(README).read()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert block == open("experiments/readme_example.py").read()


def test_dry_run_says_what_would_happen(tmp_path):
    result = runner.invoke(app, ["submit", "experiments/readme_example.py", "--dry-run", "--root", str(tmp_path / "r")])
    assert result.exit_code == 0
    assert "r32" in result.output and "run" in result.output
    assert not (tmp_path / "r").exists()


def test_status_and_show_read_a_run(tmp_path):
    """A finished training-shaped run dir: status reports progress and losses, show prints its metrics."""
    exp = tmp_path / "exp.py"
    exp.write_text(
        "import json, os\n"
        "from ladder import FunctionStep\n"
        "def fake_run(ctx):\n"
        "    with open(os.path.join(ctx.run_dir, 'metrics.jsonl'), 'w') as f:\n"
        "        f.write(json.dumps({'step': 10, 'tokens': 100, 'train/loss': 3.5}) + '\\n')\n"
        "        f.write(json.dumps({'step': 20, 'tokens': 200, 'train/loss': 3.0, 'eval/loss': 3.1}) + '\\n')\n"
        "        f.write('{\"step\": 30, \"train/lo')\n"
        "    return {'ok': True}\n"
        "work = FunctionStep(name='work', fn=fake_run)\n"
    )
    from ladder.executor import StepTask, execute_step
    from ladder.loader import load_experiment
    from ladder.store import Store

    loaded = load_experiment(str(exp))
    store = Store(str(tmp_path / "root"))
    outcome = execute_step(StepTask(step=loaded.dag["work"], fingerprint=loaded.dag.fingerprints["work"], store_url=store.url,
                                    owner="test", deps={}, dependency_fingerprints={}))
    assert outcome["outcome"] == "done"
    status = runner.invoke(app, ["status", str(exp), "--root", str(tmp_path / "root"), "--json"])
    assert status.exit_code == 0, status.output
    [row] = json.loads(status.stdout)
    assert row["state"] == "done"
    run_dir = store.run_dir("work", loaded.dag.fingerprints["work"])
    shown = runner.invoke(app, ["show", run_dir])
    assert shown.exit_code == 0, shown.output
    assert "metrics: 2 rows" in shown.output and "done" in shown.output and '"state"' not in shown.output
    raw = runner.invoke(app, ["show", run_dir, "--json"])
    assert raw.exit_code == 0 and json.loads(raw.stdout)["status"]["state"] == "done"
    missing = runner.invoke(app, ["show", str(tmp_path)])
    assert missing.exit_code == 2 and "not a run directory" in missing.output


def test_forecast_on_a_table_takes_a_schedule(tmp_path):
    table = _chinchilla_table(tmp_path / "runs.csv")
    args = ["forecast", table, "--params-active", "1e9", "--tokens", "2e10", "--method", "chinchilla", "--n-bootstrap", "20", "--json"]
    result = runner.invoke(app, args + ["--schedule", "cosine", "--num-steps", "1000", "--peak-lr", "3e-3", "--with-schedule"])
    assert result.exit_code == 0, result.output
    lr = json.loads(result.stdout)["target"]["lr"]
    assert len(lr) == 1000 and max(lr) == pytest.approx(3e-3, rel=1e-3) and lr[-1] == pytest.approx(3e-4, rel=1e-2)
    missing = runner.invoke(app, args + ["--schedule", "cosine"])
    assert missing.exit_code == 2 and "--num-steps and --peak-lr" in missing.output
    bad = runner.invoke(app, args + ["--schedule", "exponential", "--num-steps", "10", "--peak-lr", "1e-3"])
    assert bad.exit_code == 2 and "schedule.kind" in bad.output


def test_the_printed_curve_is_read_at_fractions_of_the_run_not_every_kth_of_its_log_spaced_points():
    """A forecast's curve is spaced evenly in log steps: every 10th point put 5 of 12 rows in the first 10% of a
    2,479-step run (steps 2, 20, 44, 95, 191, then 367, ...)."""
    from types import SimpleNamespace

    from ladder.cli import CURVE_ROW_FRACTIONS, _curve_rows

    steps = np.unique(np.geomspace(1, 2479, 120).round().astype(int))
    rows = _curve_rows([SimpleNamespace(step=int(s)) for s in steps])
    got = [r.step for r in rows]
    assert got == sorted(set(got)) and got[-1] == 2479 and len(got) == len(CURVE_ROW_FRACTIONS)
    for step, fraction in zip(got, CURVE_ROW_FRACTIONS, strict=True):
        assert abs(step / 2479 - fraction) < 0.035 * fraction  # half the 6.6% spacing of 120 log-spaced points


@pytest.mark.slow
def test_forecast_names_the_laws_fitted_on_converted_checkpoints(tmp_path):  # about 30 s: every law's backtest, twice
    from tests.test_forecasting_checkpoints import TPS, _annealed_run

    runs = [_annealed_run(n, 20.0, seed=i) for i, n in enumerate([1e7, 2e7, 4e7, 8e7, 1.6e8])]
    table = tmp_path / "curves.csv"
    pd.concat(runs, ignore_index=True).to_csv(table, index=False)
    n, d = 3.2e8, 200 * 3.2e8
    shown = runner.invoke(app, ["forecast", str(table), "--params-active", str(n), "--tokens", str(d), "--n-bootstrap", "10"])
    assert shown.exit_code == 0, shown.output
    assert "fitted on 40 converted checkpoints of 5 runs too" in " ".join(shown.output.split())
