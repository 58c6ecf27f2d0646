"""Reading what runs wrote: metrics.jsonl (append-only, possibly still growing) and summaries of it.

Runs are read while they are being written, from any fsspec store, so a torn last line (a writer
caught mid-append) is skipped, never fatal. A malformed line in the middle is reported once and
skipped too: one bad line must not hide a run's history.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from ladder.store import Store, StoreError


def read_metrics(store: Store, run_dir: str, *, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Rows of run_dir/metrics.jsonl from byte `offset`; returns (rows, offset to continue from)."""
    return read_jsonl(store, f"{run_dir}/metrics.jsonl", offset=offset)


def read_jsonl(store: Store, path: str, *, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Complete JSON-object lines of an append-only file from byte `offset`; ([], offset) if it is missing."""
    try:
        with store.fs.open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], offset
    rows: list[dict[str, Any]] = []
    consumed = 0
    lines = data.split(b"\n")
    for index, line in enumerate(lines):
        is_last = index == len(lines) - 1
        if is_last and line:  # no newline yet: a torn or in-flight line; read it next time
            break
        consumed += len(line) + (0 if is_last else 1)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            warnings.warn(f"{store.url_of(path)}: skipped a malformed line at byte {offset + consumed - len(line) - 1}")
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows, offset + consumed


def torn_tail(store: Store, path: str, offset: int) -> str | None:
    """A warning naming the file and line when the bytes after `offset` (what read_jsonl left) are a torn line."""
    try:
        with store.fs.open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return None
    tail = data[offset:]
    if not tail.strip():
        return None
    try:
        json.loads(tail)
        return None  # a whole line still waiting for its newline (a writer mid-append)
    except (json.JSONDecodeError, UnicodeDecodeError):
        line = data[:offset].count(b"\n") + 1
        return f"{store.url_of(path)} line {line} is torn (cut off mid-line) and was ignored"


@dataclass
class RunSummary:
    step: int | None = None
    num_steps: int | None = None
    tokens: float | None = None
    flops: float | None = None
    train_loss: float | None = None
    eval_loss: float | None = None
    eval_step: int | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def progress(self) -> float | None:
        if self.step is None or not self.num_steps:
            return None
        return min(1.0, self.step / self.num_steps)


def summarize(store: Store, run_dir: str) -> RunSummary:
    from trainer.metrics import apply_resume_markers

    rows, offset = read_metrics(store, run_dir)
    rows = apply_resume_markers(rows)
    summary = RunSummary()
    spec = store.read_json(f"{run_dir}/spec.json") or {}
    summary.num_steps = (spec.get("derived") or {}).get("num_steps")
    for row in rows:
        if "step" in row:
            summary.step = row["step"]
        summary.tokens = row.get("tokens", summary.tokens)
        summary.flops = row.get("flops", summary.flops)
        if _finite(row.get("train/loss")):
            summary.train_loss = row["train/loss"]
        if _finite(row.get("eval/loss")):
            summary.eval_loss, summary.eval_step = row["eval/loss"], row.get("step")
    torn = torn_tail(store, f"{run_dir}/metrics.jsonl", offset)
    if torn:
        try:
            result = store.read_json(f"{run_dir}/result.json") or {}
        except StoreError:
            result = {}
        if result.get("completed") and isinstance(result.get("steps"), int) and summary.eval_step != result["steps"]:
            # the torn line was the finished run's last: result.json has its step and final eval
            summary.step = result["steps"]
            summary.tokens = result.get("tokens", summary.tokens)
            summary.flops = result.get("flops", summary.flops)
            if _finite(result.get("final_eval_loss")):
                summary.eval_loss, summary.eval_step = result["final_eval_loss"], result["steps"]
            torn += f"; the finished run's final eval (step {result['steps']}) is taken from result.json"
        summary.warnings.append(torn)
    return summary


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
