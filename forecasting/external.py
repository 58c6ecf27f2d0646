"""Metrics logged by other trainers, in our names: W&B exports, Levanter, MaxText, torchtitan, OLMo tables.

Why: a lab that trained with another stack should not have to rename columns before ladder can read
its runs. Their files differ in three ways, and this module undoes each one:

- names: `_step`/`Step`/`global_step`; `eval/loss`, `learning/loss` (MaxText),
  `loss_metrics/global_avg_loss` (torchtitan), `train/CrossEntropyLoss` (OLMo), `eval/c4_en-validation/
  CrossEntropyLoss`; tokens and FLOPs under a dozen names, FLOPs sometimes in GFLOPs. Each of our keys
  (those of metrics.jsonl: `step`, `eval/loss`, `train/loss`, `tokens`, `flops`, `optim/learning_rate`,
  `time`) takes the first known name present; the choice is returned (`ColumnMapping`) so a caller can
  record it, and `loss=`, `step=`, `tokens=` override it.
- sparsity: W&B logs each metric at its own steps, so an export has empty cells wherever a metric was
  not logged; a history may also hold several rows of one step. Rows are aligned by step: one row per
  step holding the last value logged for each column at that step. Nothing is rejected for being sparse.
- layout: W&B's panel export ("Export CSV" on a chart) has `Step` and `<run> - <key>` columns (plus
  `__MIN`/`__MAX`); it is turned back into one column per key and a `run` column.

Everything a name cannot settle (no loss column, a training loss where the forecast needs an eval loss,
a column that is not there, several runs in one file) is an `ExternalFormatError` that names the column
and the option that fixes it. Pure pandas: ladder.importer builds run directories from `external_rows`,
forecasting.table.read_table_file builds the table of runs from `tidy_table`.
"""

from __future__ import annotations

import difflib
import io
import json
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import fsspec
import numpy as np
import pandas as pd

from forecasting.table import ALIASES, LeftOutWarning, TableError

STEP_NAMES = ("step", "_step", "Step", "global_step", "trainer/global_step", "train/step", "iteration", "iter")
# the loss a forecast is on: eval names first (Levanter, Marin, MaxText, OLMo, OLMo-core, HF), then a bare "loss"
EVAL_LOSS_NAMES = (
    "eval/loss", "eval_loss", "loss/eval", "val/loss", "val_loss", "validation/loss", "valid/loss", "eval/avg_loss",
    "eval_dropless/paloma/macro_loss", "eval/paloma/macro_loss", "eval/c4_en-validation/CrossEntropyLoss",
    "c4_en-validation/CrossEntropyLoss", "eval/lm/c4_en-validation/CE loss", "loss",
)
TRAIN_LOSS_NAMES = (
    "train/loss", "train_loss", "loss/train", "learning/loss", "loss_metrics/global_avg_loss", "train/CrossEntropyLoss",
    "train/CE loss", "trainer/loss",
)
TOKENS_NAMES = (
    "tokens", "throughput/total_tokens", "throughput/total tokens", "total_tokens", "num_tokens", "tokens_seen",
    "train/tokens", "Tokens",
)
# cumulative training compute; the value is the factor to FLOPs
FLOPS_NAMES = {
    "flops": 1.0, "total_flops": 1.0, "train/flops": 1.0, "throughput/total_flops": 1.0, "FLOPs": 1.0,
    "throughput/total_gflops": 1e9, "gflops": 1e9, "GFLOPs": 1e9, "total_gflops": 1e9, "compute_gflops": 1e9,
    "petaflops": 1e15, "PFLOPs": 1e15,
}
LR_NAMES = (
    "optim/learning_rate", "lr", "learning_rate", "train/learning_rate", "optim/lr", "learning/current_learning_rate",
    "optim/learning_rate_group0", "optim/LR (group 0)", "lr-AdamW",
)
TIME_NAMES = ("_timestamp", "time", "timestamp")
RUN_NAMES = ("run", "run_name", "name", "Name", "display_name", "model_name", "run_id")
# W&B bookkeeping, never a metric
IGNORED = frozenset({"_runtime", "_timestamp", "_step", "_wandb", "epoch", "Epoch"})
OWN_PREFIXES = ("forecast/", "alerts/")  # what our overlay writes; never taken from someone else's file
KEYS = ("eval/loss", "train/loss", "tokens", "flops", "optim/learning_rate", "time")
TABLE_SUFFIXES = (".csv", ".tsv", ".txt", ".parquet", ".pq", ".jsonl", ".ndjson", ".json")
_PANEL = re.compile(r"^(?P<run>.+?) - (?P<key>.+?)(?P<agg>__MIN|__MAX)?$")


