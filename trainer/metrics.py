"""Where metrics go: an append-only metrics.jsonl, W&B, and a rich progress bar.

metrics.jsonl is the run's record of truth (the orchestrator and the forecaster read it); W&B and the
progress bar are views. So the jsonl line is flushed as it is written, a reader tolerates the torn last
line a crash leaves, and a W&B failure is logged and never stops training.

The W&B view speaks Levanter's dialect, so our runs sit in the same panels as Marin's public runs: besides
the metric keys it logs ``global_step``, ``run_progress``, ``throughput/duration``,
``throughput/examples_per_second`` and ``throughput/mfu`` in percent (see ``levanter_keys``); its group,
job type, tags, entity and folder come from W&B's own environment variables, which the orchestrator sets.

Resumes append too: after a restart from the checkpoint at step ``s`` the trainer writes a marker
line ``{"event": "resume", "step": s, ...}`` and replays steps after ``s``. ``read_metrics`` drops the
rows a resume superseded (those with a step after the marker's step written before it), so the table
it returns has each step once, as the run that finished produced it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
from typing import Any

import fsspec

log = logging.getLogger(__name__)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


class JsonlSink:
    """Append-only JSON-lines file; each line is flushed (and fsynced when ``durable``)."""

    def __init__(self, path: str, *, durable: bool = False):
        self.path = path
        self.durable = durable
        if "://" not in path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = fsspec.open(path, "a").open()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _jsonable(v) for k, v in record.items()}, allow_nan=False)
        self._file.write(line + "\n")
        self._file.flush()
        if self.durable and hasattr(self._file, "fileno"):
            try:
                os.fsync(self._file.fileno())
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        self._file.close()


class NullSink:
    """Where a non-primary process of a multi-process run writes its metrics: nowhere."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: str, *, raw: bool = False) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a torn or unparsable line is skipped (only the last can be torn).

    Unless ``raw``, resume markers are applied and removed: rows written before a
    ``{"event": "resume", "step": s}`` line with ``step > s`` are dropped (the resumed run replays
    them), so every (step, kind of line) appears once.
    """
    with fsspec.open(path, "r") as f:
        text = f.read()
    rows: list[dict[str, Any]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows if raw else apply_resume_markers(rows)


def apply_resume_markers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop the rows each ``{"event": "resume", "step": s}`` marker supersedes (step > s, written
    before it) and the markers themselves: what is left is the history of the run that continued."""
    kept: list[dict[str, Any]] = []
    for row in rows:
        if row.get("event") == "resume":
            kept = [r for r in kept if r.get("step", 0) <= row["step"]]
            continue
        kept.append(row)
    return kept


def resolve_wandb_mode(mode: str) -> str:
    """TrainConfig.wandb -> a wandb.init mode. WANDB_MODE in the environment wins over 'auto'."""
    if mode != "auto":
        return mode
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode in ("online", "offline", "disabled"):
        return env_mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


DEFAULT_PROJECT = "ladder"  # TrainConfig.wandb_project's default: WANDB_PROJECT in the environment replaces it
MAX_TAG_CHARS = 64  # W&B rejects longer tags


def wandb_tags(value: str | list[str] | dict[str, str] | None) -> list[str]:
    """W&B tags from a comma-separated string (WANDB_TAGS), a list, or a spec's tags dict ({k: v} -> "k:v")."""
    if not value:
        return []
    if isinstance(value, dict):
        items = [f"{k}:{v}" for k, v in value.items()]
    elif isinstance(value, str):
        items = value.split(",")
    else:
        items = list(value)
    out: list[str] = []
    for item in (str(i).strip()[:MAX_TAG_CHARS] for i in items):
        if item and item not in out:
            out.append(item)
    return out


def _job_shape(config: dict[str, Any]) -> dict[str, float]:
    """num_steps, batch_size and tokens_per_step of a TrainJob's config dict (empty when it is not one)."""
    try:
        from trainer.config import TrainJob

        job = TrainJob.model_validate(config)
        return {"num_steps": job.num_steps, "batch_size": job.train.batch_size, "tokens_per_step": job.tokens_per_step}
    except Exception:  # noqa: BLE001 - another config only loses the derived keys
        return {}


