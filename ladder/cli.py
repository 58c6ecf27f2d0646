"""The `ladder` command line: plan, submit and inspect experiments; fit, forecast and backtest.

Exit codes scripts can trust:
  0  everything asked for is done (or, for `plan`/`status`, the command worked)
  1  a step failed, is blocked by a failure, or a forecast could not be made
  2  bad input: the experiment, a spec, a table or an option is wrong (the message says which)
  3  a step is still running in another submitter and --no-wait was given
  130 interrupted with Ctrl-C (every status.json is left true)
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from ladder.loader import Experiment, ExperimentError, load_experiment
from ladder.store import Store, resolve_root

app = typer.Typer(
    name="ladder",
    help="Plan, run and forecast scaling ladders: rungs -> scaling-law fit -> hero run.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_HELD, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

RootOption = typer.Option(None, "--root", help="Artifact root: a folder or fsspec URL (default $LADDER_ROOT or ./ladder-runs).")


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    from rich.markup import escape

    err_console.print(f"[red]error:[/red] {escape(message)}")  # a message's [brackets] are text, not markup
    raise typer.Exit(code)


def _load(ref: str) -> Experiment:
    try:
        return load_experiment(ref)
    except ExperimentError as error:
        _fail(str(error))


def _store(root: str | None) -> Store:
    try:
        return Store(resolve_root(root))
    except (ValueError, ImportError) as error:
        _fail(f"cannot open artifact root {resolve_root(root)!r}: {error}")


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if unit == "flops":
        return f"{value:.3g}"
    if unit == "tokens":
        for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if value >= scale:
                return f"{value / scale:.3g}{suffix}"
        return f"{value:.0f}"
    return f"{value:.4g}"


STATE_STYLE = {"done": "green", "running": "cyan", "failed": "red", "pending": "yellow", "blocked": "magenta"}


def _capacity_rows(exp: Experiment, names: list[str], **options: Any) -> dict[str, Any]:
    """The capacity plan (ladder.capacity) of every training step among `names`."""
    from ladder.capacity import capacity_row
    from ladder.dag import TrainStep

    rows = {}
    for name in names:
        step = exp.dag[name]
        if isinstance(step, TrainStep):
            try:
                rows[name] = capacity_row(name, step.spec, **options)
            except ValueError as error:
                _fail(f"capacity plan of step {name!r}: {error}")
    return rows


def _count(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def _gb(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1e9:,.1f}" if value >= 10e9 or value == 0 else f"{value / 1e9:.3g}"


def _print_capacity(rows: dict[str, Any]) -> None:
    """A table of the capacity plan, then the assumptions: the ones shared by every step once, the rest per step."""
    from ladder.capacity import fit_verdict

    if not rows:
        return
    priced = any(r.cost_usd is not None for r in rows.values())
    table = Table(title="capacity plan (memory per device in GB; time at the stated MFU)")
    columns = ["step", "devices", "mesh", "policy", "remat", "params", "optim", "grads", "weights", "activ",
               "total", "HBM", "fit", "step s", "wall days", "accel-h"] + (["cost USD"] if priced else [])
    for column in columns:
        table.add_column(column, overflow="fold")
    for name, r in rows.items():
        parts = r.memory.parts
        cells = [
            name,
            f"{r.devices:,} {r.accelerator or ''}".strip(),
            " x ".join(f"{k}={v}" for k, v in r.mesh.items()),
            r.memory.policy,
            r.memory.remat,
            _gb(parts["params"] + parts["master_params"]),
            _gb(parts["optimizer_state"]),
            _gb(parts["gradients"]),
            _gb(parts["compute_weights"]),
            _gb(parts["activations"]),
            _gb(r.memory.total),
            _gb(r.hbm_bytes),
            fit_verdict(r.memory, r.hbm_bytes),
            _fmt(r.step_seconds),
            "-" if r.wall_days is None else f"{r.wall_days:,.1f}" if r.wall_days >= 10 else f"{r.wall_days:.2g}",
            _count(r.accelerator_hours),
        ]
        if priced:
            cells.append(_count(r.cost_usd))
        table.add_row(*cells)
    console.print(table)
    shared = set.intersection(*(set(r.assumptions) for r in rows.values()))
    console.print("[bold]assumptions[/bold]")
    first = next(iter(rows.values()))
    for line in first.assumptions:
        if line in shared:
            console.print(f"  - {line}")
    for name, r in rows.items():
        own = [line for line in r.assumptions if line not in shared]
        if r.memory.features:
            own.append(f"relies on trainer fields: {', '.join(r.memory.features)}")
        if r.memory_trainer is not None:
            own.append(
                f"under the trainer's own policy: {_gb(r.memory_trainer.total)} GB per device, "
                f"{fit_verdict(r.memory_trainer, r.hbm_bytes)} (remat '{r.memory_trainer.remat}')"
            )
        if r.memory_trainer_sharded is not None:
            s = r.memory_trainer_sharded
            own.append(
                f"with the trainer's memory features on (policy 'trainer-sharded'): {_gb(s.total)} GB per device, "
                f"{fit_verdict(s, r.hbm_bytes)}, with {', '.join(s.features)}"
            )
        if r.fits_with_microbatch is not None:
            m = r.fits_with_microbatch
            own.append(
                f"fits with train.microbatch_size={m.microbatch_size} ({r.microbatch_size // m.microbatch_size} "
                f"micro-batches) under policy '{m.policy}': {_gb(m.total)} GB per device (micro-batching is part of "
                "the job's identity: capacity buffers are per micro-batch)"
            )
        elif r.memory_trainer_sharded is not None and not r.memory_trainer_sharded.fits:
            own.append("no micro-batch size makes the trainer's policies fit")
        if r.host_fits is not None:
            own.append(
                f"host memory: {_gb(r.host_offload_bytes_per_host)} GB offloaded per host against "
                f"{_gb(r.host_memory_bytes)} GB ({'fits' if r.host_fits else 'does not fit'})"
            )
        own += r.memory.notes
        for line in own:
            console.print(f"  - {name}: {line}")


@app.command()
def plan(
    experiment: str = typer.Argument(..., help="Experiment file (experiments/foo.py) or module (experiments.foo)."),
    root: Optional[str] = RootOption,
    mfu: float = typer.Option(0.4, help="Model FLOPs utilisation assumed for step time, wall time and accelerator-hours."),
    price_per_hour: Optional[float] = typer.Option(
        None, "--price-per-hour", help="USD per accelerator-hour; adds a cost column (there is no default price)."
    ),
    accelerator: Optional[str] = typer.Option(
        None, "--accelerator", help="Accelerator for every step's capacity plan (H100, H200, GB200, TPU-V4, TPU-V5P, "
        "TPU-V6E), overriding resources.accelerator_type."
    ),
    memory_policy: Optional[str] = typer.Option(
        None, "--memory-policy", help="Memory policy for every step: 'trainer' (the job as declared), 'trainer-sharded' "
        "(the job with EP, ZeRO-3, bf16_mixed and host offload on), 'marin' (Marin's run, described) or a MemoryPolicy "
        "as JSON, e.g. '{\"name\": \"mine\", \"trainer_fields\": {\"train.param_sharding\": \"zero3\"}}' "
        "(default: the spec's 'memory_policy' tag, else 'trainer')."
    ),
    hbm_headroom: float = typer.Option(
        0.10, "--hbm-headroom", help="Fraction of HBM held back for the runtime, fragmentation and compiler scratch."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of a table."),
) -> None:
    """Show every step's state, output path, FLOPs, and the capacity plan of every training step: memory per
    device, whether it fits, step and wall time at --mfu, accelerator-hours and cost. Runs nothing, writes nothing."""
    from ladder.executor import plan as make_plan

    if not 0 < mfu <= 1:
        _fail(f"--mfu {mfu} must be a fraction in (0, 1], e.g. 0.4.")
    if not 0 <= hbm_headroom < 1:
        _fail(f"--hbm-headroom {hbm_headroom} must be a fraction in [0, 1), e.g. 0.1.")
    if price_per_hour is not None and price_per_hour < 0:
        _fail(f"--price-per-hour {price_per_hour} must be >= 0 (USD per accelerator-hour).")
    exp = _load(experiment)
    store = _store(root)
    rows = make_plan(exp.dag, store)
    capacity = _capacity_rows(
        exp, [r.name for r in rows], mfu=mfu, price_per_hour=price_per_hour, accelerator=accelerator,
        memory_policy=memory_policy, headroom=hbm_headroom,
    )
    hours = {r.name: capacity[r.name].accelerator_hours if r.name in capacity else None for r in rows}
    plan_warnings = _eval_cadence_warnings(exp.dag) + _recipe_warnings(exp.dag)
    if as_json:
        print(json.dumps({"experiment": exp.ref, "root": store.url, "mfu": mfu, "price_per_hour": price_per_hour,
                          "hbm_headroom": hbm_headroom, "warnings": plan_warnings, "steps": [
            {"name": r.name, "kind": r.kind, "state": r.state, "detail": r.detail, "path": r.path, "fingerprint": r.fingerprint,
             "flops": r.flops, "accelerator_hours": hours[r.name], "waits_for": list(r.waits_for),
             **({"derived": exp.dag[r.name].derived.model_dump()} if r.kind == "train" else {}),
             **({"capacity": capacity[r.name].model_dump(mode="json")} if r.name in capacity else {})}
            for r in rows]}, indent=2))
        return
    table = Table(title=f"{exp.ref}  ({len(rows)} steps, root {store.url})")
    for column in ("step", "kind", "state", "active", "total", "tokens", "FLOPs", f"accel-h @{mfu:.0%} MFU", "resources", "waits for", "path"):
        table.add_column(column, overflow="fold")
    for row in rows:
        step = exp.dag[row.name]
        derived = step.derived if row.kind == "train" else None
        table.add_row(
            row.name,
            row.kind,
            f"[{STATE_STYLE[row.state]}]{row.state}[/]" + (f" ({row.detail})" if row.detail else ""),
            _fmt(derived.params_active, "tokens") if derived else "",
            _fmt(derived.params_total, "tokens") if derived else "",
            _fmt(derived.tokens, "tokens") if derived else "",
            _fmt(row.flops, "flops") if row.flops else "",
            f"{hours[row.name]:,.0f}" if hours[row.name] is not None else "",
            step.spec.resources.describe() if row.kind == "train" else "",
            ", ".join(row.waits_for),
            row.path,
        )
    console.print(table)
    _print_capacity(capacity)
    for warning in plan_warnings:
        err_console.print(f"[yellow]warning:[/] {warning}")


MIN_CURVE_EVALS = 8  # a curve law has 3-4 parameters; fewer evals than this cannot show a curve's shape


def _recipe_warnings(dag) -> list[str]:
    """Settings each fit's target changes that its rungs all share (ladder.recipe), said before anything runs."""
    from ladder.dag import FitStep
    from ladder.recipe import departures_for

    found = (departures_for(dag, step.target) for step in dag.steps.values() if isinstance(step, FitStep))
    return [warning for warning in found if warning]


