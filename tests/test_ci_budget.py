"""CI's time budget for the slow set (tests/conftest.py): a spent budget skips what has not started, and says so; and an
end-to-end run that hangs fails its test with where it hung (tests/ladder_helpers.run_logged), not a silent timeout."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ladder_helpers import run_logged

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, deadline: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text("def test_probe():\n    assert True\n")
    env = {k: v for k, v in os.environ.items() if k != "LADDER_TEST_DEADLINE"}
    if deadline is not None:
        env["LADDER_TEST_DEADLINE"] = deadline
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-rs", "-p", "no:cacheprovider",
                           str(tmp_path / "test_probe.py")], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_spent_budget_skips_a_test_that_has_not_started_and_names_the_reason(tmp_path):
    spent = _run(tmp_path, "1")
    assert spent.returncode == 0 and "1 skipped" in spent.stdout and "LADDER_TEST_DEADLINE" in spent.stdout, spent.stdout


def test_without_a_budget_or_before_it_every_test_runs(tmp_path):
    assert "1 passed" in _run(tmp_path, None).stdout
    assert "1 passed" in _run(tmp_path, "99999999999").stdout


def test_a_run_past_its_limit_fails_with_its_output_and_every_threads_stack(tmp_path):
    module = tmp_path / "hangs_here.py"
    module.write_text("import subprocess, sys, threading, time\nprint('started', flush=True)\n"
                      "helper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      "open('helper.pid', 'w').write(str(helper.pid))\n"
                      "threading.Thread(target=time.sleep, args=(600,), name='stuck-helper').start()\n"
                      "def wait_forever():\n    time.sleep(600)\nwait_forever()\n")
    root = tmp_path / "root"
    (root / "runs" / "hero-abc").mkdir(parents=True)
    (root / "runs" / "hero-abc" / "status.json").write_text('{"state": "running", "progress": {"step": 40}}')
    with pytest.raises(pytest.fail.Exception) as failure:
        run_logged("hangs_here", [], env={**os.environ, "PYTHONPATH": str(tmp_path)}, log_path=tmp_path / "run.log",
                   timeout=3, root=root, cwd=tmp_path)
    message = str(failure.value)
    assert "did not finish in 3 s" in message and "hero-abc: running (step 40)" in message
    assert "started" in message and "wait_forever" in message and message.count("hread 0x") >= 2, message
    assert not _alive(int((tmp_path / "helper.pid").read_text())), "the hung run's own child outlived it"


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper counts as gone), after up to 5 s for the kill to land."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z":
            return False
        time.sleep(0.1)
    return True


def test_a_run_that_finishes_returns_its_output(tmp_path):
    (tmp_path / "says_hello.py").write_text("import sys\nprint('hello')\nprint('careful', file=sys.stderr)\nsys.exit(3)\n")
    done = run_logged("says_hello", [], env={**os.environ, "PYTHONPATH": str(tmp_path)}, log_path=tmp_path / "run.log",
                      timeout=60, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (3, "hello\n", "careful\n")