class ExternalFormatError(TableError):
    """A file from another trainer that cannot be read as a run: the message names the column or file and the fix."""


class MissingLossError(ExternalFormatError):
    """No column of the loss to forecast (yet: a live run's first eval may still be coming)."""


@dataclass
class ColumnMapping:
    """Which source column each of our keys came from (recorded beside an import), and what else was kept."""

    columns: dict[str, str] = field(default_factory=dict)  # our key -> source column
    flops_scale: float = 1.0  # source FLOPs column x this = FLOPs
    run: str | None = None  # the run selected from a file of several
    carried: list[str] = field(default_factory=list)  # other numeric columns kept under their own names
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"columns": dict(self.columns), "flops_scale": self.flops_scale, "run": self.run,
                "carried": list(self.carried), "notes": list(self.notes)}


# ---------------------------------------------------------------------------------------- reading files


def read_export(path: str, *, text: str | None = None) -> pd.DataFrame:
    """A CSV/TSV, parquet or JSON-lines file (local path or fsspec URL) as a DataFrame, unaligned.

    A file that is not what its suffix says is an ExternalFormatError naming it; so is a missing one.
    `text` parses that text instead of reading `path` (incremental readers pass the new lines).
    """
    suffix = PurePosixPath(path.split("?")[0]).suffix.lower()
    if suffix not in TABLE_SUFFIXES:
        raise ExternalFormatError(
            f"{path}: unknown format {suffix or '(no suffix)'!r}; give a .csv, .tsv, .parquet or .jsonl file, "
            "or a W&B offline run directory."
        )
    what = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "JSON-lines", ".ndjson": "JSON-lines",
            ".json": "JSON-lines"}.get(suffix, "CSV")
    try:
        if text is not None:
            return _parse_text(text, suffix, path)
        if suffix in (".parquet", ".pq"):
            with fsspec.open(path, "rb") as handle:
                return pd.read_parquet(handle)
        with fsspec.open(path, "r", encoding="utf-8") as handle:
            return _parse_text(handle.read(), suffix, path)
    except ExternalFormatError:
        raise
    except FileNotFoundError:
        raise ExternalFormatError(f"{path}: no such file; check the path (a local path or an fsspec URL).") from None
    except UnicodeDecodeError:
        raise ExternalFormatError(f"{path} is not a {what} text file (it holds binary data); check the file or its suffix.") from None
    except Exception as error:  # noqa: BLE001 - pandas/pyarrow raise many kinds; each becomes one sentence
        raise ExternalFormatError(f"{path} is not a readable {what} file ({type(error).__name__}: {str(error)[:160]}); "
                                  "check the file or its suffix.") from None


def _parse_text(text: str, suffix: str, path: str) -> pd.DataFrame:
    if suffix in (".jsonl", ".ndjson", ".json"):
        return jsonl_frame(text.splitlines(), path)
    if not text.strip():
        raise ExternalFormatError(f"{path} is empty; nothing to read.")
    if "\x00" in text[:4096]:
        raise ExternalFormatError(f"{path} is not a CSV text file (it holds binary data); check the file or its suffix.")
    return pd.read_csv(io.StringIO(text), sep="\t" if suffix == ".tsv" else ",")


def jsonl_frame(lines: list[str], path: str = "metrics") -> pd.DataFrame:
    """JSON-object lines as a frame (nested dicts flattened with '/'); a torn last line is ignored."""
    rows = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if index == len(lines) - 1:
                continue  # a writer caught mid-line
            raise ExternalFormatError(f"{path} line {index + 1} is not JSON; a JSON-lines file holds one object per line.") from None
        if not isinstance(row, dict):
            raise ExternalFormatError(f"{path} line {index + 1} is a JSON {type(row).__name__}, not an object of metrics.")
        rows.append(_flatten(row))
    return pd.DataFrame(rows)


def _flatten(row: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}/"))
        else:
            out[name] = value
    return out


