"""A real two-node Ray cluster on this machine: a step that asks for `fake_accel` runs on the node that has it.

The head and the worker node are started with `ray start --block` in their own process groups and
torn down by those process ids only, so other Ray instances on the machine are left alone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

RAY = str(Path(sys.executable).with_name("ray"))

EXPERIMENT = '''
from ladder.dag import FunctionStep
from ladder.spec import ResourceSpec

def where_am_i(ctx):
    import ray
    node_id = ray.get_runtime_context().get_node_id()
    [node] = [n for n in ray.nodes() if n["NodeID"] == node_id]
    return {"node_id": node_id, "resources": node["Resources"]}

on_accel = FunctionStep(name="on-accel", fn=where_am_i, resources=ResourceSpec(cpus=1, custom={"fake_accel": 1}))
anywhere = FunctionStep(name="anywhere", fn=where_am_i, resources=ResourceSpec(cpus=1))
'''


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        return sock.getsockname()[1]


CLUSTER_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex * 2}


def _env() -> dict[str, str]:
    env = {**os.environ, **CLUSTER_ENV}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    return env


def _start(args: list[str]) -> subprocess.Popen:
    env = _env()
    return subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _stop(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 8), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_for_nodes(address: str, count: int, timeout: float = 90) -> None:
    probe = (
        "import ray, sys, time\n"
        f"ray.init(address={address!r}, logging_level='ERROR', _node_ip_address='127.0.0.2')\n"
        f"deadline = time.time() + {timeout}\n"
        f"while len([n for n in ray.nodes() if n['Alive']]) < {count} and time.time() < deadline:\n    time.sleep(0.5)\n"
        f"sys.exit(0 if len([n for n in ray.nodes() if n['Alive']]) >= {count} else 1)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=timeout + 60, env=_env())
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def two_node_cluster():
    port = _free_port()
    address = f"127.0.0.2:{port}"  # loopback, but not a name Ray rewrites to the external IP
    head = _start(["--head", f"--port={port}", "--node-ip-address=127.0.0.2", "--num-cpus=1", "--include-dashboard=false"])
    worker = None
    try:
        time.sleep(3)
        worker = _start([f"--address={address}", "--node-ip-address=127.0.0.2", "--num-cpus=1", '--resources={"fake_accel": 1}'])
        _wait_for_nodes(address, 2)
        yield address
    finally:
        for process in (worker, head):
            if process is not None:
                _stop(process)


@pytest.mark.slow
def test_step_asking_fake_accel_runs_on_the_node_that_has_it(two_node_cluster, tmp_path):
    exp = tmp_path / "exp.py"
    exp.write_text(EXPERIMENT)
    root = tmp_path / "root"
    result = subprocess.run(
        [sys.executable, "-m", "ladder.cli", "submit", str(exp), "--ray-address", two_node_cluster, "--root", str(root)],
        capture_output=True, text=True, timeout=300, env=_env(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    on_accel = json.loads(next(root.glob("runs/on-accel-*/result.json")).read_text())
    assert on_accel["resources"].get("fake_accel") == 1.0
    status = json.loads(next(root.glob("runs/on-accel-*/status.json")).read_text())
    assert status["state"] == "done"
