"""Divergence before the first checkpoint: a rollback with nothing to restore restarts from a fresh initial state.

The state of the first attempt was donated to the jitted step, so nothing of it (the router state included)
may be reused: the rollback builds the initial state anew, skips the bad steps, and when the run keeps
diverging it ends in ``TrainingDiverged`` naming the steps. NaNs come from train's test-only injector.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.test_trainer_loop import ladder_cache, tiny_job  # noqa: F401 - fixture
from trainer.loop import TrainingDiverged, train
from trainer.metrics import read_metrics


def early_job(**overrides):
    # 12 steps, first checkpoint only at the end: every rollback below has no checkpoint to go to
    return tiny_job(num_steps=12, eval_every=100, checkpoint_every=100, max_bad_steps=3, **overrides)


def test_rollback_with_no_checkpoint_restarts_from_a_fresh_initial_state(ladder_cache, tmp_path):  # noqa: F811
    run_dir = str(tmp_path / "run")
    result = train(early_job(), run_dir, _fault_injector=lambda step: step in (3, 4, 5))
    assert result.completed and result.rollbacks == 1 and result.skipped_steps == [3, 4, 5]
    raw = read_metrics(os.path.join(run_dir, "metrics.jsonl"), raw=True)
    marker = next(r for r in raw if r.get("reason") == "rollback")
    assert marker["step"] == 0 and marker["skipped_steps"] == [3, 4, 5]
    # the replay from the fresh state reproduces steps 1-2 bit for bit
    before = {r["step"]: r["train/loss"] for r in raw[: raw.index(marker)] if "train/loss" in r and "train/nonfinite" not in r}
    after = {r["step"]: r["train/loss"] for r in raw[raw.index(marker):] if "train/loss" in r and "train/nonfinite" not in r}
    assert before[1] == after[1] and before[2] == after[2]


def test_persistent_divergence_before_any_checkpoint_ends_in_training_diverged(ladder_cache, tmp_path):  # noqa: F811
    run_dir = str(tmp_path / "run")
    with pytest.raises(TrainingDiverged) as info:
        train(early_job(max_rollbacks=2), run_dir, _fault_injector=lambda step: step >= 2)
    message = str(info.value)
    assert "[8, 9, 10]" in message and "after 2 rollback(s)" in message
    with open(os.path.join(run_dir, "faults.json")) as f:
        rollbacks = json.load(f)["rollbacks"]
    assert [(r["to_step"], r["skipped"]) for r in rollbacks] == [(0, [2, 3, 4]), (0, [5, 6, 7])]


def test_a_diverging_learning_rate_fails_with_training_diverged(ladder_cache, tmp_path):  # noqa: F811
    # the case: LR 1e3 blows up within a few steps, long before the first checkpoint
    from trainer.config import OptimizerConfig, ScheduleConfig

    job = early_job(max_rollbacks=2)
    job = job.model_copy(update={"optimizer": OptimizerConfig(learning_rate=1e3, schedule=ScheduleConfig(kind="constant", warmup=0))})
    with pytest.raises(TrainingDiverged) as info:
        train(job, str(tmp_path / "run"))
    assert "after 2 rollback(s)" in str(info.value)


def test_a_diverging_step_fails_with_a_one_line_reason_and_its_traceback_in_the_run_directory(ladder_cache, tmp_path):  # noqa: F811
    from ladder.dag import DAG, TrainStep
    from ladder.executor import StepTask, execute_step, plan
    from ladder.store import Store
    from tests.ladder_helpers import tiny_spec
    from trainer.config import OptimizerConfig, ScheduleConfig

    base = tiny_spec()
    spec = base.model_copy(update={
        "optimizer": OptimizerConfig(learning_rate=1e3, schedule=ScheduleConfig(kind="constant", warmup=0)),
        "train": base.train.model_copy(update={"checkpoint_every": 25, "max_rollbacks": 2}),
    })
    dag = DAG([TrainStep(name="s24", spec=spec)])
    store = Store(str(tmp_path / "root"))
    task = dict(step=dag["s24"], fingerprint=dag.fingerprints["s24"], store_url=store.url, deps={}, dependency_fingerprints={})
    for attempt in ("first", "retry"):
        outcome = execute_step(StepTask(owner=attempt, **task))
        assert outcome["outcome"] == "failed" and outcome["error"].startswith("TrainingDiverged: training diverged"), outcome
        run_dir = store.run_dir("s24", dag.fingerprints["s24"])
        status = store.read_status(run_dir)
        assert status["state"] == "failed" and "\n" not in status["last_error"]
        assert "after 2 rollback(s)" in status["last_error"] and "error.log" in status["last_error"]
        with open(f"{run_dir}/error.log") as handle:
            log = handle.read()
        assert "Traceback (most recent call last)" in log and "TrainingDiverged" in log
    assert log.count("Traceback (most recent call last)") == 2
    assert plan(dag, store)[0].state == "failed"
