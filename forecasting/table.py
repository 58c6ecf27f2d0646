"""The table of runs: the one input every law, fit and backtest in forecasting/ reads.

Why a table and not our own run objects: the same forecaster must work on our ladders, on a CSV/parquet
export of someone else's W&B runs, and on public data, so the contract is a plain pandas DataFrame.

Schema (one row per logged point):

    column          type   meaning
    run             str    run name; rows of one run share it                      (required)
    step            int    optimizer step of the point                             (required)
    loss            float  loss at that step (eval loss when the run logs one)     (required)
    tokens          float  cumulative training tokens seen at `step`
    flops           float  cumulative training FLOPs (fwd+bwd) at `step`, one convention end to end
    lr              float  learning rate at `step`
    fraction        float  step / planned steps of the run (progress in [0, 1])
    params_active   float  active parameters N (MoE: shared + top-k routed, no input embeddings)
    params_total    float  total parameters
    split           str    optional: "eval" or "train"
    num_steps       int    optional: planned steps of the run (gives `fraction`)
    tokens_per_step float  optional: tokens per optimizer step (gives `tokens`)
    unique_tokens   float  optional: unique tokens of the run's data when it repeats them (epochs = tokens /
                           unique_tokens); empty (NaN) for a run that did not log it, read as one epoch

A column may be absent when the law being fitted does not need it; `validate_table(..., require=...)`
says which are needed and fails with a message that names the missing column, the bad run and step.
Rules checked: no NaN/inf and no non-positive loss/tokens/flops/params; unique_tokens positive and finite where
given; no duplicated (run, step) rows; steps are integers. Loaders: `read_table_file` (CSV/parquet; W&B history
names such as `_step`, `eval/loss`, `optim/learning_rate` are mapped; a run's eval rows are read where it logs both
splits, and what is left out is named in a LeftOutWarning: `forecasting.external.tidy_table`), `from_run_dirs` (ladder run directories:
spec.json + metrics.jsonl, fsspec URLs allowed), `from_records` (tables built in code).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import PurePosixPath

import fsspec
import numpy as np
import pandas as pd

COLUMNS = (
    "run", "step", "tokens", "flops", "loss", "lr", "fraction", "params_active", "params_total",
    "split", "num_steps", "tokens_per_step",
)
REQUIRED = ("run", "step", "loss")
POSITIVE = ("loss", "tokens", "flops", "params_active", "params_total", "num_steps", "tokens_per_step")

# Common names in W&B history exports and other people's CSVs -> our names (first match wins).
ALIASES: dict[str, tuple[str, ...]] = {
    "run": ("run", "run_name", "name", "Name", "display_name", "run_id"),
    "step": ("step", "_step", "global_step", "trainer/global_step", "iteration", "iter"),
    "loss": (
        "loss", "eval/loss", "eval_loss", "loss/eval", "val/loss", "val_loss", "validation/loss",
        "eval_dropless/paloma/macro_loss", "train/loss", "train_loss", "loss/train",
    ),
    "tokens": ("tokens", "throughput/total_tokens", "total_tokens", "num_tokens", "tokens_seen"),
    "flops": ("flops", "total_flops", "train/flops"),
    "lr": ("lr", "optim/learning_rate", "learning_rate", "train/learning_rate", "optim/lr"),
    "params_active": ("params_active", "active_params", "n_params_active", "Model Size", "params", "N"),
    "params_total": ("params_total", "total_params", "n_params"),
}


class TableError(ValueError):
    """The table of runs breaks the schema; the message says which column, run and step."""


class LeftOutWarning(UserWarning):
    """Something a reader of a table left out (a run, a column, a line); the message names it and why."""


class TornLineWarning(LeftOutWarning):
    """A run directory's metrics.jsonl ends in a torn line (its writer stopped mid-line); the line was ignored."""


