"""`ladder attach EXP STEP SOURCE`: a run that trains elsewhere, followed live with our overlay, refits and alerts.

The rungs of the quick ladder are imported (tests/test_ladder_import_external.py's law), the hero is forecast,
then a writer process appends the hero's metric lines to a file while `ladder attach` runs in its own process;
after 60% of the run the writer's eval loss jumps by 1.0, far outside the forecast band.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ladder.cli import app
from ladder.importer import import_source
from ladder.store import Store
from tests.test_ladder_import_external import (
    EXP,
    HERO,
    REPO,
    RUNGS,
    eval_steps,
    levanter_jsonl,
    metric_lines,
    read_lines,
    run_dir,
    write_wandb_run,
)

runner = CliRunner()
DEPART = 0.6
WRITER = """
import json, os, sys, time
lines, out, delay, go = json.load(open(sys.argv[1])), sys.argv[2], float(sys.argv[3]), sys.argv[4]
with open(out, "a") as handle:
    for index, line in enumerate(lines):
        if index == len(lines) // 2:
            while not os.path.exists(go):  # the second half waits until the test has looked at the live run
                time.sleep(0.05)
        handle.write(json.dumps(line) + "\\n")
        handle.flush()
        if "eval/loss" in line:
            time.sleep(delay)
"""


@pytest.fixture(scope="module")
def exp():
    from ladder.loader import load_experiment

    return load_experiment(EXP)


@pytest.fixture(scope="module")
def forecast_root(exp, tmp_path_factory):
    """The four rungs imported as done and a stored forecast (version 1) of the hero."""
    root = tmp_path_factory.mktemp("attach-root")
    store = Store(str(root / "store"))
    for name in RUNGS:
        levanter_jsonl(exp, name, root / f"{name}.jsonl")
        import_source(store, exp.dag, name, str(root / f"{name}.jsonl"))
    result = runner.invoke(app, ["forecast", EXP, HERO, "--root", store.url, "--json", "--n-bootstrap", "20"])
    assert result.exit_code == 0, result.output
    return root, store


def _attach_command(store: Store, source: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ladder.cli", "attach", EXP, HERO, str(source), "--root", store.url, "--poll", "0.1",
            "--idle-timeout", "60", "--refit-every", "4", *extra]


def test_an_attached_run_gets_the_overlay_refits_and_alerts(exp, forecast_root):
    root, store = forecast_root
    lines = metric_lines(exp, HERO, depart_after=DEPART, bump=1.0)
    (root / "hero_lines.json").write_text(json.dumps(lines))
    source = root / "hero_metrics.jsonl"
    source.write_text("")
    attach = subprocess.Popen(_attach_command(store, source), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    go = root / "go"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root / "hero_lines.json"), str(source), "0.15", str(go)])
    directory = run_dir(exp, store.url, HERO)
    try:
        # while it runs, the step is a live run of ours: running, held, and `ladder watch` shows its evals
        deadline = time.time() + 120
        while time.time() < deadline and not any("forecast/loss" in r for r in _lines(directory)):
            time.sleep(0.2)
        status = json.loads(runner.invoke(app, ["status", EXP, "--root", store.url, "--json"]).stdout)
        assert {r["name"]: r["state"] for r in status}[HERO] == "running"
        watch = runner.invoke(app, ["watch", EXP, HERO, "--root", store.url, "--once"], env={"COLUMNS": "200"})
        assert watch.exit_code == 0 and "predicted" in watch.output, watch.output
        go.touch()
        out, err = attach.communicate(timeout=240)
    finally:
        go.touch()
        writer.wait(timeout=60)
        if attach.poll() is None:
            attach.kill()
    assert attach.returncode == 0, err
    planned = exp.dag[HERO].derived.num_steps
    assert f"{HERO}: done" in out and f"reached the planned {planned} steps" in out

    metrics = read_lines(directory / "metrics.jsonl")
    evals = [r for r in metrics if "eval/loss" in r]
    assert [r["step"] for r in evals] == eval_steps(exp, HERO)  # every eval, once, in order
    assert [r["step"] for r in metrics] == sorted({r["step"] for r in lines})  # one line per step, train steps too
    assert all({"forecast/loss", "forecast/lo", "forecast/hi", "forecast/version", "forecast/sigma"} <= set(r) for r in evals)
    assert all("forecast/loss" not in r for r in metrics if "eval/loss" not in r)
    # refits with the live prefix were stored as new versions, like our own hero's
    versions = store.list_forecasts(HERO)
    assert len(versions) >= 2
    refit = store.read_forecast(HERO, versions[-1])
    assert refit["method"] == "refit" and refit["ladder"]["by"] == "overlay" and refit["ladder"]["prior_version"] == 1
    # the departure is caught: a band alert once three evals in a row sit above the band, none before it
    alerts = read_lines(directory / "alerts.jsonl")
    band = [a for a in alerts if a["kind"] == "band"]
    departed = [s for s in eval_steps(exp, HERO) if s > DEPART * planned]
    assert band and band[0]["step"] == departed[2] and "above the forecast band" in band[0]["message"]
    assert all(r["forecast/sigma"] > 0 for r in evals if r["step"] in departed[:3])
    status = store.read_status(str(directory))
    assert status["state"] == "done" and status["lease"] is None
    assert [e["event"] for e in status["history"]] == ["attached", "done"]
    record = json.loads((directory / "import.json").read_text())
    assert record["mode"] == "attach" and record["state"] == "done" and record["evals_written"] == 20
    assert json.loads((directory / "result.json").read_text())["final_eval_loss"] == pytest.approx(evals[-1]["eval/loss"])
    report = runner.invoke(app, ["status", EXP, "--root", store.url, "--json"])
    assert {r["name"]: r["state"] for r in json.loads(report.stdout)}[HERO] == "done"


def _lines(directory: Path) -> list[dict]:
    try:
        return read_lines(directory / "metrics.jsonl")
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def test_attach_resumes_after_an_idle_stop(exp, tmp_path):
    """A source that goes quiet: attach stops (interrupted, status true); once it grows again, a second attach of the
    same source continues after the last step written; a different source is refused."""
    from ladder.attach import attach_run
    from ladder.importer import ImportConflict

    store = Store(str(tmp_path / "store"))
    lines = metric_lines(exp, "q32")  # no forecast of q32: the points are appended without an overlay
    source = tmp_path / "q32.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in lines if r["step"] <= 70))
    outcome = attach_run(store, exp.dag, "q32", str(source), poll_seconds=0.05, idle_timeout=0.5, console_alerts=False)
    assert outcome.state == "interrupted" and "no new data" in outcome.why and outcome.last_step == 70
    directory = run_dir(exp, store.url, "q32")
    status = store.read_status(str(directory))
    assert status["state"] == "interrupted" and status["lease"] is None
    other = tmp_path / "other.jsonl"
    other.write_text(source.read_text())
    with pytest.raises(ImportConflict, match="not an attach of"):
        attach_run(store, exp.dag, "q32", str(other), poll_seconds=0.05, idle_timeout=0.5)
    with open(source, "a") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in lines if r["step"] > 70))
    outcome = attach_run(store, exp.dag, "q32", str(source), poll_seconds=0.05, idle_timeout=30, console_alerts=False)
    assert outcome.state == "done" and outcome.last_step == 141
    written = read_lines(directory / "metrics.jsonl")
    assert [r["step"] for r in written] == sorted({r["step"] for r in lines})  # each step once, across both attaches
    assert [e["event"] for e in store.read_status(str(directory))["history"]] == ["attached", "interrupted", "attached", "done"]


def test_attach_follows_a_wandb_run_while_the_client_writes_it(exp, tmp_path):
    """The real wandb client writing an offline run (flushing every 0.2 s, so the file often ends mid-record);
    attach reads it as it grows and finishes at the run's exit record."""
    from ladder.attach import attach_run

    store = Store(str(tmp_path / "store"))
    lines = metric_lines(exp, "q32")
    live = write_wandb_run(lines, tmp_path / "live", delay=0.01, wait=False)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not list((tmp_path / "live").glob("wandb/offline-run-*/*.wandb")):
            time.sleep(0.1)
        (wandb_dir,) = (tmp_path / "live" / "wandb").glob("offline-run-*")
        outcome = attach_run(store, exp.dag, "q32", str(wandb_dir), poll_seconds=0.05, idle_timeout=60, console_alerts=False)
    finally:
        live.wait(timeout=120)
    assert outcome.state == "done" and outcome.last_step == 141
    written = read_lines(run_dir(exp, store.url, "q32") / "metrics.jsonl")
    assert [r["step"] for r in written if "eval/loss" in r] == eval_steps(exp, "q32")
    assert [r["step"] for r in written] == sorted({r["step"] for r in lines})


