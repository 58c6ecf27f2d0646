"""Bad input exits 2 with one sentence naming the file or field (never a traceback); status files tell the truth.

Covers: unreadable tables, bad target options, spec fields named by their place with the bad value and a
close name for a typo, a STEPS that is not a list, the last step in `progress`, `last_error` cleared by a
success, a plain submit of a failed step saying why, and a takeover that does not wait out the TTL when the
holder's process on this host is gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
from typer.testing import CliRunner

from ladder.cli import app
from ladder.dag import DAG, FunctionStep, TrainStep
from ladder.executor import StepTask, execute_step, plan, run
from ladder.store import Store
from tests.test_trainer_loop import ladder_cache  # noqa: F401 - fixture

runner = CliRunner()


def _one_line_error(result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and "errors.pydantic.dev" not in result.output, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


# ------------------------------------------------------------------ tables and target options


def test_an_empty_csv_names_the_file(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("")
    line = _one_line_error(runner.invoke(app, ["fit", str(path)]))
    assert f"{path} is empty" in line and "EmptyDataError" not in line


def test_a_text_file_named_parquet_names_the_file(tmp_path):
    path = tmp_path / "runs.parquet"
    path.write_text("not a parquet file\n")
    line = _one_line_error(runner.invoke(app, ["fit", str(path)]))
    assert f"{path} is not a readable parquet file" in line and "<Buffer>" not in line


def test_a_missing_table_exits_2_and_names_it(tmp_path):
    path = tmp_path / "missing.csv"
    line = _one_line_error(runner.invoke(app, ["fit", str(path)]))
    assert f"{path} does not exist" in line


def test_a_table_without_sizes_or_flops_names_what_it_lacks_and_still_backtests_its_curves(tmp_path):
    """No law can be fitted without flops or sizes: `fit` and `forecast` say which columns and where to get them
    (`forecast` said "cannot fit any law: 3 run(s); need >= 3 runs with curves", which these are); `backtest` still
    scores each curve against its own prefix (steps and losses are all that reads) and names what the laws lack."""
    path = tmp_path / "losses_only.csv"
    steps = list(range(100, 1300, 100))
    pd.DataFrame([{"run": run, "step": s, "loss": 2.0 + scale * s ** -0.3} for run, scale in (("a", 9.0), ("b", 8.0), ("c", 7.0))
                  for s in steps]).to_csv(path, index=False)
    for command in (["fit", str(path)], ["forecast", str(path), "--params-active", "1e9", "--tokens", "2e10"]):
        line = _one_line_error(runner.invoke(app, command))
        assert "'flops', 'params_active', 'tokens'" in line and "ladder import EXP STEP SOURCE" in line, command
    report = runner.invoke(app, ["backtest", str(path), "--json"])
    assert report.exit_code == 0, report.output
    doc = json.loads(report.stdout)
    assert [r["kind"] for r in doc["results"]] == ["prefix"]
    assert any("'flops', 'params_active', 'tokens'" in w for w in doc["warnings"])


def test_a_negative_target_option_is_one_sentence(tmp_path):
    path = tmp_path / "good.csv"
    pd.DataFrame({"run": ["a", "b", "c"], "step": [1, 1, 1], "loss": [3.0, 2.9, 2.8],
                  "params_active": [1e6, 2e6, 4e6], "tokens": [1e8, 2e8, 4e8]}).to_csv(path, index=False)
    line = _one_line_error(runner.invoke(app, ["forecast", str(path), "--params-active", "-5", "--tokens", "1e9"]))
    assert line == "error: --params-active -5 must be > 0."


def test_a_data_constrained_table_needs_the_target_s_unique_tokens_and_says_which_runs_judged_it(tmp_path):
    from tests.test_forecasting_honest_bands import _repeated_data_table

    path = tmp_path / "repeated.csv"
    _repeated_data_table()[0].to_csv(path, index=False)
    target = ["forecast", str(path), "--params-active", "1e9", "--tokens", "2e10", "--n-bootstrap", "10"]
    line = _one_line_error(runner.invoke(app, target))
    assert line.startswith("error: FitError: the data_constrained law needs the target's unique tokens") and "--unique-tokens" in line
    result = runner.invoke(app, [*target, "--unique-tokens", "2.5e9"])  # 8 epochs
    assert result.exit_code == 0, result.output
    assert "by data_constrained" in result.output
    assert "runs at 4, 8, 16 epochs (the target's repetition)" in " ".join(result.output.split())


@pytest.mark.parametrize("value, shown", [("0", "got 0"), ("-3e9", "got -3e+09"), ("inf", "got inf"), ("many", "got 'many'")])
def test_a_unique_tokens_cell_that_is_not_a_positive_count_is_one_sentence(tmp_path, value, shown):
    """An empty cell is a run that did not log its unique tokens (one epoch); zero, a negative, an infinite or a
    word is a broken table: it used to reach the data-constrained law as infinite epochs."""
    from tests.test_forecasting_honest_bands import _repeated_data_table

    table = _repeated_data_table()[0]
    path = tmp_path / "repeated.csv"
    text = table.astype({"unique_tokens": object})
    text.loc[text["run"] == text["run"].iloc[-1], "unique_tokens"] = value
    text.to_csv(path, index=False)
    line = _one_line_error(runner.invoke(app, ["fit", str(path)]))
    assert line.startswith("error: TableError: column 'unique_tokens' must be a positive number of tokens") and shown in line
    assert f"at run {table['run'].iloc[-1]!r}" in line
    table.loc[table["run"] == table["run"].iloc[-1], "unique_tokens"] = float("nan")  # not logged: accepted
    table.to_csv(path, index=False)
    assert runner.invoke(app, ["backtest", str(path)]).exit_code == 0


# ------------------------------------------------------------------ specs and experiments


def _plan(tmp_path, body: str):
    exp = tmp_path / "exp.py"
    exp.write_text(textwrap.dedent(body))
    return runner.invoke(app, ["plan", str(exp), "--root", str(tmp_path / "root")]), exp


@pytest.mark.parametrize("body, expected", [
    ("train = TrainConfig(tokens=-5, batch_size=8)\n", "line 3 builds an invalid spec: train.tokens=-5 must be > 0"),
    ("opt = OptimizerConfig(learning_rate=-1.0)\n", "line 3 builds an invalid spec: optimizer.learning_rate=-1.0 must be > 0"),
    ("model = ModelConfig(hidden_dim=32, num_head=2)\n",
     "line 3 builds an invalid spec: model.num_head: unknown field; did you mean num_heads?"),
    ("spec = tiny_spec(train=TrainConfig(tokens=8192, batch_size=8, learning_rate=1e-3))\n",
     "train.learning_rate: unknown field; it belongs in optimizer.learning_rate"),
])
def test_a_spec_error_names_the_field_by_its_place_and_echoes_the_value(tmp_path, body, expected):
    result, exp = _plan(tmp_path, "from tests.ladder_helpers import tiny_spec\nfrom trainer.config import ModelConfig, "
                        "OptimizerConfig, TrainConfig\n" + body)
    line = _one_line_error(result)
    assert line.startswith(f"error: {exp}") and expected in line, line
    assert not (tmp_path / "root").exists(), "nothing is written before validation passes"


def test_a_steps_that_is_an_int_says_so(tmp_path):
    result, exp = _plan(tmp_path, """
        from ladder import TrainStep
        from tests.ladder_helpers import tiny_spec
        rung = TrainStep(name="rung", spec=tiny_spec())
        STEPS = 300
    """)
    line = _one_line_error(result)
    assert "STEPS must be a list of steps, got int" in line and "defines no steps" not in line


def test_a_steps_list_with_a_non_step_names_the_item(tmp_path):
    result, _ = _plan(tmp_path, """
        from ladder import TrainStep
        from tests.ladder_helpers import tiny_spec
        rung = TrainStep(name="rung", spec=tiny_spec())
        STEPS = [rung, "fit"]
    """)
    assert "STEPS[1] is a str ('fit'), not a step" in _one_line_error(result)


# ------------------------------------------------------------------ status files


def test_a_finished_training_step_records_its_last_step_in_progress(ladder_cache, tmp_path):  # noqa: F811
    from tests.ladder_helpers import tiny_spec

    dag = DAG([TrainStep(name="rung", spec=tiny_spec())])  # 20 steps, evals at 10 and 20
    store = Store(str(tmp_path / "root"))
    outcome = execute_step(StepTask(step=dag["rung"], fingerprint=dag.fingerprints["rung"], store_url=store.url,
                                    owner="me", deps={}, dependency_fingerprints={}))
    assert outcome["outcome"] == "done"
    status = store.read_status(store.run_dir("rung", dag.fingerprints["rung"]))
    assert status["progress"]["step"] == 20 and status["progress"]["eval/loss"] == outcome["result"]["final_eval_loss"]


def fail_until_marker(ctx, marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("first attempt fails on purpose")
    return {"value": 7}


def test_a_plain_submit_of_a_failed_step_says_why_and_a_success_clears_last_error(tmp_path):
    marker = str(tmp_path / "marker")
    dag = DAG([FunctionStep(name="flaky", fn=fail_until_marker, config={"marker": marker})])
    store = Store(str(tmp_path / "root"))
    task = dict(step=dag["flaky"], fingerprint=dag.fingerprints["flaky"], store_url=store.url, deps={}, dependency_fingerprints={})
    assert execute_step(StepTask(owner="first", **task))["outcome"] == "failed"
    run_dir = store.run_dir("flaky", dag.fingerprints["flaky"])
    assert store.read_status(run_dir)["last_error"].startswith("RuntimeError: first attempt fails on purpose")

    lines: list[str] = []
    report = run(dag, store, log=lines.append)  # nothing to launch: no Ray needed
    assert report.states == {"flaky": "failed"}
    assert any(line.startswith("[failed] flaky failed before: RuntimeError: first attempt fails on purpose")
               and "--retry-failed" in line for line in lines), lines

    assert execute_step(StepTask(owner="second", **task))["outcome"] == "done"
    status = store.read_status(run_dir)
    assert status["state"] == "done" and "last_error" not in status
    assert [h["event"] for h in status["history"]][-2:] == ["failed", "done"]


def test_a_holder_whose_process_on_this_host_is_gone_is_taken_over_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LADDER_LEASE_TTL", "3600")
    dag = DAG([FunctionStep(name="only", fn=fail_until_marker, config={"marker": str(tmp_path / "m")})])
    store = Store(str(tmp_path / "root"))
    run_dir = store.run_dir("only", dag.fingerprints["only"])
    code = f"from ladder.store import Store; assert Store({store.url!r}).acquire_lease({run_dir!r}, 'dead-owner').acquired"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.getcwd())  # takes the lease, then exits

    row = plan(dag, store)[0]
    assert row.state == "pending" and "is gone" in row.detail, row.detail
    outcome = store.acquire_lease(run_dir, "me")
    assert outcome.acquired, "no need to wait an hour for a holder that no longer exists"
    taken = [h for h in outcome.status["history"] if h["event"] == "lease_taken_over"]
    assert taken and taken[0]["from"] == "dead-owner" and "is gone" in taken[0]["reason"]

    # a holder that is alive (this very process) is still respected
    assert not store.acquire_lease(run_dir, "someone-else").acquired
    assert json.load(open(f"{run_dir}/status.json"))["lease"]["owner"] == "me"
