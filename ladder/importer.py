"""Import results of runs trained elsewhere (someone's W&B, a published grid) as real run directories.

Why: a ladder's rungs may have been trained by someone else (Marin published its four rungs' eval
curves), and the forecast, the plot and the report should read them exactly as they read our own
runs. So an import writes what the executor would have written for the step, in the step's own run
directory (same name, same fingerprint): spec.json as the executor writes it, metrics.jsonl, result.json
and a status.json whose history says "imported" and where from. Nothing is trained, nothing is faked:
the rows are the external run's logged points, and a run that crashed is imported as failed.

Sources: `ladder import EXP marin-published` (Marin's published grid), and `ladder import EXP STEP SOURCE`
for any run trained elsewhere: a CSV/TSV/parquet export (W&B history or panel export, OLMo-style eval
tables), a JSON-lines metrics file, or a W&B offline run directory (its .wandb transaction log, read by
`WandbLog`), on any fsspec URL. forecasting.external maps the columns to our metric keys and aligns
sparse ones by step; the step's spec supplies params, tokens per step, FLOPs and the schedule, so the
source needs only a step and a loss. import.json in the run directory records the source and the mapping.
`SourceReader` reads a source incrementally, which is what ladder.attach follows a live run with.

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
import math
import time
from pathlib import Path, PurePosixPath
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
    extra_files: dict[str, Any] | None = None,
) -> str:
    """Write `rows` (each with ``step`` and ``eval/loss``, or ``train/loss`` on the lines between evals) as the run
    of `step_name`: finished ('done'),
    crashed ('failed'), or a prefix of a run still going elsewhere ('interrupted', e.g. a live hero).

    ``tokens`` and ``flops`` (cumulative) are filled from the spec where a row lacks them: step x tokens
    per step, and step x 3 x forward FLOPs per token x tokens per step in the spec's accounting
    convention, with the lm_head term when ``include_lm_head`` (our trainer's metrics do), without it
    otherwise (Marin's forecast x-axis). `extra_files` (name -> JSON) are written beside them, before
    status.json (e.g. import.json: where the rows came from). Returns the run directory (a store URL or path).
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
        if "step" not in row or not ("eval/loss" in row or "train/loss" in row):
            raise ValueError(f"row {i} of {step_name!r} needs 'step' and 'eval/loss' (or 'train/loss'); got keys {sorted(row)}.")
        s = int(row["step"])
        if not 0 <= s <= derived.num_steps:
            raise ValueError(f"row {i} of {step_name!r} has step {s}, outside the spec's 0..{derived.num_steps}.")
        metrics.append({"step": s, "tokens": s * derived.tokens_per_step, "flops": s * flops_per_step, **row})
    evals = [m for m in metrics if "eval/loss" in m]
    if not evals:
        raise ValueError(f"no rows to import for {step_name!r}: none has an 'eval/loss'.")
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
        "final_eval_loss": float(evals[-1]["eval/loss"]),
        "imported_from": source,
    }
    if "train/loss" in last:
        result["final_train_loss"] = float(last["train/loss"])
    store.write_json(f"{run_dir}/result.json", result)
    for name, payload in (extra_files or {}).items():
        store.write_json(f"{run_dir}/{name}", payload)
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


# ---------------------------------------------------------------------------------------- runs trained elsewhere
#
# `ladder import EXP STEP SOURCE` (and `ladder attach`, ladder/attach.py): SOURCE is a CSV/TSV/parquet export, a
# JSON-lines metrics file or a W&B offline run directory, on any fsspec URL. Column names are mapped by
# forecasting.external; params, tokens per step, FLOPs and the schedule come from the step's spec.

IMPORT_FILE = "import.json"
FINISHED_FRACTION = 0.999  # a run whose last point reaches this share of its planned steps is finished (forecasting's rule)


def _external():
    from forecasting import external

    return external


def source_kind(source: str) -> str:
    """'wandb' (an offline run directory or its .wandb file), 'jsonl', 'csv' or 'parquet', from the path alone."""
    import fsspec

    path = source.rstrip("/")
    suffix = PurePosixPath(path.split("?")[0]).suffix.lower()
    if suffix == ".wandb":
        return "wandb"
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".csv", ".tsv", ".txt"):
        return "csv"
    fs, fpath = fsspec.core.url_to_fs(path)
    if fs.isdir(fpath):
        return "wandb"
    if not fs.exists(fpath):
        raise _external().ExternalFormatError(f"{source}: no such file or directory; check the path (a local path or an fsspec URL).")
    raise _external().ExternalFormatError(
        f"{source}: unknown format {suffix or '(no suffix)'!r}; give a .csv, .tsv, .parquet or .jsonl file, "
        "or a W&B offline run directory (wandb/offline-run-*)."
    )


