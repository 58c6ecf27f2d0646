"""Alerts that explain: band streaks, loss and grad-norm spikes, parameter-norm jumps attributed to groups."""

import math

import numpy as np
import pytest

from ladder.alerts import (
    Alert,
    append_alerts,
    band_alerts,
    band_sigma,
    norm_rise_attribution,
    param_norm_alerts,
    read_alerts,
    run_alerts,
    spike_alerts,
)


def _norm_row(step, **groups):
    row = {"step": step, **{f"params/norm/{g}": v for g, v in groups.items()}}
    row["params/norm/total"] = math.sqrt(sum(v * v for v in groups.values()))
    return row


def test_param_norm_jump_is_attributed_to_the_router_bias():
    # squared norms: 36 + 64 + 0 = 100 -> 43.68 + 64 + 88.32 = 196: the total rises 40%, the bias holds 88.32/96 = 92%
    before = _norm_row(400, attention=6.0, experts=8.0, router_bias=0.0)
    after = _norm_row(500, attention=math.sqrt(43.68), experts=8.0, router_bias=math.sqrt(88.32))
    shares = norm_rise_attribution(before, after)
    assert shares["router_bias"] == pytest.approx(0.92)
    assert shares["attention"] == pytest.approx(0.08)
    assert shares["experts"] == pytest.approx(0.0, abs=1e-12)
    (alert,) = param_norm_alerts([before, after])
    assert alert.kind == "param_norm_jump" and alert.step == 500 and alert.severity == "critical"
    assert alert.message.startswith(
        "params/norm/total rose 40% between steps 400 and 500; 92% of the rise is the router bias (then attention 8%)"
    )


def test_router_bias_outside_the_weights_total_is_still_caught():
    # the trainer's params/norm/total covers the weights only; the bias is its own group beside it
    rows = [
        {"step": 100, "params/norm/total": 10.0, "params/norm/attention": 6.0, "params/norm/experts": 8.0, "params/norm/router_bias": 1.0},
        {"step": 200, "params/norm/total": 10.0, "params/norm/attention": 6.0, "params/norm/experts": 8.0, "params/norm/router_bias": 7.0},
    ]
    (alert,) = param_norm_alerts(rows)
    # all groups: sqrt(101) -> sqrt(149), +21%; the whole rise is the bias
    assert "the parameter norm over all groups rose 21% between steps 100 and 200" in alert.message
    assert "100% of the rise is the router bias" in alert.message


def test_small_norm_growth_raises_nothing():
    rows = [_norm_row(s, attention=6.0 + 0.01 * s, experts=8.0) for s in range(0, 1000, 100)]
    assert param_norm_alerts(rows) == []


def _smooth_loss(n, seed=0):
    rng = np.random.default_rng(seed)
    steps = np.arange(1, n + 1) * 10
    return steps, 4.0 * steps ** -0.1 * (1 + 0.003 * rng.standard_normal(n))


def test_loss_spike_against_a_robust_rolling_median():
    steps, loss = _smooth_loss(60)
    loss[40] *= 1.25  # one spike, 25% above the curve (21% above the median of the 20 values before it)
    rows = [{"step": int(s), "train/loss": float(v)} for s, v in zip(steps, loss)]
    alerts = spike_alerts(rows, "train/loss")
    assert [(a.kind, a.step) for a in alerts] == [("loss_spike", 410)]
    median = float(np.median(loss[20:40]))
    assert f"train/loss jumped to {loss[40]:.4g} at step 410, {loss[40] / median - 1:.0%} above its median {median:.4g}" in alerts[0].message
    # the step after the spike is judged against a median the spike barely moved: no echo alert
    assert spike_alerts(rows[:40], "train/loss") == []


def test_grad_norm_spike_needs_a_large_relative_rise():
    rng = np.random.default_rng(1)
    norms = 1.0 + 0.05 * rng.standard_normal(50)
    norms[30] = 5.0
    norms[45] = 1.5  # a 6-sigma wobble but only +50%: below the default 100% rise for grad norms
    rows = [{"step": 10 * (i + 1), "grad/norm/total": float(v)} for i, v in enumerate(norms)]
    found = run_alerts(rows)
    assert [(a.kind, a.step) for a in found] == [("grad_spike", 310)]
    assert found[0].severity == "critical"  # 5x the median


