"""Plan and run a DAG of steps on Ray, skipping what is done and never running one step twice at once.

The executor separates *deciding* from *doing*. `plan()` reads status files and classifies every
step (done / running / failed / pending / blocked) without writing anything. `run()` launches the
steps whose inputs are done as Ray tasks with the resources their specs ask for, starts dependants
as soon as their inputs finish, and records every attempt in the step's status.json.

Exactly-once comes from the lease in status.json, taken by the process that does the work (the
Ray worker), not by the submitter: if two submitters race, both may launch a task, but only one
task gets the lease; the other reports who holds it and its submitter waits for the result. If the
holder dies, its heartbeat stops, the lease goes stale after `LADDER_LEASE_TTL` seconds, and a
waiting submitter launches a new attempt that takes it over. A training step's new attempt gets
the same run directory back, so the trainer resumes from its newest checkpoint.

A training step that spans hosts (or asks for its own processes with `cpu_devices_per_host`) runs
through `ladder.gang`: the Ray task that holds its lease becomes the gang's controller and reserves
the hosts as one placement group; lease, heartbeat and status.json work exactly as for one host.

Ctrl-C asks running steps to stop (through status.json, which their heartbeat reads), waits for
them to checkpoint, and marks them interrupted; a second Ctrl-C stops at once. Either way every
status.json ends true.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ladder.dag import DAG, FitStep, FunctionStep, Step, TrainStep
from ladder.gang import run_gang, uses_gang
from ladder.recipe import departures_for
from ladder.spec import SPEC_FORMAT_VERSION, ResourceSpec
from ladder.store import Heartbeat, Store, StoreError, holder_is_gone, lease_ttl_seconds, new_owner_id

PLAN_STATES = ("done", "running", "failed", "pending", "blocked")


class ExecutionError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------- plan


@dataclass
class PlanRow:
    name: str
    kind: str
    state: str
    detail: str
    path: str
    fingerprint: str
    flops: float | None
    waits_for: tuple[str, ...]
    status: dict[str, Any] | None = None


def plan(dag: DAG, store: Store, *, now: float | None = None) -> list[PlanRow]:
    """Classify every step; reads only, never writes."""
    now = time.time() if now is None else now
    ttl = lease_ttl_seconds()
    rows: dict[str, PlanRow] = {}
    for step in dag:
        fp = dag.fingerprints[step.name]
        run_dir = store.run_dir(step.name, fp)
        try:
            status = store.read_status(run_dir)
            state, detail = _classify(status, now, ttl)
        except StoreError as error:
            status, state, detail = None, "failed", str(error)
        rows[step.name] = PlanRow(
            name=step.name,
            kind=step.kind,
            state=state,
            detail=detail,
            path=store.url_of(run_dir),
            fingerprint=fp,
            flops=step.flops,
            waits_for=dag.waits_for(step.name),
            status=status,
        )
    for name in dag.order:
        row = rows[name]
        if row.state in ("done", "running"):
            continue
        bad = [d for d in row.waits_for if rows[d].state in ("failed", "blocked")]
        if bad:
            row.state = "blocked"
            row.detail = f"waits for {', '.join(bad)} ({rows[bad[0]].state})"
    return [rows[n] for n in dag.order]


def _classify(status: dict[str, Any] | None, now: float, ttl: float) -> tuple[str, str]:
    state, detail = _classify_state(status, now, ttl)
    note = _status_note(status or {})
    return state, (f"{note}; {detail}" if detail else note) if note else detail


def _status_note(status: dict[str, Any]) -> str:
    """Says so when status.json was unreadable (Store.read_status rebuilds it; a submit writes the rebuilt one)."""
    unreadable, rebuilt = status.get("unreadable"), status.get("rebuilt")
    if unreadable:
        sources = " / ".join(unreadable.get("rebuilt_from") or []) or "nothing (no result, metrics or checkpoints)"
        return f"status unreadable ({unreadable.get('path')}): rebuilt from {sources}; the next submit moves it aside"
    if rebuilt:
        sources = " / ".join(rebuilt.get("rebuilt_from") or []) or "nothing"
        return f"status was unreadable: moved aside to {rebuilt.get('moved_aside')}, rebuilt from {sources}"
    return ""


def _classify_state(status: dict[str, Any] | None, now: float, ttl: float) -> tuple[str, str]:
    if not status:
        return "pending", ""
    state = status.get("state", "pending")
    attempts = status.get("attempts", 0)
    if state == "done":
        return "done", f"{attempts} attempt(s)"
    if state == "running":
        lease = status.get("lease") or {}
        age = now - lease.get("heartbeat", 0)
        if holder_is_gone(lease):
            return "pending", f"interrupted: holder {lease.get('owner')} (pid {lease.get('pid')} on this host) is gone; resumes"
        if lease and age < ttl:
            return "running", f"held by {lease.get('owner')} (heartbeat {age:.0f}s ago)"
        return "pending", f"interrupted: holder {lease.get('owner', '?')} silent for {age:.0f}s; resumes"
    if state == "interrupted":
        return "pending", "interrupted; resumes from its newest checkpoint"
    if state == "failed":
        error = (status.get("last_error") or "").strip().splitlines()
        return "failed", error[-1][:160] if error else "failed"
    return "pending", ""


# ---------------------------------------------------------------------------------------- one step


@dataclass(frozen=True)
class DependencyInfo:
    name: str
    run_dir: str
    result: dict[str, Any] | None


@dataclass
class StepContext:
    """What a running step sees: where to write, what its inputs produced, when to stop."""

    name: str
    fingerprint: str
    run_dir: str
    store_url: str
    deps: dict[str, DependencyInfo]
    should_stop: Callable[[], bool] = lambda: False
    report_progress: Callable[[dict[str, Any]], None] = lambda progress: None


@dataclass
class StepTask:
    """Everything a worker needs to run one attempt of one step (pickled to the Ray worker)."""

    step: Step
    fingerprint: str
    store_url: str
    owner: str
    deps: dict[str, DependencyInfo]
    dependency_fingerprints: dict[str, str]
    target: Step | None = None
    target_fingerprint: str | None = None
    # FitStep: what the target changes that its rungs all share (ladder.recipe), added to the stored forecast's warnings
    recipe_warning: str | None = None
    lease_ttl: float = field(default_factory=lease_ttl_seconds)
    # live forecast overlay of a TrainStep (ladder.overlay): set by run() when a FitStep targets the step
    forecast_planned: bool = False
    forecast_ladder_run_dirs: tuple[str, ...] = ()
    forecast_refit_every: int | None = None
    # W&B's own environment variables for this attempt (group, job type, tags, folder): see wandb_context()
    wandb_env: dict[str, str] = field(default_factory=dict)


def execute_step(task: StepTask) -> dict[str, Any]:
    """Run one attempt: take the lease, write spec.json, run, record the outcome. Never raises for step errors."""
    store = Store(task.store_url)
    step = task.step
    run_dir = store.run_dir(step.name, task.fingerprint)
    outcome = store.acquire_lease(run_dir, task.owner, ttl=task.lease_ttl)
    if not outcome.acquired:
        if outcome.status.get("state") == "done":
            return {"outcome": "done", "result": store.read_json(f"{run_dir}/result.json")}
        return {"outcome": "held", "holder": outcome.holder, "heartbeat_age": outcome.heartbeat_age}
    _write_spec(store, run_dir, task)
    with Heartbeat(store, run_dir, task.owner, interval=min(5.0, max(0.2, task.lease_ttl / 4))) as heartbeat:
        context = StepContext(
            name=step.name,
            fingerprint=task.fingerprint,
            run_dir=store.url_of(run_dir),
            store_url=store.url,
            deps=task.deps,
            should_stop=heartbeat.lost.is_set,
            report_progress=lambda progress: setattr(heartbeat, "progress", progress),
        )
        try:
            with wandb_environment(task.wandb_env):
                result, completed = _run_step_body(step, context, task, store)
        except (KeyboardInterrupt, SystemExit) as error:
            # Ray tells a worker to exit (SystemExit) when its job ends, e.g. the submitter was killed: the step
            # was interrupted, not broken, and the next submit resumes it from its newest checkpoint.
            message = _record_failure(store, run_dir, error)
            store.finish(run_dir, task.owner, "interrupted", error=f"the worker was told to exit: {message}")
            raise
        except BaseException as error:  # noqa: BLE001 - every failure must reach status.json
            message = _record_failure(store, run_dir, error)
            store.finish(run_dir, task.owner, "failed", error=message)
            return {"outcome": "failed", "error": message}
    if not completed:
        reason = "stop requested" if heartbeat.lost.is_set() else "stopped early"
        store.finish(run_dir, task.owner, "interrupted", error=reason, extra=_final_progress(result))
        return {"outcome": "interrupted", "result": result}
    store.write_json(f"{run_dir}/result.json", result)
    store.finish(run_dir, task.owner, "done", extra=_final_progress(result))
    return {"outcome": "done", "result": result}


ERROR_LOG = "error.log"


def _record_failure(store: Store, run_dir: str, error: BaseException) -> str:
    """Append the traceback to run_dir/error.log; return the one-line reason status.json keeps."""
    reason = " ".join(f"{type(error).__name__}: {error}".split())
    if getattr(error, "ray_terminate_msg", None):  # Ray's SystemExit says why in an attribute ("receives a SIGTERM")
        reason += f" ({error.ray_terminate_msg})"
    if len(reason) > 1000:
        reason = reason[:997] + "..."
    log_path = f"{run_dir}/{ERROR_LOG}"
    try:
        store.append_text(log_path, f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {reason}\n{traceback.format_exc()}\n")
    except Exception:  # noqa: BLE001 - the reason still reaches status.json
        return reason
    return f"{reason} (traceback in {store.url_of(log_path)})"


def _final_progress(result: Any) -> dict[str, Any] | None:
    """status.json's `progress` at the end of a training attempt (the heartbeat may not have written the last step)."""
    if not isinstance(result, dict) or not isinstance(result.get("steps"), int):
        return None
    progress: dict[str, Any] = {"step": result["steps"]}
    if result.get("final_eval_loss") is not None:
        progress["eval/loss"] = result["final_eval_loss"]
    return {"progress": progress}