def wandb_log_path(source: str) -> str:
    """The transaction log (run-*.wandb) of a W&B run directory, of a `wandb/` folder holding one run, or `source` itself."""
    import fsspec

    error = _external().ExternalFormatError
    fs, path = fsspec.core.url_to_fs(source.rstrip("/"))
    proto = source.split("://")[0] + "://" if "://" in source else ""
    if path.endswith(".wandb"):
        if not fs.exists(path):
            raise error(f"{source}: no such file; check the path of the W&B run's .wandb file.")
        return proto + path
    if not fs.isdir(path):
        raise error(f"{source}: no such W&B run directory; give wandb/offline-run-* (or its run-*.wandb file).")
    logs = sorted(fs.glob(f"{path}/*.wandb"))
    if not logs:
        runs = sorted(p for p in fs.glob(f"{path}/*run-*") if fs.isdir(p) and fs.glob(f"{p}/*.wandb"))
        if len(runs) == 1:
            logs = sorted(fs.glob(f"{runs[0]}/*.wandb"))
        elif runs:
            names = ", ".join(PurePosixPath(r).name for r in runs[:5])
            raise error(f"{source} holds {len(runs)} W&B runs ({names}{', ...' if len(runs) > 5 else ''}); give one of them.")
    if not logs:
        raise error(f"{source} holds no W&B transaction log (run-*.wandb); give a wandb/offline-run-* directory.")
    if len(logs) > 1:
        raise error(f"{source} holds {len(logs)} .wandb files; give the one to read.")
    return proto + logs[0]


class WandbLog:
    """Incremental reader of a W&B transaction log, the `run-<id>.wandb` file the wandb client writes offline.

    The format is documented by the client: a 7-byte header (':W&B', magic 0xBEE1, version 0), then LevelDB
    log blocks of 32 KiB whose records (7-byte header: CRC-32 seeded with the record type, length, type
    FULL/FIRST/MIDDLE/LAST) carry serialized `wandb.proto.wandb_internal_pb2.Record` messages. The client has no
    Python reader of it any more (wandb >= 0.19 writes it from its Go core), so this follows the format and
    parses each record with the client's own protobuf classes. History records become rows ({key: value},
    `_step`); the exit record says the run finished. A run still being written ends in a partial record
    (the client flushes every `x_transaction_log_flush_interval` seconds, 15 by default): reading stops
    before it and resumes there at the next `read()`.
    """

    BLOCK = 32768
    HEADER = 7

    def __init__(self, url: str):
        import fsspec

        self.url = url
        self.fs, self.path = fsspec.core.url_to_fs(url)
        self.offset = 0  # byte position after the last complete record read
        self.finished = False
        self.exit_code: int | None = None
        self.run_info: dict[str, Any] = {}

    def _error(self, message: str):
        return _external().ExternalFormatError(f"{self.url} {message}")

    def read(self) -> list[dict[str, Any]]:
        """History rows written since the last call (complete records only)."""
        import struct
        import zlib

        try:
            from wandb.proto import wandb_internal_pb2
        except ImportError:  # pragma: no cover - wandb is a dependency
            raise self._error("is a W&B run; reading it needs the wandb package (pip install wandb).") from None
        with self.fs.open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        base = self.offset
        pos = 0
        if base == 0:
            if len(data) < self.HEADER:
                return []
            ident, magic, version = struct.unpack("<4sHB", data[:self.HEADER])
            if ident != b":W&B" or magic != 0xBEE1:
                raise self._error("is not a W&B transaction log (no ':W&B' header); give the run-*.wandb file of an offline run.")
            if version != 0:
                raise self._error(f"is a W&B transaction log of format version {version}; this reader knows version 0.")
            pos = self.HEADER
            self.offset = self.HEADER
        rows: list[dict[str, Any]] = []
        parts: list[bytes] = []
        while True:
            left = self.BLOCK - (base + pos) % self.BLOCK
            if left < self.HEADER:  # the block's zero trailer
                if len(data) - pos < left:
                    break
                pos += left
                continue
            if len(data) - pos < self.HEADER:
                break
            checksum, length, kind = struct.unpack("<IHB", data[pos:pos + self.HEADER])
            if kind == 0 or len(data) - pos - self.HEADER < length:
                break  # not written yet (zeros) or cut mid-record: read it next time
            payload = data[pos + self.HEADER:pos + self.HEADER + length]
            if zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != checksum:
                if len(data) - pos <= self.BLOCK:
                    break  # the tail of a file still being written
                raise self._error(f"is corrupt at byte {base + pos} (record checksum mismatch).")
            pos += self.HEADER + length
            if kind == 1:
                parts = [payload]
            elif kind == 2:
                parts = [payload]
                continue
            elif kind in (3, 4):
                if not parts:
                    raise self._error(f"is corrupt at byte {base + pos} (a continued record without its start).")
                parts.append(payload)
                if kind == 3:
                    continue
            else:
                raise self._error(f"is corrupt at byte {base + pos} (record type {kind}).")
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            self.offset = base + pos
            self._take(record, rows)
        return rows

    def _take(self, record, rows: list[dict[str, Any]]) -> None:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                try:
                    value = json.loads(item.value_json)
                except ValueError:
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    row[key] = value
            if "_step" not in row and record.history.HasField("step"):
                row["_step"] = record.history.step.num
            rows.append(row)
        elif kind == "exit":
            self.finished = True
            self.exit_code = int(record.exit.exit_code)
        elif kind == "run":
            run = record.run
            self.run_info = {"run_id": run.run_id, "display_name": run.display_name, "project": run.project}


