"""`ladder import EXP STEP SOURCE`: runs trained elsewhere become steps the forecaster reads like our own.

Four rungs of the quick local ladder, each from another kind of source: a sparse W&B history CSV export, a W&B
offline run directory written by the real wandb client, an OLMo-style eval table with a GFLOPs column and two
models in it, and a Levanter-style JSON-lines file. Their losses follow one law (L = 1.7 + 30 N^-0.3 + 40 D^-0.3,
with a per-run offset and a small wiggle), so the hero's forecast from them has a known answer.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from ladder.cli import app
from ladder.importer import WandbLog, wandb_log_path
from ladder.loader import load_experiment

EXP = "experiments/local_ladder_quick.py"
RUNGS = ("q16", "q24", "q32", "q48")
HERO = "hero-quick"
OFFSET = {"q16": 1.006, "q24": 0.993, "q32": 1.004, "q48": 0.997, HERO: 1.0}
REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def exp():
    return load_experiment(EXP)


def law(exp, name: str, step: int) -> float:
    derived = exp.dag[name].derived
    tokens = max(step, 1) * derived.tokens_per_step
    clean = 1.7 + 30 * derived.params_active ** -0.3 + 40 * tokens ** -0.3
    return clean * OFFSET[name] * (1 + 0.002 * math.sin(1.7 * step))


def eval_steps(exp, name: str) -> list[int]:
    """An eval every 5% of the run, as our ladders log them (matched-progress fits need the same fractions)."""
    n = exp.dag[name].derived.num_steps
    return sorted({round(n * k / 20) for k in range(1, 21)})


def metric_lines(exp, name: str, *, depart_after: float | None = None, bump: float = 0.0) -> list[dict]:
    """Our trainer's shape: a train line every 10 steps, an eval line every 5% (its loss `bump`ed after `depart_after`)."""
    n = exp.dag[name].derived.num_steps
    evals = set(eval_steps(exp, name))
    lines = []
    for s in range(1, n + 1):
        if s % 10 == 0:
            lines.append({"step": s, "train/loss": law(exp, name, s) + 0.05})
        if s in evals:
            late = depart_after is not None and s > depart_after * n
            lines.append({"step": s, "eval/loss": law(exp, name, s) + (bump if late else 0.0)})
    return lines


def wandb_history_export(exp, name: str, path: Path) -> None:
    """W&B's run-history CSV: one row per logged step, `_step`, `_runtime`, `_timestamp`, empty cells where a metric
    was not logged (train/loss every 3 steps, eval/loss every 5%, the LR every 6 steps)."""
    n = exp.dag[name].derived.num_steps
    evals = set(eval_steps(exp, name))
    rows = []
    for s in range(0, n + 1):
        if s % 3 and s not in evals:
            continue
        row = {"_step": s, "_runtime": 0.5 * s, "_timestamp": 1.7e9 + 0.5 * s}
        if s % 3 == 0:
            row["train/loss"] = law(exp, name, s) + 0.05
        if s % 6 == 0:
            row["optim/learning_rate"] = 1e-3
        if s in evals:
            row["eval/loss"] = law(exp, name, s)
        rows.append(row)
    pd.DataFrame(rows, columns=["_step", "train/loss", "optim/learning_rate", "_runtime", "_timestamp", "eval/loss"]).to_csv(path, index=False)


def olmo_table(exp, name: str, path: Path) -> None:
    """OLMo's checkpoint-eval layout (Step, model_name, num_params as text, per-set CrossEntropyLoss and Perplexity,
    downstream accuracies, a checkpoint dict), one more model in the same file, and a GFLOPs column."""
    derived = exp.dag[name].derived
    rows = []
    for model, scale in (("OLMo-style-q32", 1.0), ("OLMo-style-other", 1.3)):
        for s in eval_steps(exp, name):
            loss = law(exp, name, s) * scale
            rows.append({
                "Step": s, "downstream/piqa_len_norm": 0.5 + s / 1e4, "model_name": model, "num_params": "18K",
                "c4_en-validation/CrossEntropyLoss": loss, "c4_en-validation/Perplexity": math.exp(loss),
                "pile-validation/CrossEntropyLoss": loss + 0.1, "downstream/arc_easy_acc": 0.3,
                "GFLOPs": 6 * derived.params_active * s * derived.tokens_per_step / 1e9,
                "checkpoint": f"{{'revision': 'step{s}'}}",
            })
    pd.DataFrame(rows).to_csv(path, index=False)


