"""The public backtest suite (forecasting/suite.py): loaders, leak-free splits, exact scoring, an end-to-end quick run.

Method quality is not asserted here (that is what the suite measures); only the harness's own numbers are.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pandas as pd
import pytest
from scipy.stats import binom

from forecasting import api, suite
from forecasting.forecast import CurvePoint, Forecast, TargetSpec
from forecasting.table import validate_table
from tests.forecasting_helpers import ladder_curves


@pytest.mark.parametrize(
    ("loader", "rows", "runs"),
    [
        (suite.load_chinchilla, 240, 240),
        (suite.load_steplaw_dense, 1911, 1911),
        (suite.load_steplaw_moe, 708, 708),
        (suite.load_multipower, None, 27),
        (suite.load_porian, 1745, 1745),
        (suite.load_datablations, 9261, 48),
        (suite.load_opt, 142, 6),
        (suite.load_olmo, None, 3),
        (suite.load_k2, 9985, 1),
    ],
)
def test_loaders_give_valid_tables_of_the_documented_size(loader, rows, runs):
    t = loader()
    assert len(validate_table(t)) == len(t)
    assert {"run", "step", "loss", "tokens", "flops", "params_active"} <= set(t.columns)
    if rows is not None:
        assert len(t) == rows
    assert t["run"].nunique() == runs


def test_unit_conversions_follow_the_docstrings():
    opt = suite.load_opt()
    first = opt[(opt["run"] == "opt-125m") & (opt["step"] == 2000)].iloc[0]
    assert first["loss"] == pytest.approx(np.log(67.52265444265277))
    assert first["tokens"] == pytest.approx(1e9) and first["flops"] == pytest.approx(6 * 125e6 * 1e9, rel=1e-6)
    por = suite.load_porian()
    assert por["config"].nunique() == 15
    assert np.allclose(por["flops"], 6 * por["params_active"] * por["tokens"], rtol=1e-9)
    moe = suite.load_steplaw_moe()
    assert np.allclose(moe["flops"], moe["flops_per_token"] * moe["tokens"])
    assert len(suite.steplaw_best(moe, ["params_total", "params_active", "tokens", "topk", "experts"])) == 16
    assert len(suite.steplaw_best(suite.load_steplaw_dense(), ["params_active", "tokens"])) == 17
    db = suite.load_datablations()
    assert np.allclose(db["tokens"], db["step"] * suite.DATABLATIONS_TOKENS_PER_STEP)
    assert set(db["epochs"]) == {1, 2, 3, 4, 5, 7, 14, 44} and (db["unique_tokens"] * db["epochs"] > 0.99 * db.groupby("run")["tokens"].transform("max")).all()
    olmo = suite.load_olmo()
    assert olmo.groupby("run")["loss"].last().between(2.0, 3.0).all()  # C4 cross-entropy in nats at the end


@pytest.fixture(scope="module")
def splits():
    return suite.all_splits()


def test_every_data_set_has_splits_and_caps_hold(splits):
    assert {s.dataset for s in splits} == set(suite.DATASETS)
    assert sum(s.dataset == "porian" for s in splits) == 15
    for s in splits:
        assert 1 <= len(s.targets) <= suite.MAX_TARGETS
        for h in s.targets:
            assert 1 <= len(h.points) <= suite.MAX_CURVE_POINTS
            assert h.points["step"].is_monotonic_increasing


def test_splits_never_leak_held_out_runs_into_the_train_table(splits):
    for s in splits:
        held = {h.run for h in s.targets}
        if s.train is not None:
            assert not held & set(s.train["run"]), (s.dataset, s.name)
        for h in s.targets:
            if h.live is not None:  # refit: the live prefix ends before the first scored point
                assert h.live["step"].max() < h.points["step"].min()
                assert s.train is None or h.run not in set(s.train["run"])
        if s.dataset in ("chinchilla", "steplaw_dense", "steplaw_moe", "hh_opt", "hh_datablations"):
            assert s.train["params_active"].max() < min(h.target.params_active for h in s.targets), s.name
        if s.dataset == "porian":
            assert s.train["flops"].max() < min(h.target.total_flops for h in s.targets)
        if s.dataset.endswith("_overtrained"):  # an extrapolation in D/N only
            assert (s.train["tokens"] / s.train["params_active"]).max() <= suite.OVERTRAIN_FIT_MAX
            assert min(h.target.tokens / h.target.params_active for h in s.targets) >= suite.OVERTRAIN_PREDICT_MIN


def test_two_step_splits_leave_out_exactly_the_step_below_their_targets(splits):
    """A `_far` split predicts what its one-step sibling predicts from that sibling's ladder less the step just below
    the targets (a size, a budget or Marin's d2048): every run it drops lies above everything it still fits."""
    for far in (s for s in splits if s.dataset.endswith("_far")):
        base = far.dataset.removesuffix("_far")
        near = next(s for s in splits if s.dataset == base and s.group == far.group and {h.run for h in s.targets} == {h.run for h in far.targets})
        dropped = near.train[~near.train["run"].isin(far.train["run"])]
        assert set(far.train["run"]) < set(near.train["run"]), far.name
        column = "flops" if base == "porian" else "params_active"
        assert dropped[column].min() > far.train[column].max(), far.name
        assert dropped[column].max() <= min(getattr(h.target, "total_flops" if base == "porian" else "params_active") for h in far.targets)
    assert {s.dataset for s in splits if s.dataset.endswith("_far")} == {"chinchilla_far", "steplaw_dense_far", "steplaw_moe_far",
                                                                         "marin_far", "porian_far"}


def test_multipower_targets_carry_their_own_schedule(splits):
    s = next(s for s in splits if s.dataset == "multipower" and s.group == "csv_25")
    assert {h.run.split("/")[1] for h in s.targets} == {"constant_72000", "cosine_72000", "wsd_20000_24000",
                                                        "wsdld_20000_24000", "wsdcon_3", "wsdcon_18"}
    assert set(s.train["run"]) == {f"25M/{n}" for n in suite.MPL_TRAIN}
    wsd = next(h for h in s.targets if h.run == "25M/wsd_20000_24000")
    assert len(wsd.target.lr) == wsd.target.num_steps == 24000
    assert wsd.target.lr[15000] == pytest.approx(3e-4) and wsd.target.lr[-1] < 4e-5


def _hand_made(curve: list[tuple[int, float, float, float]], target: TargetSpec) -> Forecast:
    pts = [CurvePoint(step=s, loss=p, lo=lo, hi=hi) for s, p, lo, hi in curve]
    return Forecast(target=target, method="hand", inputs_fingerprint="x", curve=pts, final_loss=curve[-1][1],
                    final_loss_lo=curve[-1][2], final_loss_hi=curve[-1][3], law="hand")


def test_scoring_gives_exact_error_coverage_and_width():
    target = TargetSpec(name="t", params_active=1e8, tokens=1e10, num_steps=100)
    f = _hand_made([(10, 2.0, 1.8, 2.2), (100, 1.0, 0.7, 1.1)], target)
    h = suite.HeldOut(run="t", target=target, points=pd.DataFrame({"step": [10, 100], "loss": [2.1, 1.2]}))
    sc = suite.score_forecast(f, h)
    assert sc["rel_error"].tolist() == pytest.approx([2.0 / 2.1 - 1, 1.0 / 1.2 - 1])
    assert sc["covered"].tolist() == [True, False]
    assert sc["half_width"].tolist() == pytest.approx([0.1, 0.2])
    assert sc["final"].tolist() == [False, True]
    m = suite.metrics(sc.assign(curve_target=True))
    assert m["mae"] == pytest.approx(100 * (abs(2.0 / 2.1 - 1) + abs(1.0 / 1.2 - 1)) / 2)
    assert m["bias"] == pytest.approx(100 * ((2.0 / 2.1 - 1) + (1.0 / 1.2 - 1)) / 2)
    assert m["coverage"] == 50.0 and m["half_width"] == pytest.approx(15.0) and m["n"] == 2
    # a final-only forecast speaks only to the target's planned end
    only_final = _hand_made([(100, 1.1, 1.0, 1.25)], target)
    sc = suite.score_forecast(only_final, h)
    assert sc["step"].tolist() == [100] and bool(sc["covered"].iloc[0])
    assert sc["half_width"].iloc[0] == pytest.approx(0.125 / 1.1)


def _points(actual, pred, lo, hi, **extra) -> pd.DataFrame:
    actual, pred, lo, hi = (np.asarray(x, dtype=float) for x in (actual, pred, lo, hi))
    return pd.DataFrame({"actual": actual, "pred": pred, "lo": lo, "hi": hi, "rel_error": pred / actual - 1,
                         "covered": (lo <= actual) & (actual <= hi), "half_width": (hi - lo) / 2 / pred} | extra)


def test_band_z_reads_each_side_of_the_band_and_is_196_at_its_edges():
    z = suite.band_z(_points([2.4, 1.6, 2.0, 2.2, 2.0, 2.1], [2.0] * 6, [1.6, 1.6, 1.0, 2.0, 2.0, 2.0], [2.4, 2.4, 4.0, 2.0, 2.0, 2.0]))
    assert z[:2] == pytest.approx([1.959964, -1.959964])  # at hi and at lo: the edge of the 95% band
    assert z[2] == 0.0  # exact
    assert z[3] == np.inf and z[4] == 0.0 and z[5] == np.inf  # a band of zero width: off it is infinitely far
    lopsided = suite.band_z(_points([2.2, 1.9], [2.0, 2.0], [1.9, 1.9], [2.4, 2.4]))
    assert lopsided[0] == pytest.approx(1.959964 * np.log(1.1) / np.log(1.2))  # the upper half, read above
    assert lopsided[1] == pytest.approx(-1.959964)  # the lower half, read below


def test_calibration_metrics_tell_a_calibrated_band_from_one_twice_too_wide():
    rng = np.random.default_rng(0)
    pred, sigma = np.full(20_000, 2.0), 0.02
    actual = pred * np.exp(sigma * rng.standard_normal(len(pred)))
    for scale, c50, c80, z in ((1.0, 50.0, 80.0, 0.674), (2.0, 82.3, 98.9, 0.337)):
        lo, hi = pred * np.exp(-1.959964 * sigma * scale), pred * np.exp(1.959964 * sigma * scale)
        m = suite.metrics(_points(actual, pred, lo, hi))
        assert m["coverage_50"] == pytest.approx(c50, abs=1.5) and m["coverage_80"] == pytest.approx(c80, abs=1.5)
        assert m["median_abs_z"] == pytest.approx(z, abs=0.02) and m["covered"] == int(round(m["coverage"] * m["n"] / 100))
    # points without a band (older point files) still get the error metrics
    assert suite.metrics(pd.DataFrame({"rel_error": [0.01], "covered": [True], "half_width": [0.02]}))["coverage_50"] is None


def test_coverage_range_is_the_binomial_range_of_a_calibrated_band():
    assert suite.coverage_range(10) == (8, 10)  # ten of ten: 60% likely when calibrated, so not a sign of width
    assert suite.coverage_range(87) == (78, 86)  # 87 of 87: 1.2% likely, too many
    assert suite.coverage_range(2) == (1, 2)
    lo, hi = suite.coverage_range(167)
    assert binom.cdf(lo - 1, 167, 0.95) <= 0.025 < binom.cdf(lo, 167, 0.95) and binom.sf(hi, 167, 0.95) <= 0.025 and hi < 167


def test_calibration_table_flags_a_band_too_wide_on_many_targets_and_pools_the_data_sets():
    rows = []
    for d, n, width in (("wide", 90, 4.0), ("fair", 10, 1.0)):
        rng = np.random.default_rng(1)
        actual = np.full(n, 2.0)
        pred = actual * np.exp(0.01 * rng.standard_normal(n))
        lo, hi = pred * np.exp(-1.96 * 0.01 * width), pred * np.exp(1.96 * 0.01 * width)
        for method in ("auto", "compute"):
            rows.append(_points(actual, pred, lo, hi, dataset=d, split="s", group="", method=method, run=[f"r{i}" for i in range(n)],
                                step=1, final=True, curve_target=False, has_curve=False))
    points = pd.concat(rows, ignore_index=True)
    statuses = points[["dataset", "split", "method", "run"]].assign(status="ok", reason="", picked="compute", seconds=0.1)
    res = suite.SuiteResult(points=points, statuses=statuses, methods=["compute", "auto"], n_bootstrap=2, wall_s=1.0)
    check = {c["dataset"]: c for c in suite.check_auto(res)}
    assert check["wide"]["covered"] == 90 and check["wide"]["coverage_consistent"] is False
    assert check["wide"]["median_abs_z"] < 0.3 and check["wide"]["coverage_50"] > 90
    assert check["fair"]["coverage_consistent"] is True
    text = suite.calibration_table(res)
    assert "| wide | final | 90 |" in text and "90 of 90 (calibrated: 81-89 independent): NO" in text
    pooled = suite.pooled_calibration(res)
    assert [p["kind"] for p in pooled] == ["final"] and pooled[0]["n"] == 100 and "| **pooled** | final | 100 |" in text


def test_targets_that_share_their_splits_fit_are_judged_by_the_clustered_range():
    """15 splits of 6 targets, each split's errors sharing 60% of their variance (one fit per split, as Porian's
    configurations): a calibrated band covers all 90 often, which the binomial range of 90 independent targets
    (81-89) calls too many; the clustered range does not, and holds 95% of calibrated data sets."""
    rng = np.random.default_rng(3)
    groups = np.repeat(np.arange(400), 6)
    z = np.sqrt(0.6) * rng.standard_normal(400)[groups] + np.sqrt(0.4) * rng.standard_normal(len(groups))
    assert suite.intraclass_correlation(groups, z) == pytest.approx(0.6, abs=0.06)
    assert suite.intraclass_correlation(groups, rng.standard_normal(len(groups))) < 0.05
    assert suite.intraclass_correlation(np.zeros(10), z[:10]) == 0.0  # one split: not estimable, read as independent
    # a band of zero width puts a target infinitely far off: left out of the estimate, not a NaN in it
    assert 0.0 <= suite.intraclass_correlation([0, 0, 1, 1, 2, 2], [np.inf, 1.0, 2.0, 2.1, -1.0, -1.2]) <= 1.0
    sizes = [6] * 15
    assert suite.clustered_coverage_range(sizes, 0.0) == suite.coverage_range(90) == (81, 89)
    lo, hi = suite.clustered_coverage_range(sizes, 0.6)
    assert hi == 90 and lo < 81
    shared = rng.standard_normal((4000, 15))  # calibrated clustered data sets drawn afresh: ~95% inside the range
    counts = np.sum(np.abs(np.sqrt(0.6) * np.repeat(shared, 6, axis=1) + np.sqrt(0.4) * rng.standard_normal((4000, 90))) <= 1.959964, axis=1)
    assert 0.93 <= np.mean((lo <= counts) & (counts <= hi)) <= 0.995
    # through the check: every target covered, errors clustered by split
    split_error = np.linspace(-0.9, 0.9, 15)[groups[:90]] + 0.2 * rng.standard_normal(90)
    pred, sigma = np.full(90, 2.0), 0.01
    actual = pred * np.exp(sigma * split_error)
    points = _points(actual, pred, pred * np.exp(-1.96 * sigma), pred * np.exp(1.96 * sigma), dataset="clustered",
                     split=[f"s{i // 6}" for i in range(90)], group="", method="auto", run=[f"r{i}" for i in range(90)],
                     step=1, final=True, curve_target=False, has_curve=False)
    statuses = points[["dataset", "split", "method", "run"]].assign(status="ok", reason="", picked="compute", seconds=0.1)
    res = suite.SuiteResult(points=points, statuses=statuses, methods=["auto"], n_bootstrap=2, wall_s=1.0)
    [check] = suite.check_auto(res)
    assert check["covered"] == 90 and check["covered_range"] == (81, 89) and check["icc"] > 0.8
    assert check["covered_range_clustered"][1] == 90 and check["coverage_consistent"] is True and check["n_splits"] == 15
    assert "90 of 90 (calibrated: 81-89 independent; " in suite.calibration_table(res)


def test_a_method_that_fails_is_reported_never_fatal(monkeypatch):
    split = suite.splits_opt()[0]
    res = suite.run_suite([split], ["chinchilla"], n_bootstrap=2)
    assert set(res.statuses["status"]) == {"n/a"} and res.points.empty
    assert "6 finished runs" in res.statuses["reason"].iloc[0] or res.statuses["reason"].iloc[0]

    def broken(*a, **k):
        raise ZeroDivisionError("a bug in a method")

    monkeypatch.setattr(api, "forecast_target", broken)
    res = suite.run_suite([split], ["compute"], n_bootstrap=2)
    assert set(res.statuses["status"]) == {"error"}
    assert res.statuses["reason"].iloc[0] == "ZeroDivisionError: a bug in a method"

    def slow(*a, **k):
        time.sleep(5)

    monkeypatch.setattr(api, "forecast_target", slow)
    res = suite.run_suite([split], ["compute"], n_bootstrap=2, timeout_s=0.2)
    assert res.statuses["status"].tolist() == ["timeout", "timeout"]  # the second target is skipped, not run
    assert res.statuses["seconds"].iloc[1] == 0.0


def test_quick_suite_runs_end_to_end_with_a_row_per_data_set():
    res = suite.run_suite(suite.all_splits(quick=True), ["compute"], n_bootstrap=5, timeout_s=60)
    rows = suite.summarise(res)
    assert {r["dataset"] for r in rows if r["method"] == "compute"} == set(suite.DATASETS)
    assert {r["dataset"] for r in rows if r["method"] == suite.LIVE_ONLY} == {"hh_olmo", "hh_k2"}
    opt = next(r for r in rows if r["dataset"] == "hh_opt" and r["method"] == "compute")
    assert opt["status"] == "ok" and opt["final"]["n"] == 1 and opt["picked"] == {"compute": 1}
    text = suite.render_markdown(res)
    table = text.split("### Final points")[1].split("###")[0]
    assert "| hh_opt |" in table and "mean over data sets" in table
    doc = suite.to_json(res)
    assert {r["dataset"] for r in doc["datasets"]} == set(suite.DATASETS) and doc["by_group"]


def test_target_schedules_keep_the_warmup_ramp_and_lift_only_zeros(splits):
    s = next(s for s in splits if s.dataset == "multipower" and s.group == "csv_25")
    lr = np.array(next(h for h in s.targets if h.run == "25M/cosine_72000").target.lr)
    assert (np.diff(lr[:2160]) > 0).all()  # strictly increasing warmup, as the schedule-aware law detects it
    hero = next(s for s in splits if s.dataset == "marin" and "hero" in s.name).targets[0].target
    assert min(hero.lr) > 0 and min(hero.lr) == sorted(set(hero.lr))[0]


def test_ladder_backtest_suite_prints_the_table_and_rejects_unknown_names(tmp_path):
    from typer.testing import CliRunner

    from ladder.cli import app

    runner = CliRunner()
    md = tmp_path / "suite.md"
    out = runner.invoke(app, ["backtest", "--suite", "--quick", "--datasets", "hh_opt", "--methods", "compute",
                              "--n-bootstrap", "5", "--markdown", str(md)])
    assert out.exit_code == 0, out.output
    assert "| hh_opt |" in out.stdout and "### Final points" in md.read_text()
    bad = runner.invoke(app, ["backtest", "--suite", "--datasets", "nope"])
    assert bad.exit_code == 2 and "unknown data set(s) ['nope']" in bad.output
    assert runner.invoke(app, ["backtest"]).exit_code == 2


def test_ladder_backtest_forecasts_the_largest_runs_of_a_users_table_from_the_others(tmp_path):
    from typer.testing import CliRunner

    from ladder.cli import app

    table = ladder_curves([6e3, 1e4, 1.4e4, 2e4, 2.8e4], 8.0, evals=20)
    split = suite.leave_largest_out(table, 2)
    assert sorted(split.train["run"].unique()) == ["r0", "r1", "r2"] and [h.run for h in split.targets] == ["r3", "r4"]
    assert split.targets[1].target.params_active == 2.8e4 and split.targets[1].target.num_steps == 400
    with pytest.raises(ValueError, match="leaves fewer than three to fit"):
        suite.leave_largest_out(table, 3)
    path = tmp_path / "runs.csv"
    table.to_csv(path, index=False)
    runner = CliRunner()
    out = runner.invoke(app, ["backtest", str(path), "--forecast-largest", "1", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)["forecast_largest"]
    assert [r["run"] for r in rows] == ["r4"] and rows[0]["status"] == "ok"
    r = rows[0]
    assert r["actual"] == pytest.approx(table[table["run"] == "r4"]["loss"].iloc[-1])
    assert r["error"] == pytest.approx(r["predicted"] / r["actual"] - 1) and abs(r["error"]) < 0.03
    assert r["lo"] < r["predicted"] < r["hi"] and r["covered"] and r["evals"] == 20 and 0 <= r["evals_covered"] <= 1
    text = runner.invoke(app, ["backtest", str(path), "--forecast-largest", "1"])
    assert text.exit_code == 0 and "forecasts of the largest runs from the others" in text.stdout and "r4" in text.stdout
    # which held-out run each backtest missed: every one in --json, the worst first on screen
    compute = next(b for b in json.loads(out.stdout)["backtest"]["results"] if b["kind"] == "compute")
    assert {h["run"] for h in compute["runs"]} == set(compute["held_out"])
    worst = max(compute["runs"], key=lambda h: abs(h["error"]))
    shown = text.stdout.split("compute backtest: held-out runs, worst first")[1]
    first_row = next(line for line in shown.splitlines() if line.startswith("│"))
    assert worst["run"] in first_row and f"{worst['error']:+.2%}" in first_row, first_row
    too_many = runner.invoke(app, ["backtest", str(path), "--forecast-largest", "3"])
    assert too_many.exit_code != 0 and "leaves fewer than three to fit" in too_many.output
    with_suite = runner.invoke(app, ["backtest", "--suite", "--forecast-largest", "1"])
    assert with_suite.exit_code == 2 and "scores a ladder of your own" in with_suite.output


def test_forecast_largest_can_skip_the_runs_just_below_the_held_out_ones(tmp_path):
    """`--skip K`: the forecast of the largest runs made K rungs further out (the runs between neither fitted nor
    scored), refused when fewer than three runs would be left to fit or without --forecast-largest."""
    from typer.testing import CliRunner

    from ladder import cli

    table = ladder_curves([6e3, 1e4, 1.4e4, 2e4, 2.8e4], 8.0, evals=20)
    split = suite.leave_largest_out(table, 1, skip=1)
    assert sorted(split.train["run"].unique()) == ["r0", "r1", "r2"] and [h.run for h in split.targets] == ["r4"]
    assert "1 between left out" in split.name
    with pytest.raises(ValueError, match="leaves fewer than three to fit"):
        suite.leave_largest_out(table, 1, skip=2)
    near, far = (cli._forecast_largest(table, "auto", 1, 5, skip)[0] for skip in (0, 1))
    assert near["run"] == far["run"] == "r4" and near["status"] == far["status"] == "ok"
    assert far["predicted"] != near["predicted"] and far["hi"] - far["lo"] > near["hi"] - near["lo"]  # further out, wider
    path = tmp_path / "runs.csv"
    table.to_csv(path, index=False)
    runner = CliRunner()
    text = runner.invoke(cli.app, ["backtest", str(path), "--forecast-largest", "1", "--skip", "1", "--n-bootstrap", "5"])
    assert text.exit_code == 0 and "the 1 just below them left out" in text.stdout and "r4" in text.stdout
    alone = runner.invoke(cli.app, ["backtest", str(path), "--skip", "1"])
    assert alone.exit_code == 2 and "give --forecast-largest N too" in alone.output
    for option in ("--skip", "--forecast-largest"):  # a negative count is refused by name, before anything is fitted
        negative = runner.invoke(cli.app, ["backtest", str(path), "--forecast-largest", "1", option, "-1"])
        assert negative.exit_code == 2 and option in negative.output


def test_a_partial_bench_run_prints_its_table_and_leaves_the_committed_results_alone(tmp_path, monkeypatch, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_forecast_suite.py"
    spec = importlib.util.spec_from_file_location("bench_forecast_suite", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = tmp_path / "RESULTS_forecast_suite.md"
    results.write_text("the committed table\n")
    monkeypatch.setattr(bench, "RESULTS", results)
    one_split = suite.all_splits(["hh_opt"], quick=True)  # every run below scores OPT's quick split only: seconds
    monkeypatch.setattr(bench.suite, "all_splits", lambda names, quick=False: one_split)
    fast = ["--n-bootstrap", "5", "--quiet"]
    for argv in (["--methods", "compute"], ["--datasets", "hh_opt"], ["--quick"]):
        assert bench.main(argv + fast) == 0
        assert "| hh_opt |" in capsys.readouterr().out
        assert results.read_text() == "the committed table\n", argv
    assert bench.whole_suite(bench.parse_args(fast)) and bench.main(fast) == 0
    assert results.read_text().startswith("# Public backtest suite")