def wandb_context(dag: DAG, store: Store, name: str, experiment: str | None) -> dict[str, str]:
    """W&B labels of step `name`, as W&B's environment variables: group = the experiment, job type = its role
    (rung: read by a fit; fit; hero: a fit's target; train: any other), tags = the spec's tags ("key:value"),
    and, for a local store, WANDB_DIR = its root, so every offline run lands in {root}/wandb/offline-run-*.
    A variable the user already set wins (tags are merged)."""
    from trainer.metrics import wandb_tags

    step = dag[name]
    fits = [s for s in dag if isinstance(s, FitStep)]
    if isinstance(step, FitStep):
        role = "fit"
    elif any(f.target == name for f in fits):
        role = "hero"
    elif any(name in f.deps for f in fits):
        role = "rung"
    else:
        role = "train" if isinstance(step, TrainStep) else "function"
    env = {"WANDB_JOB_TYPE": role}
    if experiment:
        env["WANDB_RUN_GROUP"] = experiment
    tags = wandb_tags(os.environ.get("WANDB_TAGS"))
    tags += [t for t in wandb_tags(step.spec.tags if isinstance(step, TrainStep) else None) if t not in tags]
    if tags:
        env["WANDB_TAGS"] = ",".join(tags)
    if store.is_local:
        env["WANDB_DIR"] = store.root
    return {k: v for k, v in env.items() if k == "WANDB_TAGS" or not os.environ.get(k)}


