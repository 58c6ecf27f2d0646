"""Where metrics go: an append-only metrics.jsonl, W&B, and a rich progress bar.

metrics.jsonl is the run's record of truth (the orchestrator and the forecaster read it); W&B and the
progress bar are views. So the jsonl line is flushed as it is written, a reader tolerates the torn last
line a crash leaves, and a W&B failure is logged and never stops training.

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


class WandbSink:
    """W&B run in ``run_dir/wandb``; any failure turns the sink off with one warning."""

    def __init__(self, *, mode: str, project: str, run_dir: str, config: dict[str, Any], name: str | None = None):
        self.run = None
        mode = resolve_wandb_mode(mode)
        if mode == "disabled" or "://" in run_dir:
            return
        try:
            import wandb

            wandb_dir = os.path.join(run_dir, "wandb")
            os.makedirs(wandb_dir, exist_ok=True)
            run_id = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
            self.run = wandb.init(
                project=project,
                name=name or os.path.basename(os.path.abspath(run_dir)),
                id=run_id,
                resume="allow",
                dir=wandb_dir,
                mode=mode,
                config=config,
                settings=wandb.Settings(silent=True, console="off"),
                reinit="finish_previous",
            )
        except Exception as err:  # noqa: BLE001 - W&B must never kill training
            log.warning("W&B disabled for this run: init failed: %s", err)
            self.run = None

    def write(self, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            step = int(record["step"])
            payload = {k: v for k, v in record.items() if k not in ("step", "time", "event") and v is not None}
            self.run.log(payload, step=step)
        except Exception as err:  # noqa: BLE001
            log.warning("W&B logging failed, turning W&B off for this run: %s", err)
            self.close()

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
