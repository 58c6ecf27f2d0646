"""W&B as users of Marin's and Levanter's runs expect it, checked on what the real client writes offline.

Every test runs the wandb client in offline mode (no network) and reads the run's transaction log
(`run-<id>.wandb`) back with ladder.importer's reader of that format and the client's own protobuf
records: the labels (group, job type, tags, project), Levanter's keys and units, where the folder lands.
"""

from __future__ import annotations

import glob
import json
import os
import time

import pytest

from ladder.importer import WandbLog
from trainer.metrics import WandbSink, levanter_keys, wandb_tags

WANDB_VARIABLES = ("WANDB_RUN_GROUP", "WANDB_JOB_TYPE", "WANDB_TAGS", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY",
                   "WANDB_MODE", "WANDB_API_KEY")


class Records(WandbLog):
    """Every record of a .wandb file, as the client's protobuf messages."""

    def _take(self, record, rows):
        rows.append(record)


def read_run(path: str) -> dict:
    """run (the run record), history ({key: value} per logged step) of one offline run's .wandb file."""
    deadline = time.time() + 60
    while True:  # finish() returns before the client's core has flushed the last records (its exit record)
        records = Records(path).read()
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.time() > deadline:
            break
        time.sleep(0.2)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return {"run": run, "history": history}


def offline_runs(root) -> list[str]:
    """The .wandb files of `root/wandb/offline-run-*`: the one folder `wandb sync` is pointed at."""
    return sorted(glob.glob(os.path.join(str(root), "wandb", "offline-run-*", "run-*.wandb")))


@pytest.fixture
def clean_wandb_env(monkeypatch):
    for name in WANDB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    return monkeypatch


def _job_config(num_steps: int = 100, batch: int = 8, seq: int = 64) -> dict:
    from tests.ladder_helpers import tiny_spec

    spec = tiny_spec()
    train = spec.train.model_copy(update={"tokens": num_steps * batch * seq, "batch_size": batch})
    model = spec.model.model_copy(update={"seq_len": seq})
    return spec.job().model_copy(update={"train": train, "model": model}).model_dump(mode="json")


def test_labels_come_from_the_environment_and_the_folder_is_predictable(tmp_path, clean_wandb_env):
    clean_wandb_env.setenv("WANDB_RUN_GROUP", "local_ladder")
    clean_wandb_env.setenv("WANDB_JOB_TYPE", "rung")
    clean_wandb_env.setenv("WANDB_TAGS", "ladder:local,size:r24")
    clean_wandb_env.setenv("WANDB_DIR", str(tmp_path / "root"))
    clean_wandb_env.setenv("WANDB_PROJECT", "my-project")
    run_dir = tmp_path / "root" / "runs" / "r24-0123456789"
    sink = WandbSink(mode="offline", project="ladder", run_dir=str(run_dir), config=_job_config(), name="r24")
    assert sink.run is not None
    sink.write({"step": 10, "time": 1.0, "tokens": 5120, "flops": 1e9, "train/loss": 3.5})
    sink.close()
    [path] = offline_runs(tmp_path / "root")
    run = read_run(path)["run"]
    assert (run.run_group, run.job_type, list(run.tags), run.project) == ("local_ladder", "rung", ["ladder:local", "size:r24"], "my-project")
    assert run.display_name == "r24"
    assert not os.path.exists(run_dir / "wandb"), "with WANDB_DIR set nothing lands in the run directory"


def test_a_project_named_in_the_spec_wins_over_the_environment(tmp_path, clean_wandb_env):
    clean_wandb_env.setenv("WANDB_PROJECT", "from-env")
    sink = WandbSink(mode="offline", project="marin-ladder", run_dir=str(tmp_path / "run"), config={}, group="g", job_type="hero")
    sink.close()
    [path] = offline_runs(tmp_path / "run")  # no WANDB_DIR: {run_dir}/wandb/offline-run-*, one level, not two
    run = read_run(path)["run"]
    assert (run.project, run.run_group, run.job_type) == ("marin-ladder", "g", "hero")


def test_levanter_keys_and_mfu_in_percent(tmp_path, clean_wandb_env):
    config = _job_config(num_steps=100, batch=8, seq=64)  # 512 tokens per step
    sink = WandbSink(mode="offline", project="ladder", run_dir=str(tmp_path / "run"), config=config)
    sink.write({"step": 20, "time": 1.0, "tokens": 20 * 512, "flops": 20 * 2e9, "train/loss": 3.2,
                "throughput/tokens_per_second": 2048.0, "throughput/mfu": 0.25})
    sink.write({"step": 25, "time": 2.0, "tokens": 25 * 512, "flops": 25 * 2e9, "eval/loss": 3.3})
    sink.close()
    [path] = offline_runs(tmp_path / "run")
    history = read_run(path)["history"]
    train = next(h for h in history if "train/loss" in h)
    assert train["global_step"] == 20 and train["_step"] == 20
    assert train["run_progress"] == pytest.approx(0.2)
    assert train["throughput/duration"] == pytest.approx(512 / 2048.0)  # seconds per step, as Levanter logs it
    assert train["throughput/examples_per_second"] == pytest.approx(8 / (512 / 2048.0))
    assert train["throughput/gflops_per_second"] == pytest.approx(2e9 / 0.25 / 1e9)
    assert train["throughput/mfu"] == pytest.approx(25.0)  # Levanter: model FLOP/s / peak * 100
    assert train["throughput/tokens_per_second"] == 2048.0
    evals = next(h for h in history if "eval/loss" in h)
    assert evals["global_step"] == 25 and "throughput/mfu" not in evals


