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
err_console = Console(stderr=True, highlight=False)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_HELD, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

RootOption = typer.Option(None, "--root", help="Artifact root: a folder or fsspec URL (default $LADDER_ROOT or ./ladder-runs).")


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    err_console.print(f"[red]error:[/red] {message}")
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
    for suffix, scale in (("e24", 1e24), ("e21", 1e21), ("e18", 1e18)):
        if unit == "flops" and value >= scale:
            return f"{value:.3g}"
    if unit == "flops":
        return f"{value:.3g}"
    if unit == "tokens":
        for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if value >= scale:
                return f"{value / scale:.3g}{suffix}"
        return f"{value:.0f}"
    return f"{value:.4g}"


STATE_STYLE = {"done": "green", "running": "cyan", "failed": "red", "pending": "yellow", "blocked": "magenta"}


def _accelerator_hours(step, mfu: float) -> float | None:
    from ladder.dag import TrainStep

    if not isinstance(step, TrainStep) or not step.spec.resources.accelerator_type:
        return None
    from trainer import accounting

    try:
        peak = accounting.peak_flops_per_second(step.spec.resources.accelerator_type)
    except (KeyError, ValueError):
        return None
    return step.flops / (peak * mfu) / 3600.0


@app.command()
def plan(
    experiment: str = typer.Argument(..., help="Experiment file (experiments/foo.py) or module (experiments.foo)."),
    root: Optional[str] = RootOption,
    mfu: float = typer.Option(0.4, help="Model FLOPs utilisation assumed for accelerator-hour estimates."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of a table."),
) -> None:
    """Show every step's state, output path, FLOPs and estimated accelerator-hours. Runs nothing, writes nothing."""
    from ladder.executor import plan as make_plan

    exp = _load(experiment)
    store = _store(root)
    rows = make_plan(exp.dag, store)
    hours = {row.name: _accelerator_hours(exp.dag[row.name], mfu) for row in rows}
    if as_json:
        print(json.dumps({"experiment": exp.ref, "root": store.url, "mfu": mfu, "steps": [
            {"name": r.name, "kind": r.kind, "state": r.state, "detail": r.detail, "path": r.path, "fingerprint": r.fingerprint,
             "flops": r.flops, "accelerator_hours": hours[r.name], "waits_for": list(r.waits_for),
             **({"derived": exp.dag[r.name].derived.model_dump()} if r.kind == "train" else {})}
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
    try:
        report = run(exp.dag, store, steps or None, ray_address=ray_address, retry_failed=retry_failed,
                     log=lambda line: console.print(line, markup=False), wait_for_others=wait)
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
                           "tokens": s.tokens if s else None, "flops": s.flops if s else r.flops} for r, s in records], indent=2))
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


@app.command()
def show(
    target: str = typer.Argument(..., help="A run directory, or an experiment (then give STEP)."),
    step: Optional[str] = typer.Argument(None, help="Step name when TARGET is an experiment."),
    root: Optional[str] = RootOption,
) -> None:
    """Print one step's spec, status and a summary of its metrics."""
    from ladder.runs import read_metrics

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
    spec = store.read_json(f"{run_dir}/spec.json")
    state = store.read_json(f"{run_dir}/status.json")
    result = store.read_json(f"{run_dir}/result.json")
    rows, _ = read_metrics(store, run_dir)
    console.rule(f"[bold]{store.url_of(run_dir)}")
    console.print_json(data={"spec": spec, "status": state, "result": result})
    if rows:
        keys = sorted({k for r in rows for k in r if "/" in k})
        table = Table(title=f"metrics: {len(rows)} rows")
        for column in ("metric", "first", "last", "min", "max"):
            table.add_column(column)
        for key in keys:
            values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            if values:
                table.add_row(key, _fmt(values[0]), _fmt(values[-1]), _fmt(min(values)), _fmt(max(values)))
        console.print(table)
    else:
        console.print("no metrics yet")


@app.command()
def schema() -> None:
    """Print the JSON schema of an experiment spec (every field with its description)."""
    from ladder.spec import ExperimentSpec

    print(json.dumps(ExperimentSpec.model_json_schema(), indent=2))


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
