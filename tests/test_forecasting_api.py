"""api: fit_ladder / forecast_target / backtest on public data, results printable as tables and JSON."""

import json

import numpy as np
import pandas as pd
import pytest

from forecasting.api import BacktestReport, LadderFit, TargetSpec, backtest, fit_ladder, forecast_target
from forecasting.public_data import chinchilla_points, data_dir, marin_ladder

DATA = data_dir()


def test_fit_ladder_matched_progress_on_marin_has_intervals_and_round_trips():
    table, _, _ = marin_ladder(DATA / "marin_535b_ladder")
    fit = fit_ladder(table, n_bootstrap=20)
    assert fit.law == "matched_progress" and fit.n_runs == 4
    e = fit.params["E"]
    assert e.lo <= e.value <= e.hi and 0.0 <= e.value < 2.4
    assert any("coarse" in w for w in fit.warnings)  # 4 rungs: says so
    assert LadderFit.model_validate_json(fit.to_json()) == fit
    assert set(fit.params_table()["param"]) == {"E", "alpha_final", "log_A_final"}


def test_backtest_report_on_marin_compute_and_prefix():
    table, _, _ = marin_ladder(DATA / "marin_535b_ladder")
    rep = backtest(table)
    kinds = {r.kind: r for r in rep.results}
    assert kinds["compute"].held_out == ["d2048"] and kinds["compute"].rms_rel_error < 0.02
    assert kinds["prefix"].n_points > 20
    frame = rep.table()
    assert {"method", "kind", "rms_rel_error", "rate"} <= set(frame.columns)
    assert BacktestReport.model_validate_json(rep.to_json()) == rep


def test_chinchilla_forecast_of_a_70b_run_with_interval_and_json_keys():
    t = chinchilla_points(DATA / "chinchilla_svg_extracted_data.csv")
    f = forecast_target(t, TargetSpec(name="chinchilla-70b", params_active=70e9, tokens=1.4e12), method="chinchilla", n_bootstrap=30)
    assert f.method == "chinchilla"
    assert 1.85 < f.final_loss < 2.05
    assert f.final_loss_lo < f.final_loss < f.final_loss_hi
    doc = json.loads(json.dumps(f.summary()))
    assert doc["final_loss_lo"] == f.final_loss_lo and doc["final_loss_hi"] == f.final_loss_hi
    assert set(f.params) == {"E", "A", "B", "alpha", "beta"}


def test_auto_picks_the_law_by_backtest_and_says_which_won_and_by_how_much():
    t = chinchilla_points(DATA / "chinchilla_svg_extracted_data.csv")
    f = forecast_target(t, TargetSpec(name="chinchilla-70b", params_active=70e9, tokens=1.4e12), n_bootstrap=10)
    scored = {c["method"]: c for c in f.selection if c.get("expected_error") is not None}
    assert {"overtrain", "chinchilla", "farseer"} <= set(scored)
    chosen = [c for c in f.selection if c.get("chosen")]
    assert len(chosen) == 1
    # the chosen law's own forecast, or a blend that holds it with the laws the backtest could not tell from it
    blended = {c["method"] for c in f.selection if c.get("blend_weight")}
    assert chosen[0]["method"] == f.method or (f.method == "blend" and chosen[0]["method"] in blended)
    best = min(c["expected_error"] for c in scored.values())
    assert chosen[0]["expected_error"] <= best * 1.10 + 1e-12  # the winner, or a simpler law within 10% of it
    not_applicable = {c["method"]: c["reason"] for c in f.selection if c.get("applicable") is False}
    assert "params_total" in not_applicable["moe"] and "unique_tokens" in not_applicable["data_constrained"]
    assert "several model sizes at one compute budget" in not_applicable["compute"]  # Chinchilla's IsoFLOP profiles
    assert 1.85 < f.final_loss < 2.05