def test_levanter_keys_without_a_job_config():
    assert levanter_keys({"step": 3, "throughput/mfu": 0.1}, {}) == {"global_step": 3, "throughput/mfu": pytest.approx(10.0)}
    assert wandb_tags({"ladder": "local", "mixture": "x" * 100}) == ["ladder:local", "mixture:" + "x" * 56]
    assert wandb_tags("a, b,,a") == ["a", "b"]


def _ladder(tmp_path):
    from ladder.executor import StepTask, _dependency_info, wandb_context
    from ladder.loader import load_experiment
    from ladder.store import Store
    from tests.test_ladder_conventions import EXPERIMENT, _finished_run

    exp_file = tmp_path / "tiny_ladder.py"
    text = EXPERIMENT.replace("tiny_spec(model=model, train=train,", "tiny_spec(model=model, train=train.model_copy(update={'wandb': 'offline'}),")
    text = text.replace('hero=rung("hero", 64, 80))', 'hero=rung("hero", 64, 80), fit=FitConfig(n_bootstrap=10))')
    exp_file.write_text("from ladder.dag import FitConfig\n" + text)
    exp = load_experiment(str(exp_file))
    dag = exp.dag
    store = Store(str(tmp_path / "root"))
    for name in ("r32", "r48"):
        _finished_run(store, dag, name)

    def task(name, **extra):
        step = dag[name]
        return StepTask(step=step, fingerprint=dag.fingerprints[name], store_url=store.url, owner="test",
                        deps={d: _dependency_info(dag, store, d) for d in step.deps},
                        dependency_fingerprints={d: dag.fingerprints[d] for d in step.deps},
                        wandb_env=wandb_context(dag, store, name, exp.name), **extra)

    return dag, store, task


def test_the_fit_step_is_a_w_and_b_run_of_the_group_with_the_whole_forecast_curve(tmp_path, clean_wandb_env):
    """execute_step of the fit (on a worker, as `ladder submit` runs it): group = experiment, job_type = fit,
    its offline run in ROOT/wandb, its chart the hero's whole forecast curve (to its last planned step)."""
    import numpy as np

    from ladder.executor import execute_step
    from ladder.fitting import target_spec
    from tests.test_ladder_conventions import _finished_run

    dag, store, task = _ladder(tmp_path)
    _finished_run(store, dag, "r16")
    fit = dag["fit"]
    outcome = execute_step(task("fit", target=dag[fit.target], target_fingerprint=dag.fingerprints[fit.target]))
    assert outcome["outcome"] == "done", outcome
    assert "WANDB_RUN_GROUP" not in os.environ and "WANDB_DIR" not in os.environ  # the worker's environment is restored
    [path] = offline_runs(tmp_path / "root")
    run = read_run(path)["run"]
    assert (run.display_name, run.run_group, run.job_type) == ("fit", "tiny_ladder", "fit")
    [table] = glob.glob(str(tmp_path / "root" / "wandb" / "offline-run-*" / "files" / "media" / "table" / "forecast" / "chart*.json"))
    data = json.loads(open(table).read())["data"]
    assert max(row[0] for row in data if row[1] == "forecast/loss") == target_spec(dag["hero"]).num_steps
    assert {row[1] for row in data} == {"forecast/loss", "forecast/lo", "forecast/hi"}
    assert np.all(np.diff([row[0] for row in data if row[1] == "forecast/hi"]) > 0)


def test_roles_of_a_ladder():
    from ladder.executor import wandb_context
    from ladder.loader import load_experiment
    from ladder.store import Store

    dag = load_experiment(os.path.join(os.path.dirname(__file__), "..", "experiments", "local_ladder_quick.py")).dag
    store = Store("memory://roles")
    roles = {name: wandb_context(dag, store, name, "local_ladder_quick")["WANDB_JOB_TYPE"] for name in dag.order}
    assert roles == {"q16": "rung", "q24": "rung", "q32": "rung", "q48": "rung", "fit": "fit", "hero-quick": "hero"}
    hero = wandb_context(dag, store, "hero-quick", "local_ladder_quick")
    assert hero["WANDB_RUN_GROUP"] == "local_ladder_quick" and hero["WANDB_TAGS"] == "ladder:local"
    assert "WANDB_DIR" not in hero  # not a local folder: W&B stays in the worker's default place


@pytest.mark.slow  # ~30 s: trains a real tiny rung
def test_a_trained_rung_is_labelled_and_logs_levanter_units(tmp_path, clean_wandb_env):
    from ladder.executor import execute_step
    from trainer.metrics import read_metrics

    dag, store, task = _ladder(tmp_path)
    assert execute_step(task("r16"))["outcome"] == "done"
    [path] = offline_runs(tmp_path / "root")
    rung = read_run(path)
    assert rung["run"].display_name == "r16-" + dag.fingerprints["r16"][:10]
    assert (rung["run"].run_group, rung["run"].job_type, list(rung["run"].tags)) == ("tiny_ladder", "rung", ["ladder:conventions"])
    steps = [h["global_step"] for h in rung["history"] if "train/loss" in h]
    assert steps and steps[-1] == dag["r16"].derived.num_steps
    lines = read_metrics(f"{store.run_dir('r16', dag.fingerprints['r16'])}/metrics.jsonl")
    logged = {r["step"]: r for r in lines if "train/loss" in r}
    mfu = [(h["throughput/mfu"], logged[h["global_step"]]["throughput/mfu"]) for h in rung["history"] if "throughput/mfu" in h]
    assert mfu and all(w == pytest.approx(100 * j) for w, j in mfu)  # W&B in percent, metrics.jsonl a fraction
