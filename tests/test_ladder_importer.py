"""Importing external runs: Marin's published rungs become run directories the forecaster reads like our own."""

from __future__ import annotations

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from forecasting.api import forecast_target, refit_forecast
from forecasting.table import from_run_dirs
from forecasting.matched_progress import marin_baseline
from forecasting.public_data import data_dir, marin_ladder
from ladder.executor import plan
from ladder.fitting import table_from_steps
from ladder.importer import (
    MARIN_SOURCE,
    ImportConflict,
    import_command,
    import_external_run,
    import_marin_hero_prefix,
    import_marin_published,
    marin_forecast_target,
)
from ladder.loader import load_experiment
from ladder.store import Store

RUNGS = ["d768", "d1024", "d1536", "d2048"]
DATA = data_dir()


@pytest.fixture(scope="module")
def exp():
    return load_experiment("experiments/marin_535b.py")


@pytest.fixture(scope="module")
def imported(exp, tmp_path_factory):
    store = Store(str(tmp_path_factory.mktemp("marin-root")))
    dirs = import_marin_published(store, exp.dag)
    return store, dirs


@pytest.fixture(scope="module")
def table(exp, imported):
    store, _ = imported
    return table_from_steps(exp.dag, store, RUNGS, require_done=False)


def test_imported_runs_are_real_run_directories(exp, imported):
    store, dirs = imported
    assert set(dirs) == set(RUNGS)
    rows = {r.name: r for r in plan(exp.dag, store)}
    assert [rows[n].state for n in RUNGS] == ["done", "done", "done", "failed"]
    assert rows["fit"].state == "blocked" and rows["hero"].state == "blocked"  # d2048 never finished
    for name in RUNGS:
        run_dir = store.run_dir(name, exp.dag.fingerprints[name])
        assert dirs[name] == run_dir
        spec = store.read_json(f"{run_dir}/spec.json")
        assert spec["fingerprint"] == exp.dag.fingerprints[name] and spec["kind"] == "train"
        assert spec["derived"]["accounting"] == "marin" and spec["tags"]["wandb_run"].startswith("rav-ladder-")
        status = store.read_status(run_dir)
        (event,) = status["history"]
        assert event["event"] == "imported" and event["source"] == MARIN_SOURCE
        assert status["provenance"]["source"] == MARIN_SOURCE and status["lease"] is None
    d2048 = store.read_status(store.run_dir("d2048", exp.dag.fingerprints["d2048"]))
    assert "16,063" in d2048["last_error"]
    result = store.read_json(f"{dirs['d768']}/result.json")
    assert result["final_eval_loss"] == pytest.approx(3.01535, abs=1e-5) and result["completed"] is True


def test_imported_table_equals_the_public_table(table):
    """Same steps, losses, fractions, tokens and C (lm_head excluded) as forecasting.public_data's loader."""
    public, _, _ = marin_ladder(DATA / "marin_535b_ladder")
    a = table.sort_values(["run", "step"]).reset_index(drop=True)
    b = public.sort_values(["run", "step"]).reset_index(drop=True)
    assert list(a["run"]) == list(b["run"]) and list(a["step"]) == list(b["step"])
    for column in ("loss", "fraction", "tokens", "flops", "num_steps"):
        np.testing.assert_allclose(a[column].to_numpy(float), b[column].to_numpy(float), rtol=1e-12)
    # rungs.csv rounds the parameter counts (d2048: 1.2e9); ours are Marin's exact _active_params
    assert a.groupby("run")["params_active"].first()["d2048"] == 1_170_735_104
    assert a.groupby("run")["fraction"].max()["d2048"] == pytest.approx(16_063 / 20_072, abs=1e-4)  # crashed at 80%


def test_matched_progress_baseline_from_imported_runs_gives_2_0388(exp, table):
    target = marin_forecast_target(exp.dag["hero"])
    assert target.total_flops == pytest.approx(2.6108941613772703e24, rel=1e-12)
    fit = marin_baseline(table)
    grid = fit.predict_at_grid(target.total_flops)
    assert round(float(grid[-1]), 4) == 2.0388
    assert float(grid[0]) == pytest.approx(2.3921, abs=1e-4) and float(grid[1]) == pytest.approx(2.3261, abs=1e-4)


def test_hero_forecast_from_imported_runs_matches_the_public_table(exp, table):
    target = marin_forecast_target(exp.dag["hero"])
    public, _, _ = marin_ladder(DATA / "marin_535b_ladder")
    ours = forecast_target(table, target, n_bootstrap=8, seed=0)
    reference = forecast_target(public.drop(columns=["lr"]), target, n_bootstrap=8, seed=0)
    assert ours.method == "blend"  # the compute law and matched progress, both backtested on the crashed d2048
    # the members' forecasts agree to 1e-9; their weights read the target's distance from the runs' sizes, which
    # the spec computes (d2048: 1.171B active) and the public table rounds (1.2B)
    assert ours.final_loss == pytest.approx(reference.final_loss, rel=1e-4)
    assert ours.final_loss_lo < ours.final_loss < ours.final_loss_hi
    assert 1.9 < ours.final_loss < 2.1


def test_reimport_is_a_no_op_and_a_different_history_is_refused(exp, imported):
    store, dirs = imported
    before = store.read_status(dirs["d768"])
    assert import_marin_published(store, exp.dag) == dirs
    assert store.read_status(dirs["d768"]) == before
    with pytest.raises(ImportConflict, match="never overwritten"):
        import_external_run(store, exp.dag, "d768", [{"step": 570, "eval/loss": 9.0}], source="elsewhere")
    assert store.read_status(dirs["d768"]) == before