@contextlib.contextmanager
def wandb_environment(env: dict[str, str]):
    """`env` in os.environ while a step runs in this worker; afterwards the worker's environment is as it was."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _write_spec(store: Store, run_dir: str, task: StepTask) -> None:
    step = task.step
    spec: dict[str, Any] = {
        "format": SPEC_FORMAT_VERSION,
        "name": step.name,
        "kind": step.kind,
        "fingerprint": task.fingerprint,
        "dependencies": task.dependency_fingerprints,
        "after": list(step.after),
        "content": step.content(),
        "code_version": code_version(),
        "written_at": time.time(),
    }
    if isinstance(step, TrainStep):
        spec["job"] = step.spec.job().model_dump(mode="json")
        spec["resources"] = step.spec.resources.model_dump(mode="json")
        spec["tags"] = step.spec.tags
        spec["derived"] = step.derived.model_dump()
        try:
            from trainer import lr_at_steps
            import numpy as np

            if step.derived.num_steps <= 200_000:
                spec["lr_schedule"] = [float(x) for x in lr_at_steps(step.spec.job(), np.arange(1, step.derived.num_steps + 1))]
        except ImportError:
            pass
    store.write_json(f"{run_dir}/spec.json", spec)


def _run_step_body(step: Step, context: StepContext, task: StepTask, store: Store) -> tuple[dict[str, Any], bool]:
    if isinstance(step, TrainStep) and uses_gang(step.spec.resources):
        gang = run_gang(
            step,
            context.run_dir,
            overlay_args=_overlay_args(step, context, task),
            should_stop=context.should_stop,
            report_progress=context.report_progress,
            on_attempt=lambda record: _record_gang_attempt(store, context, task.owner, record),
        )
        payload = dict(gang.result)
        payload["gang_attempts"] = len(gang.attempts)
        return payload, bool(payload.get("completed", True))
    if isinstance(step, TrainStep):
        from ladder.overlay import REFIT_DRAIN_SECONDS
        from trainer import train

        def progress_hook(step_number: int, metrics: dict[str, Any]) -> None:
            context.report_progress({"step": step_number, **{k: v for k, v in metrics.items() if k.startswith("eval/loss")}})
            return None

        hooks: list[Callable[[int, dict[str, Any]], Any]] = [progress_hook]
        overlay = _forecast_overlay(step, context, task)
        if overlay is not None:
            hooks.append(overlay)
        result = train(step.spec.job(), context.run_dir, hooks=hooks, should_stop=context.should_stop)
        payload = result.model_dump(mode="json") if hasattr(result, "model_dump") else dict(result)
        if overlay is not None:  # an interrupted run waits only briefly for a refit in flight
            overlay.drain(REFIT_DRAIN_SECONDS if payload.get("completed", True) else 5.0)
        return payload, bool(payload.get("completed", True))
    if isinstance(step, FitStep):
        from ladder.fitting import run_fit_step

        return run_fit_step(step, context, task, store), True
    if isinstance(step, FunctionStep):
        value = step.fn(context, **step.config)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            value = {"value": value}
        return value, True
    raise ExecutionError(f"don't know how to run a {type(step).__name__}")


def _forecast_overlay(step: TrainStep, context: StepContext, task: StepTask):
    """The live forecast overlay when this step has a stored or planned forecast; never fails the step."""
    try:
        from ladder.overlay import overlay_for_step

        return overlay_for_step(step, context.store_url, context.run_dir, task.forecast_ladder_run_dirs,
                                task.forecast_refit_every, has_fit_step=task.forecast_planned)
    except Exception:  # noqa: BLE001 - a forecast view must never stop training
        traceback.print_exc()
        return None


def _record_gang_attempt(store: Store, context: StepContext, owner: str, record: dict[str, Any]) -> None:
    """One line per gang attempt in status.json's history (the whole record is in gang/attempts.jsonl)."""
    entry = {"event": f"gang_{record['outcome']}", "at": time.time(), "owner": owner, "attempt": record["attempt"],
             "nodes": record.get("nodes"), "detail": record.get("detail")}
    run_dir = store.run_dir(context.name, context.fingerprint)
    store.update_status(run_dir, lambda status: status.setdefault("history", []).append(entry))


