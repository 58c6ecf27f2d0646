"""Multi-host training steps: a gang of one training process per host, reserved and torn down as one.

Why a gang: a JAX program over several hosts is one SPMD program; if one process is missing, the others
block in their first collective. So the hosts are reserved together (a Ray placement group, one bundle
per host, STRICT_SPREAD when the cluster has enough nodes), started together, and when any member dies
the whole gang is torn down and started again from the newest checkpoint, like a single-host step that
is retried: the run directory, the lease and status.json are the same ones.

Shape of one attempt (run by the step's controller, the Ray task that holds the lease):

1. placement group of ``hosts`` bundles, each the step's per-host resources; wait until it is placed;
2. one ``GangMember`` actor per bundle; rank 0's node and a free port there are the coordinator address;
3. each member starts ``python -m ladder.gang_worker`` (a fresh interpreter, so JAX is configured before
   it starts) in its own session, with ``PR_SET_PDEATHSIG`` so it cannot outlive its actor; every worker
   calls ``jax.distributed.initialize`` and the same ``trainer.train``;
4. the controller polls the members: all exited 0 -> done; any non-zero exit or lost actor -> tear down
   (kill every worker's process group, kill the actors, remove the placement group) and restart, at most
   ``resources.max_restarts`` times (an exception a restart would raise again, e.g. a ValueError about
   the job or TrainingDiverged, fails the step at once; with ``resources.hang_timeout_s``, a gang whose
   rank 0 writes no metrics line for that long counts as failed too); a stop request (Ctrl-C in the submitter, a
   lost lease) becomes the file ``gang/stop``, which the trainer turns into a collective
   checkpoint-and-return.

The run directory must be one shared filesystem path on every host (checkpoints are written
collectively by orbax into it). Logs of each rank are ``gang/host<rank>.log``; ``gang/attempts.jsonl``
records every attempt (coordinator, nodes, pids, outcome).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ladder.spec import ResourceSpec

POLL_SECONDS = 0.5
# Exceptions of a rank's training that a restart from the checkpoint would raise again (the job, the
# data or the divergence is the problem, not a host): the step fails at once instead of retrying.
NOT_RETRIED = frozenset({"ValueError", "TypeError", "KeyError", "ValidationError", "TrainingDiverged", "FileNotFoundError"})


class GangError(RuntimeError):
    """The gang could not be placed, or failed more often than ``resources.max_restarts`` allows."""


def uses_gang(resources: ResourceSpec) -> bool:
    """Whether a training step with these resources runs as separate process(es) under ``run_gang``."""
    return resources.hosts > 1 or resources.cpu_devices_per_host is not None


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP address) is this machine's loopback, where a gang's servers must stay."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bundle_of(resources: ResourceSpec) -> dict[str, float]:
    """One host's share of the placement group (Ray resource names)."""
    bundle: dict[str, float] = {"CPU": float(resources.cpus)}
    if resources.gpus:
        bundle["GPU"] = float(resources.gpus)
    if resources.tpus:
        bundle["TPU"] = float(resources.tpus)
    if resources.memory_gb:
        bundle["memory"] = float(int(resources.memory_gb * 1024**3))
    if resources.accelerator_type:
        bundle[f"accelerator_type:{resources.accelerator_type}"] = 0.001
    bundle.update({k: float(v) for k, v in resources.custom.items()})
    return {k: v for k, v in bundle.items() if v > 0}


def placement_strategy(hosts: int, alive_nodes: int) -> str:
    """STRICT_SPREAD (one member per node) when the cluster has a node per host, else SPREAD."""
    return "STRICT_SPREAD" if alive_nodes >= hosts else "SPREAD"


def hosts_that_fit(bundle: dict[str, float], node_resources: list[dict[str, float]]) -> int:
    """How many bundles the nodes could hold when idle (several per node when it has room for them)."""
    total = 0
    for resources in node_resources:
        fits = [resources.get(key, 0.0) / amount for key, amount in bundle.items() if amount > 0]
        total += int(min(fits) + 1e-9) if fits else 0
    return total