class SourceReader:
    """Rows of SOURCE in its own column names, read incrementally: `poll()` returns what was added since the last call.

    JSON-lines and CSV files are read from the byte offset reached (complete lines only, so a line being
    written is read next time); a parquet file cannot grow in place and is read again when its size changes;
    a W&B run through `WandbLog`. A file that shrank was rewritten: it is read again from the start (callers
    skip the steps they already hold).
    """

    def __init__(self, source: str):
        import fsspec

        self.source = source
        self.kind = source_kind(source)
        self.url = wandb_log_path(source) if self.kind == "wandb" else source
        self.fs, self.path = fsspec.core.url_to_fs(self.url)
        if not self.fs.exists(self.path):
            raise _external().ExternalFormatError(f"{source}: no such file; check the path (a local path or an fsspec URL).")
        self.wandb = WandbLog(self.url) if self.kind == "wandb" else None
        self.offset = 0
        self.header: str | None = None
        self.size = -1

    @property
    def finished(self) -> bool:
        return bool(self.wandb and self.wandb.finished)

    def poll(self, *, final: bool = False):
        import pandas as pd

        ext = _external()
        if self.wandb is not None:
            return pd.DataFrame(self.wandb.read())
        size = self.fs.size(self.path)
        if self.kind == "parquet":
            if size == self.size:
                return pd.DataFrame()
            self.size = size
            return ext.read_export(self.url)
        if size < self.offset:
            self.offset, self.header = 0, None
        if size == self.offset:
            return pd.DataFrame()
        with self.fs.open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        cut = len(data) if final else data.rfind(b"\n") + 1
        if cut <= 0:
            return pd.DataFrame()
        try:
            text = data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            raise ext.ExternalFormatError(f"{self.source} is not a {self.kind} text file (it holds binary data); "
                                          "check the file or its suffix.") from None
        self.offset += cut
        if self.kind == "jsonl":
            return ext.jsonl_frame(text.splitlines(), self.source)
        if self.header is None:
            self.header, _, text = text.partition("\n")
        if not text.strip():
            return pd.DataFrame()
        return ext.read_export(self.url, text=self.header + "\n" + text)

    def read_all(self):
        """Everything the source holds now (for a one-off import)."""
        import pandas as pd

        if self.wandb is not None:
            return pd.DataFrame(self.wandb.read())
        return _external().read_export(self.url)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "format": self.kind}
        if self.wandb is not None:
            out.update(wandb_file=self.url, **self.wandb.run_info, finished=self.wandb.finished, exit_code=self.wandb.exit_code)
        return out


def absolute_source(source: str) -> str:
    """A local path made absolute (what import.json records); URLs as given."""
    import os

    return source if "://" in source else os.path.abspath(source)


