"""One corrupt status.json affects only its own step.

`Store.read_status` reads an unreadable status.json as the status rebuilt from the run directory
(result.json -> done; metrics/checkpoints -> interrupted, resumes from its checkpoint), and says so;
the next write (a submit) moves the corrupt file aside, never deleting it, and writes the rebuilt one.
The ladder here is three tiny real training steps (20 steps each), trained once in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from typer.testing import CliRunner

from ladder.cli import app
from ladder.store import Store
from tests.test_trainer_loop import ladder_cache  # noqa: F401 - fixture

runner = CliRunner()

EXPERIMENT = '''
from ladder import TrainStep
from tests.ladder_helpers import tiny_spec
from tests.test_trainer_loop import JAX_CACHE


def rung(name, seed):  # one shape, three seeds: one compile for the three runs (and the user's compile cache)
    spec = tiny_spec()
    train = spec.train.model_copy(update={"seed": seed, "compilation_cache_dir": JAX_CACHE})
    return TrainStep(name=name, spec=spec.model_copy(update={"train": train}))


rungs = [rung("s16", 16), rung("s24", 24), rung("s32", 32)]
'''


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ladder_cache):  # noqa: F811
    from ladder.executor import StepTask, execute_step
    from ladder.loader import load_experiment

    base = tmp_path_factory.mktemp("corrupt")
    exp_path = base / "exp.py"
    exp_path.write_text(EXPERIMENT)
    exp = load_experiment(str(exp_path))
    store = Store(str(base / "root"))
    for name in exp.dag.order:
        outcome = execute_step(StepTask(step=exp.dag[name], fingerprint=exp.dag.fingerprints[name], store_url=store.url,
                                        owner="fixture", deps={}, dependency_fingerprints={}))
        assert outcome["outcome"] == "done", outcome
    return exp_path, base / "root", exp


@pytest.fixture
def ladder(trained, tmp_path):
    """A fresh copy of the trained ladder, with s24's status.json corrupted as in the issue (`echo x > ...`)."""
    exp_path, template, exp = trained
    root = tmp_path / "root"
    shutil.copytree(template, root)
    store = Store(str(root))
    run_dir = store.run_dir("s24", exp.dag.fingerprints["s24"])
    with open(f"{run_dir}/status.json", "w") as handle:
        handle.write("x\n")
    return str(exp_path), str(root), store, exp, run_dir


def _invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


# ------------------------------------------------------------------ the store alone


def _run_dir(tmp_path, *, result=False, metrics=False, checkpoint=False):
    store = Store(str(tmp_path / "root"))
    run_dir = store.run_dir("x", "0123456789abcdef")
    os.makedirs(run_dir)
    with open(f"{run_dir}/status.json", "w") as handle:
        handle.write("{not json")
    if result:
        store.write_json(f"{run_dir}/result.json", {"completed": True})
    if metrics:
        with open(f"{run_dir}/metrics.jsonl", "w") as handle:
            handle.write('{"step": 1, "train/loss": 5.0}\n')
    if checkpoint:
        os.makedirs(f"{run_dir}/checkpoints/10")
    return store, run_dir


@pytest.mark.parametrize("files, state", [
    (dict(result=True, metrics=True, checkpoint=True), "done"),
    (dict(metrics=True, checkpoint=True), "interrupted"),
    (dict(), "pending"),
])
def test_an_unreadable_status_reads_as_the_one_rebuilt_from_the_run_directory(tmp_path, monkeypatch, files, state):
    monkeypatch.setenv("LADDER_LEASE_TTL", "0.01")  # metrics written just now must not look like a live holder
    store, run_dir = _run_dir(tmp_path, **files)
    time.sleep(0.05)
    status = store.read_status(run_dir)
    assert status["state"] == state and status["unreadable"]["path"] == f"{run_dir}/status.json"
    assert open(f"{run_dir}/status.json").read() == "{not json", "reading never writes"

    written = store.update_status(run_dir, lambda s: None)
    assert written["state"] == state and "unreadable" not in written
    aside = written["rebuilt"]["moved_aside"]
    assert open(aside).read() == "{not json", "the corrupt file is moved aside, never deleted"
    assert json.load(open(f"{run_dir}/status.json"))["history"][-1]["event"] == "status_rebuilt"