def levanter_jsonl(exp, name: str, path: Path) -> None:
    derived = exp.dag[name].derived
    with open(path, "w") as handle:
        for line in metric_lines(exp, name):
            line["throughput/total_tokens"] = line["step"] * derived.tokens_per_step
            handle.write(json.dumps(line) + "\n")


WANDB_WRITER = """
import json, sys, time, wandb
lines, out, delay = json.load(open(sys.argv[1])), sys.argv[2], float(sys.argv[3])
run = wandb.init(dir=out, project="external-ladder", name="q24-elsewhere", mode="offline",
                 settings=wandb.Settings(silent=True, console="off", x_transaction_log_flush_interval=0.2))
for line in lines:
    run.log({k: v for k, v in line.items() if k != "step"}, step=line["step"])
    time.sleep(delay)
run.finish()
"""


def wandb_env() -> dict[str, str]:
    """The real client, offline and quiet: no network, no login prompt (as trainer/metrics.py runs it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return {**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_CONSOLE": "off"}


def write_wandb_run(lines: list[dict], directory: Path, *, delay: float = 0.0, wait: bool = True):
    """A W&B offline run written by the real wandb client in its own process; returns it (or the process)."""
    directory.mkdir(parents=True, exist_ok=True)
    spec = directory / "lines.json"
    spec.write_text(json.dumps(lines))
    command = [sys.executable, "-c", WANDB_WRITER, str(spec), str(directory), str(delay)]
    if not wait:
        return subprocess.Popen(command, env=wandb_env(), cwd=directory)
    subprocess.run(command, env=wandb_env(), cwd=directory, check=True, timeout=180)
    (run,) = (directory / "wandb").glob("offline-run-*")
    return run


@pytest.fixture(scope="module")
def sources(exp, tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    wandb_history_export(exp, "q16", root / "q16_wandb_export.csv")
    wandb_run = write_wandb_run(metric_lines(exp, "q24"), root / "q24")
    olmo_table(exp, "q32", root / "q32_olmo_eval.csv")
    levanter_jsonl(exp, "q48", root / "q48_metrics.jsonl")
    return {"q16": [str(root / "q16_wandb_export.csv")], "q24": [str(wandb_run)],
            "q32": [str(root / "q32_olmo_eval.csv"), "--run", "OLMo-style-q32"], "q48": [str(root / "q48_metrics.jsonl")]}


@pytest.fixture(scope="module")
def imported(exp, sources, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ladder-root"))
    outputs = {}
    for name in RUNGS:
        result = runner.invoke(app, ["import", EXP, name, *sources[name], "--root", root])
        assert result.exit_code == 0, result.output
        outputs[name] = result.output
    return root, outputs


def run_dir(exp, root: str, name: str) -> Path:
    return Path(root) / "runs" / f"{name}-{exp.dag.fingerprints[name][:10]}"


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_source_becomes_a_finished_step_in_our_names(exp, imported):
    root, outputs = imported
    status = runner.invoke(app, ["status", EXP, "--root", root, "--json"])
    states = {row["name"]: row for row in json.loads(status.stdout)}
    assert [states[n]["state"] for n in RUNGS] == ["done"] * 4
    assert states[HERO]["state"] == "pending"
    expected = {"q16": ("csv", "_step", "eval/loss"), "q24": ("wandb", "_step", "eval/loss"),
                "q32": ("csv", "Step", "c4_en-validation/CrossEntropyLoss"), "q48": ("jsonl", "step", "eval/loss")}
    for name in RUNGS:
        directory = run_dir(exp, root, name)
        record = json.loads((directory / "import.json").read_text())
        fmt, step_col, loss_col = expected[name]
        assert record["format"] == fmt and record["state"] == "done" and record["eval_points"] == 20
        assert record["mapping"]["columns"]["step"] == step_col and record["mapping"]["columns"]["eval/loss"] == loss_col
        lines = read_lines(directory / "metrics.jsonl")
        evals = {r["step"]: r["eval/loss"] for r in lines if "eval/loss" in r}
        assert sorted(evals) == eval_steps(exp, name)  # sparse columns aligned by step: every eval, none invented
        assert all(evals[s] == pytest.approx(law(exp, name, s), rel=1e-12) for s in evals)
        derived = exp.dag[name].derived
        last = max(lines, key=lambda r: r["step"])
        assert last["tokens"] == derived.num_steps * derived.tokens_per_step
        assert last["flops"] == pytest.approx(last["tokens"] * 3 * derived.flops_per_token)  # the spec's convention
        result = json.loads((directory / "result.json").read_text())
        assert result["completed"] and result["final_eval_loss"] == pytest.approx(evals[max(evals)])
        spec = json.loads((directory / "spec.json").read_text())
        assert spec["fingerprint"] == exp.dag.fingerprints[name] and spec["derived"]["num_steps"] == derived.num_steps
    q16 = read_lines(run_dir(exp, root, "q16") / "metrics.jsonl")
    assert any("train/loss" in r and "eval/loss" not in r for r in q16)  # train-only steps kept as train lines
    assert {"time", "optim/learning_rate"} <= {k for r in q16 for k in r}
    q24 = json.loads((run_dir(exp, root, "q24") / "import.json").read_text())
    assert q24["display_name"] == "q24-elsewhere" and q24["finished"] is True and q24["exit_code"] == 0
    q32 = json.loads((run_dir(exp, root, "q32") / "import.json").read_text())
    assert q32["mapping"]["run"] == "OLMo-style-q32"
    olmo = read_lines(run_dir(exp, root, "q32") / "metrics.jsonl")
    derived = exp.dag["q32"].derived
    assert olmo[-1]["external/flops"] == pytest.approx(6 * derived.params_active * olmo[-1]["tokens"])  # GFLOPs x 1e9
    assert "pile-validation/CrossEntropyLoss" in olmo[-1] and "num_params" not in olmo[-1]
    assert "tokens <- 'throughput/total_tokens'" in outputs["q48"]


def test_the_hero_forecast_from_imported_runs_holds_the_law(exp, imported):
    root, _ = imported
    result = runner.invoke(app, ["forecast", EXP, HERO, "--root", root, "--json", "--n-bootstrap", "20"])
    assert result.exit_code == 0, result.output
    forecast = json.loads(result.stdout)
    truth = law(exp, HERO, exp.dag[HERO].derived.num_steps)
    chosen = [c["method"] for c in forecast["selection"] if c.get("chosen")]
    blended = {c["method"] for c in forecast["selection"] if c.get("blend_weight")}
    # the imported rungs carry whole curves: matched progress and the compute law's collapsed curve both use them, and
    # their backtests on these rungs are within 2x of each other (5.7% and 5.1% expected), so the forecast blends them
    assert chosen in (["matched_progress"], ["compute"])
    assert forecast["method"] == chosen[0] or (forecast["method"] == "blend" and blended == {"matched_progress", "compute"})
    assert forecast["final_loss_lo"] < truth < forecast["final_loss_hi"]
    assert forecast["final_loss"] == pytest.approx(truth, rel=0.03)


def test_reimport_is_a_no_op_and_show_reads_it(exp, imported, sources):
    root, _ = imported
    before = (run_dir(exp, root, "q48") / "status.json").read_text()
    again = runner.invoke(app, ["import", EXP, "q48", *sources["q48"], "--root", root])
    assert again.exit_code == 0, again.output
    assert (run_dir(exp, root, "q48") / "status.json").read_text() == before
    show = runner.invoke(app, ["show", EXP, "q24", "--root", root])
    assert show.exit_code == 0 and "eval/loss" in show.output


def test_a_sparse_wandb_export_reads_as_a_table_and_says_what_fit_lacks(exp, tmp_path):
    """The issue's export: `lr` sparse, no params. The table aligns by step; the fit names the missing column."""
    from forecasting.table import read_table_file

    frames = []
    for name in ("q16", "q24", "q32"):
        wandb_history_export(exp, name, tmp_path / f"{name}.csv")
        frames.append(pd.read_csv(tmp_path / f"{name}.csv").assign(Name=name))
    path = tmp_path / "wandb_export.csv"
    pd.concat(frames).to_csv(path, index=False)
    table = read_table_file(str(path))
    assert sorted(table["run"].unique()) == ["q16", "q24", "q32"]
    q16 = table[table["run"] == "q16"]
    assert q16["step"].tolist() == eval_steps(exp, "q16") and q16["lr"].notna().all()
    fit = runner.invoke(app, ["fit", str(path)])
    assert fit.exit_code == 2, fit.output
    assert "'params_active'" in fit.output and "ladder import EXP STEP SOURCE" in fit.output
    assert "Traceback" not in fit.output