def run_rows(step: TrainStep, frame, *, include_lm_head: bool, notes: list[str]) -> list[dict[str, Any]]:
    """Aligned rows of forecasting.external as metrics.jsonl lines of `step`: tokens from the source where it logs
    them (else step x tokens per step), FLOPs always from the spec's accounting (the source's own count, if any,
    kept as ``external/flops``), NaN cells left out."""
    derived = step.derived
    per_token = 3.0 * (derived.flops_per_token if include_lm_head else derived.flops_per_token_no_lm_head)
    rows = []
    logged: list[dict[str, Any]] = []  # rows whose tokens the source logged
    for record in frame.to_dict("records"):
        row: dict[str, Any] = {}
        for key, value in record.items():
            if isinstance(value, float) and not math.isfinite(value):
                continue
            row[key] = value.item() if hasattr(value, "item") else value
        s = int(row["step"])
        row["step"] = s
        if "flops" in row:
            row["external/flops"] = row.pop("flops")
        tokens = row.get("tokens")
        if tokens is None:
            tokens = s * derived.tokens_per_step
        elif s > 0:
            logged.append(row)
        row["tokens"] = float(tokens)
        row["flops"] = float(tokens) * per_token
        rows.append(row)
    if logged:
        last = max(logged, key=lambda r: r["step"])
        expected = last["step"] * derived.tokens_per_step
        if expected and abs(last["tokens"] / expected - 1) > 0.05:
            notes.append(
                f"the source logs {last['tokens']:.4g} tokens at step {last['step']}, the spec of {step.name!r} plans "
                f"{expected:.4g} ({derived.tokens_per_step:,} per step): check that this run trained this step's spec."
            )
    return rows


def finished_state(step: TrainStep, last_step: int, reader: SourceReader | None) -> tuple[str, str]:
    """(state, why) of an external run from how far it got and what its source says."""
    num_steps = step.derived.num_steps
    if last_step >= FINISHED_FRACTION * num_steps:
        return "done", f"reached step {last_step:,} of {num_steps:,}"
    wandb = reader.wandb if reader is not None else None
    if wandb is not None and wandb.finished and wandb.exit_code:
        return "failed", f"the W&B run exited with code {wandb.exit_code} at step {last_step:,} of {num_steps:,}"
    return "interrupted", f"stops at step {last_step:,} of {num_steps:,}; pass --state done if it finished, failed if it crashed"


def _uses_lm_head(step: TrainStep) -> bool:
    return step.spec.accounting != "marin"  # the forecaster's x-axis of the step (ladder.fitting.target_spec)


def training_step(dag, step_name: str, verb: str) -> TrainStep:
    """The training step `step_name` of `dag`, or a ValueError that says why there is nothing to `verb`."""
    from ladder.dag import DagError

    try:
        step = dag[step_name]
    except DagError as error:
        raise ValueError(str(error)) from None
    if not isinstance(step, TrainStep):
        raise ValueError(f"{step_name!r} is a {step.kind} step; only training steps have runs to {verb}.")
    return step


