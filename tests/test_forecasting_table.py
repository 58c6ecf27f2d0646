"""The table of runs: validation errors a user can act on, and every loader."""

import json

import numpy as np
import pandas as pd
import pytest

from forecasting.api import load_table
from forecasting.table import LeftOutWarning, TableError, from_records, from_run_dirs, read_table_file, validate_table


def _runs(n_runs=3, n_steps=4):
    rows = []
    for r in range(n_runs):
        for s in range(1, n_steps + 1):
            rows.append({"run": f"r{r}", "step": s * 100, "loss": 4.0 - 0.1 * s - 0.2 * r, "tokens": s * 1e6})
    return rows


def test_valid_table_is_sorted_and_typed():
    df = pd.DataFrame(_runs()[::-1])
    out = validate_table(df)
    assert list(out["run"].unique()) == ["r0", "r1", "r2"]
    assert out["step"].dtype == np.int64 and out.groupby("run")["step"].is_monotonic_increasing.all()


def test_missing_column_is_named():
    with pytest.raises(TableError, match=r"missing column\(s\) \['loss'\]"):
        validate_table(pd.DataFrame({"run": ["a"], "step": [1]}))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0, 0.0])
def test_bad_loss_values_name_run_and_step(bad):
    rows = _runs()
    rows[5]["loss"] = bad
    with pytest.raises(TableError, match=r"'loss'.*run 'r1' step 200"):
        validate_table(pd.DataFrame(rows))


def test_non_positive_tokens_and_params_rejected():
    rows = _runs()
    rows[0]["tokens"] = 0.0
    with pytest.raises(TableError, match="'tokens' must be positive"):
        validate_table(pd.DataFrame(rows))
    rows = _runs()
    for r in rows:
        r["params_active"] = -5.0
    with pytest.raises(TableError, match="params_active"):
        validate_table(pd.DataFrame(rows))


def test_duplicated_run_step_rows_rejected():
    rows = _runs() + [_runs()[2]]
    with pytest.raises(TableError, match=r"duplicated \(run, step\).*run 'r0' step 300"):
        validate_table(pd.DataFrame(rows))


def test_wandb_history_csv_columns_are_mapped(tmp_path):
    df = pd.DataFrame({"_step": [10, 20, 30], "eval/loss": [3.0, 2.9, 2.8], "optim/learning_rate": [1e-3, 9e-4, 8e-4], "Name": "my-run"})
    path = tmp_path / "export.csv"
    df.to_csv(path, index=False)
    out = read_table_file(str(path))
    assert {"run", "step", "loss", "lr"} <= set(out.columns)
    assert out["step"].tolist() == [10, 20, 30] and out["loss"].tolist() == [3.0, 2.9, 2.8]
    assert out["lr"].tolist() == [1e-3, 9e-4, 8e-4] and out["run"].unique().tolist() == ["my-run"]


def _long_csv(tmp_path, rows) -> str:
    path = tmp_path / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


def test_a_long_table_with_train_and_eval_rows_reads_the_eval_loss(tmp_path):
    """run,step,split,loss with both splits at every step: aligned by step alone, the train row (last in the file)
    used to overwrite the eval one, and the forecast read the training loss without a word."""
    rows = [{"run": run, "step": step, "split": split, "loss": base - step / 1000}
            for run in ("a", "b") for step in (100, 200) for split, base in (("eval", 3.0), ("train", 2.0))]
    rows += [{"run": "c", "step": 100, "split": "train", "loss": 2.5}]  # logged no eval: its train loss stands
    with pytest.warns(LeftOutWarning, match=r"run\(s\) 'a', 'b' log eval and train losses: their eval rows are read"):
        out = read_table_file(_long_csv(tmp_path, rows))
    assert out.loc[out["run"] != "c", "loss"].tolist() == [2.9, 2.8, 2.9, 2.8]
    assert out.loc[out["run"] == "c", ["split", "loss"]].values.tolist() == [["train", 2.5]]


