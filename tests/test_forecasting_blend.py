"""`auto` blends the laws its backtest cannot tell apart (forecasting.blend): weights, band, and the whole path."""

import math

import numpy as np
import pytest

from forecasting import blend
from forecasting.api import TargetSpec, forecast_target
from forecasting.bootstrap import Interval
from forecasting.forecast import CurvePoint, Forecast
from forecasting.public_data import chinchilla_points, data_dir
from tests.forecasting_helpers import ladder_curves

Z95 = 1.959963984540054


def _forecast(method: str, losses, half_width: float) -> Forecast:
    target = TargetSpec(name="t", params_active=1e9, tokens=2e10, num_steps=len(losses))
    curve = [CurvePoint(step=i + 1, loss=y, lo=y * math.exp(-Z95 * half_width), hi=y * math.exp(Z95 * half_width))
             for i, y in enumerate(losses)]
    return Forecast(target=target, method=method, inputs_fingerprint="x", curve=curve, final_loss=curve[-1].loss,
                    final_loss_lo=curve[-1].lo, final_loss_hi=curve[-1].hi, law=f"{method} law")


def _cand(method, expected, **kw):
    return {"method": method, "applicable": True, "expected_error": expected} | kw


def test_members_are_the_laws_within_a_factor_of_the_best_weighted_by_inverse_variance():
    sel = [_cand("overtrain", 0.010), _cand("farseer", 0.015), _cand("chinchilla", 0.025),
           _cand("moe", 0.011, excluded="not backtested along D/N"), {"method": "compute", "applicable": False, "reason": "x"}]
    w = blend.members(sel, "overtrain")
    assert set(w) == {"overtrain", "farseer"}  # chinchilla is 2.5x worse; moe was excluded; compute did not apply
    assert w["overtrain"] / w["farseer"] == pytest.approx((0.015 / 0.010) ** 2)
    assert sum(w.values()) == pytest.approx(1.0)
    assert blend.members([_cand("overtrain", 0.01)], "overtrain") == {"overtrain": 1.0}
    assert blend.members([{"method": "multipower", "chosen": True}], "multipower") == {"multipower": 1.0}


def test_the_more_sizes_the_backtest_held_out_the_more_a_lead_in_error_weighs():
    def weights(n_overtrain, n_farseer=None):
        sel = [_cand("overtrain", 0.010, independent_errors=n_overtrain),
               _cand("farseer", 0.015, independent_errors=n_overtrain if n_farseer is None else n_farseer)]
        return blend.members(sel, "overtrain")

    # one or two held-out sizes: inverse variance; eight: the likelihood of eight errors, sigma^-8
    assert weights(1)["overtrain"] / weights(1)["farseer"] == pytest.approx(1.5**2)
    assert weights(2)["overtrain"] / weights(2)["farseer"] == pytest.approx(1.5**2)
    assert weights(8)["overtrain"] / weights(8)["farseer"] == pytest.approx(1.5**8)
    # the evidence the members share: the fewer sizes of the two
    assert weights(8, 3)["overtrain"] / weights(8, 3)["farseer"] == pytest.approx(1.5**3)
    # a law left under 1% of the weight is not fitted for the blend at all
    sel = [_cand("overtrain", 0.010, independent_errors=8), _cand("farseer", 0.015, independent_errors=8),
           _cand("chinchilla", 0.019, independent_errors=8)]
    assert set(blend.members(sel, "overtrain")) == {"overtrain", "farseer"}
    # the chosen law (the reference of the blend's curve) stays a member even under 1%
    assert set(blend.members(sel, "chinchilla")) == {"overtrain", "farseer", "chinchilla"}
    assert sum(blend.members(sel, "chinchilla").values()) == pytest.approx(1.0)


def test_laws_that_nothing_could_backtest_are_averaged_with_equal_weights():
    def alike(method):
        return {"method": method, "applicable": True, "reason": "no backtest: too few runs", "no_evidence": True}

    sel = [alike("matched_progress"), {"method": "chinchilla", "applicable": False, "reason": "needs 6 runs"}, alike("compute")]
    assert blend.members(sel, "matched_progress") == {"matched_progress": 0.5, "compute": 0.5}
    assert list(blend.members(sel, "matched_progress")) == ["matched_progress", "compute"]  # the reference first
    # a law with no backtest but not marked (the selection chose by another rule) is not pulled in
    assert blend.members([alike("compute") | {"no_evidence": False}, alike("overtrain")], "compute") == {"compute": 1.0}
    # once anything is scored, the evidence decides, as before
    assert blend.members([_cand("overtrain", 0.01), alike("compute")], "overtrain") == {"overtrain": 1.0}