def _eval_cadence_warnings(dag) -> list[str]:
    """Rungs that will log too few evals for the fit to use their curves (said before anything runs)."""
    from ladder.dag import FitStep, TrainStep
    from trainer.config import evals_logged

    out = []
    for step in dag.steps.values():
        if not isinstance(step, FitStep):
            continue
        for name in step.deps:
            rung = dag.steps.get(name)
            if not isinstance(rung, TrainStep):
                continue
            n_steps = rung.derived.num_steps
            k = evals_logged(rung.spec.train.eval_every, n_steps)
            if k < MIN_CURVE_EVALS:
                fix = (f"lower train.eval_every to about {max(1, n_steps // 25)} or leave it unset"
                       if rung.spec.train.eval_every is not None else "train it for more steps or set train.eval_every=1")
                out.append(f"{name} will log only {k} eval(s) over {n_steps} steps (train.eval_every="
                           f"{rung.spec.train.eval_every}): too few for {step.name} to fit its curve; {fix}")
    return out


@app.command()
def submit(
    experiment: str = typer.Argument(..., help="Experiment file or module."),
    steps: Optional[list[str]] = typer.Argument(None, help="Steps to run (with what they wait for); default: all."),
    root: Optional[str] = RootOption,
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Address of an existing Ray cluster; default: an embedded local Ray."),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="Run failed steps again (they resume from their newest checkpoint)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would run and exit."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for steps another submitter is running (default) or exit 3."),
) -> None:
    """Run what is not done yet, on Ray: skip finished steps, resume interrupted ones, never run one step twice at once."""
    from ladder.dag import DagError
    from ladder.executor import ExecutionError, plan as make_plan, run

    exp = _load(experiment)
    store = _store(root)
    try:
        wanted = exp.dag.upstream(steps) if steps else exp.dag.order
    except DagError as error:
        _fail(str(error))
    if dry_run:
        rows = {r.name: r for r in make_plan(exp.dag, store)}
        for name in wanted:
            row = rows[name]
            action = {"done": "skip (done)", "running": "wait (running elsewhere)", "failed": "retry" if retry_failed else "stop (failed; use --retry-failed)",
                      "pending": "run", "blocked": "blocked"}[row.state]
            console.print(f"{name:24s} {action:36s} {row.path}")
        raise typer.Exit(EXIT_OK)
    from ladder.progress import SubmitProgress, quiet_ray_warnings

    quiet_ray_warnings(tty=console.is_terminal)
    try:
        report = run(exp.dag, store, steps or None, ray_address=ray_address, retry_failed=retry_failed,
                     log=lambda line: console.print(line, markup=False, highlight=False), wait_for_others=wait,
                     experiment=exp.name, progress=SubmitProgress(store, console))
    except ExecutionError as error:
        _fail(str(error))
    _print_states(report.states)
    if report.interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)
    if report.ok:
        console.print(f"all {len(report.states)} step(s) done ({len(report.skipped)} skipped as already done)")
        raise typer.Exit(EXIT_OK)
    if any(s in ("failed", "blocked") for s in report.states.values()):
        raise typer.Exit(EXIT_FAILED)
    raise typer.Exit(EXIT_HELD)