def normalise_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Rename known aliases to schema names (does not overwrite a column that already exists)."""
    out = df.copy()
    if "throughput/total_gflops" in out.columns and "flops" not in out.columns:
        out["flops"] = out["throughput/total_gflops"].astype(float) * 1e9
    for name, aliases in ALIASES.items():
        if name in out.columns:
            continue
        for alias in aliases:
            if alias in out.columns:
                out = out.rename(columns={alias: name})
                break
    return out


def validate_table(df: pd.DataFrame, require: Iterable[str] = REQUIRED) -> pd.DataFrame:
    """Return a clean copy sorted by (run, step), with `fraction`/`tokens` derived where possible.

    Raises TableError naming the problem: missing column, NaN/inf, non-positive values, duplicated
    (run, step) rows, or an empty table.
    """
    if not isinstance(df, pd.DataFrame):
        raise TableError(f"expected a pandas DataFrame, got {type(df).__name__}")
    out = normalise_columns(df)
    if len(out) == 0:
        raise TableError("the table of runs is empty")
    if "num_steps" in out.columns and "fraction" not in out.columns and "step" in out.columns:
        out["fraction"] = out["step"].astype(float) / out["num_steps"].astype(float)
    if "tokens_per_step" in out.columns and "tokens" not in out.columns and "step" in out.columns:
        out["tokens"] = out["step"].astype(float) * out["tokens_per_step"].astype(float)
    missing = [c for c in require if c not in out.columns]
    if missing:
        raise TableError(
            f"missing column(s) {missing}; have {sorted(map(str, out.columns))}. "
            "See forecasting.table's docstring for the schema."
        )
    out["run"] = out["run"].astype(str)
    numeric = [c for c in out.columns if c in COLUMNS and c not in ("run", "split")]
    for col in numeric:
        vals = pd.to_numeric(out[col], errors="coerce").astype(float)
        bad = ~np.isfinite(vals.to_numpy())
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TableError(
                f"column {col!r} has {int(bad.sum())} NaN/inf/non-numeric value(s); first at run "
                f"{out['run'].iloc[i]!r} step {out['step'].iloc[i] if 'step' in out else '?'}"
            )
        out[col] = vals
        if col in POSITIVE and (vals <= 0).any():
            i = int(np.flatnonzero((vals <= 0).to_numpy())[0])
            raise TableError(
                f"column {col!r} must be positive; got {vals.iloc[i]} at run {out['run'].iloc[i]!r} "
                f"step {out['step'].iloc[i] if 'step' in out else '?'}"
            )
    if "step" in out.columns:
        if (out["step"] < 0).any() or not np.allclose(out["step"], np.round(out["step"])):
            raise TableError("column 'step' must hold non-negative integers")
        out["step"] = out["step"].round().astype(np.int64)
        key = ["run", "step"] + (["split"] if "split" in out.columns else [])
        dup = out.duplicated(key, keep=False)
        if dup.any():
            first = out[dup].iloc[0]
            raise TableError(
                f"{int(dup.sum())} duplicated (run, step) rows, e.g. run {first['run']!r} step {int(first['step'])}; "
                "a run appended twice, or two runs under one name?"
            )
        out = out.sort_values(["run", "step"], kind="stable").reset_index(drop=True)
    if "unique_tokens" in out.columns:
        out["unique_tokens"] = _unique_tokens(out)
    return out


def _unique_tokens(out: pd.DataFrame) -> pd.Series:
    """The unique_tokens column as floats: empty where a run did not log it (NaN, read as one epoch), else positive
    and finite. Why checked: zero or a negative count reached the data-constrained law as infinite epochs."""
    raw = out["unique_tokens"]
    given = raw.notna() & (raw.astype(str).str.strip() != "")
    vals = pd.to_numeric(raw.where(given), errors="coerce").astype(float)
    bad = (given & vals.isna()) | np.isinf(vals) | (vals <= 0)
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        value = raw.iloc[i]
        shown = repr(value) if isinstance(value, str) else format(float(value), "g")
        raise TableError(
            f"column 'unique_tokens' must be a positive number of tokens, or empty where a run did not log it; got "
            f"{shown} at run {out['run'].iloc[i]!r} "
            f"step {out['step'].iloc[i] if 'step' in out else '?'}"
        )
    return vals


def read_table_file(path: str) -> pd.DataFrame:
    """Read a CSV or parquet table (local path or fsspec URL) and validate it.

    A file without a run column is one run named after the file.
    """
    suffix = PurePosixPath(path).suffix.lower()
    try:
        with fsspec.open(path, "rb") as f:
            if suffix in (".parquet", ".pq"):
                df = pd.read_parquet(f)
            elif suffix in (".csv", ".tsv", ".txt"):
                df = pd.read_csv(f, sep="\t" if suffix == ".tsv" else ",")
            else:
                raise TableError(f"unknown table format {suffix!r} for {path}; use .csv or .parquet")
    except TableError:
        raise
    except FileNotFoundError:
        raise TableError(f"{path} does not exist; give the path of a .csv or .parquet table of runs.") from None
    except Exception as error:  # pandas / pyarrow parse errors: say which file, in one sentence
        raise TableError(_unreadable_table(path, suffix, error)) from None
    from forecasting.external import tidy_table  # other trainers' names; sparse W&B exports aligned by step

    return validate_table(tidy_table(df, PurePosixPath(path).stem))


def _unreadable_table(path: str, suffix: str, error: Exception) -> str:
    if isinstance(error, pd.errors.EmptyDataError):
        return f"{path} is empty (no header row); a table of runs needs columns such as run,step,loss."
    kind = "parquet" if suffix in (".parquet", ".pq") else "CSV"
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0].replace(" input source '<Buffer>'", "")
    return f"{path} is not a readable {kind} file ({reason}); export the table of runs as .csv or .parquet."


def from_records(records: Sequence[Mapping] | pd.DataFrame, **constants: float | str) -> pd.DataFrame:
    """Build and validate a table in code: a list of row dicts (or a DataFrame) plus per-table constants."""
    df = pd.DataFrame(records).copy()
    for k, v in constants.items():
        df[k] = v
    return validate_table(df)


def _read_text(url: str) -> str | None:
    fs, p = fsspec.core.url_to_fs(url)
    if not fs.exists(p):
        return None
    with fs.open(p, "r") as f:
        return f.read()


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def _drop_superseded(rows: list[dict]) -> list[dict]:
    """Apply the trainer's resume markers: `{"event": "resume", "step": s}` means the lines before it with
    step > s belong to an attempt that was rolled back or killed after its last checkpoint; the run that
    continued rewrote them. Without this a resumed run would carry duplicated steps."""
    kept: list[dict] = []
    for row in rows:
        if row.get("event") == "resume":
            kept = [r for r in kept if r.get("step", 0) <= row.get("step", 0)]
        else:
            kept.append(row)
    return kept


def _final_eval_from_result(path: str, rows: list[dict], loss_key: str) -> dict | None:
    """The final eval of a finished run from its result.json, when metrics.jsonl lacks it (a torn last line)."""
    if loss_key != "eval/loss":
        return None
    try:
        result = json.loads(_read_text(_join(path, "result.json")) or "null")
    except json.JSONDecodeError:
        return None
    if not isinstance(result, dict) or not result.get("completed") or result.get("final_eval_loss") is None:
        return None
    step = result.get("steps")
    if not isinstance(step, int) or any(r.get("step") == step and r.get(loss_key) is not None for r in rows):
        return None
    row = {"step": step, loss_key: float(result["final_eval_loss"])}
    row.update({k: float(result[k]) for k in ("tokens", "flops") if isinstance(result.get(k), (int, float))})
    return row


def _note(message: str, notes: list[str] | None) -> None:
    if notes is None:
        import warnings

        warnings.warn(message, TornLineWarning, stacklevel=3)
    else:
        notes.append(message)


def from_run_dirs(paths: Iterable[str], *, loss_key: str = "eval/loss", notes: list[str] | None = None) -> pd.DataFrame:
    """Load ladder run directories (spec.json + metrics.jsonl each) into one validated table.

    Uses `loss_key` lines (default eval/loss); a run that has no eval line falls back to train/loss and
    marks split="train". A torn last line in metrics.jsonl is ignored and said so (appended to `notes`, or a
    TornLineWarning when `notes` is None); when the run finished, its final eval comes from result.json, so a
    torn final line does not silently move the run's last point. Paths may be fsspec URLs.
    """
    frames = []
    for path in paths:
        spec_text = _read_text(_join(path, "spec.json"))
        if spec_text is None:
            raise TableError(f"{path}: no spec.json (not a run directory?)")
        spec = json.loads(spec_text)
        derived = spec.get("derived", {})
        name = str(spec.get("name") or PurePosixPath(path).name)
        metrics_text = _read_text(_join(path, "metrics.jsonl")) or ""
        rows = []
        torn = None
        lines = metrics_text.splitlines()
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    torn = i + 1  # torn last line: the writer was interrupted mid-line
                    continue
                raise TableError(f"{path}/metrics.jsonl line {i + 1} is not JSON") from None
        rows = _drop_superseded(rows)
        if torn is not None:
            message = f"{_join(path, 'metrics.jsonl')} line {torn} is torn (cut off mid-line) and was ignored"
            final = _final_eval_from_result(path, rows, loss_key)
            if final is not None:
                rows.append(final)
                message += f"; the finished run's final eval (step {final['step']}, {final[loss_key]:.4f}) is taken from result.json"
            _note(message, notes)
        if not rows:
            continue
        m = pd.DataFrame(rows)
        split = "eval"
        key = loss_key
        if key not in m.columns or m[key].isna().all():
            key, split = "train/loss", "train"
        m = m[m[key].notna()] if key in m.columns else m.iloc[0:0]
        if m.empty:
            continue
        f = pd.DataFrame({"run": name, "step": m["step"].astype(int), "loss": m[key].astype(float), "split": split})
        for src, dst in (("tokens", "tokens"), ("flops", "flops"), ("optim/learning_rate", "lr")):
            if src in m.columns:
                f[dst] = m[src].astype(float).to_numpy()
        for k in ("params_active", "params_total", "num_steps", "tokens_per_step"):
            if k in derived:
                f[k] = float(derived[k])
        if "num_steps" in derived:
            f["fraction"] = f["step"] / float(derived["num_steps"])
        if "tokens" not in f.columns and "tokens_per_step" in derived:
            f["tokens"] = f["step"] * float(derived["tokens_per_step"])
        if "flops" not in f.columns and "flops_per_token" in derived and "tokens" in f.columns:
            f["flops"] = f["tokens"] * float(derived["flops_per_token"])
        if spec.get("lr_schedule") and ("lr" not in f.columns or f["lr"].isna().any()):
            # eval lines need not carry the LR; the schedule in spec.json is the truth for every step
            sched = np.asarray(spec["lr_schedule"], dtype=float)
            from_schedule = sched[np.clip(f["step"].to_numpy() - 1, 0, len(sched) - 1)]
            f["lr"] = f["lr"].fillna(pd.Series(from_schedule, index=f.index)) if "lr" in f.columns else from_schedule
        # step 0 has no tokens/flops yet; it carries no information for a law, drop it
        f = f[f["step"] > 0]
        frames.append(f)
    if not frames:
        raise TableError("no run directory held any metric lines")
    return validate_table(pd.concat(frames, ignore_index=True))


def run_summary(table: pd.DataFrame) -> pd.DataFrame:
    """One row per run: its last point (final loss) plus the run-level constants."""
    last = table.sort_values("step").groupby("run", sort=True).tail(1).set_index("run").sort_index()
    return last


# law inputs a final point is matched on across groups (those present), and the final-loss gap between groups at
# matched inputs above which a column is reported as splitting the table (seeds of one recipe differ by less)
MATCH_INPUTS = ("params_active", "params_total", "tokens", "unique_tokens")
MATCH_TOLERANCE = 0.005
MIXED_GAP = 0.01


def select_rows(table: pd.DataFrame, where: Mapping[str, str | float]) -> pd.DataFrame:
    """The rows whose `column` equals `value` for every item of `where` (a number column compares as a number).

    Why: a table exported from several sweeps (corpora, recipes, tokenizers) holds ladders that no law should fit as
    one; this picks one of them, and says which values exist when nothing matches."""
    out = table
    for column, value in where.items():
        if column not in out.columns:
            extra = sorted(c for c in table.columns if c not in COLUMNS)
            raise TableError(f"no column {column!r} to select on; the table's other columns: {extra or 'none'}")
        values = out[column]
        if pd.api.types.is_numeric_dtype(values):
            try:
                keep = np.isclose(values.to_numpy(float), float(value), rtol=1e-9, atol=0.0)
            except (TypeError, ValueError):
                raise TableError(f"column {column!r} holds numbers; {value!r} is not one") from None
        else:
            keep = (values.astype(str) == str(value)).to_numpy()
        if not keep.any():
            shown = sorted(map(str, table[column].unique()))
            listed = ", ".join(shown[:20]) + (f" and {len(shown) - 20} more" if len(shown) > 20 else "")
            raise TableError(f"no row has {column} = {value!r}" + (" (with the other conditions)" if out is not table else "")
                             + f"; its values: {listed}")
        out = out[keep]
    return out.reset_index(drop=True)


def mixed_groups(table: pd.DataFrame) -> list[dict]:
    """Columns outside the schema that split the table into ladders a law cannot tell apart: text columns constant
    within each run whose values differ between runs of equal size and tokens (MATCH_INPUTS within MATCH_TOLERANCE)
    by more than MIXED_GAP in final loss (the median over the matched inputs).

    Why: no law reads such a column (a corpus, a tokenizer, a recipe name), so runs of two corpora at one size and
    token count look like one ladder with noisy losses; the fit lands between them and its forecast is of neither.
    A column whose groups never meet at equal inputs (a size label, or corpora at disjoint sizes) cannot be
    judged this way and is not reported, nor is one whose groups logged different LR curves (schedules the
    curve laws tell apart through `lr`). Each item: column, runs per value, matched inputs, median gap, and the
    other columns that split the runs the same way (same_split)."""
    candidates = [c for c in table.columns if c not in COLUMNS and not pd.api.types.is_numeric_dtype(table[c])]
    if not candidates or "loss" not in table.columns:
        return []
    final = run_summary(table)
    inputs = [c for c in MATCH_INPUTS if c in final.columns]
    if not inputs:
        return []
    key = _matched_key(final, inputs)
    # a logged LR tells runs on different schedules apart (the curve laws read it): such a column is not hidden
    lr_shape = table.groupby("run")["lr"].agg(["mean", "last"]).reindex(final.index) if "lr" in table.columns else None
    found: list[dict] = []
    partitions: dict[tuple, dict] = {}
    for column in candidates:
        if (table.groupby("run")[column].nunique(dropna=False) > 1).any() or final[column].nunique() < 2:
            continue
        partition = tuple(pd.factorize(final[column].astype(str))[0])
        if partition in partitions:  # another name for a split already reported (a config name and its corpus)
            partitions[partition]["same_split"].append(column)
            continue
        gaps = []
        for _, runs in final.groupby(key):
            by_value = np.log(runs["loss"].to_numpy(float))
            values = runs[column].astype(str).to_numpy()
            if len(set(values)) < 2:
                continue
            if lr_shape is not None and _lr_tells_apart(lr_shape.loc[runs.index], values):
                continue
            means = [by_value[values == v].mean() for v in sorted(set(values))]
            gaps.append(float(np.exp(max(means) - min(means)) - 1))
        if gaps and float(np.median(gaps)) > MIXED_GAP:
            found.append({"column": column, "runs": final[column].astype(str).value_counts().sort_index().to_dict(),
                          "matched": len(gaps), "median_gap": float(np.median(gaps)), "same_split": []})
            partitions[partition] = found[-1]
    return found


# substrings of numeric column names that are not settings a sweep varies: replica counters (seeds) and outcomes
NOT_SETTINGS = ("seed", "replica", "loss", "accuracy", "ppl", "perplexity", "score")


NOT_LOGGED = np.iinfo(np.int64).min  # the key of an input a run did not log (a NaN unique_tokens)


def _matched_key(final: pd.DataFrame, inputs: Sequence[str]) -> pd.Series:
    """Each run's law inputs rounded to MATCH_TOLERANCE in log space: runs with equal keys are one (size, tokens) point;
    an input a run did not log matches the same input not logged by another run."""
    def key(values: np.ndarray) -> np.ndarray:
        logs = np.log(values)
        finite = np.isfinite(logs)
        out = np.full(len(values), NOT_LOGGED, dtype=np.int64)
        out[finite] = np.round(logs[finite] / MATCH_TOLERANCE)
        return out

    return pd.Series(list(zip(*(key(final[c].to_numpy(float)) for c in inputs), strict=True)), index=final.index)


def _settings(table: pd.DataFrame, final: pd.DataFrame) -> dict[str, pd.Series]:
    """Per run, the hyperparameters a sweep varies: the peak of its logged LR, and every numeric column outside the
    schema that is constant within each run (batch size, weight decay, ...), except seeds and outcomes (NOT_SETTINGS)."""
    out: dict[str, pd.Series] = {}
    if "lr" in table.columns:
        out["peak lr"] = table.groupby("run")["lr"].max().reindex(final.index)
    for column in table.columns:
        if column in COLUMNS or not pd.api.types.is_numeric_dtype(table[column]):
            continue
        if any(word in column.lower() for word in NOT_SETTINGS):
            continue
        if (table.groupby("run")[column].nunique(dropna=False) > 1).any():
            continue
        out[column] = final[column]
    return out


def _sweeps(table: pd.DataFrame) -> tuple[pd.DataFrame, list[tuple[pd.Index, list[str]]]]:
    """(final points, [(the runs of one (size, tokens) point, the settings they differ in)]) for every point whose
    runs differ in a hyperparameter (more than 1% apart)."""
    if "loss" not in table.columns:
        return pd.DataFrame(), []
    final = run_summary(table)
    inputs = [c for c in MATCH_INPUTS if c in final.columns]
    if not inputs or len(final) < 2:
        return final, []
    settings = _settings(table, final)
    if not settings:
        return final, []
    groups = []
    for _, runs in final.groupby(_matched_key(final, inputs)):
        if len(runs) < 2:
            continue
        differ = [name for name, values in settings.items()
                  if not np.allclose(values.loc[runs.index].to_numpy(float), float(values.loc[runs.index].iloc[0]), rtol=0.01,
                                     equal_nan=True)]
        if differ:
            groups.append((runs.index, differ))
    return final, groups


def sweep_groups(table: pd.DataFrame) -> dict | None:
    """A hyperparameter sweep inside the table: runs of equal size and tokens (MATCH_INPUTS within MATCH_TOLERANCE)
    that differ in peak LR or another numeric setting, whose losses at a point lie a median of more than MIXED_GAP
    above the best of that point. None when there is none.

    Why: a scaling law is the loss of a tuned run at each size and budget; fitted through every run of an LR x batch
    grid it fits the grid's average, with its diverged and under-trained corners, and forecasts a target as if it
    were trained at an average setting. Seeds (replicas of one setting, within ~0.5%) and schedules that differ only
    in shape (same peak LR; the curve laws read `lr`) are not sweeps. Keys: columns (the settings that vary),
    points (how many (size, tokens) points hold a sweep), runs (their runs), largest (most runs at one point),
    median_gap (the geometric mean of a point's final losses over its best, median over the points)."""
    final, groups = _sweeps(table)
    if not groups:
        return None
    gaps = []
    for index, _ in groups:
        loss = final.loc[index, "loss"].to_numpy(float)
        gaps.append(float(np.exp(np.log(loss).mean()) / loss.min() - 1))
    if float(np.median(gaps)) <= MIXED_GAP:
        return None
    columns = sorted({name for _, differ in groups for name in differ})
    return {"columns": columns, "points": len(groups), "runs": int(sum(len(index) for index, _ in groups)),
            "largest": int(max(len(index) for index, _ in groups)), "median_gap": float(np.median(gaps))}


def best_of_sweeps(table: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """(the table with only the best run, the lowest final loss, of each (size, tokens) point whose runs differ in a
    hyperparameter; the runs dropped). Runs at points without a sweep, and replicas that differ in nothing but a
    seed, stay as they are."""
    final, groups = _sweeps(table)
    dropped = []
    for index, _ in groups:
        losses = final.loc[index, "loss"]
        dropped.extend(str(run) for run in index if run != losses.idxmin())
    return table[~table["run"].astype(str).isin(dropped)].reset_index(drop=True), sorted(dropped)


def _lr_tells_apart(lr_shape: pd.DataFrame, values: np.ndarray) -> bool:
    """Whether runs of different `values` logged different LR curves (mean or last LR more than 1% apart)."""
    shapes = {v: lr_shape[values == v].mean().to_numpy(float) for v in set(values)}
    ref = next(iter(shapes.values()))
    return any(not np.allclose(s, ref, rtol=0.01) for s in shapes.values())


def find_duplicate_runs(table: pd.DataFrame) -> list[tuple[str, str]]:
    """Pairs (kept, duplicate) of runs whose rows are identical in every column but the name: one run logged twice under
    two names would count as two independent runs in a bootstrap and fake confidence."""
    seen: dict[int, str] = {}
    pairs = []
    cols = [c for c in table.columns if c != "run"]
    for run, c in table.sort_values(["run", "step"]).groupby("run", sort=True):
        key = hash(tuple(map(str, c[cols].to_numpy().ravel().tolist())))
        if key in seen:
            pairs.append((seen[key], str(run)))
        else:
            seen[key] = str(run)
    return pairs
