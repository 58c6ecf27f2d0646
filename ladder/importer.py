"""Import results of runs trained elsewhere (someone's W&B, a published grid) as real run directories.

Why: a ladder's rungs may have been trained by someone else (Marin published its four rungs' eval
curves), and the forecast, the plot and the report should read them exactly as they read our own
runs. So an import writes what the executor would have written for the step, in the step's own run
directory (same name, same fingerprint): spec.json as the executor writes it, metrics.jsonl, result.json
and a status.json whose history says "imported" and where from. Nothing is trained, nothing is faked:
the rows are the external run's logged points, and a run that crashed is imported as failed.

Rules:
- An existing run directory is never overwritten. Importing the same rows from the same source again
  is a no-op; anything else already there (our own attempt, another import) is an error that says so.
- status.json is written last, so an interrupted import leaves no "done" step behind.

FLOP convention of imported Marin rows (the choice, written down here): metrics.jsonl ``flops`` is
Marin's forecast x-axis, C = 3 x (forward FLOPs per token without the lm_head term, Marin's
``lm_flops_per_token``) x tokens, i.e. the ``FLOPS`` constants of Marin's ``plot_scaling_ladder.py``.
That is what makes the matched-progress baseline on the imported runs give Marin's 2.0388 at g = 1:
the per-fraction laws are fits in C, and the lm_head share differs by rung (50% of d768's FLOPs, 3%
of the hero's), so counting it changes the slopes. A forecast of the hero from these runs must use
the same x-axis: ``marin_forecast_target(step)``.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Literal, Optional

import typer

from ladder.dag import DAG, TrainStep
from ladder.executor import StepTask, _write_spec
from ladder.spec import canonical_json
from ladder.store import Store, resolve_root

MARIN_PUBLISHED = "marin-published"
MARIN_SOURCE = (
    "Marin W&B project marin-community/marin_moe, eval_dropless/paloma/macro_loss every 5% "
    "(forecasting/data/marin_535b_ladder/ladder_eval_grid.json, via fudan-chen/pretrain)"
)
# Marin's W&B run of each rung (reference §0); d2048 crashed at step 16,063 of 20,072 and was not resumed.
MARIN_RUNS = {"d768": "rav-ladder-d768-v2", "d1024": "rav-ladder-d1024", "d1536": "rav-ladder-d1536", "d2048": "rav-ladder-d2048-v3"}
MARIN_CRASHED = {"d2048": "crashed at step 16,063 of 20,072 (80.0%), 31 steps after its data-phase switch; never resumed"}
MARIN_METRIC = "eval_dropless/paloma/macro_loss"
MARIN_HERO_SOURCE = (
    "Marin W&B run hero-12d8b6f0-dee637, Paloma evals steps 0-38,999 "
    "(forecasting/data/marin_535b_ladder/hero_eval_paloma_subset.csv, via fudan-chen/pretrain)"
)


class ImportConflict(RuntimeError):
    """The step's run directory already holds a different history; importing would overwrite it."""


def rows_digest(rows: list[dict[str, Any]]) -> str:
    return hashlib.sha256(canonical_json(rows).encode()).hexdigest()