# ---------------------------------------------------------------------------------------- column mapping


def unpivot_panel_export(df: pd.DataFrame) -> pd.DataFrame:
    """W&B's chart export (`Step`, `<run> - <key>`, `<run> - <key>__MIN`, ...) as one column per key plus `run`."""
    step = next((c for c in ("Step", "step", "_step") if c in df.columns), None)
    others = [c for c in df.columns if c != step]
    matches = {c: _PANEL.match(str(c)) for c in others}
    if step is None or not others or not all(matches.values()):
        return df
    frames = []
    for run in dict.fromkeys(m["run"] for m in matches.values()):
        cols = {c: m["key"] for c, m in matches.items() if m["run"] == run and not m["agg"]}
        part = df[[step, *cols]].rename(columns={step: "step", **cols})
        part.insert(0, "run", run)
        frames.append(part)
    return pd.concat(frames, ignore_index=True)


def _find(df: pd.DataFrame, names, exclude: tuple[str, ...] = ()) -> str | None:
    """The first of `names` among the columns (exact, then case-insensitive)."""
    columns = [c for c in df.columns if c not in exclude]
    for name in names:
        if name in columns:
            return name
    lower = {str(c).lower(): c for c in columns}
    for name in names:
        if name.lower() in lower:
            return lower[name.lower()]
    return None


def _numeric_columns(df: pd.DataFrame) -> list[str]:
    return [str(c) for c in df.columns if pd.api.types.is_numeric_dtype(df[c]) and c not in IGNORED]


def _no_such_column(df: pd.DataFrame, column: str, option: str, source: str) -> ExternalFormatError:
    close = difflib.get_close_matches(column, [str(c) for c in df.columns], n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(map(repr, close))}?" if close else f"its columns include {_some(df.columns)}."
    return ExternalFormatError(f"column {column!r} ({option}) is not in {source}; {hint}")


def _some(columns, n: int = 10) -> str:
    names = [str(c) for c in columns]
    return ", ".join(map(repr, names[:n])) + (f" and {len(names) - n} more" if len(names) > n else "")


def _choose(df: pd.DataFrame, given: str | None, names, option: str, source: str, exclude: tuple[str, ...] = ()) -> str | None:
    if given is not None:
        if given not in df.columns:
            error = _no_such_column(df, given, option, source)
            raise MissingLossError(str(error)) if option == "--loss-column" else error
        return given
    return _find(df, names, exclude)


def select_run(df: pd.DataFrame, run: str | None, source: str) -> tuple[pd.DataFrame, str | None, str | None]:
    """Rows of one run of a file that may hold several (a `run`/`name`/`model_name` column); (rows, run column, run)."""
    column = _find(df, RUN_NAMES)
    if column is None:
        if run is not None:
            raise ExternalFormatError(f"{source} has no run column ({', '.join(RUN_NAMES[:5])}, ...) to pick --run {run!r} from; "
                                      "drop --run, the file holds one run.")
        return df, None, None
    names = [str(v) for v in pd.unique(df[column].dropna())]
    if run is None:
        if len(names) > 1:
            raise ExternalFormatError(f"{source} holds {len(names)} runs in column {column!r} ({_some(names, 5)}); "
                                      "choose one with --run NAME.")
        return df, column, names[0] if names else None
    if run not in names:
        raise ExternalFormatError(f"run {run!r} (--run) is not in column {column!r} of {source}; it holds {_some(names, 5)}.")
    return df[df[column].astype(str) == run], column, run


