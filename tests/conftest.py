"""Three things every test run needs: Ctrl-C reaching the processes the tests start, CI's time budget, and how many
worker processes share the tests.

Ctrl-C: a shell that starts pytest in the background (`nohup ... &`, a job runner) starts it with SIGINT
ignored, every process pytest starts inherits that, and Python leaves an ignored SIGINT ignored: the tests that
press Ctrl-C on `ladder submit` and `ladder attach` then saw it do nothing (both failed in every background run
of the whole set; in the foreground, and in CI, they passed). Restoring Python's own handler in pytest's process
makes the children start with the default again (an exec resets caught signals, not ignored ones).

The time budget for the slow set in CI: tests not yet started when it is spent are skipped, and say so.

Why: `.ci/run` runs README's test command (every default test, always in full) and then the `slow` end-to-end
tests "when they fit" in CI's 90 minutes. On a fast 2-core machine the two sets took about 8 and 17 minutes; on
a machine about 3x slower (seen in one session: 25 minutes for the default set) the slow set alone would take
most of an hour and a half, and a CI run that goes over its limit checks nothing at all. So `.ci/run` sets
LADDER_TEST_DEADLINE (seconds since the epoch) for the slow set only: a test that starts before it runs to its end
and fails CI if it fails; one that would start after it is skipped with this reason, listed in pytest's summary.
Unset (a developer's own run), nothing is skipped.

Workers: pyproject's addopts run the test files in parallel (pytest-xdist, `-n auto --dist loadfile`: a file's tests
stay in one process, so a module fixture is built once). Most tests keep one core busy (scipy fits, XLA compiles, one
Ray driver), so on 2 cores two workers took the default set from 25-29 to 15-19 minutes. `auto` is one worker per
core this process may use, at most four: a worker can hold a JAX process with eight fake devices and a Ray cluster
of its own (a few GiB), and more workers than that do not shorten a run whose largest files take minutes each.
"""

from __future__ import annotations

import os
import signal
import time

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_runtest_setup(item: pytest.Item) -> None:
    deadline = os.environ.get("LADDER_TEST_DEADLINE")
    if deadline and time.time() > float(deadline):
        pytest.skip("CI's time budget for the slow set is spent (LADDER_TEST_DEADLINE): not started")


MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, usable))