def import_external_run(
    store: Store,
    dag: DAG,
    step_name: str,
    rows: list[dict[str, Any]],
    *,
    source: str,
    state: Literal["done", "failed", "interrupted"] = "done",
    note: str | None = None,
    include_lm_head: bool = True,
) -> str:
    """Write `rows` (each with ``step`` and ``eval/loss``) as the run of `step_name`: finished ('done'),
    crashed ('failed'), or a prefix of a run still going elsewhere ('interrupted', e.g. a live hero).

    ``tokens`` and ``flops`` (cumulative) are filled from the spec where a row lacks them: step x tokens
    per step, and step x 3 x forward FLOPs per token x tokens per step in the spec's accounting
    convention, with the lm_head term when ``include_lm_head`` (our trainer's metrics do), without it
    otherwise (Marin's forecast x-axis). Returns the run directory (a store URL or path).
    """
    step = dag[step_name]
    if not isinstance(step, TrainStep):
        raise ValueError(f"{step_name!r} is a {step.kind} step; only training steps have runs to import.")
    if state not in ("done", "failed", "interrupted"):
        raise ValueError(f"state={state!r}; an imported run is 'done', 'failed' or 'interrupted' (still going elsewhere).")
    derived = step.derived
    per_token = derived.flops_per_token if include_lm_head else derived.flops_per_token_no_lm_head
    flops_per_step = 3.0 * per_token * derived.tokens_per_step
    metrics = []
    for i, row in enumerate(sorted(rows, key=lambda r: r.get("step", -1))):
        if "step" not in row or "eval/loss" not in row:
            raise ValueError(f"row {i} of {step_name!r} needs 'step' and 'eval/loss'; got keys {sorted(row)}.")
        s = int(row["step"])
        if not 0 <= s <= derived.num_steps:
            raise ValueError(f"row {i} of {step_name!r} has step {s}, outside the spec's 0..{derived.num_steps}.")
        metrics.append({"step": s, "tokens": s * derived.tokens_per_step, "flops": s * flops_per_step, **row})
    if not metrics:
        raise ValueError(f"no rows to import for {step_name!r}.")
    digest = rows_digest(metrics)

    fp = dag.fingerprints[step_name]
    run_dir = store.run_dir(step_name, fp)
    status = store.read_status(run_dir)
    if status is not None or store.exists(f"{run_dir}/metrics.jsonl"):
        same = [e for e in (status or {}).get("history", []) if e.get("event") == "imported" and e.get("digest") == digest
                and e.get("source") == source]
        if same and status.get("state") == state:
            return store.url_of(run_dir)
        events = [e.get("event") for e in (status or {}).get("history", [])]
        raise ImportConflict(
            f"{store.url_of(run_dir)} already holds a run of {step_name!r} (state {(status or {}).get('state', 'unknown')}, "
            f"history {events or 'none'}) that differs from this import; it is never overwritten. Delete that directory "
            "to replace it, or import into another --root."
        )

    task = StepTask(step=step, fingerprint=fp, store_url=store.url, owner="import", deps={},
                    dependency_fingerprints={d: dag.fingerprints[d] for d in step.deps})
    _write_spec(store, run_dir, task)
    text = "".join(json.dumps(m, sort_keys=True, allow_nan=False) + "\n" for m in metrics)
    store.fs.pipe_file(f"{run_dir}/metrics.jsonl", text.encode())
    last = metrics[-1]
    result = {
        "completed": state == "done",
        "steps": last["step"],
        "num_steps": derived.num_steps,
        "tokens": last["tokens"],
        "flops": last["flops"],
        "flops_convention": f"{derived.accounting}, lm_head {'included' if include_lm_head else 'excluded'}",
        "final_train_loss": None,
        "final_eval_loss": float(last["eval/loss"]),
        "imported_from": source,
    }
    store.write_json(f"{run_dir}/result.json", result)
    now = time.time()

    def record(current: dict[str, Any]) -> dict[str, Any]:
        if current.get("history"):  # someone else wrote this step's status since we looked
            raise ImportConflict(f"{store.url_of(run_dir)} gained a history while importing; its status was left as it is.")
        event = {"event": "imported", "at": now, "source": source, "state": state, "rows": len(metrics), "digest": digest}
        if note:
            event["note"] = note
        new = {"state": state, "attempts": 0, "lease": None, "finished_at": now, "history": [event],
               "provenance": {"source": source, "note": note, "rows": len(metrics), "digest": digest}}
        if state == "failed":
            new["last_error"] = f"imported as failed: {note or 'the external run did not finish'}"
        return new

    store.update_status(run_dir, record)
    return store.url_of(run_dir)


