"""The live forecast overlay: band and sigma beside each eval, refits that take over, failures that change nothing."""

import json
import logging
import math
import os
from datetime import datetime

import numpy as np
import pytest

from forecasting.forecast import CurvePoint, Forecast, TargetSpec, log_band_z
from ladder.fitting import store_forecast
from ladder.overlay import ForecastOverlay, live_table
from ladder.store import Store

NUM_STEPS = 400


def _target(name: str = "hero") -> TargetSpec:
    lr = (1e-3 * (1 - 0.9 * np.arange(NUM_STEPS) / NUM_STEPS)).tolist()  # linear decay: the refit's annealing term applies
    return TargetSpec(name=name, params_active=3e6, tokens=4e5, num_steps=NUM_STEPS, tokens_per_step=1000, lr=lr)


def _forecast(target: TargetSpec, *, shift: float = 0.0) -> Forecast:
    # (loss, lo, hi): (4.0, 3.8, 4.2) at step 10 and (3.0, 2.9, 3.1) at step 1000, interpolated in log(step)
    curve = [CurvePoint(step=10, loss=4.0 + shift, lo=3.8 + shift, hi=4.2 + shift),
             CurvePoint(step=1000, loss=3.0 + shift, lo=2.9 + shift, hi=3.1 + shift)]
    return Forecast(target=target, method="compute", inputs_fingerprint="test", curve=curve, final_loss=3.0 + shift,
                    final_loss_lo=2.9 + shift, final_loss_hi=3.1 + shift, law="test law")


def _ladder_curve(n: float, steps):
    steps = np.asarray(steps, dtype=float)
    return (1.8 + 30 * n ** -0.25 + 2.0 * steps ** -0.4) * (1 + 0.002 * np.sin(7.3 * steps + n))


def _ladder_run_dirs(root) -> list[str]:
    """Three finished rungs as run directories (spec.json + metrics.jsonl), as the trainer writes them."""
    dirs = []
    for name, n in (("r1", 1e5), ("r2", 3e5), ("r3", 1e6)):
        run_dir = os.path.join(root, name)
        os.makedirs(run_dir)
        derived = {"params_active": n, "params_total": n, "num_steps": NUM_STEPS, "tokens_per_step": 1000, "tokens": 4e5}
        with open(os.path.join(run_dir, "spec.json"), "w") as handle:
            json.dump({"name": name, "derived": derived}, handle)
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as handle:
            for step in range(50, NUM_STEPS + 1, 50):
                handle.write(json.dumps({"step": step, "tokens": step * 1000, "eval/loss": float(_ladder_curve(n, step))}) + "\n")
        dirs.append(run_dir)
    return dirs


def test_hook_returns_the_band_and_sigma_of_the_newest_version(tmp_path):
    store = Store(str(tmp_path / "root"))
    target = _target()
    assert store_forecast(store, _forecast(target), meta={}) == 1
    overlay = ForecastOverlay(store.url, "hero", target, [], run_dir=None, refit_every=0, console_alerts=False)
    out = overlay(100, {"step": 100, "eval/loss": 3.6})
    # step 100 is halfway between 10 and 1000 in log(step): (3.5, 3.35, 3.65); sigma read in log space, upper half
    assert out["forecast/loss"] == pytest.approx(3.5)
    assert out["forecast/lo"] == pytest.approx(3.35) and out["forecast/hi"] == pytest.approx(3.65)
    assert out["forecast/sigma"] == pytest.approx(math.log(3.6 / 3.5) / (math.log(3.65 / 3.5) / 1.959963984540054))
    assert out["forecast/version"] == 1 and out["alerts/count"] == 0
    # a new version (e.g. `ladder forecast EXP hero --refit`) takes over at the next eval
    assert store_forecast(store, _forecast(target, shift=0.5), meta={}) == 2
    out = overlay(100, {"step": 100, "eval/loss": 3.6})
    assert out["forecast/version"] == 2 and out["forecast/loss"] == pytest.approx(4.0)


def test_no_forecast_means_no_forecast_keys(tmp_path):
    overlay = ForecastOverlay(str(tmp_path / "root"), "hero", _target(), [], refit_every=0, console_alerts=False)
    out = overlay(10, {"step": 10, "eval/loss": 3.0})
    assert not any(k.startswith("forecast/") for k in out)