def _print_states(states: dict[str, str]) -> None:
    for name, state in states.items():
        console.print(f"  {name:24s} [{STATE_STYLE.get(state, 'white')}]{state}[/]")


@app.command()
def status(
    experiment: str = typer.Argument(..., help="Experiment file or module."),
    root: Optional[str] = RootOption,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """A table of every step: state, progress, last loss, tokens, FLOPs, path."""
    from ladder.executor import plan as make_plan
    from ladder.runs import summarize

    exp = _load(experiment)
    store = _store(root)
    rows = make_plan(exp.dag, store)
    records = []
    for row in rows:
        run_dir = store.run_dir(row.name, row.fingerprint)
        summary = summarize(store, run_dir) if row.kind == "train" else None
        records.append((row, summary))
    if as_json:
        print(json.dumps([{"name": r.name, "state": r.state, "detail": r.detail, "path": r.path,
                           "step": s.step if s else None, "num_steps": s.num_steps if s else None,
                           "train_loss": s.train_loss if s else None, "eval_loss": s.eval_loss if s else None,
                           "tokens": s.tokens if s else None, "flops": s.flops if s else r.flops,
                           "warnings": s.warnings if s else []} for r, s in records], indent=2))
        _print_summary_warnings(records)
        return
    table = Table(title=f"{exp.ref}  (root {store.url})")
    for column in ("step", "state", "progress", "train loss", "eval loss", "tokens", "FLOPs", "path"):
        table.add_column(column, overflow="fold")
    for row, summary in records:
        progress = ""
        if summary and summary.progress is not None:
            progress = f"{summary.progress:6.1%} ({summary.step}/{summary.num_steps})"
        table.add_row(
            row.name,
            f"[{STATE_STYLE[row.state]}]{row.state}[/]",
            progress,
            _fmt(summary.train_loss) if summary else "",
            _fmt(summary.eval_loss) if summary else "",
            _fmt(summary.tokens, "tokens") if summary and summary.tokens else "",
            _fmt(summary.flops if summary and summary.flops else row.flops, "flops") if (row.flops or (summary and summary.flops)) else "",
            row.path,
        )
    console.print(table)
    _print_summary_warnings(records)


def _print_summary_warnings(records) -> None:
    for row, summary in records:
        for line in summary.warnings if summary else ():
            err_console.print(f"[yellow]warning:[/] {row.name}: {line}")


@app.command()
def show(
    target: str = typer.Argument(..., help="A run directory, or an experiment (then give STEP)."),
    step: Optional[str] = typer.Argument(None, help="Step name when TARGET is an experiment."),
    root: Optional[str] = RootOption,
    as_json: bool = typer.Option(False, "--json", help="Print the raw spec, status, result and metric ranges as one JSON document."),
) -> None:
    """One step at a glance: state, sizes, progress and losses, then gang attempts (multi-host steps) and every
    metric's first/last/min/max; --json for the raw spec, status and result."""
    from ladder.runs import read_jsonl, read_metrics

    store = _store(root)
    if step is None:
        run_store = _store(target)
        run_dir = run_store.root
        if not run_store.exists(f"{run_dir}/spec.json") and not run_store.exists(f"{run_dir}/status.json"):
            _fail(f"{target} is not a run directory (no spec.json or status.json); give `ladder show EXPERIMENT STEP`.")
        store = run_store
    else:
        exp = _load(target)
        from ladder.dag import DagError

        try:
            exp.dag[step]
        except DagError as error:
            _fail(str(error))
        run_dir = store.run_dir(step, exp.dag.fingerprints[step])
    from ladder.store import StoreError

    def read(name: str) -> Any:
        try:
            return store.read_status(run_dir) if name == "status.json" else store.read_json(f"{run_dir}/{name}")
        except StoreError as error:  # one unreadable file must not hide the rest of the step
            err_console.print(f"[yellow]warning:[/] {error}")
            return None

    spec, state, result = read("spec.json"), read("status.json"), read("result.json")
    if state and state.get("unreadable"):
        from ladder.executor import _status_note

        err_console.print(f"[yellow]warning:[/] {_status_note(state)}")
    from trainer.metrics import apply_resume_markers

    rows, _ = read_metrics(store, run_dir)
    rows = apply_resume_markers(rows)
    if as_json:
        print(json.dumps({"run_dir": store.url_of(run_dir), "spec": spec, "status": state, "result": result,
                          "metrics": _metric_ranges(rows)}, indent=2, default=str))
        return
    console.rule(f"[bold]{store.url_of(run_dir)}")
    _print_step_summary(spec or {}, state or {}, result, rows)
    attempts, _ = read_jsonl(store, f"{run_dir}/gang/attempts.jsonl")
    if attempts:
        gang = Table(title=f"gang attempts ({run_dir}/gang/host<rank>.log)")
        for column in ("attempt", "outcome", "placement", "nodes", "coordinator", "seconds", "detail"):
            gang.add_column(column)
        for a in attempts:
            seconds = a["ended_at"] - a["started_at"] if "ended_at" in a else None
            gang.add_row(str(a["attempt"]), a.get("outcome", ""), a.get("strategy", ""), ", ".join(a.get("nodes") or []),
                         a.get("coordinator", ""), _fmt(seconds) if seconds is not None else "", a.get("detail", ""))
        console.print(gang)
    if rows:
        table = Table(title=f"metrics: {len(rows)} rows")
        for column in ("metric", "first", "last", "min", "max"):
            table.add_column(column)
        for key, r in _metric_ranges(rows).items():
            table.add_row(key, _fmt(r["first"]), _fmt(r["last"]), _fmt(r["min"]), _fmt(r["max"]))
        console.print(table)
    else:
        console.print("no metrics yet")
    console.print("raw spec, status and result: add --json")


def _metric_ranges(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """first/last/min/max of every numeric metric ("a/b" keys) over the rows."""
    out = {}
    for key in sorted({k for r in rows for k in r if "/" in k}):
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if values:
            out[key] = {"first": values[0], "last": values[-1], "min": min(values), "max": max(values)}
    return out


def _print_step_summary(spec: dict[str, Any], status: dict[str, Any], result: dict[str, Any] | None,
                        rows: list[dict[str, Any]]) -> None:
    """The lines a user reads first: what the step is, where it stands, how far it got and its losses."""
    import datetime

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    state = status.get("state", "not started")
    detail = f"{status.get('attempts', 0)} attempt(s)"
    if status.get("finished_at"):
        detail += ", finished " + datetime.datetime.fromtimestamp(status["finished_at"]).strftime("%Y-%m-%d %H:%M:%S")
    grid.add_row("step", f"{spec.get('name', '?')} ({spec.get('kind', '?')}), fingerprint {str(spec.get('fingerprint', ''))[:12]}")
    grid.add_row("state", f"[{STATE_STYLE.get(state, 'white')}]{state}[/] ({detail})")
    error = (status.get("last_error") or "").strip().splitlines()
    if error and state != "done":
        grid.add_row("last error", error[0][:200])
    derived = spec.get("derived") or {}
    if derived:
        grid.add_row("model", f"{_fmt(derived.get('params_active'), 'tokens')} active / {_fmt(derived.get('params_total'), 'tokens')} total params, "
                              f"{_fmt(derived.get('tokens'), 'tokens')} tokens in {derived.get('num_steps', '?'):,} steps, "
                              f"{_fmt(derived.get('total_flops'), 'flops')} FLOPs")
    if spec.get("resources"):
        from ladder.spec import ResourceSpec

        try:
            grid.add_row("resources", ResourceSpec.model_validate(spec["resources"]).describe())
        except Exception:  # noqa: BLE001 - a spec.json of another version still shows the rest
            pass
    if spec.get("tags"):
        grid.add_row("tags", ", ".join(f"{k}={v}" for k, v in spec["tags"].items()))
    if spec.get("dependencies"):
        grid.add_row("inputs", ", ".join(spec["dependencies"]))
    train = [r for r in rows if isinstance(r.get("train/loss"), (int, float)) and "step" in r]
    evals = [r for r in rows if isinstance(r.get("eval/loss"), (int, float)) and "step" in r]
    last_step = max((r["step"] for r in rows if isinstance(r.get("step"), int)), default=None)
    if last_step is not None:
        total = derived.get("num_steps")
        grid.add_row("progress", f"step {last_step:,}" + (f" of {total:,} ({last_step / total:.1%})" if total else ""))
    if train:
        speed = next((r["throughput/tokens_per_second"] for r in reversed(train) if isinstance(r.get("throughput/tokens_per_second"), (int, float))), None)
        grid.add_row("train loss", f"{train[-1]['train/loss']:.4f} at step {train[-1]['step']:,}" + (f", {_fmt(speed, 'tokens')} tokens/s" if speed else ""))
    if evals:
        band = ""
        if isinstance(evals[-1].get("forecast/loss"), (int, float)):
            band = f" (forecast {evals[-1]['forecast/loss']:.4f} [{evals[-1].get('forecast/lo', float('nan')):.4f}, {evals[-1].get('forecast/hi', float('nan')):.4f}])"
        grid.add_row("eval loss", f"{evals[-1]['eval/loss']:.4f} at step {evals[-1]['step']:,}{band}")
    if result:
        keys = [k for k in ("completed", "final_eval_loss", "final_train_loss", "forecast_version", "final_loss", "final_loss_lo", "final_loss_hi") if k in result]
        if keys:
            grid.add_row("result", ", ".join(f"{k} {_fmt(result[k]) if isinstance(result[k], float) else result[k]}" for k in keys))
    if spec.get("code_version"):
        grid.add_row("code", str(spec["code_version"]))
    console.print(grid)


# ---------------------------------------------------------------------------------------- forecasting

TABLE_SUFFIXES = (".csv", ".parquet", ".pq", ".tsv")


def _is_table(source: str) -> bool:
    """A CSV/parquet export or a folder of run directories, as opposed to an experiment file or module."""
    if source.lower().endswith(TABLE_SUFFIXES):
        return True
    return os.path.isdir(source) or "://" in source


WHERE_HELP = ("With a table: keep only the rows whose COLUMN equals VALUE (COLUMN=VALUE; repeat to combine), e.g. one "
              "corpus of a table that holds several.")
SWEEP_HELP = ("With a table: keep only the best run (lowest final loss) of each size and token count whose runs differ "
              "in peak LR, batch or another numeric setting: the tuned loss a scaling law describes.")


def _parse_where(where: list[str] | None) -> dict[str, str]:
    """--where COLUMN=VALUE options as {column: value}."""
    out: dict[str, str] = {}
    for item in where or []:
        column, sep, value = item.partition("=")
        if not sep or not column.strip():
            _fail(f"--where takes COLUMN=VALUE; got {item!r}.")
        out[column.strip()] = value.strip()
    return out


def _load_table(source: str, where: list[str] | None = None, best_of_sweep: bool = False):
    """forecasting.api.load_table (only the rows --where selects, the best of each sweep with --best-of-sweep), what
    it left out (torn lines, runs without a loss, a column with holes) printed as one line each."""
    import warnings

    from forecasting import api
    from forecasting.table import LeftOutWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LeftOutWarning)
        table = api.load_table(source, where=_parse_where(where), best_of_sweep=best_of_sweep)
    for warning in caught:
        if issubclass(warning.category, LeftOutWarning):
            err_console.print(f"[yellow]warning:[/] {warning.message}")
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return table


TARGET_OPTIONS = {"params_active": "--params-active", "params_total": "--params-total", "tokens": "--tokens",
                  "unique_tokens": "--unique-tokens",
                  "num_steps": "--num-steps", "total_flops": "--flops", "name": "--name", "lr": "--schedule/--peak-lr",
                  "tokens_per_step": "--tokens / --num-steps"}


def _target_option_error(error) -> str:
    """A TargetSpec validation error as the command-line options that caused it, with the bad value."""
    from ladder.spec import short_message

    parts = []
    for problem in error.errors():
        field = str(problem["loc"][0]) if problem["loc"] else ""
        option = TARGET_OPTIONS.get(field, field or "the target")
        value = problem.get("input")
        shown = f" {value:g}" if isinstance(value, float) else f" {value}" if isinstance(value, (int, str)) else ""
        parts.append(f"{option}{shown} {short_message(problem)}" if shown else f"{option}: {short_message(problem)}")
    return "; ".join(parts) + "."


def _forecasting_error(error: Exception) -> None:
    from forecasting.fitting import MissingColumnsError
    from forecasting.table import COLUMNS

    if isinstance(error, MissingColumnsError):  # a table exported from another trainer, without the runs' sizes
        _fail(f"{error}; add them, or register each run with `ladder import EXP STEP SOURCE`, whose step spec supplies "
              "params, tokens and FLOPs.")
    column = error.args[0] if isinstance(error, KeyError) and error.args else None
    if column in COLUMNS:  # a law reached for a column the table does not have (a table exported from another trainer)
        _fail(f"the table has no {column!r} column, which this law needs; add it, or register each run with "
              "`ladder import EXP STEP SOURCE`, whose step spec supplies params, tokens and FLOPs.")
    _fail(f"{type(error).__name__}: {error}", EXIT_FAILED if not isinstance(error, (ValueError, KeyError)) else EXIT_BAD_INPUT)


def _source_table(source: str, root: str | None, where: list[str] | None, best_of_sweep: bool = False):
    """The table of runs `source` names: a table file or run folder (its rows --where selects, the best of each sweep
    with --best-of-sweep), or an experiment's training steps."""
    if _is_table(source):
        return _load_table(source, where, best_of_sweep)
    _refuse_table_options(where, best_of_sweep)
    return _experiment_table(_load(source), _store(root), None)


def _refuse_table_options(where: list[str] | None, best_of_sweep: bool) -> None:
    if where:
        _fail("--where selects rows of a table of runs; an experiment's runs are its steps.")
    if best_of_sweep:
        _fail("--best-of-sweep picks runs of a table of runs; an experiment's runs are its steps.")


def _experiment_table(exp: Experiment, store: Store, target: str | None):
    from ladder.dag import TrainStep
    from ladder.fitting import FitInputError, ladder_runs_for, table_from_steps

    if target is not None:
        names = ladder_runs_for(exp.dag, target)
    else:
        fits = [s for s in exp.dag if s.kind == "fit"]
        names = list(fits[0].deps) if fits else [s.name for s in exp.dag if isinstance(s, TrainStep)]
    notes: list[str] = []
    try:
        table = table_from_steps(exp.dag, store, names, allow_partial=True, warnings=notes)
    except FitInputError as error:
        _fail(str(error), EXIT_FAILED)
    for note in notes:
        err_console.print(f"[yellow]warning:[/] {note}")
    return table


def _print_intervals(title: str, params: dict) -> None:
    table = Table(title=title)
    for column in ("parameter", "value", "95% lo", "95% hi"):
        table.add_column(column)
    for name, interval in params.items():
        table.add_row(name, f"{interval.value:.6g}", f"{interval.lo:.6g}", f"{interval.hi:.6g}")
    console.print(table)


CURVE_ROW_FRACTIONS = (0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def _curve_rows(curve: list) -> list:
    """The curve's points nearest to CURVE_ROW_FRACTIONS of its last step, once each (a forecast's curve is spaced
    evenly in log steps, so every k-th point would crowd the first percent of the run)."""
    last = curve[-1].step
    picked = {min(range(len(curve)), key=lambda i: abs(curve[i].step - f * last)) for f in CURVE_ROW_FRACTIONS}
    return [curve[i] for i in sorted(picked)]


def _print_forecast(forecast, where: str | None) -> None:
    console.print(f"[bold]{forecast.target.name}[/]: final loss {forecast.final_loss:.4f} "
                  f"[{forecast.final_loss_lo:.4f}, {forecast.final_loss_hi:.4f}] ({forecast.level:.0%}) by {forecast.method}"
                  + (f", stored as version {forecast.version} in {where}" if where else ""))
    console.print(f"law: {forecast.law}")
    if forecast.params:
        _print_intervals("parameters", forecast.params)
    if forecast.curve:
        table = Table(title="predicted curve (at 1%, 5% and every 10% of the run)")
        for column in ("step", "tokens", "loss", "lo", "hi"):
            table.add_column(column)
        for point in _curve_rows(forecast.curve):
            table.add_row(str(point.step), _fmt(point.tokens, "tokens") if point.tokens else "-", f"{point.loss:.4f}", f"{point.lo:.4f}", f"{point.hi:.4f}")
        console.print(table)
    for result in forecast.backtest:
        repetition = (f", runs at {', '.join(f'{e:.3g}' for e in result.repetition_epochs)} epochs (the target's repetition)"
                      if result.repetition_epochs else "")
        missed = result.worst_runs(1)
        worst_run = (f"; the run it missed most: {missed[0].run} by {missed[0].error:+.2%} at its last point, fitted on "
                     f"{missed[0].fitted_on}" if missed else "")
        console.print(f"backtest of {result.method} ({result.kind}) on this ladder: rms error {result.rms_rel_error:.2%}, worst {result.max_abs_rel_error:.2%} "
                      f"over {result.distance:.2f} units of extrapolation ({_held_out(result.held_out)}{repetition}){worst_run}")
    if forecast.selection:
        _print_selection(forecast.selection)
    for warning in forecast.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


@app.command()
def fit(
    source: str = typer.Argument(..., help="Experiment file/module, or a CSV/parquet table of runs, or a folder of run directories."),
    root: Optional[str] = RootOption,
    law: str = typer.Option("auto", help="auto, chinchilla (L(N,D)), compute (L(C)) or matched_progress."),
    n_bootstrap: int = typer.Option(200, min=0, help="Bootstrap resamples over runs for the intervals."),
    seed: int = typer.Option(0, help="Bootstrap seed."),
    as_json: bool = typer.Option(False, "--json", help="Print the fit as one JSON document."),
    select: Optional[list[str]] = typer.Option(None, "--where", help=WHERE_HELP),
    best_of_sweep: bool = typer.Option(False, "--best-of-sweep", help=SWEEP_HELP),
) -> None:
    """Fit a scaling law to finished runs; every parameter with its 95% interval."""
    from forecasting import api

    try:
        table = _source_table(source, root, select, best_of_sweep)
        result = api.fit_ladder(table, law=law, n_bootstrap=n_bootstrap, seed=seed)
    except typer.Exit:
        raise
    except Exception as error:  # noqa: BLE001 - every forecasting failure becomes one clear line
        _forecasting_error(error)
    if as_json:
        print(result.to_json(indent=2))
        return
    console.print(f"[bold]{result.law}[/] on {result.n_runs} runs / {result.n_points} points: {result.formula}")
    _print_intervals(f"parameters (95% intervals, {result.n_bootstrap} bootstrap refits over runs)", result.params)
    residuals = Table(title="residuals")
    for column in ("run", "loss", "predicted", "rel. error"):
        residuals.add_column(column)
    for row in result.residuals:
        residuals.add_row(str(row.get("run")), f"{row.get('loss', float('nan')):.4f}", f"{row.get('predicted', float('nan')):.4f}", f"{row.get('rel_error', float('nan')):+.2%}")
    console.print(residuals)
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


def _schedule_values(kind, peak_lr, num_steps, warmup, min_lr_fraction, decay_fraction) -> list[float] | None:
    """The LR at steps 1..num_steps of a schedule described on the command line (the trainer's formula)."""
    if kind is None:
        return None
    if not num_steps or peak_lr is None:
        _fail("--schedule needs --num-steps and --peak-lr to turn the schedule into an LR per step.")
    import numpy as np
    from pydantic import ValidationError

    from ladder.spec import explain_validation_error
    from trainer.config import ScheduleConfig
    from trainer.optim import schedule_value

    try:
        config = ScheduleConfig(kind=kind, warmup=warmup, min_lr_fraction=min_lr_fraction, decay_fraction=decay_fraction)
    except ValidationError as error:
        _fail(explain_validation_error(error, "schedule"))
    steps = np.arange(1, num_steps + 1)
    return [float(v) for v in schedule_value(steps, peak=peak_lr, schedule=config, num_steps=num_steps)]


# forecasting.api.METHODS, written out so the CLI starts without importing the forecasting stack (a test holds them equal)
METHOD_HELP = ("auto (chosen by a backtest on the table), or one of matched_progress, chinchilla, compute, multipower, "
               "overtrain, farseer, moe, data_constrained.")


@app.command()
def forecast(
    source: str = typer.Argument(..., help="Experiment file/module, or a CSV/parquet table of runs."),
    target: Optional[str] = typer.Argument(None, help="With an experiment: the training step to forecast (e.g. hero)."),
    root: Optional[str] = RootOption,
    refit: bool = typer.Option(False, "--refit", help="Refit with the target's own live prefix (its metrics so far)."),
    method: str = typer.Option("auto", help=METHOD_HELP),
    n_bootstrap: int = typer.Option(200, min=0, help="Bootstrap resamples over runs."),
    seed: int = typer.Option(0, help="Bootstrap seed."),
    params_active: Optional[float] = typer.Option(None, help="With a table: active parameters of the target."),
    params_total: Optional[float] = typer.Option(None, help="With a table: total parameters of the target."),
    tokens: Optional[float] = typer.Option(None, help="With a table: training tokens of the target."),
    unique_tokens: Optional[float] = typer.Option(None, help="With a table: unique tokens of the target's data, when it repeats them (tokens / unique tokens = epochs; the table's unique_tokens column)."),
    num_steps: Optional[int] = typer.Option(None, help="With a table: planned optimizer steps of the target."),
    flops: Optional[float] = typer.Option(None, help="With a table: planned training FLOPs of the target (default 6ND)."),
    name: str = typer.Option("target", help="With a table: a name for the target."),
    schedule: Optional[str] = typer.Option(None, help="With a table: the target's LR schedule kind (constant, cosine, linear, wsd); needs --num-steps and --peak-lr."),
    peak_lr: Optional[float] = typer.Option(None, help="With a table and --schedule: peak learning rate."),
    warmup: float = typer.Option(0.01, help="With --schedule: warmup, a fraction of steps if < 1, else steps."),
    min_lr_fraction: float = typer.Option(0.1, help="With --schedule: final LR as a fraction of peak."),
    decay_fraction: float = typer.Option(0.2, help="With --schedule wsd: fraction of steps in the cooldown."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document: final_loss, final_loss_lo, final_loss_hi, curve, ..."),
    with_schedule: bool = typer.Option(False, "--with-schedule", help="With --json: keep target.lr, the LR at every step (left out by default)."),
    select: Optional[list[str]] = typer.Option(None, "--where", help=WHERE_HELP),
    best_of_sweep: bool = typer.Option(False, "--best-of-sweep", help=SWEEP_HELP),
) -> None:
    """Forecast a run's whole loss curve and final loss with a band; with an experiment, store it as a new version
    (only when the inputs, method or options changed: otherwise it says which stored version it equals)."""
    from pydantic import ValidationError

    from forecasting import api
    from forecasting.forecast import TargetSpec

    where, stored_new = None, False
    try:
        if _is_table(source):
            if params_active is None or tokens is None:
                _fail("with a table, describe the target: --params-active N --tokens D (and optionally --num-steps, --flops).")
            table = _load_table(source, select, best_of_sweep)
            lr = _schedule_values(schedule, peak_lr, num_steps, warmup, min_lr_fraction, decay_fraction)
            try:
                spec = TargetSpec(name=name, params_active=params_active, params_total=params_total, tokens=tokens,
                                  unique_tokens=unique_tokens, num_steps=num_steps, total_flops=flops, tokens_per_step=tokens / num_steps if num_steps else None, lr=lr)
            except ValidationError as error:
                _fail(_target_option_error(error))
            result = api.forecast_target(table, spec, method=method, n_bootstrap=n_bootstrap, seed=seed)
        else:
            from ladder.dag import DagError, TrainStep
            from ladder.fitting import load_forecast, target_spec

            _refuse_table_options(select, best_of_sweep)
            exp = _load(source)
            store = _store(root)
            if target is None:
                _fail("give the training step to forecast: `ladder forecast EXPERIMENT TARGET`.")
            try:
                step = exp.dag[target]
            except DagError as error:
                _fail(str(error))
            if not isinstance(step, TrainStep):
                _fail(f"{target!r} is a {step.kind} step; forecasts are for training steps.")
            table = _experiment_table(exp, store, target)
            spec = target_spec(step)
            if refit:
                from forecasting.table import from_run_dirs

                run_dir = store.url_of(store.run_dir(target, exp.dag.fingerprints[target]))
                try:
                    live = from_run_dirs([run_dir])
                except Exception as error:  # noqa: BLE001
                    _fail(f"{target} has no live metrics to refit with yet ({error}); start it with `ladder submit`.", EXIT_FAILED)
                prior = load_forecast(store, target)
                result = api.refit_forecast(table, spec, live, prior=prior, n_bootstrap=n_bootstrap, seed=seed)
            else:
                from ladder.recipe import departures_for

                result = api.forecast_target(table, spec, method=method, n_bootstrap=n_bootstrap, seed=seed)
                recipe_warning = departures_for(exp.dag, target)
                if recipe_warning:  # as the fit step stores it
                    result.warnings.append(recipe_warning)
            from ladder.fitting import forecast_options, store_forecast_if_changed

            _, stored_new = store_forecast_if_changed(
                store, result, meta={"experiment": exp.ref, "target_fingerprint": exp.dag.fingerprints[target], "refit": refit,
                                     "options": forecast_options(method, n_bootstrap, seed)})
            where = store.url_of(store.forecast_dir(target))
    except typer.Exit:
        raise
    except Exception as error:  # noqa: BLE001
        _forecasting_error(error)
    if where is not None and not stored_new:
        (err_console if as_json else console).print(
            f"unchanged: version {result.version} (same inputs, method and options as the newest stored forecast; nothing written)")
    allocation = None
    if not refit:
        try:
            allocation = api.optimal_allocation(table, spec, n_bootstrap=min(n_bootstrap, 50), seed=seed)
        except Exception as error:  # noqa: BLE001  (the forecast stands; the planner is extra)
            allocation = {"available": False, "reason": f"{type(error).__name__}: {error}"}
    if as_json:
        doc = json.loads(result.to_json())
        if not with_schedule:
            doc["target"].pop("lr", None)
        if allocation is not None:
            doc["allocation"] = allocation
        print(json.dumps(doc, indent=2))
        return
    _print_forecast(result, where if stored_new else None)
    if allocation is not None:
        _print_allocation(allocation)


def _print_selection(candidates: list[dict]) -> None:
    """method=auto: every candidate with its backtest on this table, the winner marked."""
    table = Table(title="method chosen by backtest on this table (expected error = error per unit distance on the splits "
                        "that fit the most runs x the target's distance x a small-sample factor for the held-out sizes "
                        "they were scored on)")
    for column in ("method", "backtest rms", "held-out sizes", "expected error at target", "blend weight", "note"):
        table.add_column(column, overflow="fold")
    for c in candidates:
        rms = f"{c['backtest_rms']:.2%}" if c.get("backtest_rms") is not None else "-"
        sizes = f"{c['independent_errors']} (x{c['small_sample_factor']:.2f})" if c.get("independent_errors") is not None else "-"
        exp_err = f"{c['expected_error']:.2%}" if c.get("expected_error") is not None else "-"
        weight = f"{c['blend_weight']:.2f}" if c.get("blend_weight") else "-"
        if c.get("band_weight") and f"{c['band_weight']:.2f}" != f"{c.get('blend_weight') or 0:.2f}":
            weight += f" (band {c['band_weight']:.2f})"
        note = "chosen" if c.get("chosen") else (c.get("excluded") or c.get("reason") or "")
        if c.get("no_evidence"):
            note = f"{'the reference; ' if c.get('chosen') else ''}no backtest possible: averaged with equal weights"
        if c.get("fit_at_bounds"):
            note += f" (its fit sits on a bound of {', '.join(c['fit_at_bounds'])})"
        ck = c.get("checkpoints")
        if ck:
            note += (f" (fitted on {ck['points']} converted checkpoints of {ck['runs']} runs too: {ck['reason']})" if ck["use"]
                     else f" (not fitted on the {ck['points']} converted checkpoints: {ck['reason']})")
        table.add_row(c["method"], rms, sizes, exp_err, weight, note)
    console.print(table)


def _print_allocation(a: dict) -> None:
    """The compute-optimal N and D for the target's budget, and where the declared target sits."""
    if not a.get("available"):
        console.print(f"compute-optimal allocation: not available ({a.get('reason')})")
        return

    def iv(key: str, kind: str) -> str:
        i = a["intervals"].get(key)
        return f"{_fmt(a[key], kind)}" + (f" [{_fmt(i['lo'], kind)}, {_fmt(i['hi'], kind)}]" if i else "")

    t = a["target"]
    console.print(
        f"compute-optimal at {_fmt(a['flops_6nd'], 'flops')} FLOPs (6ND, law {a['law']}): N {iv('params_opt', 'tokens')}, "
        f"D {iv('tokens_opt', 'tokens')}, {a['tokens_per_param']:.3g} tokens/param, "
        + (f"{a['tokens_opt'] / a['unique_tokens']:.3g} epochs of the target's {_fmt(a['unique_tokens'], 'tokens')} unique tokens, "
           if a.get("unique_tokens") else "")
        + f"loss {a['loss_opt']:.4f}")
    console.print(
        f"declared target: N {_fmt(t['params_active'], 'tokens')} ({t['params_vs_opt']:.2f}x the optimum), "
        f"{t['tokens_per_param']:.3g} tokens/param, predicted {t['predicted_loss']:.4f} ({t['loss_above_opt']:+.2%} vs the optimum)")
    for w in a.get("warnings", []):
        console.print(f"[yellow]warning:[/] {w}")
    sp = a.get("sparsity")
    if sp:
        cells = []
        for r in sp["rows"]:
            band = f" [{r['loss_lo']:.4f}, {r['loss_hi']:.4f}]" if r["loss_lo"] is not None else ""
            mark = " (target's)" if r["target"] else ("" if r["within_ladder"] else " (beyond the ladder)")
            cells.append(f"{r['sparsity']:.3g}x: {r['loss']:.4f}{band}{mark}")
        lo, hi = sp["ladder_sparsity"]
        console.print(f"loss-optimal split at each total/active ratio (moe law, kappa {sp['kappa']:.3g}; the ladder spans "
                      f"{lo:.3g}-{hi:.3g}x): " + "; ".join(cells))
        for w in sp.get("warnings", []):
            console.print(f"[yellow]warning:[/] {w}")


@app.command()
def backtest(
    source: Optional[str] = typer.Argument(None, help="Experiment file/module, or a CSV/parquet table of runs (not with --suite)."),
    root: Optional[str] = RootOption,
    method: str = typer.Option("auto", help=METHOD_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
    suite: bool = typer.Option(False, "--suite", help="The public backtest suite: every method on every shipped public data set, one table."),
    quick: bool = typer.Option(False, "--quick", help="With --suite: a small subset (one split per data set, few targets)."),
    datasets: Optional[str] = typer.Option(None, "--datasets", help="With --suite: comma-separated data sets (default all)."),
    methods: Optional[str] = typer.Option(None, "--methods", help="With --suite: comma-separated methods (default every method + auto)."),
    n_bootstrap: int = typer.Option(20, "--n-bootstrap", min=0, help="With --suite or --forecast-largest: bootstrap refits per forecast."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="With --suite: seconds per forecast call before it counts as a timeout (default 120; 10 with --quick)."),
    budget: Optional[float] = typer.Option(None, "--budget", help="With --suite: seconds one method may spend on one data set, the rest skipped (default 600; 10 with --quick)."),
    markdown: Optional[str] = typer.Option(None, "--markdown", help="With --suite: also write the report to this file."),
    select: Optional[list[str]] = typer.Option(None, "--where", help=WHERE_HELP),
    best_of_sweep: bool = typer.Option(False, "--best-of-sweep", help=SWEEP_HELP),
    forecast_largest: int = typer.Option(0, "--forecast-largest", min=0, help="Also forecast the N largest finished runs from the "
                                         "others, as the method would have before they ran, and score each forecast and its "
                                         "95% band on their final loss and every eval (0: off)."),
    skip: int = typer.Option(0, "--skip", min=0, help="With --forecast-largest: leave out the K finished runs just below "
                             "the held-out ones too (neither fitted nor scored), so each forecast is made K rungs further "
                             "out, as a hero sits further beyond its ladder than one rung."),
) -> None:
    """How wrong a method is on this ladder: fit the smaller runs (or a curve's prefix), predict the rest.

    With --suite: the public backtest suite (forecasting/suite.py), the same as bench/bench_forecast_suite.py.
    """
    from forecasting import api

    if suite:
        if forecast_largest:
            _fail("--forecast-largest scores a ladder of your own (give an experiment or a table); the suite already holds "
                  "out the largest runs of every public data set.")
        _backtest_suite(quick, datasets, methods, n_bootstrap, timeout, budget, markdown, as_json)
        return
    if source is None:
        _fail("give an experiment or a table of runs to backtest, or --suite for the public backtest suite.")
    if skip and not forecast_largest:
        _fail("--skip leaves out the runs just below those --forecast-largest holds out: give --forecast-largest N too.")
    try:
        table = _source_table(source, root, select, best_of_sweep)
        report = api.backtest(table, method=method)
        largest = _forecast_largest(table, method, forecast_largest, n_bootstrap, skip) if forecast_largest else None
    except typer.Exit:
        raise
    except Exception as error:  # noqa: BLE001
        _forecasting_error(error)
    if as_json:
        print(report.to_json(indent=2) if largest is None else
              json.dumps({"backtest": json.loads(report.to_json()), "forecast_largest": largest}, indent=2, default=str))
        return
    table_view = Table(title=f"backtests of {report.method}")
    for column in ("kind", "held out", "mean err", "rms err", "worst", "distance", "err per unit"):
        table_view.add_column(column)
    for r in report.results:
        table_view.add_row(r.kind, _held_out(r.held_out), f"{r.mean_rel_error:+.2%}", f"{r.rms_rel_error:.2%}", f"{r.max_abs_rel_error:.2%}", f"{r.distance:.2f}", f"{r.rate:.2%}")
    console.print(table_view)
    for r in report.results:
        _print_held_out_runs(r)
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    if largest is not None:
        _print_forecast_largest(largest, method, skip)


def _forecast_largest(table, method: str, n_held: int, n_bootstrap: int, skip: int = 0) -> list[dict]:
    """Each of the n largest finished runs forecast from the others, less the `skip` just below them
    (`forecasting.suite.leave_largest_out`): the forecast at the run's last eval against the actual, and over every
    eval its MAE and band coverage."""
    from forecasting import suite as public_suite

    split = public_suite.leave_largest_out(table, n_held, skip=skip)
    res = public_suite.run_suite([split], [method], n_bootstrap=n_bootstrap, timeout_s=None)
    rows = []
    for _, st in res.statuses.iterrows():
        pts = res.points[res.points["run"] == st["run"]]
        row = {"run": st["run"], "status": st["status"], "reason": st["reason"], "method": st["picked"]}
        if len(pts):
            last = pts.sort_values("step").iloc[-1]
            every = public_suite.metrics(pts)
            row |= {"step": int(last["step"]), "actual": float(last["actual"]), "predicted": float(last["pred"]),
                    "lo": float(last["lo"]), "hi": float(last["hi"]), "error": float(last["rel_error"]), "covered": bool(last["covered"]),
                    "evals": every["n"], "evals_mae": every["mae"] / 100, "evals_covered": every["coverage"] / 100}
        rows.append(row)
    return rows


def _print_forecast_largest(rows: list[dict], method: str, skip: int = 0) -> None:
    below = f", the {skip} just below them left out" if skip else ""
    view = Table(title=f"{method} forecasts of the largest runs from the others{below} (95% band)")
    for column in ("run", "method", "last eval", "predicted [band]", "actual", "error", "in band", "evals: MAE, in band"):
        view.add_column(column)
    for r in rows:
        if "actual" not in r:
            view.add_row(r["run"], f"{r['status']}: {r['reason']}", "-", "-", "-", "-", "-", "-")
            continue
        view.add_row(r["run"], str(r["method"]), str(r["step"]), f"{r['predicted']:.4f} [{r['lo']:.4f}, {r['hi']:.4f}]",
                     f"{r['actual']:.4f}", f"{r['error']:+.2%}", "yes" if r["covered"] else "NO",
                     f"{r['evals']}: {r['evals_mae']:.2%}, {r['evals_covered']:.0%}")
    console.print(view)


def _print_held_out_runs(result) -> None:
    """Where a backtest's error came from: its held-out runs, worst last point first, as many as the report shows
    (all of them in --json)."""
    from ladder.views.report import HELD_OUT_SHOWN

    if not result.runs:
        return
    view = Table(title=f"{result.kind} backtest: held-out runs, worst first")
    for column in ("run", "fitted on", "distance", "predicted", "actual", "error", "rms over its points"):
        view.add_column(column)
    for h in result.worst_runs(HELD_OUT_SHOWN):
        view.add_row(h.run, h.fitted_on, f"{h.distance:.2f}", f"{h.predicted:.4f}", f"{h.actual:.4f}", f"{h.error:+.2%}",
                     f"{h.rms_error:.2%} ({h.n_points})")
    console.print(view)
    if len(result.runs) > HELD_OUT_SHOWN:
        console.print(f"{len(result.runs) - HELD_OUT_SHOWN} more held-out runs in --json (results[].runs)")


def _held_out(runs: list[str], shown: int = 6) -> str:
    return ", ".join(runs[:shown]) + (f" and {len(runs) - shown} more" if len(runs) > shown else "")


def _backtest_suite(quick: bool, datasets: str | None, methods: str | None, n_bootstrap: int, timeout: float | None,
                    budget: float | None, markdown: str | None, as_json: bool) -> None:
    from forecasting import suite as public_suite

    try:
        names = datasets.split(",") if datasets else list(public_suite.DATASETS)
        chosen = methods.split(",") if methods else None
        public_suite.suite_methods(chosen)
        splits = public_suite.all_splits(names, quick=quick)
    except ValueError as error:
        _fail(f"--datasets/--methods: {error}")
    timeout = timeout if timeout is not None else (10.0 if quick else 120.0)
    budget = budget if budget is not None else (10.0 if quick else 600.0)
    res = public_suite.run_suite(splits, chosen, n_bootstrap=n_bootstrap, timeout_s=timeout, budget_s=budget, quick=quick,
                                 progress=None if as_json else (lambda line: err_console.print(line, markup=False, highlight=False)))
    text = public_suite.render_markdown(res, "ladder backtest --suite" + (" --quick" if quick else ""))
    if markdown:
        with open(markdown, "w") as f:
            f.write("# Public backtest suite\n\n" + text)
    if as_json:
        print(json.dumps(public_suite.to_json(res), indent=1, default=str))
    else:
        print(text)


@app.command()
def schema() -> None:
    """Print the JSON schema of an experiment spec (every field with its description)."""
    from ladder.spec import ExperimentSpec

    print(json.dumps(ExperimentSpec.model_json_schema(), indent=2))


def _register_commands_from_modules() -> None:
    """Commands whose code lives beside what they drive (importer, plots, live view)."""
    from ladder.attach import attach_command
    from ladder.demo import demo_command
    from ladder.importer import import_command
    from ladder.views.plots import plot_command
    from ladder.views.report import report_command
    from ladder.views.serve import serve_command
    from ladder.views.watch import watch_command

    app.command("import")(import_command)
    app.command("attach")(attach_command)
    app.command("plot")(plot_command)
    app.command("watch")(watch_command)
    app.command("report")(report_command)
    app.command("serve")(serve_command)
    app.command("demo")(demo_command)


_register_commands_from_modules()


def run_as_script(path: str, argv: list[str] | None = None) -> None:
    """`python experiments/foo.py [COMMAND [ARGS...]]` (Marin's habit) is `ladder COMMAND experiments/foo.py [ARGS...]`;
    with no COMMAND it is `ladder plan experiments/foo.py` (it shows the steps and runs nothing)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    relative = os.path.relpath(path)
    path = relative if not relative.startswith("..") else path
    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    if not argv or argv[0].startswith("-"):
        argv = ["plan", *argv]
        print(f"python {path} is `ladder plan {path}`: it shows the steps and runs nothing. "
              f"To run them: `ladder submit {path}` (or `python {path} submit`).", flush=True)
    if argv[0] not in commands or argv[0] in ("schema", "demo"):
        print(f"error: {argv[0]!r} is not a ladder command that takes an experiment; try `python {path} plan` "
              f"or `python {path} submit` (`ladder --help` lists the commands).", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)
    app([argv[0], path, *argv[1:]], prog_name="ladder")


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