def test_band_alert_after_three_consecutive_evals_outside():
    rows = []
    for i, actual in enumerate([3.00, 3.00, 3.20, 3.21, 3.22, 3.23, 3.00, 3.25]):
        rows.append({"step": 100 * (i + 1), "eval/loss": actual, "forecast/loss": 3.0, "forecast/lo": 2.9, "forecast/hi": 3.1})
    (alert,) = band_alerts(rows, consecutive=3)
    assert alert.kind == "band" and alert.step == 500
    # sigma = log(3.22 / 3.0) / (log(3.1 / 3.0) / 1.96) = 4.23: the band's upper half read in log space
    assert "above the forecast band for 3 evals in a row (steps 300-500)" in alert.message
    assert "+4.2 sigma" in alert.message and alert.severity == "critical"
    assert band_sigma(3.22, 3.0, 2.9, 3.1) == pytest.approx(math.log(3.22 / 3.0) / (math.log(3.1 / 3.0) / 1.959963984540054))


def test_band_sigma_passes_1_96_exactly_at_the_edges_of_a_wide_log_normal_band():
    loss, s = 2.0, 0.3
    lo, hi = loss * math.exp(-1.959963984540054 * s), loss * math.exp(1.959963984540054 * s)
    assert band_sigma(hi, loss, lo, hi) == pytest.approx(1.959963984540054)
    assert band_sigma(lo, loss, lo, hi) == pytest.approx(-1.959963984540054)
    assert band_sigma(loss * math.exp(s), loss, lo, hi) == pytest.approx(1.0)
    assert band_sigma(2.0, 2.0, 2.0, 2.0) == 0.0
    assert band_sigma(2.1, 2.0, 2.0, 2.0) == math.inf and band_sigma(1.9, 2.0, 2.0, 2.0) == -math.inf


def test_band_alert_uses_the_forecast_when_lines_carry_no_band():
    from forecasting.forecast import CurvePoint, Forecast, TargetSpec

    forecast = Forecast(
        target=TargetSpec(name="hero", params_active=1e6, tokens=1e7, num_steps=1000), method="test",
        inputs_fingerprint="x", curve=[CurvePoint(step=1, loss=5.0, lo=4.5, hi=5.5), CurvePoint(step=1000, loss=3.0, lo=2.9, hi=3.1)],
        final_loss=3.0, final_loss_lo=2.9, final_loss_hi=3.1, law="test",
    )
    rows = [{"step": 1000, "eval/loss": 2.5}, {"step": 1000, "eval/loss": 2.6}]
    (alert,) = band_alerts(rows, forecast, consecutive=2)
    assert "below the forecast band" in alert.message


def test_alerts_stream_appends_and_reads_back(tmp_path):
    append_alerts(str(tmp_path), [Alert("loss_spike", 10, "warning", "one")])
    append_alerts(str(tmp_path), [Alert("band", 20, "critical", "two")])
    with open(tmp_path / "alerts.jsonl", "a") as handle:
        handle.write('{"torn": ')  # a writer caught mid-line
    rows = read_alerts(str(tmp_path))
    assert [(r["kind"], r["step"], r["message"]) for r in rows] == [("loss_spike", 10, "one"), ("band", 20, "two")]
    assert read_alerts(str(tmp_path / "nowhere")) == []


def test_a_final_loss_forecast_only_speaks_about_the_last_step():
    """A chinchilla/compute forecast has no curve: early evals are not 'outside its band'."""
    from forecasting.forecast import Forecast, TargetSpec

    from ladder.alerts import band_alerts, band_at_step

    forecast = Forecast(target=TargetSpec(name="hero", params_active=1e6, tokens=1e8, num_steps=100), method="compute",
                        inputs_fingerprint="x", final_loss=2.0, final_loss_lo=1.9, final_loss_hi=2.1, law="L(C)")
    assert band_at_step(forecast, 50) is None
    assert band_at_step(forecast, 100) == (2.0, 1.9, 2.1)
    rows = [{"step": s, "eval/loss": 3.0} for s in (10, 20, 30, 40)] + [{"step": 100, "eval/loss": 2.05}]
    assert band_alerts(rows, forecast) == []
