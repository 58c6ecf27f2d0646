"""CI's time budget for the slow set (tests/conftest.py): a spent budget skips what has not started, and says so."""

import os
import subprocess
import sys
from pathlib import Path

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