def test_two_losses_at_one_step_of_a_file_are_an_error_and_a_row_repeated_is_not(tmp_path):
    rows = [{"run": "a", "step": s, "loss": 3.0 - s / 1000} for s in (100, 200)]
    assert len(read_table_file(_long_csv(tmp_path, rows + [rows[1]]))) == 2
    with pytest.raises(TableError, match=r"run 'a' holds 2 different losses at step 200 .*appended twice"):
        read_table_file(_long_csv(tmp_path, rows + [{"run": "a", "step": 200, "loss": 2.5}]))


def test_a_run_without_any_loss_is_left_out_by_name(tmp_path):
    rows = [{"run": run, "step": 1, "loss": loss} for run, loss in (("a", 3.0), ("b", None), ("c", 2.5))]
    with pytest.warns(LeftOutWarning, match=r"run\(s\) 'b' hold no loss value in any row: left out"):
        out = read_table_file(_long_csv(tmp_path, rows))
    assert out["run"].tolist() == ["a", "c"]


def test_parquet_and_run_name_from_file(tmp_path):
    df = pd.DataFrame({"step": [1, 2, 3], "loss": [3.0, 2.5, 2.4]})
    path = tmp_path / "alpha.parquet"
    df.to_parquet(path)
    out = load_table(str(path))
    assert out["run"].unique().tolist() == ["alpha"] and len(out) == 3


def test_from_records_with_constants_derives_fraction_and_tokens():
    out = from_records([{"run": "a", "step": 50, "loss": 3.0}, {"run": "a", "step": 100, "loss": 2.9}], num_steps=100, tokens_per_step=1000.0)
    assert out["fraction"].tolist() == [0.5, 1.0] and out["tokens"].tolist() == [50000.0, 100000.0]


def _write_run_dir(fs_root, name, lines, torn=False):
    spec = {
        "name": name, "fingerprint": "abc", "kind": "train", "job": {},
        "derived": {"params_active": 1e8, "params_total": 2e8, "num_steps": 100, "tokens": 1e8,
                    "tokens_per_step": 1e6, "flops_per_token": 6e8, "total_flops": 6e16},
    }
    import fsspec

    fs, root = fsspec.core.url_to_fs(fs_root)
    fs.makedirs(f"{root}/{name}", exist_ok=True)
    with fs.open(f"{root}/{name}/spec.json", "w") as f:
        f.write(json.dumps(spec))
    text = "\n".join(json.dumps(x) for x in lines) + "\n"
    if torn:
        text += '{"step": 99, "train/lo'
    with fs.open(f"{root}/{name}/metrics.jsonl", "w") as f:
        f.write(text)
    return f"{fs_root}/{name}"


def test_run_dirs_on_memory_fs_with_torn_last_line():
    lines = [
        {"step": s, "tokens": s * 1e6, "flops": s * 6e14, "time": s, "train/loss": 4 - s / 100, "optim/learning_rate": 1e-3,
         **({"eval/loss": 4.1 - s / 100} if s % 20 == 0 else {})}
        for s in range(10, 101, 10)
    ]
    a = _write_run_dir("memory://ladder-test", "run-a", lines, torn=True)
    b = _write_run_dir("memory://ladder-test", "run-b", lines)
    out = from_run_dirs([a, b])
    assert out["run"].unique().tolist() == ["run-a", "run-b"]
    assert (out["split"] == "eval").all() and len(out) == 10  # eval lines only, torn line ignored
    assert out["fraction"].max() == 1.0 and out["params_active"].iloc[0] == 1e8
    assert out["lr"].iloc[0] == 1e-3
    assert load_table("memory://ladder-test")["run"].nunique() == 2


def test_run_dir_without_eval_falls_back_to_train_loss():
    lines = [{"step": s, "tokens": s * 1e6, "flops": s * 6e14, "time": s, "train/loss": 4 - s / 100, "optim/learning_rate": 1e-3} for s in (10, 20, 30)]
    p = _write_run_dir("memory://ladder-test2", "only-train", lines)
    out = from_run_dirs([p])
    assert (out["split"] == "train").all() and out["loss"].tolist() == [3.9, 3.8, 3.7]


def test_not_a_run_dir_is_a_clear_error():
    with pytest.raises(TableError, match="no spec.json"):
        from_run_dirs(["memory://nowhere/at-all"])
