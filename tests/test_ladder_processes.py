"""Real `ladder submit` processes: two racing submitters, a SIGKILLed submitter taken over, Ctrl-C.

Each submitter starts its own embedded Ray, as a user's would. The step is a function that works
in small increments and keeps its progress in its run directory, the way the trainer keeps
checkpoints, so a taken-over attempt resumes rather than restarts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXPERIMENT = '''
import os, time
from ladder.dag import FunctionStep

def slow_count(ctx, units, seconds_per_unit, log):
    progress = os.path.join(ctx.run_dir, "progress.txt")
    done = int(open(progress).read()) if os.path.exists(progress) else 0
    with open(log, "a") as handle:
        handle.write(f"start {done} {os.getpid()}\\n")
    while done < units:
        if ctx.should_stop():
            return {"stopped_at": done}
        time.sleep(seconds_per_unit)
        done += 1
        with open(progress + ".tmp", "w") as handle:
            handle.write(str(done))
        os.replace(progress + ".tmp", progress)
    with open(log, "a") as handle:
        handle.write(f"finish {done} {os.getpid()}\\n")
    return {"units": done}

work = FunctionStep(name="work", fn=slow_count, config={"units": UNITS, "seconds_per_unit": 0.25, "log": LOG})
'''


def _experiment(tmp_path: Path, units: int) -> tuple[str, Path]:
    log = tmp_path / "log.txt"
    path = tmp_path / "exp.py"
    path.write_text(EXPERIMENT.replace("UNITS", str(units)).replace("LOG", repr(str(log))))
    return str(path), log


def _submit(exp: str, root: Path, *extra: str, ttl: str = "4") -> subprocess.Popen:
    env = {**os.environ, "LADDER_LEASE_TTL": ttl, "LADDER_ROOT": str(root)}
    return subprocess.Popen(
        [sys.executable, "-m", "ladder.cli", "submit", exp, *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


def _status(root: Path) -> dict:
    [path] = root.glob("runs/work-*/status.json")
    return json.loads(path.read_text())


def _progress(root: Path) -> int:
    found = list(root.glob("runs/work-*/progress.txt"))
    return int(found[0].read_text()) if found else 0


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_two_racing_submitters_run_the_step_once(tmp_path):
    exp, log = _experiment(tmp_path, units=16)
    root = tmp_path / "root"
    first, second = _submit(exp, root), _submit(exp, root)
    out1, _ = first.communicate(timeout=240)
    out2, _ = second.communicate(timeout=240)
    assert first.returncode == 0, out1
    assert second.returncode == 0, out2
    starts = [line for line in log.read_text().splitlines() if line.startswith("start")]
    assert len(starts) == 1, log.read_text()
    status = _status(root)
    assert status["state"] == "done" and status["attempts"] == 1
    assert ("held by" in out1 + out2) or ("running elsewhere" in out1 + out2) or ("skipped" in out1 + out2)


def test_sigkilled_submitter_is_taken_over_and_resumes(tmp_path):
    exp, log = _experiment(tmp_path, units=40)
    root = tmp_path / "root"
    victim = _submit(exp, root)
    _wait_for(lambda: _progress(root) >= 4, 120, "the first attempt to make progress")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    killed_at = _progress(root)
    assert _status(root)["state"] == "running", "a killed submitter cannot update its status"
    rescuer = _submit(exp, root)
    out, _ = rescuer.communicate(timeout=300)
    assert rescuer.returncode == 0, out
    status = _status(root)
    assert status["state"] == "done" and status["attempts"] == 2
    assert any(event["event"] == "lease_taken_over" for event in status["history"])
    starts = [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("start")]
    assert starts[0] == 0 and starts[1] >= killed_at - 1 > 0, f"the second attempt must resume, not restart: {starts}"
    result = json.loads(next(root.glob("runs/work-*/result.json")).read_text())
    assert result == {"units": 40}


def test_ctrl_c_leaves_status_true(tmp_path):
    exp, log = _experiment(tmp_path, units=400)
    root = tmp_path / "root"
    submitter = _submit(exp, root, ttl="8")
    _wait_for(lambda: _progress(root) >= 3, 120, "progress")
    submitter.send_signal(signal.SIGINT)
    out, _ = submitter.communicate(timeout=120)
    assert submitter.returncode == 130, out
    status = _status(root)
    assert status["state"] == "interrupted" and status["lease"] is None
    assert 3 <= _progress(root) < 400
    plan = subprocess.run([sys.executable, "-m", "ladder.cli", "plan", exp, "--json"], env={**os.environ, "LADDER_ROOT": str(root)},
                          capture_output=True, text=True, timeout=60)
    step = json.loads(plan.stdout)["steps"][0]
    assert step["state"] == "pending" and "resumes" in step["detail"]