class GangMember:
    """A Ray actor on one host of the gang: finds the coordinator address and owns one worker process."""

    def __init__(self, rank: int):
        self.rank = rank
        self.process: subprocess.Popen | None = None

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        host = self.node_address()
        with socket.socket() as sock:
            sock.bind((host if is_loopback(host) else "", 0))
            return sock.getsockname()[1]

    def start(self, argv: list[str], env: dict[str, str], log_path: str) -> int:
        merged = {**os.environ, **env}
        with open(log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                argv, env=merged, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        return self.process.pid

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self, grace_seconds: float = 5.0) -> int | None:
        """Kill the worker's whole process group (SIGTERM, then SIGKILL after the grace period)."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        for sig, wait in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                return self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        return self.process.poll()


def _die_with_parent() -> None:
    """In the forked worker: its own session (one kill takes its children too); SIGKILL when the actor dies."""
    os.setsid()
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class GangOutcome:
    result: dict[str, Any] | None
    attempts: list[dict[str, Any]] = field(default_factory=list)


def run_gang(
    step: Any,
    run_dir: str,
    *,
    overlay_args: dict[str, Any] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    report_progress: Callable[[dict[str, Any]], None] = lambda progress: None,
    log: Callable[[str], None] = lambda message: print(message, file=sys.stderr, flush=True),
    on_attempt: Callable[[dict[str, Any]], None] = lambda record: None,
) -> GangOutcome:
    """Train ``step`` (a TrainStep) across ``step.spec.resources.hosts`` hosts; retries included.

    ``on_attempt(record)`` is called after every attempt that got its hosts (the executor records
    them in status.json's history).

    Returns the trainer's result (``completed`` False after a stop). Raises GangError when the gang
    cannot be placed within ``resources.placement_timeout_s`` or fails ``max_restarts + 1`` times.
    """
    import ray

    resources: ResourceSpec = step.spec.resources
    if "://" in run_dir and not run_dir.startswith("file://"):
        raise GangError(f"multi-host steps need a shared filesystem path for the run directory, not {run_dir}.")
    run_dir = run_dir.removeprefix("file://")
    gang_dir = os.path.join(run_dir, "gang")
    os.makedirs(gang_dir, exist_ok=True)
    for stale in ("stop", "result.json", *(f"error{rank}.json" for rank in range(resources.hosts))):
        _remove(os.path.join(gang_dir, stale))
    outcome = GangOutcome(result=None)
    failures: list[str] = []
    for attempt in range(resources.max_restarts + 1):
        record: dict[str, Any] = {"attempt": attempt, "started_at": time.time(), "hosts": resources.hosts}
        task_file = os.path.join(gang_dir, f"task-{attempt}.pkl")
        with open(task_file, "wb") as f:
            f.write(_pickled_task(step, run_dir, attempt, overlay_args))
        pg, members = None, []
        try:
            pg, strategy = _place(ray, resources, step.name, attempt, should_stop)
            record.update(strategy=strategy, placed_s=time.time() - record["started_at"])
            member_cls = ray.remote(GangMember)
            options = {**resources.ray_options(), "max_restarts": 0}
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            members = [
                member_cls.options(
                    **options,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                ).remote(rank)
                for rank in range(resources.hosts)
            ]
            nodes = ray.get([m.node_address.remote() for m in members], timeout=120)
            coordinator = f"{nodes[0]}:{ray.get(members[0].free_port.remote(), timeout=60)}"
            record.update(coordinator=coordinator, nodes=nodes)
            env = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")} if os.environ.get("JAX_PLATFORMS") else {}
            if is_loopback(nodes[0]):  # jax.distributed's coordinator would listen on [::] (all addresses)
                env["JAX_COORDINATOR_BIND_ADDRESS"] = coordinator
            # the step's W&B settings (group, job type, tags, offline folder), which the executor set for this task
            env.update({k: v for k, v in os.environ.items() if k.startswith("WANDB_")})
            pids = ray.get(
                [
                    m.start.remote(
                        [sys.executable, "-m", "ladder.gang_worker", task_file, str(rank), str(resources.hosts), coordinator],
                        env,
                        os.path.join(gang_dir, f"host{rank}.log"),
                    )
                    for rank, m in enumerate(members)
                ],
                timeout=120,
            )
            record.update(pids=pids, spawned_s=time.time() - record["started_at"])
            log(f"[gang] {step.name}: attempt {attempt} on {len(set(nodes))} node(s) {nodes}, coordinator {coordinator}")
            record["outcome"], detail = _supervise(
                ray, members, gang_dir, attempt, should_stop, report_progress, run_dir, resources.hang_timeout_s
            )
            record["detail"] = detail
        except GangError as error:
            record.update(outcome="unplaced", detail=str(error))
            _append_attempt(gang_dir, record, outcome)
            raise
        except Exception as error:  # noqa: BLE001 - a lost actor or a Ray error fails this attempt, not the step
            record.update(outcome="failed", detail=f"{type(error).__name__}: {error}")
        finally:
            _teardown(ray, members, pg)
        record["ended_at"] = time.time()
        _append_attempt(gang_dir, record, outcome)
        on_attempt(record)
        if record["outcome"] in ("done", "stopped"):
            outcome.result = _read_json(os.path.join(gang_dir, "result.json"))
            if outcome.result is None:
                raise GangError(f"the gang of {step.name} exited cleanly but rank 0 wrote no gang/result.json")
            return outcome
        failures.append(f"attempt {attempt}: {record['detail']}")
        if record["outcome"] == "error":
            raise GangError(f"the gang of {step.name} failed and a restart would fail the same way: {record['detail']}. "
                            f"Tracebacks: {gang_dir}/error<rank>.json; logs: {gang_dir}/host<rank>.log")
        if should_stop():
            break
        if attempt < resources.max_restarts:
            log(f"[gang] {step.name}: attempt {attempt} failed ({record['detail']}); restarting the whole gang "
                "from the newest checkpoint")
    raise GangError(
        f"the gang of {step.name} failed {len(failures)} time(s) (resources.max_restarts={resources.max_restarts}): "
        + "; ".join(failures) + f". Logs: {gang_dir}/host<rank>.log"
    )


def _pickled_task(step: Any, run_dir: str, attempt: int, overlay_args: dict[str, Any] | None) -> bytes:
    from ray import cloudpickle

    return cloudpickle.dumps({
        "job": step.spec.job(),
        "run_dir": run_dir,
        "cpu_devices": step.spec.resources.cpu_devices_per_host,
        "attempt": attempt,
        "overlay_args": overlay_args,
    })


def _place(ray: Any, resources: ResourceSpec, name: str, attempt: int, should_stop: Callable[[], bool]):
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    alive = len(nodes)
    strategy = placement_strategy(resources.hosts, alive)
    bundle = bundle_of(resources)
    room = hosts_that_fit(bundle, [n.get("Resources", {}) for n in nodes])
    if room < resources.hosts and not os.environ.get("LADDER_GANG_AUTOSCALE"):
        raise GangError(
            f"{name} needs {resources.hosts} host(s) of {bundle}, but the cluster's {alive} node(s) can hold only "
            f"{room} such host(s) even when idle. Run it on a cluster that has them (--ray-address), lower "
            "resources.hosts or the per-host resources, or set LADDER_GANG_AUTOSCALE=1 to wait up to "
            "resources.placement_timeout_s for an autoscaler to add nodes."
        )
    pg = placement_group([bundle_of(resources)] * resources.hosts, strategy=strategy, name=f"ladder:{name}:{attempt}")
    deadline = time.time() + resources.placement_timeout_s
    ready = pg.ready()
    while True:
        done, _ = ray.wait([ready], timeout=1.0)
        if done:
            return pg, strategy
        if should_stop() or time.time() > deadline:
            remove_placement_group(pg)
            why = "a stop was requested" if should_stop() else f"not placed within {resources.placement_timeout_s:g} s"
            raise GangError(
                f"could not reserve {resources.hosts} host(s) x {bundle_of(resources)} ({strategy}) for {name}: {why}; "
                f"the cluster has {alive} alive node(s) with {ray.available_resources()} available."
            )


def _supervise(
    ray, members, gang_dir, attempt, should_stop, report_progress, run_dir, hang_timeout_s
) -> tuple[str, str]:
    """Wait for the members' workers; returns (outcome, detail), outcome one of done / stopped / failed
    (worth a restart) / error (an exception a restart would raise again)."""
    stop_file = os.path.join(gang_dir, "stop")
    stop_sent = False
    first_exit: float | None = None
    progress = _ProgressReader(os.path.join(run_dir, "metrics.jsonl"))
    while True:
        if hang_timeout_s is not None and time.time() - progress.grew_at > hang_timeout_s:
            return "failed", (f"no metrics line for {time.time() - progress.grew_at:.0f} s "
                              f"(resources.hang_timeout_s={hang_timeout_s:g}): the gang is hung")
        if not stop_sent and should_stop():
            open(stop_file, "w").close()
            stop_sent = True
        codes = ray.get([m.poll.remote() for m in members], timeout=60)
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            errors = {rank: _read_json(os.path.join(gang_dir, f"error{rank}.json")) for rank, _ in failed}
            errors = {rank: e for rank, e in errors.items() if e is not None and e.get("attempt") == attempt}
            detail = ", ".join(
                f"rank {rank} exited with {_describe_exit(code)}"
                + (f" ({errors[rank]['type']}: {errors[rank]['message']})" if rank in errors else "")
                for rank, code in failed
            )
            deterministic = any(e["type"] in NOT_RETRIED for e in errors.values())
            return ("error" if deterministic else "failed"), detail
        if all(code == 0 for code in codes):
            return ("stopped" if stop_sent else "done"), "all ranks exited 0"
        if any(code == 0 for code in codes):
            first_exit = first_exit or time.time()
            if time.time() - first_exit > 120:
                waiting = [rank for rank, code in enumerate(codes) if code is None]
                return "failed", f"ranks {waiting} still running 120 s after another rank finished"
        latest = progress.read()
        if latest:
            report_progress(latest)
        time.sleep(POLL_SECONDS)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


class _ProgressReader:
    """The last eval line of a growing metrics.jsonl, read incrementally (for the lease's progress), and
    when the file last grew (for the hang watchdog)."""

    def __init__(self, path: str):
        self.path, self.latest = path, None
        try:
            self.offset = os.path.getsize(path)  # an earlier attempt's lines are not this attempt's progress
        except OSError:
            self.offset = 0
        self.grew_at = time.time()  # when the last complete line arrived (or the attempt started)

    def read(self) -> dict[str, Any] | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.latest
        end = chunk.rfind(b"\n")
        if end < 0:
            return self.latest
        self.offset += end + 1
        self.grew_at = time.time()
        for line in chunk[: end + 1].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "eval/loss" in row:
                self.latest = {"step": row["step"], "eval/loss": row["eval/loss"]}
        return self.latest


def _teardown(ray: Any, members: list, pg: Any) -> None:
    """Kill every worker process group, then the actors, then free the placement group. Never raises."""
    if members:
        try:
            ray.get([m.stop.remote() for m in members], timeout=30)
        except Exception:  # noqa: BLE001 - a dead actor's worker already died with it (PDEATHSIG)
            pass
        for member in members:
            try:
                ray.kill(member, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
    if pg is not None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass


def _append_attempt(gang_dir: str, record: dict[str, Any], outcome: GangOutcome) -> None:
    outcome.attempts.append(record)
    with open(os.path.join(gang_dir, "attempts.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)

