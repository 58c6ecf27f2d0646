"""A torn last line of metrics.jsonl is tolerated, said so (file and line), and never moves a finished run's last point.

The runs are Marin's published rungs imported as run directories (`ladder import ... marin-published`):
real spec.json / metrics.jsonl / result.json files. Cutting d1536's last line (its final eval at step
15,127) is what a writer killed mid-append leaves; the final eval must then come from result.json.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
from typer.testing import CliRunner

from forecasting.table import TornLineWarning, from_run_dirs
from ladder.cli import app
from ladder.importer import import_marin_published
from ladder.loader import load_experiment
from ladder.store import Store

runner = CliRunner()
EXP = "experiments/marin_535b.py"


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    exp = load_experiment(EXP)
    root = tmp_path_factory.mktemp("marin") / "root"
    import_marin_published(Store(str(root)), exp.dag)
    return exp, root


@pytest.fixture
def torn(imported, tmp_path):
    """A copy of the imported ladder whose d1536 metrics.jsonl lost the end of its last line."""
    exp, template = imported
    root = tmp_path / "root"
    shutil.copytree(template, root)
    store = Store(str(root))
    run_dir = store.run_dir("d1536", exp.dag.fingerprints["d1536"])
    path = f"{run_dir}/metrics.jsonl"
    data = open(path, "rb").read()
    lines = data.count(b"\n")
    with open(path, "wb") as handle:
        handle.write(data[:-40])
    result = json.load(open(f"{run_dir}/result.json"))
    return str(root), store, run_dir, path, lines, result


def test_from_run_dirs_says_so_and_takes_the_final_eval_from_result_json(torn):
    root, store, run_dir, path, lines, result = torn
    notes: list[str] = []
    table = from_run_dirs([run_dir], notes=notes)
    last = table.iloc[-1]
    assert int(last["step"]) == result["steps"] == 15127
    assert last["loss"] == pytest.approx(result["final_eval_loss"]) and last["fraction"] == pytest.approx(15127 / 15128)
    assert last["flops"] == pytest.approx(result["flops"])
    assert notes == [f"{path} line {lines} is torn (cut off mid-line) and was ignored; the finished run's final eval "
                     f"(step 15127, {result['final_eval_loss']:.4f}) is taken from result.json"]
    with pytest.warns(TornLineWarning, match="line 21 is torn"):
        from_run_dirs([run_dir])


def test_a_torn_line_of_an_unfinished_run_is_named_and_nothing_is_invented(torn):
    root, store, run_dir, path, lines, result = torn
    store.write_json(f"{run_dir}/result.json", {**result, "completed": False})
    notes: list[str] = []
    table = from_run_dirs([run_dir], notes=notes)
    assert int(table["step"].max()) < 15127
    assert len(notes) == 1 and notes[0].endswith("is torn (cut off mid-line) and was ignored")


def test_fit_and_forecast_warn_and_keep_the_final_point(torn):
    root, store, run_dir, path, lines, result = torn
    fit = runner.invoke(app, ["fit", EXP, "--root", root, "--law", "compute", "--n-bootstrap", "10", "--json"])
    assert fit.exit_code == 0, fit.output
    assert f"{path} line {lines} is torn" in fit.stderr
    residuals = {r["run"]: r for r in json.loads(fit.stdout)["residuals"]}
    assert residuals["d1536"]["loss"] == pytest.approx(result["final_eval_loss"])
    on_folder = runner.invoke(app, ["fit", f"{root}/runs", "--law", "compute", "--n-bootstrap", "10", "--json"])
    assert on_folder.exit_code == 0 and f"{path} line {lines} is torn" in on_folder.stderr, on_folder.output
    assert "Traceback" not in on_folder.output and "TornLineWarning" not in on_folder.output
    forecast = runner.invoke(app, ["forecast", EXP, "hero", "--root", root, "--n-bootstrap", "10", "--json"])
    assert forecast.exit_code == 0 and f"{path} line {lines} is torn" in forecast.stderr, forecast.output


def test_status_shows_the_final_eval_of_result_json_and_warns(torn):
    root, store, run_dir, path, lines, result = torn
    status = runner.invoke(app, ["status", EXP, "--root", root, "--json"])
    assert status.exit_code == 0, status.output
    row = {r["name"]: r for r in json.loads(status.stdout)}["d1536"]
    assert row["step"] == 15127 and row["eval_loss"] == pytest.approx(result["final_eval_loss"])
    assert row["warnings"] and f"{path} line {lines} is torn" in row["warnings"][0]
    assert f"d1536: {path} line {lines} is torn" in status.stderr


def test_the_report_names_the_torn_line(torn, tmp_path):
    root, store, run_dir, path, lines, result = torn
    with warnings.catch_warnings():
        warnings.simplefilter("error", TornLineWarning)  # every reader on the way passes the note on instead
        report = runner.invoke(app, ["report", EXP, "--root", root, "--out", str(tmp_path / "report")])
    assert report.exit_code == 0, report.output
    page = (tmp_path / "report" / "index.html").read_text()
    assert f"{path} line {lines} is torn" in page