def test_auto_on_three_rungs_with_curves_averages_matched_progress_and_the_compute_law(tmp_path):
    table = ladder_curves([6e3, 1.4e4, 2.5e4], 8.0, evals=20)
    target = TargetSpec(name="hero", params_active=5.5e4, tokens=8 * 5.5e4, num_steps=400, tokens_per_step=8 * 5.5e4 / 400)
    f = forecast_target(table, target, n_bootstrap=20)
    assert f.method == "blend"
    weights = {c["method"]: c.get("blend_weight") for c in f.selection}
    assert weights["matched_progress"] == weights["compute"] == 0.5
    assert any("averaged with equal weights" in w for w in f.warnings)
    mp, cl = (forecast_target(table, target, method=m, n_bootstrap=20) for m in ("matched_progress", "compute"))
    assert f.final_loss == pytest.approx(math.sqrt(mp.final_loss * cl.final_loss), rel=1e-9)  # the mean of the logs
    assert f.final_loss_lo <= min(mp.final_loss, cl.final_loss) and f.final_loss_hi >= max(mp.final_loss, cl.final_loss)
    # the CLI says so in its candidates table, rather than calling the reference "chosen" by a backtest
    from typer.testing import CliRunner

    from ladder.cli import app

    table.to_csv(tmp_path / "runs.csv", index=False)
    out = CliRunner().invoke(app, ["forecast", str(tmp_path / "runs.csv"), "--params-active", "5.5e4", "--tokens", "440000",
                                   "--num-steps", "400", "--n-bootstrap", "20"], env={"COLUMNS": "250"})
    assert out.exit_code == 0, out.output
    assert out.stdout.count("averaged with equal weights") >= 3  # the warning and both members' notes


def test_the_blend_is_a_log_space_mixture_whose_band_widens_when_the_members_disagree():
    a = _forecast("overtrain", [3.0, 2.5, 2.0], 0.01)
    b = _forecast("farseer", [3.0, 2.5, 2.2], 0.01)
    f = blend.blend({"overtrain": a, "farseer": b}, {"overtrain": 0.5, "farseer": 0.5})
    assert f.method == "blend" and "overtrain" in f.law and "farseer" in f.law
    assert f.final_loss == pytest.approx(math.sqrt(2.0 * 2.2))  # geometric mean at equal weights
    assert f.final_loss_lo < 2.0 < 2.2 < f.final_loss_hi  # the band holds both members' points
    # where they agree the band is theirs; where they disagree it is wider by exactly the spread of the logs
    first = f.curve[0]
    assert (first.hi / first.lo) == pytest.approx(math.exp(2 * Z95 * 0.01))
    spread = 0.5 * math.log(2.2 / 2.0)
    assert math.log(f.final_loss_hi / f.final_loss_lo) / (2 * Z95) == pytest.approx(math.hypot(0.01, spread))
    assert f.band_terms["disagreement"] == pytest.approx(spread)
    # a single member is that member's own forecast, untouched
    assert blend.blend({"overtrain": a}, {"overtrain": 1.0}) is a


def test_auto_on_epochs_chinchilla_blends_the_close_laws_and_records_their_weights():
    t = chinchilla_points(data_dir() / "chinchilla_svg_extracted_data.csv")
    f = forecast_target(t, TargetSpec(name="chinchilla-70b", params_active=70e9, tokens=1.4e12), n_bootstrap=10)
    weights = {c["method"]: c["blend_weight"] for c in f.selection if c.get("blend_weight")}
    scored = {c["method"]: c["expected_error"] for c in f.selection if c.get("expected_error") is not None and not c.get("excluded")}
    best = min(scored.values())
    assert f.method == "blend" and len(weights) >= 2
    assert sum(weights.values()) == pytest.approx(1.0)
    band = {c["method"]: c["band_weight"] for c in f.selection if c.get("band_weight")}
    assert set(weights) <= set(band) and sum(band.values()) == pytest.approx(1.0)
    assert f.band_terms[f"band_weight.{min(band, key=band.get)}"] == pytest.approx(min(band.values()))
    assert all(scored[m] <= blend.WITHIN * best for m in weights)
    assert [c["method"] for c in f.selection if c.get("chosen")][0] in weights
    members = {m: forecast_target(t, f.target, method=m, n_bootstrap=10) for m in weights}
    lo = min(m.final_loss for m in members.values())
    hi = max(m.final_loss for m in members.values())
    assert lo <= f.final_loss <= hi
    assert f.final_loss_hi - f.final_loss_lo >= min(m.final_loss_hi - m.final_loss_lo for m in members.values())
    assert np.isfinite([f.final_loss_lo, f.final_loss_hi]).all() and 1.85 < f.final_loss < 2.05


