"""`ladder watch`: one frame of a live run against its forecast, from a local or remote run directory."""

import json
import math

import fsspec
import pytest
import typer
from typer.testing import CliRunner

from forecasting.forecast import CurvePoint, Forecast, TargetSpec
from ladder.alerts import Alert, append_alerts
from ladder.fitting import store_forecast
from ladder.store import Store
from ladder.views.watch import WatchState, watch_command


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("watch")(watch_command)
    app.command("noop")(lambda: None)  # two commands: typer keeps `watch` as a subcommand
    return app


def _write(fs, path, text, mode="w"):
    with fs.open(path, mode) as handle:
        handle.write(text)


def _make_run(root_url: str) -> tuple[Store, str]:
    """A hero half-way: 200 of 400 steps at 2000 tokens/s, evals at 100 and 200, a stored forecast and one alert."""
    store = Store(root_url)
    run_dir = store.run_dir("hero", "abcdef0123456789")
    store.fs.makedirs(run_dir, exist_ok=True)
    derived = {"num_steps": 400, "tokens_per_step": 1000, "tokens": 400_000, "params_active": 3e6}
    store.write_json(f"{run_dir}/spec.json", {"name": "hero", "derived": derived})
    store.write_json(f"{run_dir}/status.json", {"state": "running"})
    lines = []
    for step in range(10, 201, 10):
        lines.append({"step": step, "tokens": step * 1000, "train/loss": 4.0 - step / 400, "throughput/tokens_per_second": 2000.0})
        if step % 100 == 0:
            lines.append({"step": step, "tokens": step * 1000, "eval/loss": 3.6 if step == 100 else 3.3})
    _write(store.fs, f"{run_dir}/metrics.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
    target = TargetSpec(name="hero", params_active=3e6, tokens=4e5, num_steps=400, tokens_per_step=1000)
    curve = [CurvePoint(step=2, loss=4.0, lo=3.8, hi=4.2), CurvePoint(step=20_000, loss=3.0, lo=2.9, hi=3.1)]
    store_forecast(store, Forecast(target=target, method="compute", inputs_fingerprint="t", curve=curve, final_loss=3.05,
                                   final_loss_lo=2.95, final_loss_hi=3.15, law="test"), meta={})
    append_alerts(store.url_of(run_dir), [Alert("loss_spike", 150, "warning", "train/loss jumped to 4.1 at step 150")])
    return store, run_dir


def test_watch_once_renders_progress_band_sigma_eta_and_alerts(tmp_path):
    store, run_dir = _make_run(str(tmp_path / "root"))
    result = CliRunner().invoke(_app(), ["watch", run_dir, "--once"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.output
    # step 200 is halfway between 2 and 20000 in log(step): predicted (3.5, 3.35, 3.65); sigma = log(3.3 / 3.5) / (log(3.5 / 3.35) / 1.96)
    assert "200 / 400 (50.0%)" in out
    assert "200K / 400K" in out
    assert "3.3000 at step 200" in out and "predicted 3.5000 [3.3500, 3.6500]" in out
    assert "-2.63 sigma" in out
    assert "2,000 tokens/s" in out and "0:01:40" in out  # 200 steps x 1000 tokens at 2000 tokens/s
    assert "version 1 (compute)" in out and "3.0500 [2.9500, 3.1500] (95%)" in out
    assert "loss_spike" in out and "train/loss jumped to 4.1 at step 150" in out


def test_watch_follows_a_remote_run_incrementally():
    root = "memory://watch-test-root"
    store, run_dir = _make_run(root)
    url = store.url_of(run_dir)
    state = WatchState(run_dir=url, target="hero", forecast_store=store)
    state.poll()
    assert (state.step, state.eval_step, state.eval_loss) == (200, 200, 3.3)
    first_offset = state.offset
    assert state.sigma() == pytest.approx(math.log(3.3 / 3.5) / (math.log(3.5 / 3.35) / 1.959963984540054))
    # the run goes on: two more lines, one of them torn (not yet complete)
    _write(store.fs, f"{run_dir}/metrics.jsonl", json.dumps({"step": 300, "tokens": 300_000, "eval/loss": 3.2}) + "\n" + '{"step": 31', mode="a")
    state.poll()
    assert (state.step, state.eval_loss) == (300, 3.2) and state.offset > first_offset
    assert state.eta_seconds() == pytest.approx(100 * 1000 / 2000)
    # a refit lands: the view switches to the new version
    target = TargetSpec(name="hero", params_active=3e6, tokens=4e5, num_steps=400)
    curve = [CurvePoint(step=s, loss=3.1, lo=3.0, hi=3.2) for s in (100, 400)]
    store_forecast(store, Forecast(target=target, method="refit", inputs_fingerprint="t", final_loss=3.1, final_loss_lo=3.0,
                                   final_loss_hi=3.2, law="refit", curve=curve), meta={"live_step": 300})
    state.poll()
    assert state.forecast_version == 2 and state.forecast_meta["live_step"] == 300
    assert state.band() == (3.1, 3.0, 3.2)
    fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


def test_watch_of_a_missing_experiment_is_bad_input(tmp_path):
    result = CliRunner().invoke(_app(), ["watch", str(tmp_path / "nothing.py"), "hero", "--once"])
    assert result.exit_code == 2


def test_watch_an_experiment_target_before_it_starts(tmp_path):
    result = CliRunner().invoke(_app(), ["watch", "experiments/readme_example.py", "hero", "--root", str(tmp_path), "--once"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "ladder watch: hero" in result.output and "(no eval yet)" in result.output
    assert "none stored for this target" in result.output
    result = CliRunner().invoke(_app(), ["watch", "experiments/readme_example.py", "fit", "--root", str(tmp_path), "--once"])
    assert result.exit_code == 2 and "only training steps can be watched" in result.output


def test_watch_derives_alerts_for_a_run_without_an_overlay(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / "metrics.jsonl", "w") as handle:
        for step in range(1, 61):
            handle.write(json.dumps({"step": step, "train/loss": 4.0 - step / 1000 + (1.0 if step == 50 else 0.0)}) + "\n")
    state = WatchState(run_dir=str(run_dir), target="r32", forecast_store=None)
    state.poll()
    assert [(a["kind"], a["step"]) for a in state.alerts] == [("loss_spike", 50)]
    state.poll()  # nothing new: the same alert, once
    assert len(state.alerts) == 1


def test_live_watch_stops_when_the_run_is_done(tmp_path):
    store, run_dir = _make_run(str(tmp_path / "root"))
    store.write_json(f"{run_dir}/status.json", {"state": "done"})
    result = CliRunner().invoke(_app(), ["watch", run_dir, "--interval", "0.1"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "200 / 400 (50.0%)" in result.output and "done" in result.output