def detect_columns(
    df: pd.DataFrame, *, source: str, loss: str | None = None, step: str | None = None, tokens: str | None = None,
    require_eval: bool = True,
) -> ColumnMapping:
    """Which column is each of our keys (`ColumnMapping.columns`). The forecast's loss (`eval/loss`) is `loss`, else the
    first eval-loss name present; without one it is an error naming the training loss found (when `require_eval`)."""
    mapping = ColumnMapping()
    step_col = _choose(df, step, STEP_NAMES, "--step-column", source)
    if step_col is None:
        raise ExternalFormatError(f"{source} has no step column ({', '.join(STEP_NAMES[:4])}, ...); name it with --step-column.")
    mapping.columns["step"] = step_col
    taken: tuple[str, ...] = (step_col,)
    eval_col = _choose(df, loss, EVAL_LOSS_NAMES, "--loss-column", source, taken)
    train_col = _find(df, TRAIN_LOSS_NAMES, taken + ((eval_col,) if eval_col else ()))
    if eval_col is None and require_eval:
        if train_col is not None:
            raise MissingLossError(
                f"{source} has no eval loss column, only the training loss {train_col!r}; pass --loss-column {train_col!r} "
                "to forecast on it."
            )
        raise MissingLossError(f"{source} has no loss column (looked for eval/loss, loss, train/loss, ...); name the loss "
                                  f"to forecast with --loss-column (numeric columns: {_some(_numeric_columns(df), 8)}).")
    for key, col in (("eval/loss", eval_col), ("train/loss", train_col)):
        if col is not None:
            mapping.columns[key] = col
    taken = tuple(mapping.columns.values())
    tokens_col = _choose(df, tokens, TOKENS_NAMES, "--tokens-column", source, taken)
    if tokens_col is not None:
        mapping.columns["tokens"] = tokens_col
    flops_col = _find(df, tuple(FLOPS_NAMES), taken)
    if flops_col is not None:
        mapping.columns["flops"] = flops_col
        mapping.flops_scale = next(v for k, v in FLOPS_NAMES.items() if k.lower() == str(flops_col).lower())
    for key, names in (("optim/learning_rate", LR_NAMES), ("time", TIME_NAMES)):
        col = _find(df, names, tuple(mapping.columns.values()))
        if col is not None:
            mapping.columns[key] = col
    return mapping


def _to_numbers(df: pd.DataFrame, column: str, source: str) -> pd.Series:
    """A column as floats; empty cells are NaN (sparse), text that is not a number is an error naming it."""
    values = df[column]
    numbers = pd.to_numeric(values, errors="coerce")
    if not pd.api.types.is_numeric_dtype(values):
        text = values.astype(str).str.strip().str.lower()
        blank = values.isna() | text.isin(["", "nan", "none", "null", "inf", "-inf", "infinity", "-infinity"])
        bad = numbers.isna() & ~blank
        if bad.any():
            first = values[bad].iloc[0]
            raise ExternalFormatError(f"column {column!r} of {source} holds {int(bad.sum())} value(s) that are not numbers "
                                      f"(first {first!r}); fix the file or map another column.")
    return numbers.astype(float)


def align_by_step(frame: pd.DataFrame, keys: list[str], by: tuple[str, ...] = ("step",)) -> pd.DataFrame:
    """One row per step: the last finite value of every column logged at that step; rows with nothing dropped."""
    frame = frame.replace([np.inf, -np.inf], np.nan)
    aligned = frame.groupby(list(by), sort=True, as_index=False).last()
    present = [k for k in keys if k in aligned.columns]
    return aligned[aligned[present].notna().any(axis=1)].reset_index(drop=True) if present else aligned.iloc[0:0]