def levanter_keys(record: dict[str, Any], shape: dict[str, float]) -> dict[str, Any]:
    """The keys Levanter logs beside ours, so a panel of Marin's public W&B runs plots our runs too:
    ``global_step``, ``run_progress`` (step / num_steps), ``throughput/duration`` (seconds per step),
    ``throughput/examples_per_second``, ``throughput/gflops_per_second``, and ``throughput/mfu`` in
    Levanter's unit, percent of the peak (metrics.jsonl keeps it a fraction)."""
    step = int(record["step"])
    out: dict[str, Any] = {"global_step": step}
    if shape.get("num_steps"):
        out["run_progress"] = step / shape["num_steps"]
    speed = record.get("throughput/tokens_per_second")
    if isinstance(speed, (int, float)) and speed > 0 and shape.get("tokens_per_step"):
        duration = shape["tokens_per_step"] / speed
        out["throughput/duration"] = duration
        out["throughput/examples_per_second"] = shape["batch_size"] / duration
        if isinstance(record.get("flops"), (int, float)) and step > 0:
            out["throughput/gflops_per_second"] = record["flops"] / step / duration / 1e9
    mfu = record.get("throughput/mfu")
    if isinstance(mfu, (int, float)):
        out["throughput/mfu"] = 100.0 * mfu
    return out


class WandbSink:
    """A W&B run for one run directory; any failure turns the sink off with one warning.

    Where and under which labels, each argument falling back to W&B's own environment variable (so an
    orchestrator, or a user, sets them without the trainer knowing why): ``wandb_dir`` (WANDB_DIR, else
    ``run_dir``; the client writes ``{wandb_dir}/wandb/offline-run-*`` offline, ready for ``wandb sync``),
    ``group`` (WANDB_RUN_GROUP), ``job_type`` (WANDB_JOB_TYPE), ``tags`` (WANDB_TAGS, comma-separated),
    ``entity`` (WANDB_ENTITY). ``project``: the spec's; WANDB_PROJECT replaces the default "ladder" only.
    The run id is a hash of the run directory, so a resumed run continues the same W&B run.
    """

    def __init__(self, *, mode: str, project: str, run_dir: str, config: dict[str, Any], name: str | None = None,
                 group: str | None = None, job_type: str | None = None, tags: str | list[str] | dict[str, str] | None = None,
                 entity: str | None = None, wandb_dir: str | None = None):
        self.run = None
        self.wandb_dir: str | None = None
        self._shape = _job_shape(config)
        mode = resolve_wandb_mode(mode)
        if mode == "disabled" or "://" in run_dir:
            return
        try:
            import wandb

            wandb_dir = wandb_dir or os.environ.get("WANDB_DIR") or run_dir
            if project == DEFAULT_PROJECT:
                project = os.environ.get("WANDB_PROJECT") or project
            os.makedirs(os.path.join(wandb_dir, "wandb"), exist_ok=True)
            run_id = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
            self.run = wandb.init(
                project=project,
                entity=entity or os.environ.get("WANDB_ENTITY") or None,
                name=name or os.path.basename(os.path.abspath(run_dir)),
                id=run_id,
                group=group or os.environ.get("WANDB_RUN_GROUP") or None,
                job_type=job_type or os.environ.get("WANDB_JOB_TYPE") or None,
                tags=wandb_tags(tags if tags is not None else os.environ.get("WANDB_TAGS")) or None,
                resume="allow",
                dir=wandb_dir,
                mode=mode,
                config=config,
                settings=wandb.Settings(silent=True, console="off"),
                reinit="finish_previous",
            )
            self.wandb_dir = os.path.join(wandb_dir, "wandb")
        except Exception as err:  # noqa: BLE001 - W&B must never kill training
            log.warning("W&B disabled for this run: init failed: %s", err)
            self.run = None

    def write(self, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            step = int(record["step"])
            payload = {k: v for k, v in record.items() if k not in ("step", "time", "event") and v is not None}
            payload.update(levanter_keys(record, self._shape))
            self.run.log(payload, step=step)
        except Exception as err:  # noqa: BLE001
            log.warning("W&B logging failed, turning W&B off for this run: %s", err)
            self.close()

    def summary(self, values: dict[str, Any]) -> None:
        """Set the run's summary (what W&B's run table shows), e.g. a forecast's final loss and band."""
        if self.run is None:
            return
        try:
            self.run.summary.update(values)
        except Exception as err:  # noqa: BLE001
            log.warning("W&B summary not written: %s", err)

    def close(self) -> None:
        if self.run is None:
            return
        try:
            self.run.finish()
        except Exception as err:  # noqa: BLE001
            log.warning("W&B finish failed: %s", err)
        self.run = None


class ProgressBar:
    """A rich progress bar over steps, shown only when asked for and stderr is a terminal."""

    def __init__(self, *, total: int, start: int, enabled: bool, description: str = "train"):
        self._progress = None
        if not (enabled and sys.stderr.isatty()):
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(description, total=total, completed=start, status="")

    def update(self, step: int, status: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=status)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