def test_failed_refit_keeps_the_forecast_and_is_logged(tmp_path, caplog):
    store = Store(str(tmp_path / "root"))
    target = _target()
    store_forecast(store, _forecast(target), meta={})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    overlay = ForecastOverlay(store.url, "hero", target, [str(tmp_path / "no-such-rung")], run_dir=str(run_dir),
                              refit_every=1, refit_in="thread", console_alerts=False)
    overlay(100, {"step": 100, "eval/loss": 3.5})
    overlay.wait(60)
    with caplog.at_level(logging.WARNING, logger="ladder.overlay"):
        out = overlay(200, {"step": 200, "eval/loss": 3.3})
    assert overlay.refits_failed == 1 and "TableError" in overlay.last_refit_error
    assert "failed; keeping forecast version 1" in caplog.text
    assert out["forecast/version"] == 1 and store.list_forecasts("hero") == [1]
    (alert,) = [json.loads(line) for line in open(run_dir / "alerts.jsonl")]
    assert alert["kind"] == "overlay_error" and alert["step"] == 100 and "version 1 stays" in alert["message"]


def test_refit_with_the_live_prefix_stores_the_next_version(tmp_path):
    store = Store(str(tmp_path / "root"))
    target = _target()
    store_forecast(store, _forecast(target), meta={})
    ladder = _ladder_run_dirs(str(tmp_path / "rungs"))
    overlay = ForecastOverlay(store.url, "hero", target, ladder, refit_every=8, n_bootstrap=10, console_alerts=False)
    assert overlay.refit_in == "process"  # the default: a refit's scipy never holds the trainer's GIL
    live_steps = range(25, 201, 25)
    for step in live_steps:
        out = overlay(step, {"step": step, "tokens": step * 1000, "eval/loss": float(_ladder_curve(3e6, step))})
        assert out["forecast/version"] == 1
    assert overlay.refits_started == 1
    overlay.wait(240)
    out = overlay(225, {"step": 225, "eval/loss": float(_ladder_curve(3e6, 225))})
    assert overlay.refits_failed == 0, overlay.last_refit_error
    assert out["forecast/version"] == 2 and store.list_forecasts("hero") == [1, 2]
    stored = store.read_forecast("hero", 2)
    assert stored["method"] == "refit"
    assert stored["ladder"] == {"refit": True, "by": "overlay", "live_step": 200, "live_points": 8, "prior_version": 1}
    # the refit blends the live curve in: at the last live eval it sits much closer to what the run did than the prior
    actual = float(_ladder_curve(3e6, 200))
    assert abs(out["forecast/loss"] - float(_ladder_curve(3e6, 225))) < abs(_forecast(target).band_at(225)[0] - float(_ladder_curve(3e6, 225)))
    assert Forecast.model_validate({k: v for k, v in stored.items() if k != "ladder"}).band_at(200)[0] == pytest.approx(actual, rel=0.01)


def test_live_table_reads_like_a_run_directory():
    table = live_table([{"step": 50, "eval/loss": 3.0, "flops": 1e9}, {"step": 100, "eval/loss": 2.8, "flops": 2e9},
                        {"step": 100, "eval/loss": 2.7, "flops": 2e9}], _target())
    assert table["step"].tolist() == [50, 100] and table["loss"].tolist() == [3.0, 2.7]  # a rewritten step: the newest wins
    assert table["tokens"].tolist() == [50_000, 100_000] and table["fraction"].tolist() == [0.125, 0.25]
    assert table["lr"].iloc[0] == pytest.approx(1e-3 * (1 - 0.9 * 49 / NUM_STEPS))


def test_train_step_writes_forecast_keys_on_eval_lines(tmp_path):
    from ladder.dag import DAG, TrainStep
    from ladder.executor import StepTask, execute_step
    from ladder.fitting import target_spec
    from tests.ladder_helpers import tiny_spec

    step = TrainStep(name="hero", spec=tiny_spec())
    dag = DAG([step])
    store = Store(str(tmp_path / "root"))
    spec = target_spec(step)
    curve = [CurvePoint(step=1, loss=6.0, lo=5.0, hi=7.0), CurvePoint(step=spec.num_steps, loss=5.0, lo=4.0, hi=6.0)]
    forecast = Forecast(target=spec, method="compute", inputs_fingerprint="t", curve=curve, final_loss=5.0,
                        final_loss_lo=4.0, final_loss_hi=6.0, law="test")
    store_forecast(store, forecast, meta={})
    outcome = execute_step(StepTask(step=step, fingerprint=dag.fingerprints["hero"], store_url=store.url, owner="me",
                                    deps={}, dependency_fingerprints={}))
    assert outcome["outcome"] == "done", outcome
    run_dir = store.run_dir("hero", dag.fingerprints["hero"])
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    evals = [r for r in rows if "eval/loss" in r]
    assert evals and all(r["forecast/version"] == 1 for r in evals)
    for r in evals:
        loss, lo, hi = forecast.band_at(r["step"])
        assert r["forecast/loss"] == pytest.approx(loss) and (r["forecast/lo"], r["forecast/hi"]) == pytest.approx((lo, hi))
        assert r["forecast/sigma"] == pytest.approx(float(log_band_z(r["eval/loss"], loss, lo, hi)))
    assert not any("forecast/loss" in r for r in rows if "eval/loss" not in r)