def external_rows(
    df: pd.DataFrame, *, source: str, loss: str | None = None, step: str | None = None, tokens: str | None = None,
    run: str | None = None, carry: bool = True,
) -> tuple[pd.DataFrame, ColumnMapping]:
    """One run of an external export as metric rows in our names, aligned by step.

    Returns (frame, mapping): `frame` has `step` (int) and whichever of `eval/loss`, `train/loss`, `tokens`,
    `flops` (in FLOPs), `optim/learning_rate`, `time` the source has, plus (with `carry`) its other numeric
    columns under their own names; NaN where a column was not logged at a step.
    """
    df = unpivot_panel_export(df)
    if df.empty:
        raise ExternalFormatError(f"{source} holds no rows.")
    df, run_col, chosen = select_run(df, run, source)
    mapping = detect_columns(df, source=source, loss=loss, step=step, tokens=tokens)
    mapping.run = chosen
    out = pd.DataFrame(index=df.index)
    step_values = _to_numbers(df, mapping.columns["step"], source)
    out["step"] = step_values
    for key, col in mapping.columns.items():
        if key != "step":
            out[key] = _to_numbers(df, col, source) * (mapping.flops_scale if key == "flops" else 1.0)
    if carry:
        used = set(mapping.columns.values()) | {run_col}
        for col in _numeric_columns(df):
            if col not in used and col not in out.columns and not col.startswith(OWN_PREFIXES) and df[col].notna().any():
                out[col] = df[col].astype(float)
                mapping.carried.append(col)
    missing_step = out["step"].isna()
    if missing_step.any():
        out = out[~missing_step]  # W&B rows that carry only system metrics have no step
    if out.empty:
        raise ExternalFormatError(f"{source} has no row with a step in column {mapping.columns['step']!r}.")
    steps = out["step"].to_numpy()
    if (steps < 0).any() or not np.allclose(steps, np.round(steps)):
        raise ExternalFormatError(f"column {mapping.columns['step']!r} of {source} must hold whole, non-negative steps; "
                                  "name the step column with --step-column.")
    out["step"] = np.round(steps).astype(np.int64)
    loss_key = "eval/loss"
    bad = out[loss_key].notna() & ~np.isfinite(out[loss_key].fillna(0.0))
    aligned = align_by_step(out, [k for k in out.columns if k != "step"])
    aligned["step"] = aligned["step"].astype(np.int64)
    n_eval = int(aligned[loss_key].notna().sum())
    if n_eval == 0:
        raise MissingLossError(f"column {mapping.columns[loss_key]!r} of {source} holds no finite loss at any step; "
                                  "name another with --loss-column.")
    if bad.any():
        mapping.notes.append(f"{int(bad.sum())} non-finite value(s) of {mapping.columns[loss_key]!r} read as missing")
    return aligned, mapping


# ---------------------------------------------------------------------------------------- the table of runs


def tidy_table(df: pd.DataFrame, default_run: str) -> pd.DataFrame:
    """A CSV/parquet table of runs (ours, a W&B export, an OLMo table) in forecasting.table's schema, before validation.

    Sparse columns are aligned by (run, step); `loss` is the eval loss, or the training loss (split "train") for
    a run that logged no eval, in a wide export (eval and train columns) and a long one (a `split` column) alike; an
    optional column still missing at some points after interpolating in step within its run is dropped (its name
    goes to ``attrs["dropped"]``), so the laws that need it say so by name. What is left out (a run without any
    loss value, a column with holes, train rows beside eval ones) is named in a LeftOutWarning; two different
    losses at one step of one run are a TableError.
    """
    df = unpivot_panel_export(df)
    if df.empty:
        raise ExternalFormatError(f"{default_run}: the table holds no rows.")
    out = df.copy()
    if "run" not in out.columns:
        run_col = _find(out, RUN_NAMES)
        out["run"] = out[run_col].astype(str) if run_col is not None else default_run
        if run_col is not None:
            out = out.drop(columns=[run_col])
    if "step" not in out.columns:
        step_col = _find(out, STEP_NAMES[1:])
        if step_col is not None:
            out = out.rename(columns={step_col: "step"})
        else:
            out["step"] = out.groupby("run").cumcount()
    if "loss" not in out.columns:
        eval_col = _find(out, EVAL_LOSS_NAMES)
        train_col = _find(out, TRAIN_LOSS_NAMES)
        if eval_col is not None:
            out = out.rename(columns={eval_col: "loss"})
        elif train_col is not None:
            out = out.rename(columns={train_col: "loss"})
            if "split" not in out.columns:
                out["split"] = "train"
    if "flops" not in out.columns:
        flops_col = _find(out, tuple(FLOPS_NAMES))
        if flops_col is not None:
            scale = next(v for k, v in FLOPS_NAMES.items() if k.lower() == str(flops_col).lower())
            out["flops"] = pd.to_numeric(out[flops_col], errors="coerce") * scale
    for name, names in (("tokens", TOKENS_NAMES), ("lr", LR_NAMES)):
        if name not in out.columns:
            col = _find(out, names)
            if col is not None:
                out = out.rename(columns={col: name})
    for name, aliases in ALIASES.items():  # params columns and anything else forecasting.table knows
        if name not in out.columns:
            col = next((a for a in aliases if a in out.columns), None)
            if col is not None:
                out = out.rename(columns={col: name})
    if "loss" not in out.columns or "step" not in out.columns:
        return out  # validate_table names what is missing
    out["step"] = pd.to_numeric(out["step"], errors="coerce")
    out = out[out["step"].notna()]
    out = _eval_rows_where_logged(out, default_run)
    _no_two_losses_at_one_step(out)
    sparse = out["loss"].isna().any() or out.duplicated(["run", "step"]).any()
    if not sparse:
        return out
    aligned = align_by_step(out, ["loss"], by=("run", "step"))
    aligned = aligned[aligned["loss"].notna()]
    silent = sorted(set(out["run"].astype(str)) - set(aligned["run"].astype(str)))
    if silent:
        warnings.warn(f"{default_run}: run(s) {', '.join(map(repr, silent))} hold no loss value in any row: left out",
                      LeftOutWarning, stacklevel=2)
    dropped = []
    for column in ("tokens", "flops", "lr", "fraction", "params_active", "params_total", "num_steps", "tokens_per_step"):
        if column not in aligned.columns or not aligned[column].isna().any():
            continue
        values = pd.to_numeric(aligned[column], errors="coerce")
        filled = []
        for _, group in aligned.assign(_v=values).groupby("run", sort=False):
            series = group.set_index("step")["_v"]
            if column in ("tokens", "flops", "fraction"):  # cumulative: never extrapolated
                series = series.interpolate(method="index", limit_area="inside")
            elif column == "lr":  # logged every few steps; the nearest logged value stands in at the edges
                series = series.interpolate(method="index", limit_area="inside").ffill().bfill()
            else:  # a per-run constant
                series = series.ffill().bfill()
            filled.append(pd.Series(series.to_numpy(), index=group.index))
        aligned[column] = pd.concat(filled).reindex(aligned.index)
        if aligned[column].isna().any():
            first_missing = aligned[aligned[column].isna()]
            if (first_missing["step"] == 0).all():
                aligned = aligned[~(aligned[column].isna() & (aligned["step"] == 0))]
            else:
                runs = sorted(set(first_missing["run"].astype(str)))
                warnings.warn(f"{default_run}: column {column!r} is missing at some steps of run(s) {', '.join(map(repr, runs[:3]))}"
                              f"{' and more' if len(runs) > 3 else ''} even after interpolating within each run: the column is "
                              "left out (a law that needs it says so)", LeftOutWarning, stacklevel=2)
                aligned = aligned.drop(columns=[column])
                dropped.append(column)
    aligned.attrs["dropped"] = dropped
    return aligned.reset_index(drop=True)