def test_metrics_written_within_the_lease_ttl_read_as_a_live_unknown_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("LADDER_LEASE_TTL", "60")
    store, run_dir = _run_dir(tmp_path, metrics=True, checkpoint=True)
    status = store.read_status(run_dir)
    assert status["state"] == "running" and status["lease"]["owner"].startswith("unknown")
    assert not store.acquire_lease(run_dir, "me").acquired, "a holder may still be writing: do not run it twice"


# ------------------------------------------------------------------ the commands


def test_status_calls_the_finished_run_done_and_names_the_unreadable_file(ladder):
    exp_path, root, store, exp, run_dir = ladder
    result = _invoke("status", exp_path, "--root", root, "--json")
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert {n: r["state"] for n, r in rows.items()} == {"s16": "done", "s24": "done", "s32": "done"}
    assert f"status unreadable ({run_dir}/status.json)" in rows["s24"]["detail"]
    assert "rebuilt from result.json" in rows["s24"]["detail"]
    assert rows["s16"]["detail"] == "1 attempt(s)" and rows["s24"]["step"] == 20


def test_show_plot_and_report_work(ladder, tmp_path):
    exp_path, root, store, exp, run_dir = ladder
    for step in ("s16", "s24"):
        result = _invoke("show", exp_path, step, "--root", root)
        assert result.exit_code == 0, result.output
    assert "status unreadable" in _invoke("show", exp_path, "s24", "--root", root).output
    result = _invoke("plot", exp_path, "s32", "--root", root, "--out", tmp_path / "plot.html")
    assert result.exit_code == 0 and "2 rungs" in result.output, result.output
    result = _invoke("report", exp_path, "--root", root, "--out", tmp_path / "report")
    assert result.exit_code == 0, result.output
    page = (tmp_path / "report" / "index.html").read_text()
    assert "could not be read" not in page and "status unreadable" in page
    assert open(f"{run_dir}/status.json").read() == "x\n", "inspecting writes nothing"


def test_submit_retry_failed_rebuilds_a_finished_run_as_done(ladder):
    exp_path, root, store, exp, run_dir = ladder
    result = _invoke("submit", exp_path, "--root", root, "--retry-failed")
    assert result.exit_code == 0 and "[repair] s24" in result.output, result.output
    status = json.load(open(f"{run_dir}/status.json"))
    assert status["state"] == "done" and status["rebuilt"]["rebuilt_from"] == ["result.json", "metrics.jsonl", "checkpoints"]
    assert open(status["rebuilt"]["moved_aside"]).read() == "x\n"
    again = _invoke("status", exp_path, "--root", root, "--json")
    assert "moved aside to" in {r["name"]: r for r in json.loads(again.stdout)}["s24"]["detail"]


def test_an_unfinished_run_with_a_corrupt_status_resumes_from_its_checkpoint(ladder):
    from ladder.executor import StepTask, execute_step, plan

    exp_path, root, store, exp, run_dir = ladder
    os.remove(f"{run_dir}/result.json")
    shutil.rmtree(f"{run_dir}/checkpoints/20")  # killed after step 20, before its checkpoint: 10 is the newest
    os.utime(f"{run_dir}/metrics.jsonl", (time.time() - 3600, time.time() - 3600))
    row = {r.name: r for r in plan(exp.dag, store)}["s24"]
    assert row.state == "pending" and "rebuilt from metrics.jsonl / checkpoints" in row.detail
    # what the submit's worker does: take the lease (which writes the rebuilt status) and train
    outcome = execute_step(StepTask(step=exp.dag["s24"], fingerprint=exp.dag.fingerprints["s24"], store_url=store.url,
                                    owner="rescuer", deps={}, dependency_fingerprints={}))
    assert outcome["outcome"] == "done" and outcome["result"]["resumed_from_step"] == 10, outcome
    status = store.read_status(run_dir)
    assert status["state"] == "done" and any(h["event"] == "status_rebuilt" for h in status["history"])
    assert [p for p in os.listdir(run_dir) if p.startswith("status.json.corrupt-")]
