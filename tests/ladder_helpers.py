"""Small builders shared by the orchestrator tests, and a way to run the CLI end to end that says where it hung."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ladder.spec import ExperimentSpec, ResourceSpec
from trainer.config import DataConfig, MixturePhase, ModelConfig, MoEConfig, OptimizerConfig, SourceConfig, TrainConfig


def tiny_spec(**overrides) -> ExperimentSpec:
    """A small but real MoE spec on the built-in corpora; `overrides` replace whole sections."""
    sections = dict(
        model=ModelConfig(hidden_dim=32, num_layers=2, num_heads=2, seq_len=32, moe=MoEConfig(num_experts=4, top_k=2, expert_dim=32)),
        data=DataConfig(
            sources=[SourceConfig(name="code", kind="stdlib_code"), SourceConfig(name="docs", kind="stdlib_docs")],
            phases=[MixturePhase(weights={"code": 0.7, "docs": 0.3})],
            max_tokens_per_source=200_000,
        ),
        optimizer=OptimizerConfig(learning_rate=3e-3),
        train=TrainConfig(tokens=32 * 8 * 20, batch_size=8, eval_every=10, checkpoint_every=10, progress=False, wandb="disabled"),
        resources=ResourceSpec(cpus=1),
    )
    sections.update(overrides)
    return ExperimentSpec(**sections)


def run_logged(module: str, args: list[str], *, env: dict[str, str], log_path: Path, timeout: float, root: Path | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGS` with stdout streamed to `log_path` and stderr beside it (`.err`), under a limit
    shorter than pytest's own.

    Why: a child run with `capture_output` that overruns pytest-timeout is killed with everything it printed (a CI
    run of the mini Marin ladder hung past 900 s and left nothing to read). Here, past `timeout` the child gets
    SIGABRT with faulthandler on, which writes every thread's stack to its stderr, and the test fails with both
    tails and the state of each run under `root` (which step was running, which was waiting).

    The child leads a process group of its own, killed when it ends: what it started (an embedded Ray's raylet and
    workers) must not outlive it and take the cores of the tests that follow."""
    err_path = log_path.with_suffix(".err")
    with open(log_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"},
                                stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            _kill_group(proc.pid)
            pytest.fail(f"`python -m {module} {' '.join(args)}` did not finish in {timeout:.0f} s; the runs: {_run_states(root)}\n"
                        f"its stdout:\n{log_path.read_text()[-4000:]}\n"
                        f"its stderr (every thread's stack at the end):\n{err_path.read_text()[-12000:]}")
    _kill_group(proc.pid)
    return subprocess.CompletedProcess(proc.args, returncode, log_path.read_text(), err_path.read_text())


def _kill_group(pgid: int) -> None:
    """SIGKILL whatever is left of a process group (nothing, when the child cleaned up after itself)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run_states(root: Path | None) -> str:
    """Each run's status.json state and last step, for a hang report."""
    runs = Path(root) / "runs" if root is not None else None
    if runs is None or not runs.is_dir():
        return "(no runs)"
    states = []
    for run_dir in sorted(runs.iterdir()):
        try:
            status = json.loads((run_dir / "status.json").read_text())
            states.append(f"{run_dir.name}: {status.get('state')} (step {(status.get('progress') or {}).get('step')})")
        except (OSError, ValueError):
            states.append(f"{run_dir.name}: no readable status.json")
    return "; ".join(states) or "(no runs)"
