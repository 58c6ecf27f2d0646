"""Conventions users expect from the CLI: `show` leads with a summary, `forecast` files a version only when
something changed and keeps per-step schedules out of --json, `python experiments/foo.py` does something,
`submit` reports progress from the run directories in a log without terminal codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from typer.testing import CliRunner

from ladder.cli import app

runner = CliRunner()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXPERIMENT = textwrap.dedent(
    """
    from ladder import TrainStep, build_ladder
    from trainer.config import ModelConfig, MoEConfig
    from tests.ladder_helpers import tiny_spec


    def rung(name, width, batches):
        model = ModelConfig(hidden_dim=width, num_layers=2, num_heads=2, seq_len=32,
                            moe=MoEConfig(num_experts=4, top_k=2, expert_dim=width))
        train = tiny_spec().train.model_copy(update={"tokens": 32 * 8 * batches})
        return TrainStep(name=name, spec=tiny_spec(model=model, train=train, tags={"ladder": "conventions"}))


    steps = build_ladder([rung("r16", 16, 20), rung("r32", 32, 30), rung("r48", 48, 40)], hero=rung("hero", 64, 80))
    """
)


def _finished_run(store, dag, name: str) -> str:
    """A finished run directory as the executor and trainer leave it: spec.json (with the LR schedule), status,
    metrics.jsonl of train and eval lines on a smooth law."""
    from ladder.executor import StepTask, _write_spec

    step = dag[name]
    run_dir = store.run_dir(name, dag.fingerprints[name])
    _write_spec(store, run_dir, StepTask(step=step, fingerprint=dag.fingerprints[name], store_url=store.url, owner="test",
                                         deps={}, dependency_fingerprints={}))
    derived = step.derived
    lines = []
    for g in np.linspace(0.1, 1.0, 10):
        s = max(1, int(round(g * derived.num_steps)))
        loss = 1.5 + 40.0 * (g * derived.total_flops) ** -0.12 * (1 + 0.1 * (1 - g)) * (1 + 0.004 * np.sin(7 * g + len(name)))
        lines.append({"step": s, "tokens": s * derived.tokens_per_step, "flops": s * derived.total_flops / derived.num_steps,
                      "train/loss": loss + 0.01, "throughput/tokens_per_second": 1234.0, "eval/loss": loss})
    with store.fs.open(f"{run_dir}/metrics.jsonl", "w") as handle:
        handle.write("".join(json.dumps(line) + "\n" for line in lines))
    store.acquire_lease(run_dir, "writer")
    store.write_json(f"{run_dir}/result.json", {"completed": True, "final_eval_loss": lines[-1]["eval/loss"]})
    store.finish(run_dir, "writer", "done")
    return run_dir


@pytest.fixture(scope="module")
def ladder_store(tmp_path_factory):
    from ladder.loader import load_experiment
    from ladder.store import Store

    root = tmp_path_factory.mktemp("conventions")
    exp_file = root / "tiny_ladder.py"
    exp_file.write_text(EXPERIMENT)
    dag = load_experiment(str(exp_file)).dag
    store = Store(str(root / "store"))
    dirs = {name: _finished_run(store, dag, name) for name in ("r16", "r32", "r48")}
    return {"experiment": str(exp_file), "root": store.url, "dag": dag, "store": store, "dirs": dirs}


# ------------------------------------------------------------------------------------ ladder show


def test_show_leads_with_a_summary_and_keeps_the_raw_spec_for_json(ladder_store):
    args = ["show", ladder_store["experiment"], "r48", "--root", ladder_store["root"]]
    shown = runner.invoke(app, args)
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    spec = json.load(open(f"{ladder_store['dirs']['r48']}/spec.json"))
    assert len(spec["lr_schedule"]) == spec["derived"]["num_steps"]  # what used to be printed line by line
    assert len(lines) < 60, f"{len(lines)} lines"
    head = "\n".join(lines[:12])
    assert "r48 (train)" in head and "done" in head and "progress" in head and "eval loss" in head
    assert f"step {spec['derived']['num_steps']:,} of {spec['derived']['num_steps']:,} (100.0%)" in head
    assert "lr_schedule" not in shown.output and '"fingerprint"' not in shown.output
    assert "ladder=conventions" in shown.output and "--json" in lines[-1]
    raw = runner.invoke(app, args + ["--json"])
    assert raw.exit_code == 0, raw.output
    doc = json.loads(raw.stdout)
    assert doc["spec"] == spec and doc["status"]["state"] == "done" and doc["result"]["completed"] is True
    assert doc["metrics"]["eval/loss"]["last"] == pytest.approx(doc["result"]["final_eval_loss"])


# ------------------------------------------------------------------------------------ ladder forecast


def test_forecast_files_a_version_only_when_something_changed(ladder_store):
    store = ladder_store["store"]
    args = ["forecast", ladder_store["experiment"], "hero", "--root", ladder_store["root"], "--n-bootstrap", "8"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert store.list_forecasts("hero") == [1] and "stored as version 1" in first.output
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert store.list_forecasts("hero") == [1], "an identical forecast must not clutter the history"
    assert "unchanged: version 1" in again.output
    other = runner.invoke(app, args[:-1] + ["9"])  # another option: another forecast
    assert other.exit_code == 0 and store.list_forecasts("hero") == [1, 2] and "stored as version 2" in other.output
    back = runner.invoke(app, args + ["--json"])  # the newest is version 2: the first one's options again is new
    assert back.exit_code == 0 and store.list_forecasts("hero") == [1, 2, 3]
    assert json.loads(back.stdout)["version"] == 3
    # new inputs: a rung's curve changes
    run_dir = ladder_store["dirs"]["r16"]
    with open(f"{run_dir}/metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"step": 1, "tokens": 1, "flops": 1.0, "eval/loss": 9.0}) + "\n")
    changed = runner.invoke(app, args + ["--json"])
    assert changed.exit_code == 0 and store.list_forecasts("hero") == [1, 2, 3, 4]


def test_forecast_json_keeps_the_per_step_schedule_out_unless_asked(ladder_store):
    args = ["forecast", ladder_store["experiment"], "hero", "--root", ladder_store["root"], "--n-bootstrap", "8", "--json"]
    plain = runner.invoke(app, args)
    assert plain.exit_code == 0, plain.output
    doc = json.loads(plain.stdout)
    assert "lr" not in doc["target"] and doc["target"]["num_steps"] == 80 and doc["curve"]
    from forecasting.forecast import Forecast

    assert Forecast.model_validate(doc).final_loss == doc["final_loss"]  # still a Forecast
    full = runner.invoke(app, args + ["--with-schedule"])
    assert full.exit_code == 0 and len(json.loads(full.stdout)["target"]["lr"]) == 80
    assert len(plain.stdout) < len(full.stdout)


# ------------------------------------------------------------------------------------ python experiments/foo.py


def test_running_an_experiment_file_plans_it_and_says_how_to_run_it(tmp_path):
    root = tmp_path / "root"
    env = {**os.environ, "LADDER_ROOT": str(root)}
    done = subprocess.run([sys.executable, "experiments/readme_example.py"], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "ladder plan experiments/readme_example.py" in done.stdout and "ladder submit" in done.stdout
    assert "r32" in done.stdout and "hero" in done.stdout and "pending" in done.stdout
    assert not root.exists(), "planning writes nothing"
    wrong = subprocess.run([sys.executable, "experiments/readme_example.py", "frobnicate"], cwd=REPO, capture_output=True,
                           text=True, env=env, timeout=300)
    assert wrong.returncode == 2 and "not a ladder command" in wrong.stderr


@pytest.mark.parametrize("name", ["local_ladder", "local_ladder_quick", "local_ladder_seeds", "marin_535b", "readme_example"])
def test_every_shipped_experiment_has_a_main_block(name):
    text = open(os.path.join(REPO, "experiments", f"{name}.py")).read()
    assert 'if __name__ == "__main__":' in text and "run_as_script(__file__)" in text


def test_seed_replicates_differ_from_the_local_ladders_steps_in_their_seed_alone():
    from ladder.loader import load_experiment

    ladder, seeds = (load_experiment(os.path.join(REPO, "experiments", f"{n}.py")).dag for n in ("local_ladder", "local_ladder_seeds"))
    assert sorted(seeds.order) == ["hero_s1", "hero_s2", "r64_s1", "r64_s2"]
    for name in seeds.order:
        base, seed = name.rsplit("_s", 1)
        replica, original = seeds[name].spec, ladder[base].spec
        assert replica.train.seed == int(seed) != original.train.seed
        assert replica.model_copy(update={"train": replica.train.model_copy(update={"seed": original.train.seed})}) == original
        assert seeds.fingerprints[name] != ladder.fingerprints[base] and not seeds[name].deps


# ------------------------------------------------------------------------------------ ladder submit: live progress


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _append(path, rows) -> None:
    with open(path, "a") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in rows))


def _train_rows(steps, t0=1000.0, seconds_per_step=0.5):
    return [{"step": s, "time": t0 + s * seconds_per_step, "tokens": s * 256, "train/loss": 5.0 - s / 100,
             "throughput/tokens_per_second": 512.0} for s in steps]


def test_submit_progress_prints_one_line_per_step_from_the_run_directory(tmp_path):
    import io

    from rich.console import Console

    from ladder.progress import SubmitProgress
    from ladder.store import Store

    store = Store(str(tmp_path))
    run_dir = store.run_dir("r24", "0" * 16)
    os.makedirs(run_dir)
    metrics = f"{run_dir}/metrics.jsonl"
    _append(metrics, _train_rows(range(10, 31, 10)))  # an earlier attempt's lines: read once when following starts
    out = io.StringIO()
    clock = _Clock()
    progress = SubmitProgress(store, Console(file=out, width=200), interval=5.0, read_every=1.0, clock=clock)
    assert not progress.live  # not a terminal: plain lines
    progress.start("r24", run_dir, num_steps=100, tokens_per_step=256)
    _append(metrics, _train_rows(range(40, 61, 10)))
    clock.now = 6.0
    [line] = progress.poll()
    assert line.startswith("[progress] r24 step 60/100 (60.0%)") and "loss 4.4000" in line and "512 tokens/s" in line
    assert "ETA 0:00:20" in line  # 40 steps left at the 0.5 s per step the lines show
    clock.now = 7.0
    _append(metrics, _train_rows([70]))
    assert progress.poll() == [], "at most one line per step every `interval` seconds"
    clock.now = 12.0
    _append(metrics, [{"step": 70, "time": 1035.5, "tokens": 70 * 256, "eval/loss": 4.35}])
    with open(metrics, "a") as handle:
        handle.write('{"step": 80, "train/lo')  # a line still being written is left for the next read
    [line] = progress.poll()
    assert "step 70/100" in line and "eval 4.3500" in line
    clock.now = 18.0
    assert progress.poll() == [], "nothing new, nothing printed"
    assert progress.bytes_read == os.path.getsize(metrics) - len('{"step": 80, "train/lo')  # every byte read once
    progress.finish("r24")
    progress.close()
    assert "\x1b[" not in out.getvalue()
    assert out.getvalue().count("[progress] r24") == 2


def test_submit_progress_on_a_terminal_is_a_rich_display(tmp_path):
    import io

    from rich.console import Console

    from ladder.progress import SubmitProgress
    from ladder.store import Store

    store = Store(str(tmp_path))
    run_dir = store.run_dir("hero", "1" * 16)
    os.makedirs(run_dir)
    out = io.StringIO()
    clock = _Clock()
    progress = SubmitProgress(store, Console(file=out, force_terminal=True, width=160), clock=clock)
    assert progress.live
    progress.start("hero", run_dir, num_steps=200)
    _append(f"{run_dir}/metrics.jsonl", _train_rows(range(10, 101, 10)))
    clock.now = 2.0
    progress.poll()
    progress.finish("hero")
    progress.close()
    text = out.getvalue()
    assert "100/200" in text and "loss 4.0000" in text and "512 tokens/s" in text


def test_quiet_ray_warnings_drops_the_token_auth_notice_and_colour_codes(monkeypatch):
    import logging

    from ladder.progress import RAY_TOKEN_AUTH_LOGGER, quiet_ray_warnings

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    quiet_ray_warnings(tty=False)
    assert os.environ["RAY_COLOR_PREFIX"] == "0"
    from ray._private.authentication import authentication_token_setup

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(RAY_TOKEN_AUTH_LOGGER)  # Ray's loggers do not propagate to the root
    logger.addHandler(handler)
    try:
        authentication_token_setup._warn_token_auth_enabled()  # what every embedded ray.init says
        logger.warning("another warning stays")
    finally:
        logger.removeHandler(handler)
    assert seen == ["another warning stays"]


@pytest.mark.slow  # ~1 min: an embedded Ray and a real tiny training step
def test_submit_in_a_log_shows_progress_without_terminal_codes_or_ray_notices(tmp_path):
    exp = tmp_path / "one.py"
    exp.write_text(textwrap.dedent(
        """
        from ladder import TrainStep
        from tests.ladder_helpers import tiny_spec

        spec = tiny_spec()
        step = TrainStep(name="solo", spec=spec.model_copy(update={"train": spec.train.model_copy(update={"log_every": 2})}))
        """
    ))
    env = {**os.environ, "PYTHONPATH": REPO, "TERM": "xterm-256color"}
    env.pop("RAY_COLOR_PREFIX", None)
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ladder"), "submit", str(exp), "--root", str(tmp_path / "root")],
                          cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert "[progress] solo step 20/20 (100.0%)" in log and "loss" in log and "ETA" in log
    assert "\x1b[" not in log, "terminal codes in a log"
    assert "Token authentication" not in log
