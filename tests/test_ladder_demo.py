"""`ladder demo`: the quick ladder end to end (slow), and the verdict read back from a prepared store (fast)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ladder.demo import QUICK_EXPERIMENT, DemoResult, ForecastSummary, collect_verdict, demo_command, run_demo, verdict_lines
from ladder.dag import FitStep, TrainStep
from ladder.loader import load_experiment
from ladder.store import Store
from tests.ladder_helpers import run_logged

REPO = Path(__file__).resolve().parents[1]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _evals(run_dir: Path) -> list[dict]:
    return [row for row in _rows(run_dir) if isinstance(row.get("eval/loss"), float)]


@pytest.mark.slow
def test_quick_demo_runs_the_whole_chain_and_a_second_run_reuses_it(tmp_path):
    root = tmp_path / "root"
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    first = run_logged("ladder.demo", ["--quick", "--root", str(root)], env=env, log_path=tmp_path / "demo.log", timeout=840,
                       root=root, cwd=REPO)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert "Token authentication" not in first.stdout + first.stderr, "Ray's notice in the demo's log (as `ladder submit`, it is dropped)"
    assert_whole_chain(root, first.stdout)


def assert_whole_chain(root: Path, out: str) -> None:
    """What the quick demo left in `root` and printed (`out`), checked with numbers; then a second run reuses it."""
    exp = load_experiment(QUICK_EXPERIMENT)
    store = Store(str(root))
    run_dir = {s.name: Path(store.run_dir(s.name, exp.dag.fingerprints[s.name])) for s in exp.dag}
    rungs = [s for s in exp.dag if isinstance(s, TrainStep) and s.name != "hero-quick"]
    assert len(rungs) == 4
    # specs -> Ray -> trainer -> metrics: every rung finished, and more compute gave a lower final eval loss
    by_compute = sorted(rungs, key=lambda s: s.derived.flops_per_token * s.derived.tokens)
    finals = [_evals(run_dir[s.name])[-1]["eval/loss"] for s in by_compute]
    assert all(json.loads((run_dir[s.name] / "status.json").read_text())["state"] == "done" for s in rungs)
    assert all(a > b for a, b in zip(finals, finals[1:])), finals

    # fit -> forecast: version 1 was made before the hero started
    v1 = json.loads((root / "forecasts" / "hero-quick" / "1.json").read_text())
    hero_status = json.loads((run_dir["hero-quick"] / "status.json").read_text())
    from datetime import datetime

    assert datetime.fromisoformat(v1["created_at"]).timestamp() < hero_status["started_at"]
    assert v1["final_loss_lo"] < v1["final_loss"] < v1["final_loss_hi"]
    # the quick hero changes nothing its rungs share (ladder.recipe): no departure in the stored forecast
    assert not any("hold fixed" in w for w in v1["warnings"]), v1["warnings"]

    # overlay: every eval of the hero carries the band it was judged against
    hero_evals = _evals(run_dir["hero-quick"])
    assert len(hero_evals) >= 10
    for row in hero_evals:
        assert row["forecast/lo"] <= row["forecast/loss"] <= row["forecast/hi"], row
    actual = hero_evals[-1]["eval/loss"]
    assert math.isfinite(actual) and 0.5 < actual < 4.0

    # the printed verdict is the store's numbers
    assert f"forecast v1 of hero-quick" in out and f"{v1['final_loss']:.4f}" in out
    assert "hold fixed" not in out
    assert f"actual final eval loss of hero-quick: {actual:.4f}" in out
    assert f"error: {100 * (actual / v1['final_loss'] - 1):+.2f}%" in out
    png = root / "reports" / "local_ladder_quick" / "hero-quick.png"
    assert f"figure: {png}" in out and png.stat().st_size > 10_000
    try:
        from ladder.views.report import write_report  # noqa: F401
        has_report = True
    except ImportError:
        has_report = False
    if has_report:
        assert (root / "reports" / "local_ladder_quick" / "index.html").stat().st_size > 1000
    else:
        assert "write_report is not available" in out

    # a second run reuses every step: nothing launched, no Ray started, same verdict
    import ray

    lines: list[str] = []
    again = run_demo(quick=True, root=str(root), out=lines.append)
    assert again.launched == [] and sorted(again.skipped) == sorted(exp.dag.order)
    assert not ray.is_initialized()
    assert again.exit_code == 0 and again.forecast.version == 1 and again.forecast_lead_s > 0
    assert again.actual_final_loss == actual
    assert again.error == pytest.approx(actual / v1["final_loss"] - 1, rel=1e-12)
    assert again.inside_band == (v1["final_loss_lo"] <= actual <= v1["final_loss_hi"])
    assert again.refits and all(r.version > 1 for r in again.refits)


# ---------------------------------------------------------------- fast: the verdict from a prepared store


def _forecast(final: float, lo: float, hi: float, created: str, meta: dict) -> dict:
    return {"final_loss": final, "final_loss_lo": lo, "final_loss_hi": hi, "created_at": created, "ladder": meta, "method": "x"}


def _prepared_store(tmp_path: Path):
    exp = load_experiment(QUICK_EXPERIMENT)
    store = Store(str(tmp_path / "root"))
    fit = next(s for s in exp.dag if isinstance(s, FitStep))
    fit_dir = store.run_dir(fit.name, exp.dag.fingerprints[fit.name])
    hero_dir = store.run_dir("hero-quick", exp.dag.fingerprints["hero-quick"])
    # v1: a `ladder forecast` made earlier by hand; v2: the fit step's; v3, v4: the overlay's refits
    store.write_forecast("hero-quick", _forecast(2.0, 1.0, 3.0, "2026-01-01T00:00:00+00:00", {}))
    store.write_forecast("hero-quick", _forecast(1.60, 1.40, 1.80, "2026-01-01T00:01:00+00:00", {"fit_step": "fit"}))
    store.write_forecast("hero-quick", _forecast(1.55, 1.45, 1.65, "2026-01-01T00:03:00+00:00", {"refit": True, "by": "overlay"}))
    store.write_forecast("hero-quick", _forecast(1.52, 1.48, 1.56, "2026-01-01T00:04:00+00:00", {"refit": True, "by": "overlay"}))
    store.write_json(f"{fit_dir}/result.json", {"forecast_version": 2})
    from datetime import datetime

    store.write_json(f"{hero_dir}/status.json", {"state": "done", "started_at": datetime.fromisoformat("2026-01-01T00:02:30+00:00").timestamp()})
    Path(hero_dir).mkdir(parents=True, exist_ok=True)
    lines = [{"step": 10, "eval/loss": 1.9}, {"step": 20, "train/loss": 1.7}, {"step": 20, "eval/loss": 1.5}]
    (Path(hero_dir) / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return exp, store, fit


def test_verdict_uses_the_fit_steps_forecast_and_counts_overlay_refits(tmp_path):
    exp, store, fit = _prepared_store(tmp_path)
    result = DemoResult(experiment=exp.name, root=store.url, target="hero-quick", states={n: "done" for n in exp.dag.order})
    collect_verdict(result, exp.dag, store, fit)
    assert result.forecast.version == 2 and result.forecast.final_loss == 1.60
    assert result.forecast_lead_s == pytest.approx(90.0)
    assert result.actual_final_loss == 1.5
    assert result.error == pytest.approx(1.5 / 1.6 - 1) and result.inside_band is True
    assert [r.version for r in result.refits] == [3, 4]
    text = "\n".join(verdict_lines(result))
    assert "forecast v2 of hero-quick (made 00:01:00.00 UTC, 90.0 s before hero-quick started at 00:02:30.00): final eval loss 1.6000 [1.4000, 1.8000]" in text
    assert "error: -6.25% of the forecast; inside the 95% band" in text
    assert "2 refit(s); the last (v4) estimated 1.5200 [1.4800, 1.5600]" in text


def test_verdict_says_outside_the_band_and_a_forecast_made_after_the_start():
    forecast = ForecastSummary(version=1, final_loss=2.0, lo=1.9, hi=2.1, created_at=1000.0,
                               warnings=("hero changes what its 2 rungs hold fixed: model.num_heads 3 (every rung: 2). ...",))
    result = DemoResult(experiment="e", root="/r", target="hero", states={"a": "done"}, forecast=forecast,
                        hero_started_at=940.0, actual_final_loss=2.3)
    text = "\n".join(verdict_lines(result))
    assert "60.0 s AFTER hero started" in text
    assert "(95%)\n  warning: hero changes what its 2 rungs hold fixed: model.num_heads 3" in text  # under the forecast it qualifies
    assert "error: +15.00% of the forecast; OUTSIDE the 95% band" in text
    assert result.exit_code == 0


def test_a_failed_step_is_reported_and_exits_1():
    result = DemoResult(experiment="e", root="/r", target="hero", states={"r1": "done", "r2": "failed", "hero": "blocked"},
                        errors={"r2": "boom"})
    text = "\n".join(verdict_lines(result))
    assert "did not complete: r2 failed, hero blocked" in text and "r2: boom" in text
    assert result.exit_code == 1


def test_command_registers_with_quick_and_root_options():
    app = typer.Typer()
    app.command("demo")(demo_command)
    app.command("noop")(lambda: None)
    help_text = CliRunner().invoke(app, ["demo", "--help"]).output
    assert "--quick" in help_text and "--root" in help_text


def test_verdict_counts_the_heros_alerts(tmp_path):
    exp, store, fit = _prepared_store(tmp_path)
    hero_dir = Path(store.run_dir("hero-quick", exp.dag.fingerprints["hero-quick"]))
    alerts = [{"kind": "grad_spike", "step": 5}, {"kind": "outside_band", "step": 9}, {"kind": "grad_spike", "step": 12}]
    (hero_dir / "alerts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in alerts) + '{"kind": "torn')
    result = DemoResult(experiment=exp.name, root=store.url, target="hero-quick", states={n: "done" for n in exp.dag.order})
    collect_verdict(result, exp.dag, store, fit)
    assert [a["step"] for a in result.alerts] == [5, 9, 12]
    assert "alerts on hero-quick: 3 (grad_spike, outside_band)" in "\n".join(verdict_lines(result))