def test_a_wandb_panel_export_is_unpivoted(exp, tmp_path):
    from forecasting.external import external_rows

    steps = eval_steps(exp, "q16")
    panel = pd.DataFrame({"Step": steps, "my-run - eval/loss": [law(exp, "q16", s) for s in steps]})
    panel["my-run - eval/loss__MIN"] = panel["my-run - eval/loss"] - 0.1
    panel["my-run - eval/loss__MAX"] = panel["my-run - eval/loss"] + 0.1
    frame, mapping = external_rows(panel, source="panel.csv")
    assert mapping.run == "my-run" and frame["step"].tolist() == steps
    assert frame["eval/loss"].tolist() == panel["my-run - eval/loss"].tolist()


@pytest.mark.parametrize("make, args, message", [
    ("csv", ["--loss-column", "eval/los"], "column 'eval/los' (--loss-column) is not in"),
    ("nolosscsv", [], "has no loss column"),
    ("trainonly", [], "pass --loss-column 'learning/loss' to forecast on it"),
    ("nostep", [], "has no step column"),
    ("olmo", [], "holds 2 runs in column 'model_name'"),
    ("olmo", ["--run", "nope"], "run 'nope' (--run) is not in column 'model_name'"),
    ("parquet_as_csv", [], "is not a CSV text file"),
    ("text_as_parquet", [], "is not a readable parquet file"),
    ("text_as_wandb", [], "is not a W&B transaction log"),
    ("missing", [], "no such file"),
    ("unknown_suffix", [], "unknown format '.xlsx'"),
    ("too_long", [], "plans 37"),
    ("textstep", [], "holds 1 value(s) that are not numbers (first 'ten')"),
])
def test_bad_sources_exit_2_with_one_sentence(exp, tmp_path, make, args, message):
    steps = eval_steps(exp, "q16")
    path = tmp_path / {"parquet_as_csv": "x.csv", "text_as_parquet": "x.parquet", "text_as_wandb": "run-x.wandb",
                       "unknown_suffix": "x.xlsx", "missing": "absent.csv"}.get(make, "x.csv")
    good = pd.DataFrame({"step": steps, "eval/loss": [3.0] * len(steps)})
    if make == "csv":
        good.to_csv(path, index=False)
    elif make == "nolosscsv":
        good.rename(columns={"eval/loss": "mystery"}).to_csv(path, index=False)
    elif make == "trainonly":
        good.rename(columns={"eval/loss": "learning/loss"}).to_csv(path, index=False)
    elif make == "nostep":
        good.rename(columns={"step": "when"}).to_csv(path, index=False)
    elif make == "olmo":
        olmo_table(exp, "q16", path)
    elif make == "parquet_as_csv":
        good.to_parquet(path)
    elif make in ("text_as_parquet", "text_as_wandb", "unknown_suffix"):
        path.write_text("step,loss\n1,3.0\n")
    elif make == "too_long":
        pd.DataFrame({"step": [10, 100], "eval/loss": [3.0, 2.9]}).to_csv(path, index=False)
    elif make == "textstep":
        pd.DataFrame({"step": ["5", "ten"], "eval/loss": [3.0, 2.9]}).to_csv(path, index=False)
    root = tmp_path / "root"
    result = runner.invoke(app, ["import", EXP, "q16", str(path), *args, "--root", str(root)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert result.output.count("error:") == 1 and len(result.output.strip().splitlines()) <= 3
    assert not (root / "runs").exists()  # nothing written before the source is understood


def test_the_wandb_reader_tolerates_a_partial_last_record(exp, tmp_path):
    """A .wandb file cut anywhere (a run being written) reads as its complete records; the rest comes next time."""
    lines = [{"step": s, "eval/loss": 3.0 - s / 1e3, "blob": "x" * 900} for s in range(0, 400, 5)]  # > one 32 KiB block
    wandb_file = wandb_log_path(str(write_wandb_run(lines, tmp_path / "w")))
    data = Path(wandb_file).read_bytes()
    whole = WandbLog(wandb_file).read()
    assert [r["_step"] for r in whole if "eval/loss" in r] == list(range(0, 400, 5))
    assert len(data) > 32768
    growing = tmp_path / "growing.wandb"
    for cuts in ([5, 40_000], [33_000, 33_100, 60_000], [len(data) // 3, len(data) // 2 + 7]):
        growing.write_bytes(b"")
        reader = WandbLog(str(growing))
        seen = []
        for cut in [*cuts, len(data)]:
            growing.write_bytes(data[:cut])
            seen += reader.read()
        assert seen == whole and reader.finished and reader.exit_code == 0


def test_sources_and_stores_on_fsspec_urls(exp, tmp_path):
    """A parquet export on one fsspec filesystem imported into a store on another (memory:// here; gs:// alike)."""
    import fsspec

    from ladder.importer import import_source
    from ladder.store import Store

    frame = pd.DataFrame([r for r in metric_lines(exp, "q16")])
    with fsspec.open("memory://exports/q16.parquet", "wb") as handle:
        frame.to_parquet(handle)
    store = Store("memory://ladder-import-external")
    run, record = import_source(store, exp.dag, "q16", "memory://exports/q16.parquet")
    assert record["format"] == "parquet" and record["state"] == "done" and record["source"] == "memory://exports/q16.parquet"
    assert store.read_status(store.run_dir("q16", exp.dag.fingerprints["q16"]))["state"] == "done"
    lines = store.fs.cat_file(f"{store.run_dir('q16', exp.dag.fingerprints['q16'])}/metrics.jsonl").decode().splitlines()
    assert [json.loads(line)["step"] for line in lines] == sorted(frame["step"].unique().tolist())


@pytest.mark.parametrize("columns, loss_option, expected", [
    ({"_step": "step", "eval/loss": "eval", "train/loss": "train", "throughput/total_tokens": "tokens",
      "optim/learning_rate": "lr"}, None,  # Levanter / Marin
     {"step": "_step", "eval/loss": "eval/loss", "train/loss": "train/loss", "tokens": "throughput/total_tokens",
      "optim/learning_rate": "optim/learning_rate"}),
    ({"step": "step", "eval/avg_loss": "eval", "learning/loss": "train", "learning/current_learning_rate": "lr"}, None,  # MaxText
     {"step": "step", "eval/loss": "eval/avg_loss", "train/loss": "learning/loss", "optim/learning_rate": "learning/current_learning_rate"}),
    ({"step": "step", "loss_metrics/global_avg_loss": "train", "lr": "lr"}, "loss_metrics/global_avg_loss",  # torchtitan
     {"step": "step", "eval/loss": "loss_metrics/global_avg_loss", "optim/learning_rate": "lr"}),
    ({"global_step": "step", "eval/lm/c4_en-validation/CE loss": "eval", "train/CE loss": "train",
      "throughput/total tokens": "tokens", "optim/LR (group 0)": "lr"}, None,  # OLMo-core
     {"step": "global_step", "eval/loss": "eval/lm/c4_en-validation/CE loss", "train/loss": "train/CE loss",
      "tokens": "throughput/total tokens", "optim/learning_rate": "optim/LR (group 0)"}),
])
def test_other_trainers_names_map_to_ours(columns, loss_option, expected):
    from forecasting.external import external_rows

    values = {"step": [10, 20, 30], "eval": [3.0, float("nan"), 2.8], "train": [3.1, 3.0, 2.9], "tokens": [1e4, 2e4, 3e4],
              "lr": [1e-3, 1e-3, 9e-4]}
    frame = pd.DataFrame({name: values[kind] for name, kind in columns.items()})
    rows, mapping = external_rows(frame, source="x.csv", loss=loss_option)
    assert mapping.columns == expected
    assert rows["step"].tolist() == [10, 20, 30]
    if loss_option is None:
        assert rows["eval/loss"].isna().tolist() == [False, True, False]  # sparse: the missing eval stays missing