def import_source(
    store: Store,
    dag: DAG,
    step_name: str,
    source: str,
    *,
    loss_column: str | None = None,
    step_column: str | None = None,
    tokens_column: str | None = None,
    run: str | None = None,
    state: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """Register an external run read from SOURCE as the run of `step_name`; returns (run dir, import.json record)."""
    ext = _external()
    step = training_step(dag, step_name, "import")
    reader = SourceReader(source)
    where = absolute_source(source)
    frame, mapping = ext.external_rows(reader.read_all(), source=source, loss=loss_column, step=step_column,
                                       tokens=tokens_column, run=run)
    num_steps = step.derived.num_steps
    if int(frame["step"].max()) > num_steps:
        raise ValueError(
            f"{source} logs steps up to {int(frame['step'].max()):,} but step {step_name!r} plans {num_steps:,}; import it as "
            "the step whose spec it trained (or fix that spec)."
        )
    notes = list(mapping.notes)
    rows = run_rows(step, frame, include_lm_head=_uses_lm_head(step), notes=notes)
    last_step = max(r["step"] for r in rows)
    if state is None:
        state, why = finished_state(step, last_step, reader)
    else:
        why = "--state"
    record = {
        **reader.describe(), "source": where, "mode": "import", "mapping": mapping.to_json(), "rows": len(rows),
        "eval_points": int(frame["eval/loss"].notna().sum()), "last_step": last_step, "num_steps": num_steps,
        "state": state, "why": why, "notes": notes,
        "tokens_from": f"source column {mapping.columns['tokens']!r}" if "tokens" in mapping.columns else "the spec: step x tokens per step",
        "flops_from": "the spec's accounting: tokens x 3 x forward FLOPs per token"
                      + ("" if _uses_lm_head(step) else " without the lm_head (Marin's axis)"),
    }
    note = f"{record['format']} via `ladder import`: " + ", ".join(f"{k} <- {v!r}" for k, v in mapping.columns.items())
    run_dir = import_external_run(
        store, dag, step_name, rows, source=where, state=state, note=note, include_lm_head=_uses_lm_head(step),
        extra_files={IMPORT_FILE: record},
    )
    return run_dir, record


def import_command(
    experiment: str = typer.Argument(..., help="Experiment file or module (experiments/marin_535b.py)."),
    what: str = typer.Argument(..., metavar="STEP|marin-published", help=f"The training step to import into, or {MARIN_PUBLISHED}."),
    source: Optional[str] = typer.Argument(None, help="With STEP: a CSV/TSV/parquet export, a JSON-lines metrics file or a "
                                           "W&B offline run directory (any fsspec URL)."),
    root: Optional[str] = typer.Option(None, "--root", help="Artifact root (default $LADDER_ROOT or ./ladder-runs)."),
    loss_column: Optional[str] = typer.Option(None, "--loss-column", help="Column of the loss to forecast (default: eval/loss, "
                                              "eval_loss, val/loss, ... then loss)."),
    step_column: Optional[str] = typer.Option(None, "--step-column", help="Column of the optimizer step (default: step, _step, Step, ...)."),
    tokens_column: Optional[str] = typer.Option(None, "--tokens-column", help="Column of cumulative tokens (default: "
                                                "throughput/total_tokens, tokens, ...; else step x the spec's tokens per step)."),
    run: Optional[str] = typer.Option(None, "--run", help="The run to take from a file that holds several (its run/name column)."),
    state: Optional[str] = typer.Option(None, "--state", help="done, failed or interrupted (default: done when the source "
                                        "reaches the step's planned steps, else interrupted; failed for a W&B run that exited non-zero)."),
) -> None:
    """`ladder import EXP STEP SOURCE`: register a run trained elsewhere as STEP's run; `ladder import EXP marin-published`:
    Marin's four 535B ladder rungs and the hero's published first ~10% (forecasting/data/marin_535b_ladder).

    Nothing is retrained: params, tokens per step, FLOPs and the schedule come from STEP's spec, so the source needs
    only a step and a loss column. The run directory then reads like one of ours (status, watch, plot, report,
    fit, forecast); import.json in it records the source and which column became which metric.
    """
    from ladder.loader import ExperimentError, load_experiment

    def fail(message: str, code: int = 2) -> None:
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(code)

    if source is None and what != MARIN_PUBLISHED:
        fail(f"unknown import source {what!r}: give `ladder import EXP STEP SOURCE` (a step of the experiment and a "
             f"CSV/parquet/JSON-lines file or W&B run directory), or `ladder import EXP {MARIN_PUBLISHED}`.")
    if state is not None and state not in ("done", "failed", "interrupted"):
        fail(f"--state {state!r}: an imported run is done, failed or interrupted.")
    try:
        exp = load_experiment(experiment)
    except ExperimentError as error:
        fail(str(error))
    store = Store(resolve_root(root))
    if source is not None:
        try:
            run_dir, record = import_source(store, exp.dag, what, source, loss_column=loss_column, step_column=step_column,
                                            tokens_column=tokens_column, run=run, state=state)
        except ImportConflict as error:
            fail(str(error), 1)
        except (ValueError, FileNotFoundError) as error:
            fail(str(error))
        for note in record["notes"]:
            typer.echo(f"warning: {note}", err=True)
        columns = ", ".join(f"{k} <- {v!r}" for k, v in record["mapping"]["columns"].items())
        typer.echo(f"{what}: {record['state']} ({record['why']}) <- {run_dir}")
        typer.echo(f"  {record['rows']} rows, {record['eval_points']} evals from {record['format']} {record['source']}; {columns}")
        return
    try:
        dirs = import_marin_published(store, exp.dag)
        if "hero" in exp.dag.steps:
            dirs["hero"] = import_marin_hero_prefix(store, exp.dag)
    except (ImportConflict, ValueError, FileNotFoundError) as error:
        fail(str(error), 1 if isinstance(error, ImportConflict) else 2)
    for name, run_dir in dirs.items():
        status = store.read_status(store.run_dir(name, exp.dag.fingerprints[name])) or {}
        typer.echo(f"{name}: {status.get('state')} <- {run_dir}")