def test_the_driver_gives_a_forecast_target_its_finished_rungs_and_cadence(tmp_path):
    from ladder.executor import _overlay_fields
    from ladder.loader import load_experiment

    dag = load_experiment("experiments/readme_example.py").dag
    store = Store(str(tmp_path / "root"))
    for name in ("r32", "r48"):  # r64 not finished: a refit must not read it
        store.write_json(f"{store.run_dir(name, dag.fingerprints[name])}/status.json", {"state": "done"})
    fields = _overlay_fields(dag, store, "hero")
    assert fields == {
        "forecast_planned": True,
        "forecast_ladder_run_dirs": tuple(store.run_dir(n, dag.fingerprints[n]) for n in ("r32", "r48")),
        "forecast_refit_every": dag["fit"].config.overlay_refit_every,
    }
    assert dag["fit"].config.overlay_refit_every == 10
    assert _overlay_fields(dag, store, "r64")["forecast_planned"] is False  # a rung: overlay only if a forecast is stored


def test_hook_raises_each_alert_once_from_the_growing_metrics_file(tmp_path):
    store = Store(str(tmp_path / "root"))
    target = _target()
    store_forecast(store, _forecast(target), meta={})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    overlay = ForecastOverlay(store.url, "hero", target, [], run_dir=str(run_dir), refit_every=0, console_alerts=False)

    def train_lines(steps, spike_at=None):
        with open(metrics, "a") as handle:
            for s in steps:
                loss = 4.0 - s / 1000 + (1.0 if s == spike_at else 0.0)
                handle.write(json.dumps({"step": s, "train/loss": loss, "grad/norm/total": 1.0 + 0.01 * (s % 3)}) + "\n")

    train_lines(range(1, 101), spike_at=80)
    out = overlay(100, {"step": 100, "eval/loss": 3.5})  # inside the band (3.35, 3.65)
    assert out["alerts/new"] == 1 and out["alerts/count"] == 1
    train_lines(range(101, 201))
    with open(metrics, "a") as handle:  # the trainer writes the eval line after the hook returns
        handle.write(json.dumps({"step": 100, "eval/loss": 3.5, **{k: v for k, v in out.items() if k.startswith("forecast/")}}) + "\n")
    for step in (200, 300, 400):  # eval losses far above the band three times in a row
        out = overlay(step, {"step": step, "eval/loss": 4.5})
    assert [(a.kind, a.step) for a in overlay.alerts] == [("loss_spike", 80), ("band", 400)]
    assert out["alerts/count"] == 2 and out["forecast/sigma"] > 10
    stream = [json.loads(line) for line in open(run_dir / "alerts.jsonl")]
    assert [(a["kind"], a["step"]) for a in stream] == [("loss_spike", 80), ("band", 400)]


@pytest.mark.slow  # trains three tiny rungs and a hero on an embedded Ray (about a minute on 2 cores)
def test_ladder_hero_gets_the_overlay_and_refits_through_the_driver(tmp_path):
    import ray

    from ladder.dag import DAG, FitConfig, TrainStep, build_ladder
    from ladder.executor import run
    from tests.ladder_helpers import tiny_spec
    from trainer.config import ModelConfig, MoEConfig, TrainConfig

    def rung(name, width, steps, eval_every=5):
        model = ModelConfig(hidden_dim=width, num_layers=2, num_heads=2, seq_len=32, moe=MoEConfig(num_experts=4, top_k=2, expert_dim=width))
        train = TrainConfig(tokens=32 * 8 * steps, batch_size=8, eval_every=eval_every, checkpoint_every=100, progress=False, wandb="disabled")
        return TrainStep(name=name, spec=tiny_spec(model=model, train=train))

    steps = build_ladder([rung("r16", 16, 40), rung("r24", 24, 40), rung("r32", 32, 40)], hero=rung("hero", 48, 240, eval_every=4),
                         fit=FitConfig(n_bootstrap=5, overlay_refit_every=5))
    dag = DAG(steps)
    store = Store(str(tmp_path / "root"))
    try:
        report = run(dag, store, log=lambda line: None)
    finally:
        ray.shutdown()
    assert report.ok, report.errors
    run_dir = store.run_dir("hero", dag.fingerprints["hero"])
    evals = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl") if '"eval/loss"' in line]
    assert len(evals) >= 60 and all("forecast/loss" in r for r in evals)
    assert evals[0]["forecast/version"] == 1 and store.list_forecasts("hero")[0] == 1
    # refits every 5 evals: the overlay stored at least one with the live prefix while the hero ran ...
    stored = store.list_forecasts("hero")
    assert len(stored) >= 2 and store.read_forecast("hero", stored[-1])["ladder"]["by"] == "overlay", stored
    # ... and each took over the eval lines written after it landed. When it lands relative to the hero's last
    # evals depends on the machine's load (a refit starts a process), so lines are judged by their own time
    landed = {v: datetime.fromisoformat(store.read_forecast("hero", v)["created_at"]).timestamp() for v in stored[1:]}
    by_step = [r["forecast/version"] for r in sorted(evals, key=lambda r: r["step"])]
    assert by_step == sorted(by_step) and set(by_step) <= set(stored)
    for row in evals:
        due = [v for v, t in landed.items() if row["time"] > t + 5.0]
        assert row["forecast/version"] >= max(due, default=1), (row, landed)


