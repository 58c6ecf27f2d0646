"""The store: atomic status, leases that expire, forecasts that are never overwritten, torn metrics."""

from __future__ import annotations

import json
import threading
import time

import pytest

from ladder.runs import read_metrics
from ladder.store import Store


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        return Store(str(tmp_path / "root"))
    return Store(f"memory://ladder-test-{time.time_ns()}")


def test_lease_excludes_a_second_owner_until_stale(store, monkeypatch):
    monkeypatch.setenv("LADDER_LEASE_TTL", "0.5")
    run_dir = store.run_dir("step", "f" * 64)
    first = store.acquire_lease(run_dir, "owner-1")
    assert first.acquired and first.status["attempts"] == 1 and first.status["state"] == "running"
    second = store.acquire_lease(run_dir, "owner-2")
    assert not second.acquired and second.holder == "owner-1"
    time.sleep(0.6)  # owner-1 stops heartbeating: it died
    third = store.acquire_lease(run_dir, "owner-2")
    assert third.acquired and third.status["attempts"] == 2
    assert third.status["history"][-1]["event"] == "lease_taken_over"
    assert not store.heartbeat(run_dir, "owner-1"), "the old owner must learn it lost the lease"
    assert store.heartbeat(run_dir, "owner-2")


def test_finish_by_a_stale_owner_does_not_clobber_the_new_one(store, monkeypatch):
    monkeypatch.setenv("LADDER_LEASE_TTL", "0.2")
    run_dir = store.run_dir("step", "a" * 64)
    store.acquire_lease(run_dir, "old")
    time.sleep(0.3)
    store.acquire_lease(run_dir, "new")
    store.finish(run_dir, "old", "failed", error="late crash report")
    status = store.read_status(run_dir)
    assert status["state"] == "running" and status["lease"]["owner"] == "new"


def test_done_step_is_never_leased_again(store):
    run_dir = store.run_dir("step", "b" * 64)
    store.acquire_lease(run_dir, "one")
    store.finish(run_dir, "one", "done")
    again = store.acquire_lease(run_dir, "two")
    assert not again.acquired and again.status["state"] == "done"


def test_concurrent_acquires_give_one_winner(tmp_path):
    store = Store(str(tmp_path / "root"))
    run_dir = store.run_dir("step", "c" * 64)
    winners = []

    def attempt(i):
        if Store(store.url).acquire_lease(run_dir, f"owner-{i}").acquired:
            winners.append(i)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1


def test_forecast_versions_are_kept(store):
    assert store.write_forecast("hero", {"final_loss": 2.0}) == 1
    assert store.write_forecast("hero", {"final_loss": 1.9}) == 2
    assert store.list_forecasts("hero") == [1, 2]
    assert store.read_forecast("hero", 1)["final_loss"] == 2.0
    assert store.read_forecast("hero")["final_loss"] == 1.9


def test_torn_last_metrics_line_is_ignored_then_read(store):
    run_dir = store.run_dir("step", "d" * 64)
    path = f"{run_dir}/metrics.jsonl"
    store.fs.makedirs(run_dir, exist_ok=True)
    complete = json.dumps({"step": 1, "train/loss": 3.0}) + "\n" + json.dumps({"step": 2, "train/loss": 2.5}) + "\n"
    store.fs.pipe_file(path, (complete + '{"step": 3, "train/lo').encode())
    rows, offset = read_metrics(store, run_dir)
    assert [r["step"] for r in rows] == [1, 2] and offset == len(complete)
    store.fs.pipe_file(path, (complete + '{"step": 3, "train/loss": 2.2}\n').encode())
    more, _ = read_metrics(store, run_dir, offset=offset)
    assert [r["step"] for r in more] == [3]


def test_corrupt_status_is_a_clear_error(tmp_path):
    store = Store(str(tmp_path))
    run_dir = store.run_dir("step", "e" * 64)
    store.fs.makedirs(run_dir, exist_ok=True)
    (tmp_path / "runs" / ("step-" + "e" * 10) / "status.json").write_text("{not json")
    with pytest.raises(Exception, match="not valid JSON"):
        store.read_json(store.status_path(run_dir))
    # read_status rebuilds it from the run directory and names the file (tests/test_ladder_corrupt_status.py)
    assert store.read_status(run_dir)["unreadable"]["path"] == store.status_path(run_dir)


def _object_locked_store():
    """A memory:// store guarded the way object stores are: a lock object created only if absent."""
    store = Store(f"memory://objlock-{time.time_ns()}")
    store.locking = "object"
    return store


def test_object_store_guard_waits_for_a_live_lock_object_and_breaks_a_stale_one():
    import json as json_lib

    store = _object_locked_store()
    assert store.conditional_create(), "memory:// implements pipe_file(mode='create')"
    run_dir = store.run_dir("step", "f" * 64)
    lock = f"{store.status_path(run_dir)}.lock"
    store.update_status(run_dir, lambda s: s.update(state="pending"))
    assert not store.exists(lock), "the lock object is removed after the write"

    store.fs.pipe_file(lock, json_lib.dumps({"token": "other", "at": time.time()}).encode())
    release = threading.Timer(0.5, lambda: store.fs.rm(lock))
    release.start()
    started = time.time()
    store.update_status(run_dir, lambda s: s.update(state="running"))
    release.join()
    assert time.time() - started >= 0.4, "a live lock object is waited for"
    assert store.read_status(run_dir)["state"] == "running"

    store.fs.pipe_file(lock, json_lib.dumps({"token": "crashed", "at": time.time() - 3600}).encode())
    store.update_status(run_dir, lambda s: s.update(state="done"))  # would wait 60 s if the stale lock were honoured
    assert store.read_status(run_dir)["state"] == "done" and not store.exists(lock)


def test_a_local_folder_has_no_conditional_create_and_uses_a_file_lock(tmp_path):
    store = Store(str(tmp_path))
    assert store.locking == "file" and not store.conditional_create()