def _overlay_args(step: TrainStep, context: StepContext, task: StepTask) -> dict[str, Any]:
    """What a gang's rank 0 needs to build the same overlay as ``_forecast_overlay`` (see ladder.gang_worker)."""
    return {
        "step": step,
        "store_url": context.store_url,
        "run_dir": context.run_dir,
        "ladder_run_dirs": task.forecast_ladder_run_dirs,
        "refit_every": task.forecast_refit_every,
        "has_fit_step": task.forecast_planned,
    }


def code_version() -> str:
    """The git commit of the code that ran (plus '-dirty'), or the package version outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=5)
        if commit.returncode == 0:
            return commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"ladder-{version('ladder')}"
    except PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------------------- run


MAX_RESUMES_PER_SUBMIT = 3  # a step whose worker keeps being told to exit is not relaunched for ever


@dataclass
class RunReport:
    states: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    launched: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    interrupted: bool = False
    resumes: dict[str, int] = field(default_factory=dict)  # interrupted attempts relaunched by this submit, per step

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(s == "done" for s in self.states.values())


# Ray 2.60's switches that keep an embedded Ray on this machine (README.md, "Network"). They are in the
# environment while ray.init starts Ray's processes, which inherit them (the workers through the raylet).
EMBEDDED_RAY_ENV = {
    # Ray's single-machine mode (its default on macOS and Windows). Without it Ray rewrites the node IP
    # 127.0.0.1 to this machine's external address (services.resolve_ip_for_localhost), and its servers
    # bind and dial that address; with it every node address, and so every Ray server, is on loopback.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage reports to usage-stats.ray.io
    # Ray's dashboard process asks the cloud metadata service (169.254.169.254, metadata.google.internal) which
    # cloud it is on, whatever the settings (usage_lib.get_cloud_from_metadata_requests, plain-http `requests`
    # GETs). A plain-http proxy on a closed loopback port turns those into an immediate refusal on this machine,
    # with no DNS query; loopback is exempt, so Ray's and jax.distributed's gRPC (which read the same variables)
    # stay direct. https (W&B online) is untouched.
    "http_proxy": "http://127.0.0.1:9",
    "no_proxy": "127.0.0.1,localhost,::1",
}


@contextlib.contextmanager
def embedded_ray_environment():
    """EMBEDDED_RAY_ENV while an embedded Ray starts; afterwards the driver's environment is as it was."""
    from ray._private import ray_constants

    saved_env = {key: os.environ.get(key) for key in EMBEDDED_RAY_ENV}
    saved_cluster = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(EMBEDDED_RAY_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False  # read from the environment when this driver imported ray
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_cluster
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def init_ray(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """Connect to `address` (an existing cluster) or start an embedded local Ray."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    kwargs: dict[str, Any] = dict(include_dashboard=False, configure_logging=True, logging_level="WARNING", log_to_driver=True)
    if address:
        kwargs["address"] = address
        host = address.removeprefix("ray://").split(":")[0]
        if host.startswith("127."):
            kwargs["_node_ip_address"] = host  # a cluster on loopback: the driver's node is on loopback too
    else:
        kwargs["address"] = "local"  # a new embedded instance, even if `ray start` left one running here
        kwargs["_node_ip_address"] = "127.0.0.1"
        os.environ.pop("RAY_ADDRESS", None)
        if num_cpus is not None:
            kwargs["num_cpus"] = num_cpus
    try:
        with embedded_ray_environment() if not address else contextlib.nullcontext():
            ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as error:
        where = f"the Ray cluster at {address}" if address else "an embedded local Ray"
        raise ExecutionError(f"could not start or reach {where}: {error}") from error


def run(
    dag: DAG,
    store: Store,
    targets: Iterable[str] | None = None,
    *,
    ray_address: str | None = None,
    retry_failed: bool = False,
    log: Callable[[str], None] = print,
    poll_seconds: float = 0.5,
    wait_for_others: bool = True,
    experiment: str | None = None,
    progress: Any = None,
) -> RunReport:
    """Run `targets` (default: every step) and what they wait for. Returns the final state of each.

    `experiment` names the W&B group of every run (see `wandb_context`); `progress`, a
    `ladder.progress.SubmitProgress`, follows each training step's metrics while it runs."""
    import ray

    wanted = dag.upstream(targets) if targets else list(dag.order)
    rows = {row.name: row for row in plan(dag, store)}
    unreadable = [n for n in wanted if (rows[n].status or {}).get("unreadable")]
    for name in unreadable:  # write the rebuilt status, the corrupt file moved aside (Store.update_status)
        store.update_status(store.run_dir(name, dag.fingerprints[name]), lambda status: None)
        log(f"[repair] {name}: {rows[name].detail.split('; the next submit')[0]}")
    if unreadable:
        rows = {row.name: row for row in plan(dag, store)}
    report = RunReport()
    state: dict[str, str] = {}
    for name in wanted:
        row = rows[name]
        state[name] = row.state
        if (row.state == "failed" and retry_failed) or row.state == "blocked":
            state[name] = "pending"  # re-derived below from this run's view of its inputs
        if row.state == "done":
            report.skipped.append(name)
        if row.state == "failed" and not retry_failed:
            why = " ".join(((row.status or {}).get("last_error") or row.detail or "no error recorded").split())
            log(f"[failed] {name} failed before: {why}. It is not run again unless you pass --retry-failed.")
    _propagate_blocked(dag, wanted, state)

    needs_ray = any(state[n] in ("pending", "running") for n in wanted)
    if needs_ray:
        init_ray(ray_address)
    remote_execute = ray.remote(execute_step) if needs_ray else None

    inflight: dict[Any, tuple[str, str]] = {}  # ObjectRef -> (step, owner)
    waiting: dict[str, float] = {}  # steps held by someone else -> since
    for name in wanted:
        if state[name] == "running":
            waiting[name] = time.time()
            log(f"[wait] {name}: running elsewhere ({rows[name].detail})")

    def launch(name: str) -> None:
        step = dag[name]
        owner = new_owner_id()
        task = StepTask(
            step=step,
            fingerprint=dag.fingerprints[name],
            store_url=store.url,
            owner=owner,
            deps={d: _dependency_info(dag, store, d) for d in step.deps},
            dependency_fingerprints={d: dag.fingerprints[d] for d in step.deps},
            target=dag[step.target] if isinstance(step, FitStep) else None,
            target_fingerprint=dag.fingerprints[step.target] if isinstance(step, FitStep) else None,
            recipe_warning=departures_for(dag, step.target) if isinstance(step, FitStep) else None,
            **(_overlay_fields(dag, store, name) if isinstance(step, TrainStep) else {}),
            wandb_env=wandb_context(dag, store, name, experiment),
        )
        options: dict[str, Any] = {"max_retries": 0, "name": f"ladder:{name}"}
        if isinstance(step, TrainStep) and uses_gang(step.spec.resources):
            options["num_cpus"] = 0  # the gang's controller only; its hosts are reserved as a placement group
        else:
            options.update(step_resources(step).ray_options())
        ref = remote_execute.options(**options).remote(task)
        inflight[ref] = (name, owner)
        state[name] = "running"
        report.launched.append(name)
        log(f"[start] {name} -> {rows[name].path}")
        if progress is not None and isinstance(step, TrainStep):
            progress.start(name, store.run_dir(name, dag.fingerprints[name]), step.derived.num_steps, step.derived.tokens_per_step)

    try:
        while True:
            for name in wanted:
                if state[name] == "pending" and name not in waiting and all(state[d] == "done" for d in dag.waits_for(name)):
                    launch(name)
            if not inflight and not waiting:
                break
            if inflight:
                done_refs, _ = ray.wait(list(inflight), num_returns=1, timeout=poll_seconds)
            else:
                done_refs = []
                time.sleep(poll_seconds)
            for ref in done_refs:
                name, owner = inflight.pop(ref)
                if progress is not None:
                    progress.finish(name)
                _collect(ref, name, owner, dag, store, state, report, waiting, log)
            if progress is not None:
                progress.poll()
            for name in list(waiting):
                _poll_waiting(name, dag, store, state, waiting, log, wait_for_others)
            _propagate_blocked(dag, wanted, state)
    except KeyboardInterrupt:
        report.interrupted = True
        log("[ctrl-c] asking running steps to stop and checkpoint (press Ctrl-C again to stop at once)")
        _stop_inflight(inflight, dag, store, state, log)
    finally:
        if progress is not None:
            progress.close()
    report.states = {n: state[n] for n in wanted}
    return report


def _overlay_fields(dag: DAG, store: Store, name: str) -> dict[str, Any]:
    """StepTask fields for the live overlay of TrainStep `name`: the finished runs its forecast reads, the refit cadence."""
    from ladder.fitting import ladder_runs_for

    fit = next((s for s in dag if isinstance(s, FitStep) and s.target == name), None)
    dirs = []
    for run in ladder_runs_for(dag, name):
        run_dir = store.run_dir(run, dag.fingerprints[run])
        if (store.read_status(run_dir) or {}).get("state") == "done":
            dirs.append(store.url_of(run_dir))
    return {
        "forecast_planned": fit is not None,
        "forecast_ladder_run_dirs": tuple(dirs),
        "forecast_refit_every": fit.config.overlay_refit_every if fit is not None else None,
    }


def _dependency_info(dag: DAG, store: Store, name: str) -> DependencyInfo:
    run_dir = store.run_dir(name, dag.fingerprints[name])
    return DependencyInfo(name=name, run_dir=store.url_of(run_dir), result=store.read_json(f"{run_dir}/result.json"))


def _collect(ref, name, owner, dag, store, state, report, waiting, log) -> None:
    import ray

    run_dir = store.run_dir(name, dag.fingerprints[name])
    try:
        outcome = ray.get(ref)
    except ray.exceptions.RayError as error:
        message = f"worker died: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        status = store.read_status(run_dir) or {}
        last = (status.get("history") or [{}])[-1]
        if status.get("state") == "interrupted" and last.get("owner") == owner:
            # the worker was told to exit (SIGTERM: a preempted node, `ray stop`) and recorded that itself
            outcome = {"outcome": "interrupted", "error": status.get("last_error", message)}
        else:
            store.finish(run_dir, owner, "failed", error=message)
            outcome = {"outcome": "failed", "error": message}
    kind = outcome["outcome"]
    if kind == "done":
        state[name] = "done"
        report.errors.pop(name, None)  # an earlier attempt of this submit was interrupted
        log(f"[done] {name}")
    elif kind == "held":
        state[name] = "running"
        waiting[name] = time.time()
        log(f"[wait] {name}: held by {outcome.get('holder')}; waiting for it to finish or go stale")
    elif kind == "interrupted":
        report.errors[name] = "interrupted"
        report.resumes[name] = report.resumes.get(name, 0) + 1
        if report.resumes[name] <= MAX_RESUMES_PER_SUBMIT:
            state[name] = "pending"  # relaunched by this submit: it resumes from its newest checkpoint
            log(f"[stop] {name}: interrupted ({outcome.get('error') or 'stopped'}); resuming it")
        else:
            state[name] = "interrupted"
            log(f"[stop] {name}: interrupted {report.resumes[name]} times in this submit; not relaunched, "
                "it resumes on the next submit")
    else:
        state[name] = "failed"
        report.errors[name] = outcome.get("error", "failed")
        log(f"[fail] {name}: {report.errors[name]}")


def _poll_waiting(name, dag, store, state, waiting, log, wait_for_others) -> None:
    run_dir = store.run_dir(name, dag.fingerprints[name])
    status = store.read_status(run_dir) or {}
    current, detail = _classify(status, time.time(), lease_ttl_seconds())
    if current == "done":
        state[name] = "done"
        waiting.pop(name)
        log(f"[done] {name} (finished by another submitter)")
    elif current == "failed":
        state[name] = "failed"
        waiting.pop(name)
        log(f"[fail] {name} (failed in another submitter): {detail}")
    elif current == "pending":  # holder went silent: take over
        state[name] = "pending"
        waiting.pop(name)
        log(f"[takeover] {name}: {detail}")
    elif not wait_for_others:
        state[name] = "running"
        waiting.pop(name)


def _propagate_blocked(dag: DAG, wanted: list[str], state: dict[str, str]) -> None:
    for name in wanted:
        if state[name] == "pending" and any(state.get(d) in ("failed", "blocked") for d in dag.waits_for(name)):
            state[name] = "blocked"


def step_resources(step: Step) -> ResourceSpec:
    if isinstance(step, TrainStep):
        return step.spec.resources
    if isinstance(step, FunctionStep):
        return step.resources
    return ResourceSpec(cpus=1)


def _stop_inflight(inflight, dag, store, state, log) -> None:
    import ray

    for ref, (name, owner) in inflight.items():
        run_dir = store.run_dir(name, dag.fingerprints[name])
        store.update_status(run_dir, lambda s, owner=owner: s.update(stop_requested=owner))
    deadline = time.time() + max(10.0, lease_ttl_seconds() / 2)
    pending = list(inflight)
    try:
        while pending and time.time() < deadline:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
    except KeyboardInterrupt:
        log("[ctrl-c] stopping at once")
    for ref in pending:
        ray.cancel(ref, force=True)
    for ref, (name, owner) in inflight.items():
        run_dir = store.run_dir(name, dag.fingerprints[name])
        store.finish(run_dir, owner, "interrupted", error="interrupted by Ctrl-C in the submitter")
        state[name] = "pending"