def test_a_run_of_our_own_is_never_overwritten(exp, tmp_path):
    store = Store(str(tmp_path))
    run_dir = store.run_dir("d1024", exp.dag.fingerprints["d1024"])
    store.update_status(run_dir, lambda s: s.update(state="interrupted", history=[{"event": "interrupted"}]))
    with pytest.raises(ImportConflict, match=r"history \['interrupted'\]"):
        import_external_run(store, exp.dag, "d1024", [{"step": 763, "eval/loss": 3.4}], source="x")
    assert not store.exists(f"{run_dir}/metrics.jsonl")


def test_bad_imports_are_refused_with_the_reason(exp, tmp_path):
    store = Store(str(tmp_path))
    with pytest.raises(ValueError, match="fit step"):
        import_external_run(store, exp.dag, "fit", [{"step": 1, "eval/loss": 3.0}], source="x")
    with pytest.raises(ValueError, match="needs 'step' and 'eval/loss'"):
        import_external_run(store, exp.dag, "d768", [{"step": 1, "loss": 3.0}], source="x")
    with pytest.raises(ValueError, match="outside the spec"):
        import_external_run(store, exp.dag, "d768", [{"step": 99_999, "eval/loss": 3.0}], source="x")
    assert not store.exists(f"{store.root}/runs")


def test_our_convention_keeps_the_lm_head(exp, tmp_path):
    store = Store(str(tmp_path))
    run_dir = import_external_run(store, exp.dag, "d768", [{"step": 100, "eval/loss": 4.0}], source="x")
    (row,) = [json.loads(line) for line in store.fs.cat_file(f"{run_dir}/metrics.jsonl").decode().splitlines()]
    d = exp.dag["d768"].derived
    assert row["flops"] == pytest.approx(100 * 3 * d.flops_per_token * d.tokens_per_step)
    assert row["tokens"] == 100 * 1024 * 4096


def test_import_command(tmp_path):
    app = typer.Typer()
    app.command("import")(import_command)
    app.command("noop")(lambda: None)  # two commands keep typer's subcommand parsing
    runner = CliRunner()
    result = runner.invoke(app, ["import", "experiments/marin_535b.py", "marin-published", "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "d768: done" in result.output and "d2048: failed" in result.output and "hero: interrupted" in result.output
    bad = runner.invoke(app, ["import", "experiments/marin_535b.py", "somewhere", "--root", str(tmp_path)])
    assert bad.exit_code == 2 and "unknown import source" in bad.output


def test_hero_prefix_is_a_live_run_on_the_rungs_x_axis(exp, imported, table):
    store, _ = imported
    run_dir = import_marin_hero_prefix(store, exp.dag)
    assert store.read_status(run_dir)["state"] == "interrupted"
    assert {r.name: r.state for r in plan(exp.dag, store)}["hero"] == "blocked"  # waits for the fit, which waits for d2048
    live = from_run_dirs([run_dir])
    _, hero, observed = marin_ladder(DATA / "marin_535b_ladder")
    assert list(live["step"]) == list(observed["step"])
    for column in ("loss", "flops", "tokens", "fraction"):
        np.testing.assert_allclose(live[column].to_numpy(float), observed[column].to_numpy(float), rtol=1e-12)
    target = marin_forecast_target(exp.dag["hero"])
    prior = forecast_target(table, target, n_bootstrap=8, seed=0)
    refit = refit_forecast(table, target, live[live["step"] <= 18000], prior=prior, n_bootstrap=8, seed=0)
    later = observed[observed["step"] >= 21000]
    predicted = np.array([refit.band_at(s)[0] for s in later["step"]])
    assert np.abs(predicted / later["loss"].to_numpy() - 1).max() < 0.005  # the published refit quality, from run dirs


def test_cli_import_then_forecast_and_refit_the_marin_hero(tmp_path):
    """`ladder import` + `ladder forecast` as a user runs them: the crashed rung is used as a partial curve,
    the forecast is on Marin's axis, the refit with the hero's published prefix is a new version."""
    from typer.testing import CliRunner

    from ladder.cli import app

    runner = CliRunner()
    root = str(tmp_path / "root")
    assert runner.invoke(app, ["import", "experiments/marin_535b.py", "marin-published", "--root", root]).exit_code == 0
    first = runner.invoke(app, ["forecast", "experiments/marin_535b.py", "hero", "--root", root, "--json", "--n-bootstrap", "40"])
    assert first.exit_code == 0, first.output
    forecast = json.loads(first.stdout)
    assert forecast["method"] == "blend" and forecast["final_loss_lo"] < 2.0 < forecast["final_loss_hi"]
    assert forecast["target"]["total_flops"] == pytest.approx(2.6109e24, rel=1e-3)  # Marin's C without the lm_head
    refit = runner.invoke(app, ["forecast", "experiments/marin_535b.py", "hero", "--root", root, "--refit", "--json", "--n-bootstrap", "40"])
    assert refit.exit_code == 0, refit.output
    assert json.loads(refit.stdout)["method"] == "refit"
    stored = sorted(p.name for p in (tmp_path / "root" / "forecasts" / "hero").iterdir())
    assert stored == ["1.json", "2.json"]
    assert json.loads((tmp_path / "root" / "forecasts" / "hero" / "2.json").read_text())["ladder"]["target_lr_omitted"] == 390_251