def marin_published_rows(path: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Marin's eval grid as metric rows per rung: ``eval/loss`` (and the original key) at each logged step."""
    grid = json.loads(Path(path).read_text())
    return {
        rung: [{"step": int(step), "eval/loss": float(loss), MARIN_METRIC: float(loss)} for step, loss in points]
        for rung, points in grid.items()
    }


def marin_hero_rows(path: str | Path) -> list[dict[str, Any]]:
    """The live hero's published Paloma evals (hero_eval_paloma_subset.csv) as metric rows, W&B names restored."""
    import csv

    rows = []
    with open(path, newline="") as handle:
        for record in csv.DictReader(handle):
            row: dict[str, Any] = {"step": int(record.pop("step"))}
            for key, value in record.items():
                row[key.replace("_paloma_", "/paloma/", 1)] = float(value)
            row["eval/loss"] = row[MARIN_METRIC]
            rows.append(row)
    return rows


def _marin_data() -> Path:
    from forecasting.public_data import data_dir

    return data_dir() / "marin_535b_ladder"


def _default_grid() -> Path:
    return _marin_data() / "ladder_eval_grid.json"


def import_marin_hero_prefix(store: Store, dag: DAG, *, step_name: str = "hero", csv_path: str | Path | None = None) -> str:
    """Register the live hero's published first ~10% (steps 0..38,999) as the hero step's interrupted run.

    'interrupted' is what it is here: a prefix of a run that goes on elsewhere. The overlay, the plot and
    ``forecast --refit`` read it like a live run of ours; the rows use the same x-axis as the rungs.
    """
    rows = marin_hero_rows(csv_path or _marin_data() / "hero_eval_paloma_subset.csv")
    return import_external_run(
        store, dag, step_name, rows, source=MARIN_HERO_SOURCE, state="interrupted",
        note="W&B run hero-12d8b6f0-dee637 (390,251 steps), published evals to step 38,999 (~10%)", include_lm_head=False,
    )


def import_marin_published(store: Store, dag: DAG, *, grid_path: str | Path | None = None) -> dict[str, str]:
    """Register Marin's four published rungs as runs of `dag` (experiments/marin_535b.py); returns step -> run dir.

    d768, d1024 and d1536 finished and are imported as done. d2048 crashed at 80% and is imported as
    what it is: a failed run with its 16 logged fractions (5%..80%) and nothing invented after them. No
    extrapolation and no +0.005 are written into its run: the matched-progress forecasters handle the
    missing fractions themselves (ours fits the fractions the rungs reached; ``marin_baseline`` applies
    Marin's own extension). A forecast reads it with ``table_from_steps(..., require_done=False)``.
    """
    rows = marin_published_rows(grid_path or _default_grid())
    out = {}
    for rung, points in rows.items():
        crashed = MARIN_CRASHED.get(rung)
        note = f"W&B run {MARIN_RUNS.get(rung, rung)}" + (f"; {crashed}" if crashed else "")
        out[rung] = import_external_run(
            store, dag, rung, points, source=MARIN_SOURCE, state="failed" if crashed else "done", note=note,
            include_lm_head=False,
        )
    return out


def marin_forecast_target(step: TrainStep):
    """The forecaster's target for a Marin step: `ladder.fitting.target_spec` already puts specs with
    Marin's accounting on Marin's x-axis (C without the lm_head), like the imported rows."""
    from ladder.fitting import target_spec

    return target_spec(step)


def import_command(
    experiment: str = typer.Argument(..., help="Experiment file or module (experiments/marin_535b.py)."),
    source: str = typer.Argument(..., help=f"What to import: {MARIN_PUBLISHED}."),
    root: Optional[str] = typer.Option(None, "--root", help="Artifact root (default $LADDER_ROOT or ./ladder-runs)."),
) -> None:
    """`ladder import EXP SOURCE`: register externally trained runs as finished (or failed) steps.

    SOURCE: 'marin-published': Marin's four 535B ladder rungs and the hero's published first ~10%
    (forecasting/data/marin_535b_ladder, shipped in the package).
    """
    from ladder.loader import ExperimentError, load_experiment

    if source != MARIN_PUBLISHED:
        typer.echo(f"error: unknown import source {source!r}; known: {MARIN_PUBLISHED}.", err=True)
        raise typer.Exit(2)
    try:
        exp = load_experiment(experiment)
    except ExperimentError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    store = Store(resolve_root(root))
    try:
        dirs = import_marin_published(store, exp.dag)
        if "hero" in exp.dag.steps:
            dirs["hero"] = import_marin_hero_prefix(store, exp.dag)
    except (ImportConflict, ValueError, FileNotFoundError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1 if isinstance(error, ImportConflict) else 2) from None
    for name, run_dir in dirs.items():
        status = store.read_status(store.run_dir(name, exp.dag.fingerprints[name])) or {}
        typer.echo(f"{name}: {status.get('state')} <- {run_dir}")