def _eval_rows_where_logged(out: pd.DataFrame, source: str) -> pd.DataFrame:
    """A long table with a `split` column: the eval rows of every run that has any (the loss a forecast reads), the
    train rows only of runs without one. Aligned by step, one run's train and eval losses would merge into one row."""
    if "split" not in out.columns:
        return out
    is_eval = out["split"].astype(str).str.strip().str.lower().eq("eval")
    has_eval = is_eval.groupby(out["run"].astype(str)).transform("any")
    left = out.loc[has_eval & ~is_eval, "run"].astype(str).unique()
    if len(left):
        warnings.warn(f"{source}: run(s) {', '.join(map(repr, sorted(left)[:3]))}{' and more' if len(left) > 3 else ''} log "
                      "eval and train losses: their eval rows are read, their train rows left out", LeftOutWarning,
                      stacklevel=3)
    return out[~has_eval | is_eval]


def _no_two_losses_at_one_step(out: pd.DataFrame) -> None:
    """TableError when a run holds two different finite losses at one step (and split): which is the run's is a guess."""
    loss = pd.to_numeric(out["loss"], errors="coerce")
    key = ["run", "step"] + (["split"] if "split" in out.columns else [])
    rows = out.assign(loss=loss)[np.isfinite(loss.to_numpy(float))]
    if not rows.duplicated(key).any():  # one loss per step (every file but a long table with repeats): nothing to group
        return
    counts = rows.groupby(key, sort=True)["loss"].nunique()
    if (counts > 1).any():
        where = counts[counts > 1].index[0]
        run, step = where[0], where[1]
        raise TableError(f"run {run!r} holds {int(counts.loc[where])} different losses at step {int(step)} "
                         f"({int((counts > 1).sum())} such step(s)): a run appended twice, or two runs under one name?")


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


__all__ = [
    "ColumnMapping", "ExternalFormatError", "MissingLossError", "align_by_step", "detect_columns", "external_rows", "jsonl_frame", "read_export",
    "select_run", "tidy_table", "unpivot_panel_export",
]
