"""`ladder attach EXP STEP SOURCE`: follow a run that trains elsewhere as if it were one of ours.

Why: a hero trained with Levanter, MaxText or torchtitan is watched the same way as ours, without touching its
trainer. Attach holds the step's lease (status.json says running, heartbeat and all, so `ladder status` and
`ladder watch` show it live and nobody else runs the step), re-reads SOURCE as it grows (a metrics file on
shared storage, a W&B offline run directory being written; ladder.importer.SourceReader reads only what was
added), maps its columns to ours (forecasting.external), and appends the new points to the step's
metrics.jsonl. Each eval goes through the same `ForecastOverlay` hook our trainer calls, in the same order
(hook first, then the line is written with what it returned), so forecast/* beside each eval, the refits
with the live prefix and the alerts are exactly those of our own runs.

Rows are aligned by step: the newest step seen is held back until a later step (or the end) shows that
nothing more will be logged at it. Attach stops when the source says the run finished (W&B's exit record),
when the step's planned steps are reached (done), after `--idle-timeout` seconds without new data, or on
Ctrl-C (interrupted: `ladder attach` again resumes after the last step it wrote). status.json is left true
in every case.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import typer

from ladder.dag import DAG, TrainStep
from ladder.importer import (
    IMPORT_FILE,
    ImportConflict,
    SourceReader,
    _uses_lm_head,
    absolute_source,
    finished_state,
    run_rows,
    training_step,
)
from ladder.store import Heartbeat, Store, lease_ttl_seconds, new_owner_id, resolve_root

ATTACHED = "attached"


@dataclass
class AttachOutcome:
    state: str  # done | failed | interrupted
    why: str
    run_dir: str
    rows: int = 0  # metric lines written by this attach
    evals: int = 0
    last_step: int | None = None
    mapping: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    refits: int = 0
    alerts: int = 0


def _last_step(store: Store, run_dir: str) -> int | None:
    from ladder.runs import read_metrics
    from trainer.metrics import apply_resume_markers

    rows, _ = read_metrics(store, run_dir)
    steps = [int(r["step"]) for r in apply_resume_markers(rows) if "step" in r and "event" not in r]
    return max(steps) if steps else None


def _check_resumable(store: Store, run_dir: str, where: str) -> None:
    """Only an earlier attach of the same source may be continued; anything else in the directory stays as it is."""
    status = store.read_status(run_dir)
    if status is None and not store.exists(f"{run_dir}/metrics.jsonl"):
        return
    status = status or {}
    events = [e for e in status.get("history", []) if e.get("event") == ATTACHED]
    if status.get("state") == "done":
        raise ImportConflict(f"{store.url_of(run_dir)} already holds a finished run of this step; there is nothing to follow.")
    if not events or events[-1].get("source") != where:
        kinds = [e.get("event") for e in status.get("history", [])]
        raise ImportConflict(
            f"{store.url_of(run_dir)} already holds a run of this step (state {status.get('state', 'unknown')}, history "
            f"{kinds or 'none'}) that is not an attach of {where}; it is never overwritten. Delete that directory to "
            "replace it, or attach into another --root."
        )


def _overlay(step: TrainStep, dag: DAG, store: Store, run_dir_url: str, refit_every: int | None, n_bootstrap: int,
             console_alerts: bool, refit_in: str):
    """The overlay our trainer would get for this step (ladder.executor's rule): None without a forecast or a fit step."""
    from ladder.executor import _overlay_fields
    from ladder.fitting import target_spec
    from ladder.overlay import DEFAULT_REFIT_EVERY, ForecastOverlay

    fields = _overlay_fields(dag, store, step.name)
    if not fields["forecast_planned"] and not store.list_forecasts(step.name):
        return None
    every = refit_every if refit_every is not None else fields["forecast_refit_every"]
    return ForecastOverlay(
        store.url, step.name, target_spec(step), fields["forecast_ladder_run_dirs"], run_dir=run_dir_url,
        refit_every=DEFAULT_REFIT_EVERY if every is None else every, n_bootstrap=n_bootstrap,
        console_alerts=console_alerts, refit_in=refit_in,
    )


def attach_run(
    store: Store,
    dag: DAG,
    step_name: str,
    source: str,
    *,
    poll_seconds: float = 5.0,
    idle_timeout: float = 3600.0,
    loss_column: str | None = None,
    step_column: str | None = None,
    tokens_column: str | None = None,
    run: str | None = None,
    refit_every: int | None = None,
    n_bootstrap: int = 50,
    refit_in: str = "process",
    console_alerts: bool = True,
    log: Callable[[str], None] = lambda line: None,
    should_stop: Callable[[], bool] = lambda: False,
) -> AttachOutcome:
    """Follow SOURCE as the run of `step_name` until it finishes, reaches its planned steps, goes idle or is stopped."""
    import pandas as pd

    from forecasting import external
    from ladder.executor import StepTask, _write_spec
    from trainer.metrics import JsonlSink

    step = training_step(dag, step_name, "attach")
    if poll_seconds <= 0 or idle_timeout <= 0:
        raise ValueError("--poll and --idle-timeout must be positive numbers of seconds.")
    reader = SourceReader(source)
    where = absolute_source(source)
    fp = dag.fingerprints[step_name]
    run_dir = store.run_dir(step_name, fp)
    run_dir_url = store.url_of(run_dir)
    _check_resumable(store, run_dir, where)
    last_step = _last_step(store, run_dir)

    owner = f"attach:{new_owner_id()}"
    lease = store.acquire_lease(run_dir, owner)
    if not lease.acquired:
        raise ImportConflict(f"{run_dir_url} is held by {lease.holder} (heartbeat {lease.heartbeat_age or 0:.0f}s ago); "
                             "wait for it, or stop it first.")
    started = time.time()
    store.update_status(run_dir, lambda s: s.setdefault("history", []).append(
        {"event": ATTACHED, "at": started, "owner": owner, "source": where, "from_step": last_step}))
    task = StepTask(step=step, fingerprint=fp, store_url=store.url, owner=owner, deps={},
                    dependency_fingerprints={d: dag.fingerprints[d] for d in step.deps})
    _write_spec(store, run_dir, task)

    outcome = AttachOutcome(state="interrupted", why="", run_dir=run_dir_url, last_step=last_step)
    num_steps = step.derived.num_steps
    pins: dict[str, str | None] = {"loss": loss_column, "step": step_column, "tokens": tokens_column}
    pending: list[pd.DataFrame] = []
    mapping: external.ColumnMapping | None = None
    record = {**reader.describe(), "source": where, "mode": "attach", "owner": owner, "started_at": started}

    def write_record(extra: dict[str, Any]) -> None:
        payload = {**record, **extra, "mapping": mapping.to_json() if mapping else None, "rows_written": outcome.rows,
                   "evals_written": outcome.evals, "last_step": outcome.last_step, "num_steps": num_steps,
                   "notes": outcome.notes, **reader.describe(), "source": where}
        store.write_json(f"{run_dir}/{IMPORT_FILE}", payload)

    write_record({})
    overlay = _overlay(step, dag, store, run_dir_url, refit_every, n_bootstrap, console_alerts, refit_in)
    sink = JsonlSink(f"{run_dir_url}/metrics.jsonl")

    def emit(final: bool) -> None:
        nonlocal pending, mapping
        if not pending:
            return
        raw = pd.concat(pending, ignore_index=True) if len(pending) > 1 else pending[0]
        try:
            frame, found = external.external_rows(raw, source=source, loss=pins["loss"], step=pins["step"],
                                                  tokens=pins["tokens"], run=run)
        except external.MissingLossError:
            if final:
                raise
            return  # the first eval has not been logged yet: keep the rows until it is
        if mapping is None:
            pins.update(loss=found.columns["eval/loss"], step=found.columns["step"], tokens=found.columns.get("tokens"))
            log("columns: " + ", ".join(f"{k} <- {v!r}" for k, v in found.columns.items()))
        mapping = found
        if outcome.last_step is not None:
            frame = frame[frame["step"] > outcome.last_step]
        frame = frame[frame["step"] <= num_steps]
        if not final and len(frame):
            frame = frame[frame["step"] < frame["step"].max()]  # more may still be logged at the newest step
        if len(frame):
            for row in run_rows(step, frame, include_lm_head=_uses_lm_head(step), notes=outcome.notes):
                row.setdefault("time", time.time())
                if _finite(row.get("eval/loss")) and overlay is not None:
                    extra = overlay(row["step"], dict(row))  # the trainer's order: the hook, then the line
                    if extra:
                        row.update(extra)
                sink.write(row)
                outcome.rows += 1
                outcome.evals += int(_finite(row.get("eval/loss")))
                outcome.last_step = row["step"]
                heartbeat.progress = {"step": row["step"], **({"eval/loss": row["eval/loss"]} if "eval/loss" in row else {})}
            if len(outcome.notes) > 1:
                outcome.notes = list(dict.fromkeys(outcome.notes))
        step_col = mapping.columns["step"]
        keep = pd.to_numeric(raw[step_col], errors="coerce") > (outcome.last_step if outcome.last_step is not None else -1)
        pending = [raw[keep]] if keep.any() else []

    interrupted_by_user = False
    last_data = time.time()
    with Heartbeat(store, run_dir, owner, interval=min(5.0, max(0.2, lease_ttl_seconds() / 4))) as heartbeat:
        try:
            while True:
                new = reader.poll()
                if len(new):
                    pending.append(new)
                    last_data = time.time()
                finished = reader.finished
                # the planned last step, seen and quiet for a poll: nothing more will be logged at it
                last_planned = not len(new) and any(_reaches(p, mapping, num_steps) for p in pending)
                emit(final=finished or last_planned)
                reached = outcome.last_step is not None and outcome.last_step >= num_steps
                if finished or reached:
                    if reached:
                        emit(final=True)
                    outcome.why = "the source says the run finished" if finished else f"reached the planned {num_steps:,} steps"
                    break
                if time.time() - last_data > idle_timeout:
                    tail = reader.poll(final=True)
                    if len(tail):
                        pending.append(tail)
                    emit(final=True)
                    outcome.why = f"no new data for {idle_timeout:g}s"
                    break
                if heartbeat.lost.is_set():
                    outcome.why = "lost the lease (another process took the step, or a stop was requested)"
                    break
                if should_stop():
                    outcome.why = "stopped"
                    break
                time.sleep(poll_seconds)
        except KeyboardInterrupt:
            interrupted_by_user = True
            outcome.why = "interrupted with Ctrl-C"
        except BaseException as error:
            sink.close()
            message = f"{type(error).__name__}: {error}"
            write_record({"error": message})
            store.finish(run_dir, owner, "failed", error=f"attach failed: {message}")
            raise
        finally:
            if overlay is not None:
                overlay.drain(None if not interrupted_by_user else 5.0)  # a refit in flight stores its version
                outcome.refits = overlay.refits_started
                outcome.alerts = len(overlay.alerts)
    sink.close()
    if outcome.last_step is None:
        state, why = "interrupted", outcome.why + "; no point written yet"
    elif outcome.why == "stopped" or interrupted_by_user or outcome.why.startswith("lost"):
        state, why = "interrupted", outcome.why
    else:
        state, why = finished_state(step, outcome.last_step, reader)
        why = f"{outcome.why}; {why}"
    outcome.state, outcome.why = state, why
    outcome.mapping = mapping.to_json() if mapping else {}
    write_record({"state": state, "why": why, "ended_at": time.time()})
    if state == "done":
        store.write_json(f"{run_dir}/result.json", _result(store, run_dir, step, where))
    store.finish(run_dir, owner, state, error=None if state == "done" else f"attach ended: {why}")
    return outcome


def _result(store: Store, run_dir: str, step: TrainStep, where: str) -> dict[str, Any]:
    """result.json of a finished external run, as the importer writes it."""
    from ladder.runs import read_metrics
    from trainer.metrics import apply_resume_markers

    rows = [r for r in apply_resume_markers(read_metrics(store, run_dir)[0]) if "step" in r and "event" not in r]
    last = max(rows, key=lambda r: r["step"])
    evals = [r for r in rows if _finite(r.get("eval/loss"))]
    trains = [r for r in rows if _finite(r.get("train/loss"))]
    derived = step.derived
    return {
        "completed": True, "steps": last["step"], "num_steps": derived.num_steps, "tokens": last.get("tokens"),
        "flops": last.get("flops"),
        "flops_convention": f"{derived.accounting}, lm_head {'included' if _uses_lm_head(step) else 'excluded'}",
        "final_train_loss": trains[-1]["train/loss"] if trains else None,
        "final_eval_loss": evals[-1]["eval/loss"] if evals else None, "imported_from": where, "attached": True,
    }


def _reaches(raw, mapping, num_steps: int) -> bool:
    import pandas as pd

    if mapping is None or mapping.columns["step"] not in raw.columns:
        return False
    return bool((pd.to_numeric(raw[mapping.columns["step"]], errors="coerce") >= num_steps).any())


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def attach_command(
    experiment: str = typer.Argument(..., help="Experiment file or module."),
    step: str = typer.Argument(..., help="The training step the external run trains (e.g. hero)."),
    source: str = typer.Argument(..., help="A growing JSON-lines or CSV metrics file, or a W&B offline run directory "
                                 "being written (any fsspec URL)."),
    root: Optional[str] = typer.Option(None, "--root", help="Artifact root (default $LADDER_ROOT or ./ladder-runs)."),
    poll: float = typer.Option(5.0, "--poll", help="Seconds between reads of SOURCE."),
    idle_timeout: float = typer.Option(3600.0, "--idle-timeout", help="Stop (interrupted) after this many seconds without new data."),
    refit_every: Optional[int] = typer.Option(None, "--refit-every", help="Refit the forecast every this many evals "
                                              "(default: the fit step's overlay_refit_every; 0: never)."),
    loss_column: Optional[str] = typer.Option(None, "--loss-column", help="Column of the loss to forecast (default: eval/loss, ...)."),
    step_column: Optional[str] = typer.Option(None, "--step-column", help="Column of the optimizer step (default: step, _step, ...)."),
    tokens_column: Optional[str] = typer.Option(None, "--tokens-column", help="Column of cumulative tokens (default: step x tokens per step)."),
    run: Optional[str] = typer.Option(None, "--run", help="The run to follow in a file that holds several."),
) -> None:
    """Follow a run trained elsewhere: append its new points to STEP's run, with the live forecast overlay, refits and
    alerts of our own runs. Stops when it finishes, reaches its planned steps, or goes idle; Ctrl-C leaves status true."""
    from ladder.loader import ExperimentError, load_experiment

    def fail(message: str, code: int = 2) -> None:
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(code)

    try:
        exp = load_experiment(experiment)
    except ExperimentError as error:
        fail(str(error))
    store = Store(resolve_root(root))
    try:
        outcome = attach_run(store, exp.dag, step, source, poll_seconds=poll, idle_timeout=idle_timeout,
                             loss_column=loss_column, step_column=step_column, tokens_column=tokens_column, run=run,
                             refit_every=refit_every, log=lambda line: typer.echo(line, err=True))
    except ImportConflict as error:
        fail(str(error), 1)
    except ValueError as error:
        fail(str(error))
    for note in outcome.notes:
        typer.echo(f"warning: {note}", err=True)
    typer.echo(f"{step}: {outcome.state}: {outcome.why} <- {outcome.run_dir}")
    typer.echo(f"  {outcome.rows} rows ({outcome.evals} evals) appended, last step {outcome.last_step}; "
               f"{outcome.refits} refit(s), {outcome.alerts} alert(s)")
    if outcome.why.startswith("interrupted with Ctrl-C"):
        raise typer.Exit(130)