def test_a_member_speaks_only_where_it_has_a_curve():
    early = _forecast("matched_progress", [3.0, 2.5, 2.0], 0.01)
    final_only = _forecast("chinchilla", [2.2], 0.01)
    final_only = final_only.model_copy(update={"target": early.target, "curve": [final_only.curve[0].model_copy(update={"step": 3})]})
    f = blend.blend({"matched_progress": early, "chinchilla": final_only}, {"matched_progress": 0.5, "chinchilla": 0.5})
    # before the end only matched progress has a curve: its points, untouched by the final-only law's 2.2
    assert [p.loss for p in f.curve[:2]] == pytest.approx([3.0, 2.5])
    assert f.final_loss == pytest.approx(math.sqrt(2.0 * 2.2))


def test_the_blend_spans_every_member_s_curve_when_the_chosen_law_starts_later():
    """A final law draws its curve from half the rungs' first eval; matched progress from a thousandth of the run.
    With the final law chosen (the blend's first member), the evals before its curve are matched progress's, not
    the blend's first point held flat."""
    early = _forecast("matched_progress", [4.0, 3.0, 2.5, 2.0], 0.01)
    late = _forecast("compute", [9.9, 2.6, 2.2, 2.2], 0.02)
    late = late.model_copy(update={"target": early.target, "curve": late.curve[2:]})  # steps 3 and 4 only
    f = blend.blend({"compute": late, "matched_progress": early}, {"compute": 0.5, "matched_progress": 0.5})
    assert [p.step for p in f.curve] == [1, 2, 3, 4]
    assert [p.loss for p in f.curve[:2]] == pytest.approx([4.0, 3.0])  # matched progress alone, its own band
    assert f.band_at(1)[2] / f.band_at(1)[1] == pytest.approx(math.exp(2 * Z95 * 0.01))
    assert f.curve[2].loss == pytest.approx(math.sqrt(2.5 * 2.2))  # both speak from the final law's first step
    assert f.final_loss == pytest.approx(math.sqrt(2.0 * 2.2))


def test_the_weights_reported_are_those_used_when_a_member_dropped_out():
    a = _forecast("overtrain", [3.0, 2.5, 2.0], 0.01)
    b = _forecast("farseer", [3.0, 2.5, 2.2], 0.01)
    # weights as members() gave them for three laws, one of which then failed on the whole table
    f = blend.blend({"overtrain": a, "farseer": b}, {"overtrain": 0.3, "farseer": 0.3, "chinchilla": 0.4})
    assert f.band_terms["weight.overtrain"] == pytest.approx(0.5) and "chinchilla" not in f.law
    assert f.final_loss == pytest.approx(math.sqrt(2.0 * 2.2))


def test_a_law_the_points_weights_drop_still_widens_the_band_by_its_disagreement_at_inverse_variance():
    """Twelve held-out sizes weigh a 1.6x lead as 1.6^12: the point is the better law's alone. Those errors were
    measured at the backtest's distances, not the target's, so the band keeps the other law's disagreement at the
    inverse-variance weight (public suite, Epoch's points two steps out: Chinchilla's law at 0.98 of the weight missed
    the under-trained largest sizes by -4.6% to -5.8% with a +-2% band, over-training's by -0.5% to -2.1%)."""
    sel = [_cand("chinchilla", 0.010, independent_errors=12), _cand("overtrain", 0.016, independent_errors=12)]
    point, band = blend.members(sel, "chinchilla"), blend.members(sel, "chinchilla", band=True)
    assert point == {"chinchilla": 1.0}  # 1.6^-12 is under MIN_WEIGHT
    assert band["overtrain"] / band["chinchilla"] == pytest.approx(1 / 1.6**2)
    chinchilla, overtrain = _forecast("chinchilla", [2.0], 0.01), _forecast("overtrain", [2.2], 0.05)
    chinchilla.params, overtrain.params = ({"E": Interval(value=v, lo=v, hi=v)} for v in (1.7, 1.8))
    f = blend.blend({"chinchilla": chinchilla, "overtrain": overtrain}, point, band)
    assert f.params == {"E": chinchilla.params["E"], "overtrain.E": overtrain.params["E"]}  # its method's own, unprefixed
    assert f.method == "chinchilla" and f.final_loss == pytest.approx(2.0)  # the point does not move
    # the point's own band (its weight 1) and the other law's disagreement at its band weight; not its own wide band
    sigma = math.log(f.final_loss_hi / f.final_loss_lo) / (2 * Z95)
    assert sigma == pytest.approx(math.hypot(0.01, math.sqrt(band["overtrain"]) * math.log(1.1)))
    assert f.band_terms["members_total"] == pytest.approx(0.01)
    assert f.final_loss_hi > 2.2 and f.band_terms["band_weight.overtrain"] == pytest.approx(band["overtrain"])
    assert "band over" in f.law and "overtrain law" in f.law
    # with the same weights for both, nothing changes from before
    assert blend.blend({"chinchilla": chinchilla, "overtrain": overtrain}, point) is chinchilla
