"""The executor on an embedded Ray: runs what is ready, skips what is done, records failures, waits for holders."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from ladder.dag import DAG, FunctionStep
from ladder.executor import plan, run
from ladder.store import Store


def write_value(ctx, value):
    with open(os.path.join(ctx.run_dir, "value.txt"), "w") as handle:
        handle.write(str(value))
    return {"value": value}


def add_inputs(ctx):
    return {"value": sum(dep.result["value"] for dep in ctx.deps.values())}


def fail_until_marker(ctx, marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("first attempt fails on purpose")
    return {"value": 7}


def exit_until_marker(ctx, marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise SystemExit(1)  # what Ray raises in a worker whose job ends (its submitter was killed)
    return {"value": 3}


def sigterm_self_until_marker(ctx, marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGTERM)  # what a preempted node or `ray stop` sends the worker
        time.sleep(60)
    return {"value": 5}


def sigterm_self(ctx):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)


def count_runs(ctx, counter):
    with open(counter, "a") as handle:
        handle.write(f"{ctx.name}\n")
    return {"value": 1}


@pytest.fixture(scope="module", autouse=True)
def embedded_ray():
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield
    ray.shutdown()


def _lines(path):
    return open(path).read().split() if os.path.exists(path) else []


def test_diamond_runs_in_order_then_everything_is_skipped(tmp_path):
    counter = str(tmp_path / "counter")
    dag = DAG([
        FunctionStep(name="a", fn=write_value, config={"value": 1}),
        FunctionStep(name="b", fn=write_value, config={"value": 2}),
        FunctionStep(name="sum", fn=add_inputs, deps=("a", "b")),
        FunctionStep(name="count", fn=count_runs, config={"counter": counter}, deps=("sum",)),
    ])
    store = Store(str(tmp_path / "root"))
    assert [r.state for r in plan(dag, store)] == ["pending"] * 4
    report = run(dag, store, log=lambda line: None)
    assert report.ok and report.states == {n: "done" for n in dag.order}
    assert store.read_json(f"{store.run_dir('sum', dag.fingerprints['sum'])}/result.json") == {"value": 3}
    status = store.read_status(store.run_dir("sum", dag.fingerprints["sum"]))
    assert status["attempts"] == 1 and status["lease"] is None and status["host"] and status["finished_at"] >= status["started_at"]
    spec = store.read_json(f"{store.run_dir('sum', dag.fingerprints['sum'])}/spec.json")
    assert spec["dependencies"] == {"a": dag.fingerprints["a"], "b": dag.fingerprints["b"]}
    again = run(dag, store, log=lambda line: None)
    assert again.ok and again.launched == [] and sorted(again.skipped) == sorted(dag.order)
    assert _lines(counter) == ["count"]


def test_failure_is_recorded_blocks_dependants_and_retries_on_request(tmp_path):
    marker = str(tmp_path / "marker")
    dag = DAG([
        FunctionStep(name="flaky", fn=fail_until_marker, config={"marker": marker}),
        FunctionStep(name="after", fn=add_inputs, deps=("flaky",)),
    ])
    store = Store(str(tmp_path / "root"))
    report = run(dag, store, log=lambda line: None)
    assert report.states == {"flaky": "failed", "after": "blocked"}
    status = store.read_status(store.run_dir("flaky", dag.fingerprints["flaky"]))
    assert status["state"] == "failed" and "first attempt fails on purpose" in status["last_error"]
    assert [r.state for r in plan(dag, store)] == ["failed", "blocked"]
    assert run(dag, store, log=lambda line: None).states["flaky"] == "failed", "no retry unless asked"
    retried = run(dag, store, retry_failed=True, log=lambda line: None)
    assert retried.ok
    status = store.read_status(store.run_dir("flaky", dag.fingerprints["flaky"]))
    assert status["attempts"] == 2 and status["state"] == "done"


def test_a_step_held_by_a_live_owner_is_waited_for_not_run_twice(tmp_path, monkeypatch):
    monkeypatch.setenv("LADDER_LEASE_TTL", "30")
    counter = str(tmp_path / "counter")
    dag = DAG([FunctionStep(name="only", fn=count_runs, config={"counter": counter})])
    store = Store(str(tmp_path / "root"))
    run_dir = store.run_dir("only", dag.fingerprints["only"])
    assert store.acquire_lease(run_dir, "someone-else").acquired
    assert plan(dag, store)[0].state == "running"

    def other_submitter_finishes():
        time.sleep(1.5)
        store.heartbeat(run_dir, "someone-else")
        store.write_json(f"{run_dir}/result.json", {"value": 1, "by": "someone-else"})
        store.finish(run_dir, "someone-else", "done")

    thread = threading.Thread(target=other_submitter_finishes)
    thread.start()
    report = run(dag, store, log=lambda line: None, poll_seconds=0.2)
    thread.join()
    assert report.ok and report.launched == []
    assert _lines(counter) == []


def test_a_dead_holder_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("LADDER_LEASE_TTL", "1")
    counter = str(tmp_path / "counter")
    dag = DAG([FunctionStep(name="only", fn=count_runs, config={"counter": counter})])
    store = Store(str(tmp_path / "root"))
    run_dir = store.run_dir("only", dag.fingerprints["only"])
    store.acquire_lease(run_dir, "dead-owner")  # never heartbeats again
    report = run(dag, store, log=lambda line: None, poll_seconds=0.2)
    assert report.ok and _lines(counter) == ["only"]
    status = store.read_status(run_dir)
    assert status["attempts"] == 2 and any(h["event"] == "lease_taken_over" for h in status["history"])


def test_memory_root(tmp_path):
    dag = DAG([FunctionStep(name="a", fn=add_inputs)])
    store = Store(f"memory://executor-{time.time_ns()}")
    # memory:// lives in one process: run the step in-process the way a worker would
    from ladder.executor import StepTask, execute_step

    outcome = execute_step(StepTask(step=dag["a"], fingerprint=dag.fingerprints["a"], store_url=store.url, owner="me", deps={}, dependency_fingerprints={}))
    assert outcome == {"outcome": "done", "result": {"value": 0}}
    assert plan(dag, store)[0].state == "done"


def test_a_worker_told_to_exit_leaves_the_step_interrupted_not_failed(tmp_path):
    """Ray raises SystemExit in a worker when its job ends (the submitter was killed): that attempt is an
    interruption, so the next submit resumes the step instead of refusing it as failed."""
    from ladder.executor import StepTask, execute_step

    dag = DAG([FunctionStep(name="a", fn=exit_until_marker, config={"marker": str(tmp_path / "marker")})])
    store = Store(str(tmp_path / "root"))
    task = dict(step=dag["a"], fingerprint=dag.fingerprints["a"], store_url=store.url, deps={}, dependency_fingerprints={})
    with pytest.raises(SystemExit):
        execute_step(StepTask(owner="killed-submitter", **task))
    run_dir = store.run_dir("a", dag.fingerprints["a"])
    status = store.read_status(run_dir)
    assert status["state"] == "interrupted" and status["lease"] is None
    assert "SystemExit" in status["last_error"] and "SystemExit: 1" in open(f"{run_dir}/error.log").read()
    assert plan(dag, store)[0].state == "pending"
    report = run(dag, store, log=lambda line: None)
    assert report.ok and store.read_json(f"{run_dir}/result.json") == {"value": 3}
    assert store.read_status(run_dir)["attempts"] == 2


def test_a_worker_sigtermed_while_the_submitter_lives_is_resumed_in_the_same_submit(tmp_path):
    """A Ray worker that gets SIGTERM mid-step (preemption, `ray stop`) records the attempt as interrupted, not
    failed, and the submitter relaunches it (it resumes from its newest checkpoint)."""
    dag = DAG([FunctionStep(name="a", fn=sigterm_self_until_marker, config={"marker": str(tmp_path / "marker")})])
    store = Store(str(tmp_path / "root"))
    lines = []
    report = run(dag, store, log=lines.append)
    run_dir = store.run_dir("a", dag.fingerprints["a"])
    status = store.read_status(run_dir)
    assert report.ok and report.resumes == {"a": 1} and report.errors == {} and store.read_json(f"{run_dir}/result.json") == {"value": 5}
    events = [h["event"] for h in status["history"] if h["event"] in ("interrupted", "failed", "done")]
    assert events == ["interrupted", "done"] and status["attempts"] == 2
    assert any("SIGTERM" in h.get("error", "") for h in status["history"]), status["history"]
    assert any(line.startswith("[stop] a: interrupted") for line in lines), lines


def test_a_step_interrupted_again_and_again_is_not_relaunched_for_ever(tmp_path):
    from ladder.executor import MAX_RESUMES_PER_SUBMIT

    dag = DAG([FunctionStep(name="a", fn=sigterm_self), FunctionStep(name="after", fn=add_inputs, deps=("a",))])
    store = Store(str(tmp_path / "root"))
    report = run(dag, store, log=lambda line: None)
    assert not report.ok and report.states == {"a": "interrupted", "after": "pending"}
    assert report.resumes == {"a": MAX_RESUMES_PER_SUBMIT + 1}
    status = store.read_status(store.run_dir("a", dag.fingerprints["a"]))
    assert status["state"] == "interrupted" and status["attempts"] == MAX_RESUMES_PER_SUBMIT + 1
    assert plan(dag, store)[0].state == "pending", "the next submit resumes it"