def test_a_restarted_run_does_not_repeat_its_alerts(tmp_path):
    store = Store(str(tmp_path / "root"))
    target = _target()
    store_forecast(store, _forecast(target), meta={})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / "metrics.jsonl", "w") as handle:
        for s in range(1, 101):
            handle.write(json.dumps({"step": s, "train/loss": 4.0 - s / 1000 + (1.0 if s == 80 else 0.0)}) + "\n")
    first = ForecastOverlay(store.url, "hero", target, [], run_dir=str(run_dir), refit_every=0, console_alerts=False)
    assert first(100, {"step": 100, "eval/loss": 3.5})["alerts/new"] == 1
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"event": "resume", "step": 90}) + "\n")
    again = ForecastOverlay(store.url, "hero", target, [], run_dir=str(run_dir), refit_every=0, console_alerts=False)
    assert again(100, {"step": 100, "eval/loss": 3.5})["alerts/new"] == 0
    assert len(open(run_dir / "alerts.jsonl").readlines()) == 1


def test_a_resumed_run_refits_with_the_evals_of_its_earlier_attempt(tmp_path):
    store = Store(str(tmp_path / "root"))
    target = _target()
    store_forecast(store, _forecast(target), meta={})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / "metrics.jsonl", "w") as handle:  # the first attempt: evals at 25..175, killed after 175
        for step in range(25, 176, 25):
            handle.write(json.dumps({"step": step, "eval/loss": float(_ladder_curve(3e6, step))}) + "\n")
        handle.write(json.dumps({"event": "resume", "step": 125}) + "\n")  # restarted from its step-125 checkpoint
    overlay = ForecastOverlay(store.url, "hero", target, [], run_dir=str(run_dir), refit_every=0, alerts=False, console_alerts=False)
    overlay(150, {"step": 150, "eval/loss": 2.9})
    # the earlier attempt's evals up to the checkpoint, then this attempt's; its superseded 150 and 175 are gone
    assert sorted(overlay._eval_points) == [25, 50, 75, 100, 125, 150]
    assert overlay._eval_points[150]["eval/loss"] == 2.9
    assert live_table(list(overlay._eval_points.values()), target)["step"].tolist() == [25, 50, 75, 100, 125, 150]


def test_wandb_gets_the_whole_forecast_curve_once_per_version(tmp_path, monkeypatch):
    """An offline W&B run (as the trainer opens one) receives, for each forecast version, one line chart of the
    whole forecast curve (loss, lo, hi to the last curve step, ahead of the run) beside eval/loss so far; the
    evals in between do not log the table again."""
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    store = Store(str(tmp_path / "root"))
    target = _target()
    store_forecast(store, _forecast(target), meta={})
    overlay = ForecastOverlay(store.url, "hero", target, [], run_dir=None, refit_every=0, console_alerts=False)
    run = wandb.init(mode="offline", dir=str(tmp_path), project="ladder-test")
    try:
        for step, loss in ((100, 3.6), (200, 3.4), (300, 3.3)):
            overlay(step, {"step": step, "eval/loss": loss})
            wandb.log({"eval/loss": loss}, step=step)
            if step == 200:  # a refit lands: the next eval charts the new version
                store_forecast(store, _forecast(target, shift=0.1), meta={"refit": True})
    finally:
        run.finish()
    tables = sorted((tmp_path / "wandb").glob("offline-run-*/files/media/table/forecast/chart*.table.json"))
    assert len(tables) == 2, [t.name for t in tables]  # versions 1 and 2, not one per eval
    first, second = (json.loads(t.read_text())["data"] for t in sorted(tables, key=lambda t: t.stat().st_mtime))
    assert {"eval/loss", "forecast/loss", "forecast/lo", "forecast/hi"} == {row[1] for row in first}
    assert [row[0] for row in first if row[1] == "forecast/hi"] == [10, 1000]  # the band ahead of the run
    assert [row[0] for row in first if row[1] == "eval/loss"] == [100]
    assert [row[0] for row in second if row[1] == "eval/loss"] == [100, 200, 300]
    assert [row[2] for row in second if row[1] == "forecast/loss"] == pytest.approx([4.1, 3.1])
