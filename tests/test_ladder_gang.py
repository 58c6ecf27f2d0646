"""Multi-process training steps as Ray gangs (ladder.gang): the same losses as one process, and recovery.

The proof runs JAX multi-process on CPUs with gloo collectives: a small MoE on a data 4 x expert 2 mesh,
once as 1 process x 8 devices and once as 2 processes x 4 devices (both mesh axes span both processes).
Both go through `ladder submit`, i.e. the executor, a placement group, member actors and
`python -m ladder.gang_worker` processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ladder.fitting import store_forecast
from ladder.gang import GangError, bundle_of, hosts_that_fit, placement_strategy, run_gang, uses_gang
from ladder.spec import ResourceSpec
from ladder.store import Store
from tests.test_ladder_overlay import _forecast, _target
from tests.test_ladder_multinode import _env, two_node_cluster  # noqa: F401 - the fixture is used below
from trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]

EXPERIMENT = '''
from ladder import ExperimentSpec, ResourceSpec, TrainStep
from trainer.config import (DataConfig, MixturePhase, ModelConfig, MoEConfig, OptimizerConfig, ScheduleConfig,
                            SourceConfig, TrainConfig)

NUM_STEPS = {num_steps}
MESH = {mesh!r}
EXPERTS = {experts}
HANG_TIMEOUT = {hang_timeout}


def spec(hosts):
    return ExperimentSpec(
        model=ModelConfig(hidden_dim=32, num_layers=2, num_heads=2, seq_len=32,
                          moe=MoEConfig(num_experts=EXPERTS, top_k=2, expert_dim=32)),
        data=DataConfig(sources=[SourceConfig(name="code", kind="stdlib_code"), SourceConfig(name="docs", kind="stdlib_docs")],
                        phases=[MixturePhase(weights={{"code": 0.7, "docs": 0.3}})], max_tokens_per_source=200_000),
        optimizer=OptimizerConfig(learning_rate=1e-2, schedule=ScheduleConfig(kind="cosine", warmup=5)),
        train=TrainConfig(tokens=NUM_STEPS * 16 * 32, batch_size=16, eval_every=10, eval_batches=2, log_every=1,
                          checkpoint_every=10, wandb="disabled", progress=False, mesh=MESH),
        resources=ResourceSpec(cpus=1, hosts=hosts, cpu_devices_per_host=8 // hosts, hang_timeout_s=HANG_TIMEOUT),
    )


one = TrainStep(name="one-process", spec=spec(1))
two = TrainStep(name="two-process", spec=spec(2))
'''


def _experiment(tmp_path: Path, num_steps: int, mesh: dict[str, int] | None = None, experts: int = 4,
                hang_timeout: float | None = None) -> Path:
    path = tmp_path / "gang_exp.py"
    path.write_text(EXPERIMENT.format(num_steps=num_steps, mesh=mesh or {"data": 4, "expert": 2}, experts=experts,
                                      hang_timeout=hang_timeout))
    return path


def _run_dir(root: Path, name: str) -> Path:
    [run_dir] = root.glob(f"runs/{name}-*")
    return run_dir


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(str(run_dir / "metrics.jsonl")) if "train/loss" in r}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _placement_group_states(address: str) -> list[str]:
    """The state of every placement group the cluster has seen (from a separate driver)."""
    probe = (
        "import ray, json\n"
        f"ray.init(address={address!r}, logging_level='ERROR', _node_ip_address='127.0.0.2')\n"
        "print('PGS' + json.dumps([g['state'] for g in ray.util.placement_group_table().values()]))\n"
    )
    tables = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=_env())
    return json.loads(tables.stdout.split("PGS", 1)[1])


def _signal_rank_and_finish(process: subprocess.Popen, root: Path, *, rank: int, at_step: int, sig: int) -> tuple[int, str]:
    """Send `sig` to the gang's rank `rank` once the run has logged `at_step` steps, then wait for the
    submitter; returns (the signalled pid, the submitter's output). The submitter is killed if anything fails."""
    try:
        deadline, signalled = time.time() + 300, None
        while time.time() < deadline and signalled is None:
            runs = list(root.glob("runs/two-process-*"))
            if runs and (runs[0] / "metrics.jsonl").exists() and len(_losses(runs[0])) >= at_step:
                signalled = int((runs[0] / "gang" / f"host{rank}.pid").read_text())
                os.kill(signalled, sig)
            time.sleep(0.2)
        assert signalled is not None, f"the gang never reached step {at_step}"
        output, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return signalled, output


# ----------------------------------------------------------------------------------- pure parts


def test_gang_bundles_strategy_and_spec_validation():
    resources = ResourceSpec(cpus=120, gpus=4, accelerator_type="GB200", hosts=176, memory_gb=890, custom={"rack": 1})
    assert bundle_of(resources) == {
        "CPU": 120.0, "GPU": 4.0, "memory": float(890 * 1024**3), "accelerator_type:GB200": 0.001, "rack": 1.0,
    }
    assert placement_strategy(hosts=2, alive_nodes=2) == "STRICT_SPREAD"
    assert placement_strategy(hosts=2, alive_nodes=1) == "SPREAD"
    assert uses_gang(resources) and uses_gang(ResourceSpec(cpu_devices_per_host=8)) and not uses_gang(ResourceSpec())
    idle_nodes = [{"CPU": 2.0, "memory": 1e12}, {"CPU": 1.0, "GPU": 4.0}]
    assert hosts_that_fit({"CPU": 1.0}, idle_nodes) == 3
    assert hosts_that_fit({"CPU": 1.0, "GPU": 4.0}, idle_nodes) == 1
    assert hosts_that_fit(bundle_of(resources), idle_nodes) == 0
    for bad in ({"cpu_devices_per_host": 0}, {"max_restarts": -1}, {"placement_timeout_s": 0}, {"hang_timeout_s": 0}):
        with pytest.raises(ValueError):
            ResourceSpec(**bad)


def test_gang_refuses_a_run_directory_that_is_not_a_shared_path():
    from tests.ladder_helpers import tiny_spec
    from ladder.dag import TrainStep

    step = TrainStep(name="s", spec=tiny_spec(resources=ResourceSpec(hosts=2)))
    with pytest.raises(GangError, match="shared filesystem"):
        run_gang(step, "memory://root/runs/s-0")


# ------------------------------------------------------------------------ through the executor


def test_a_gang_the_cluster_cannot_hold_fails_at_once_with_the_reason(tmp_path):
    """Two hosts of 64 CPUs on the embedded Ray of a 2-core machine: failed in seconds, not after the
    placement timeout, and status.json says why."""
    experiment = tmp_path / "huge.py"
    experiment.write_text(
        "from ladder import ResourceSpec, TrainStep\n"
        "from tests.ladder_helpers import tiny_spec\n"
        "huge = TrainStep(name='huge', spec=tiny_spec(resources=ResourceSpec(cpus=64, hosts=2)))\n"
    )
    root = tmp_path / "root"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("LADDER_GANG_AUTOSCALE", None)
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", str(experiment), "--root", str(root)],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert time.time() - started < 120
    status = json.loads(next(root.glob("runs/huge-*/status.json")).read_text())
    assert status["state"] == "failed"
    assert "needs 2 host(s)" in status["last_error"] and "can hold only 0" in status["last_error"]


def test_an_error_a_restart_would_repeat_fails_the_gang_at_once_with_the_message(tmp_path):
    """A batch of 12 on an 8-device data mesh cannot be split: every rank raises the trainer's ValueError;
    the step fails after one attempt (not max_restarts + 1) and status.json carries the message."""
    experiment = tmp_path / "bad_mesh.py"
    experiment.write_text(
        "from ladder import ResourceSpec, TrainStep\n"
        "from tests.ladder_helpers import tiny_spec\n"
        "from trainer.config import TrainConfig\n"
        "bad = TrainStep(name='bad', spec=tiny_spec(\n"
        "    train=TrainConfig(tokens=32 * 12 * 10, batch_size=12, mesh={'data': 8}, wandb='disabled', progress=False),\n"
        "    resources=ResourceSpec(cpus=1, hosts=2, cpu_devices_per_host=4, max_restarts=2)))\n"
    )
    root = tmp_path / "root"
    result = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", str(experiment), "--root", str(root)],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 1, result.stdout + result.stderr
    run_dir = _run_dir(root, "bad")
    attempts = [json.loads(line) for line in (run_dir / "gang" / "attempts.jsonl").read_text().splitlines()]
    assert [a["outcome"] for a in attempts] == ["error"]
    assert "ValueError" in attempts[0]["detail"] and "does not split evenly" in attempts[0]["detail"]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and "a restart would fail the same way" in status["last_error"]
    assert not any(_alive(pid) for pid in attempts[0]["pids"])
    shown = subprocess.run([sys.executable, "-m", "ladder.cli", "show", str(run_dir)], capture_output=True, text=True,
                           timeout=120, cwd=REPO, env={**os.environ, "COLUMNS": "300"})
    assert shown.returncode == 0 and "gang attempts" in shown.stdout and "exited with code 1" in shown.stdout


@pytest.mark.parametrize(
    "mesh, experts",
    # about 50 s each on 2 cores: both in the slow set (CI runs it), the default run keeps the gang's failure paths
    [pytest.param({"data": 4, "expert": 2}, 4, marks=pytest.mark.slow), pytest.param({"expert": 8}, 8, marks=pytest.mark.slow)],
    ids=["data4-expert2:data-axis-crosses-processes", "expert8:expert-axis-crosses-processes"],
)
def test_two_processes_give_the_losses_of_one_process_on_embedded_ray(tmp_path, mesh, experts):
    """2 processes x 4 CPU devices (gloo) == 1 process x 8 devices, step by step, through `ladder submit`.
    Process 0 holds the first 4 devices of the mesh, so with data 4 x expert 2 the data axis crosses the
    processes (as on a real cluster, where experts stay inside a host's fast domain) and with expert 8 the
    expert axis does (its dispatch and gradient reductions go through gloo)."""
    experiment, root = _experiment(tmp_path, num_steps=12, mesh=mesh, experts=experts), tmp_path / "root"
    store_forecast(Store(str(root)), _forecast(_target("two-process")), meta={})  # rank 0 must attach the overlay
    result = subprocess.run(
        [sys.executable, "-m", "ladder.cli", "submit", str(experiment), "--root", str(root)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, two = _run_dir(root, "one-process"), _run_dir(root, "two-process")
    one_losses, two_losses = _losses(one), _losses(two)
    assert sorted(two_losses) == list(range(1, 13)) == sorted(one_losses)
    np.testing.assert_allclose([two_losses[s] for s in range(1, 13)], [one_losses[s] for s in range(1, 13)], rtol=1e-5)
    rows = read_metrics(str(two / "metrics.jsonl"), raw=True)
    assert len([r for r in rows if "train/loss" in r]) == 12  # written once, by process 0
    evals = [r for r in rows if "eval/loss" in r]
    assert len(evals) == 2 and all(r["forecast/version"] == 1 and r["forecast/lo"] < r["forecast/hi"] for r in evals)
    assert not any("forecast/loss" in r for r in read_metrics(str(one / "metrics.jsonl"), raw=True))
    throughput = [r for r in rows if "throughput/host1/tokens_per_second" in r]
    assert throughput and all(r["throughput/host0/tokens_per_second"] > 0 for r in throughput)
    attempts = [json.loads(line) for line in (two / "gang" / "attempts.jsonl").read_text().splitlines()]
    assert [a["outcome"] for a in attempts] == ["done"] and attempts[0]["hosts"] == 2
    assert not any(_alive(pid) for pid in attempts[0]["pids"])
    status = json.loads((two / "status.json").read_text())
    assert status["state"] == "done" and status.get("lease") is None
    assert json.loads((two / "result.json").read_text())["completed"] is True


@pytest.mark.slow
def test_killing_a_gang_member_restarts_the_gang_from_its_checkpoint_on_two_nodes(two_node_cluster, tmp_path):  # noqa: F811
    """On a real two-node Ray cluster (STRICT_SPREAD: one member per node): rank 1's trainer is SIGKILLed
    mid-run; the whole gang is torn down, restarted from the newest checkpoint and finishes with the losses
    of the one-process run; no worker process and no placement group is left behind."""
    num_steps = 40
    experiment, root = _experiment(tmp_path, num_steps=num_steps), tmp_path / "root"
    submit = [sys.executable, "-m", "ladder.cli", "submit", str(experiment), "--ray-address", two_node_cluster, "--root", str(root)]
    reference = subprocess.run([*submit, "one-process"], capture_output=True, text=True, timeout=600, cwd=REPO, env=_env())
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    process = subprocess.Popen([*submit, "two-process"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=REPO, env=_env(), start_new_session=True)
    killed, output = _signal_rank_and_finish(process, root, rank=1, at_step=22, sig=signal.SIGKILL)
    assert process.returncode == 0, output[-4000:]
    run_dir = _run_dir(root, "two-process")
    attempts = [json.loads(line) for line in (run_dir / "gang" / "attempts.jsonl").read_text().splitlines()]
    assert [a["outcome"] for a in attempts] == ["failed", "done"], attempts
    assert "rank 1 exited with signal SIGKILL" in attempts[0]["detail"]
    assert all(a["strategy"] == "STRICT_SPREAD" for a in attempts)
    assert attempts[0]["pids"][1] == killed
    assert not any(_alive(pid) for a in attempts for pid in a["pids"])  # rank 0 of attempt 0 was torn down too
    resumes = [r for r in read_metrics(str(run_dir / "metrics.jsonl"), raw=True) if r.get("event") == "resume"]
    assert [r["step"] for r in resumes] in ([20], [30])  # the newest checkpoint when rank 1 died (killed at >= 22)
    two_losses, one_losses = _losses(run_dir), _losses(_run_dir(root, "one-process"))
    assert sorted(two_losses) == list(range(1, num_steps + 1))
    np.testing.assert_allclose([two_losses[s] for s in two_losses], [one_losses[s] for s in two_losses], rtol=1e-5)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["completed"] and result["gang_attempts"] == 2 and result["resumed_from_step"] == resumes[0]["step"]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "done" and status.get("lease") is None
    gang_events = [h for h in status["history"] if h["event"].startswith("gang_")]
    assert [(h["event"], h["attempt"]) for h in gang_events] == [("gang_failed", 0), ("gang_done", 1)]

    states = _placement_group_states(two_node_cluster)
    assert len(states) == 3 and set(states) == {"REMOVED"}, states  # the reference run's, and one per gang attempt


@pytest.mark.slow
def test_a_killed_submitter_leaves_no_gang_behind_and_the_next_submit_resumes(two_node_cluster, tmp_path):  # noqa: F811
    """SIGKILL of the submitter's whole process group mid-run: Ray ends its job, so the controller, the
    member actors, their trainer processes (PR_SET_PDEATHSIG) and the placement group all go; the next
    `ladder submit` takes the stale lease over and the gang resumes from its newest checkpoint."""
    experiment, root = _experiment(tmp_path, num_steps=40), tmp_path / "root"
    submit = [sys.executable, "-m", "ladder.cli", "submit", str(experiment), "--ray-address", two_node_cluster,
              "--root", str(root), "two-process"]
    env = {**_env(), "LADDER_LEASE_TTL": "6"}
    process = subprocess.Popen(submit, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
                               start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            runs = list(root.glob("runs/two-process-*"))
            if runs and (runs[0] / "metrics.jsonl").exists() and len(_losses(runs[0])) >= 12:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the gang never reached step 12")
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    run_dir = _run_dir(root, "two-process")
    pids = [int((run_dir / "gang" / f"host{rank}.pid").read_text()) for rank in (0, 1)]
    deadline = time.time() + 60
    while any(_alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.5)
    assert not any(_alive(pid) for pid in pids), "a trainer process outlived its gang"

    again = subprocess.run(submit, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["completed"] and result["resumed_from_step"] in (10, 20)  # the newest checkpoint at the kill (>= 12)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "done"
    assert set(_placement_group_states(two_node_cluster)) == {"REMOVED"}


@pytest.mark.slow
def test_a_frozen_member_trips_the_hang_watchdog_and_the_gang_restarts(tmp_path):
    """SIGSTOP of rank 1 mid-run: nobody exits, rank 0 waits in a collective; with hang_timeout_s=15 the
    controller sees no metrics line for 15 s, tears the gang down (SIGKILL reaches the stopped process)
    and restarts it from the newest checkpoint; the run finishes."""
    experiment, root = _experiment(tmp_path, num_steps=40, hang_timeout=45.0), tmp_path / "root"
    process = subprocess.Popen([sys.executable, "-m", "ladder.cli", "submit", str(experiment), "--root", str(root), "two-process"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True)
    frozen, output = _signal_rank_and_finish(process, root, rank=1, at_step=12, sig=signal.SIGSTOP)
    assert process.returncode == 0, output[-4000:]
    run_dir = _run_dir(root, "two-process")
    attempts = [json.loads(line) for line in (run_dir / "gang" / "attempts.jsonl").read_text().splitlines()]
    assert [a["outcome"] for a in attempts] == ["failed", "done"], attempts
    assert "the gang is hung" in attempts[0]["detail"] and frozen in attempts[0]["pids"]
    assert not any(_alive(pid) for a in attempts for pid in a["pids"])
    result = json.loads((run_dir / "result.json").read_text())
    assert result["completed"] and result["resumed_from_step"] in (10, 20)