@pytest.mark.slow  # ~35 s: CURVE's Multi-Power Law fit and its model-error calibration
def test_auto_uses_the_schedule_aware_curve_law_for_a_same_size_target():
    from forecasting.multipower import load_multipowerlaw_curve

    folder = DATA / "multipowerlaw" / "csv_25"
    frames = []
    for name in ("cosine_24000", "constant_24000", "wsdcon_9"):
        c = load_multipowerlaw_curve(folder / f"{name}.csv")
        frames.append(pd.DataFrame({"run": name, "step": c.steps, "loss": c.loss, "lr": c.lr[c.steps - 1],
                                    "params_active": 25e6, "num_steps": len(c.lr)}))
    target_curve = load_multipowerlaw_curve(folder / "wsd_20000_24000.csv")
    f = forecast_target(
        pd.concat(frames),
        TargetSpec(name="wsd", params_active=25e6, tokens=1e9, num_steps=len(target_curve.lr), lr=target_curve.lr.tolist()),
        n_bootstrap=2,
    )
    assert f.method == "multipower"
    pred = np.array([f.band_at(s)[0] for s in target_curve.steps])
    assert np.mean(np.abs(pred / target_curve.loss - 1)) < 0.005


def test_chinchilla_ordered_backtest_fits_small_compute_predicts_large():
    t = chinchilla_points(DATA / "chinchilla_svg_extracted_data.csv")
    rep = backtest(t)
    res = rep.results[0]
    assert rep.method == "chinchilla" and res.kind == "compute"
    # auto's expanding splits: the smaller half of the runs by compute fits first, every larger run is predicted
    order = t.assign(c=6 * t["params_active"] * t["tokens"]).sort_values("c")["run"].tolist()
    assert set(res.held_out) == set(order[(len(order) + 1) // 2:]) and res.n_points > len(res.held_out)
    assert res.rms_rel_error < 0.03 and res.rate > 0
    # the same evidence `auto` weighed when it chose among the candidates
    from forecasting import final_laws as fl

    assert res == fl.backtest_law("chinchilla", fl.fit_frame("chinchilla", t))


def test_cli_json_documents_carry_final_loss_keys():
    table, _, _ = marin_ladder(DATA / "marin_535b_ladder")
    fit = fit_ladder(table, n_bootstrap=10).summary()
    rep = backtest(table).summary()
    for doc in (fit, rep):
        doc = json.loads(json.dumps(doc))
        assert doc["final_loss_lo"] <= doc["final_loss"] <= doc["final_loss_hi"]
    assert fit["final_run"] == "d2048" and rep["final_run"] == "d2048"
    assert abs(rep["final_loss"] / rep["final_loss_actual"] - 1) < 0.02
    assert rep["final_loss_lo"] * rep["final_loss_hi"] == pytest.approx(rep["final_loss"] ** 2, rel=1e-12), "a log-space band"


def test_auto_falls_back_to_the_next_best_when_the_winner_fails_on_the_whole_table(monkeypatch):
    from forecasting import final_laws
    from forecasting.fitting import FitError

    real = final_laws.forecast_final

    def winner_does_not_converge(table, target, law, n_boot, seed):
        if law == "overtrain":
            raise FitError("the overtrain law did not converge")
        return real(table, target, law, n_boot, seed)

    monkeypatch.setattr(final_laws, "forecast_final", winner_does_not_converge)
    t = chinchilla_points(DATA / "chinchilla_svg_extracted_data.csv")
    f = forecast_target(t, TargetSpec(name="chinchilla-70b", params_active=70e9, tokens=1.4e12), n_bootstrap=10)
    assert any("failed on the whole table" in w for w in f.warnings)
    chosen = [c["method"] for c in f.selection if c.get("chosen")]
    assert chosen != ["overtrain"] and len(chosen) == 1
    blended = {c["method"] for c in f.selection if c.get("blend_weight")}
    assert "overtrain" not in blended and (f.method == chosen[0] or chosen[0] in blended)
