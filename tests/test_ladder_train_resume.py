"""A training step through the executor: killed mid-run with its submitter, taken over, resumed from its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from pathlib import Path

# Long enough that the Ray worker, which may outlive its killed driver by a few seconds, cannot finish first.
STEPS = 3000

EXPERIMENT_TEMPLATE = '''
from ladder import TrainStep
from tests.ladder_helpers import tiny_spec

spec = tiny_spec()
NUM_STEPS = %d
spec = spec.model_copy(update={"train": spec.train.model_copy(update={"tokens": 32 * 8 * NUM_STEPS, "checkpoint_every": 25, "eval_every": 500, "log_every": 5})})
train = TrainStep(name="train", spec=spec)
'''
EXPERIMENT = EXPERIMENT_TEMPLATE % STEPS


def _metrics(root: Path) -> list[dict]:
    found = list(root.glob("runs/train-*/metrics.jsonl"))
    if not found:
        return []
    return [json.loads(line) for line in found[0].read_text().splitlines() if line.strip().endswith("}")]


@pytest.mark.slow
def test_killed_training_step_resumes_from_its_checkpoint(tmp_path):
    exp = tmp_path / "exp.py"
    exp.write_text(EXPERIMENT)
    root = tmp_path / "root"
    env = {**os.environ, "LADDER_LEASE_TTL": "4", "LADDER_ROOT": str(root), "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "ladder.cli", "submit", str(exp)]
    victim = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and not list(root.glob("runs/train-*/checkpoints/*/_CHECKPOINT_METADATA")):
        time.sleep(0.5)
    while time.time() < deadline and max([m.get("step", 0) for m in _metrics(root)] or [0]) < 60:
        time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    # Ray's worker may outlive its driver by a moment; once the lease is stale, it is gone
    [status_path] = root.glob("runs/train-*/status.json")
    while time.time() < deadline and time.time() - (json.loads(status_path.read_text()).get("lease") or {}).get("heartbeat", 0) < 5:
        time.sleep(0.5)
    killed_at = max(m.get("step", 0) for m in _metrics(root))
    assert 25 <= killed_at < STEPS, killed_at

    rescuer = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert rescuer.returncode == 0, rescuer.stdout + rescuer.stderr
    [run_dir] = root.glob("runs/train-*")
    status = json.loads((run_dir / "status.json").read_text())
    result = json.loads((run_dir / "result.json").read_text())
    assert status["state"] == "done" and status["attempts"] == 2
    assert result["completed"] and result["steps"] == STEPS
    assert result["resumed_from_step"] and 25 <= result["resumed_from_step"] <= killed_at
    assert result["final_eval_loss"] < 5.0