def test_ctrl_c_leaves_the_status_true(exp, tmp_path):
    import signal

    store = Store(str(tmp_path / "store"))
    source = tmp_path / "q32.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in metric_lines(exp, "q32") if r["step"] <= 70))
    attach = subprocess.Popen([sys.executable, "-m", "ladder.cli", "attach", EXP, "q32", str(source), "--root", store.url,
                               "--poll", "0.1", "--idle-timeout", "600"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    directory = run_dir(exp, store.url, "q32")
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(_lines(directory)) < 2:
            time.sleep(0.1)
        attach.send_signal(signal.SIGINT)
        out, err = attach.communicate(timeout=120)
    finally:
        if attach.poll() is None:
            attach.kill()
    assert attach.returncode == 130, err
    assert "interrupted with Ctrl-C" in out and "Traceback" not in err
    status = store.read_status(str(directory))
    assert status["state"] == "interrupted" and status["lease"] is None
    assert max(r["step"] for r in _lines(directory)) < 70  # the newest step stays held until the source moves on


def test_a_growing_csv_is_read_from_where_it_stopped(tmp_path):
    """Only the lines appended since the last poll are parsed; a line still being written waits for its newline."""
    from ladder.importer import SourceReader

    path = tmp_path / "metrics.csv"
    path.write_text("step,train/loss,eval/loss\n1,4.0,\n2,3.9,3.95\n3,3.")
    reader = SourceReader(str(path))
    assert reader.poll()["step"].tolist() == [1, 2]
    assert reader.poll().empty
    with open(path, "a") as handle:
        handle.write("8,\n4,3.7,3.75\n")
    new = reader.poll()
    assert new["step"].tolist() == [3, 4] and new["train/loss"].tolist() == [3.8, 3.7]
    assert reader.offset == path.stat().st_size
    path.write_text("step,train/loss\n9,3.0\n")  # rewritten from scratch (shorter): read again from the start
    assert reader.poll()["step"].tolist() == [9]
