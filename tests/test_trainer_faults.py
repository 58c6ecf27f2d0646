"""Non-finite steps: never applied, counted and logged; rollback and skip; a clear failure when it persists.

NaNs are injected with train's test-only ``_fault_injector`` (it makes the loss and every gradient of
the chosen steps NaN inside the jitted step; steps are 1-based as in metrics.jsonl). The job has 24 steps and a checkpoint every 10.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.test_trainer_loop import ladder_cache, tiny_job, train_losses  # noqa: F401 - fixture
from trainer.loop import TrainingDiverged, train
from trainer.metrics import read_metrics

NUM_STEPS = 24


def fault_job(**overrides):
    return tiny_job(num_steps=NUM_STEPS, eval_every=100, checkpoint_every=10, max_bad_steps=3, **overrides)


def poison(indices):
    return lambda step: step in indices


def stop_after(n):
    calls = []
    return lambda: calls.append(1) or len(calls) > n


def saved_state(run_dir: str, step: int):
    return ocp.PyTreeCheckpointer().restore(os.path.join(run_dir, "checkpoints", str(step), "state"))


def test_isolated_nan_step_is_not_applied_and_is_logged(ladder_cache, tmp_path):  # noqa: F811
    clean_dir, bad_dir = str(tmp_path / "clean"), str(tmp_path / "bad")
    train(fault_job(), clean_dir, should_stop=stop_after(5))
    result = train(fault_job(), bad_dir, should_stop=stop_after(6), _fault_injector=poison({6}))
    assert result.steps == 6 and result.rollbacks == 0 and result.skipped_steps == []

    clean, bad = saved_state(clean_dir, 5), saved_state(bad_dir, 6)
    assert int(bad["step"]) == 6
    for name in ("params", "opt_state", "router_state"):
        jax.tree.map(np.testing.assert_array_equal, bad[name], clean[name])

    rows = read_metrics(os.path.join(bad_dir, "metrics.jsonl"))
    flagged = [r for r in rows if "train/nonfinite" in r]
    assert [(r["step"], r["train/loss"]) for r in flagged] == [(6, None)]


def test_consecutive_nan_steps_roll_back_and_skip_those_batches(ladder_cache, tmp_path):  # noqa: F811
    run_dir = str(tmp_path / "run")
    result = train(fault_job(), run_dir, _fault_injector=poison({13, 14, 15}))
    assert result.completed and result.rollbacks == 1 and result.skipped_steps == [13, 14, 15]
    assert np.isfinite(result.final_train_loss)

    raw = read_metrics(os.path.join(run_dir, "metrics.jsonl"), raw=True)
    assert [r["step"] for r in raw if "train/nonfinite" in r] == [13, 14, 15]
    marker = next(r for r in raw if r.get("reason") == "rollback")
    assert marker["step"] == 10 and marker["skipped_steps"] == [13, 14, 15]

    # after the rollback, steps 11-12 replay bit for bit, 13-15 are skipped, the rest trains
    first_attempt = {r["step"]: r["train/loss"] for r in raw[: raw.index(marker)] if "train/loss" in r}
    final = train_losses(run_dir)
    assert final[11] == first_attempt[11] and final[12] == first_attempt[12]
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows if "train/skipped" in r] == [13, 14, 15]
    assert sorted(final) == [s for s in range(1, NUM_STEPS + 1) if s not in (13, 14, 15)]

    with open(os.path.join(run_dir, "faults.json")) as f:
        faults = json.load(f)
    assert faults["skipped_steps"] == [13, 14, 15]
    assert [(r["to_step"], r["skipped"]) for r in faults["rollbacks"]] == [(10, [13, 14, 15])]
    with open(os.path.join(run_dir, "checkpoints", str(NUM_STEPS), "meta", "metadata")) as f:
        assert json.load(f)["skipped_steps"] == [13, 14, 15]


def test_skipped_steps_survive_a_restart_through_checkpoint_metadata(ladder_cache, tmp_path):  # noqa: F811
    run_dir = str(tmp_path / "run")
    faults_path = os.path.join(run_dir, "faults.json")
    calls_after_rollback = []

    def stop_two_steps_after_rollback():
        if os.path.exists(faults_path):
            calls_after_rollback.append(1)
        return len(calls_after_rollback) > 2

    first = train(fault_job(), run_dir, should_stop=stop_two_steps_after_rollback, _fault_injector=poison({13, 14, 15}))
    assert not first.completed and first.steps == 12 and first.rollbacks == 1
    os.remove(faults_path)  # only the checkpoint at step 12 remembers the skips now

    second = train(fault_job(), run_dir)  # no injector: the skips must come from the checkpoint
    assert second.completed and second.resumed_from_step == 12 and second.skipped_steps == [13, 14, 15]
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows if "train/skipped" in r] == [13, 14, 15]


@pytest.mark.parametrize("max_rollbacks, last_bad", [(0, [13, 14, 15]), (2, [19, 20, 21])])
def test_persistent_nan_fails_clearly_after_max_rollbacks(ladder_cache, tmp_path, max_rollbacks, last_bad):  # noqa: F811
    run_dir = str(tmp_path / "run")
    with pytest.raises(TrainingDiverged) as info:
        train(fault_job(max_rollbacks=max_rollbacks), run_dir, _fault_injector=lambda step: step >= 13)
    message = str(info.value)
    assert str(last_bad) in message and f"max_rollbacks={max_rollbacks}" in message
    raw = read_metrics(os.path.join(run_dir, "metrics.jsonl"), raw=True)
    assert [r["step"] for r in raw if "train/nonfinite" in r][-3:] == last_bad
    if max_rollbacks:
        with open(os.path.join(run_dir, "faults.json")) as f:
            assert len(json.load(f)["rollbacks"]) == max_rollbacks
