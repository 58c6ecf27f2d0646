"""Notebook use: Forecast, LadderFit and BacktestReport print short, render as small HTML tables, turn into
DataFrames and plot on matplotlib Axes; a fitted law answers L(N, D) and the compute-optimal split in one call."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
from matplotlib.axes import Axes

from forecasting.api import TargetSpec, backtest, fit_ladder, forecast_target
from forecasting.forecast import Forecast
from forecasting.public_data import chinchilla_points, data_dir, linear_decay_schedule, marin_ladder

DATA = data_dir()


@pytest.fixture(scope="module")
def marin():
    table, hero, observed = marin_ladder(DATA / "marin_535b_ladder")
    target = TargetSpec(
        name="hero", params_active=hero["params_active"], params_total=hero["params_total"], tokens=hero["tokens"],
        num_steps=hero["num_steps"], tokens_per_step=hero["tokens_per_step"], total_flops=hero["total_flops"],
        lr=linear_decay_schedule(hero["num_steps"]).tolist(),
    )
    return table, target, observed


@pytest.fixture(scope="module")
def hero_forecast(marin):
    table, target, _ = marin
    return forecast_target(table, target, n_bootstrap=10)


@pytest.fixture(scope="module")
def chinchilla_fit():
    return fit_ladder(chinchilla_points(DATA / "chinchilla_svg_extracted_data.csv"), law="chinchilla", n_bootstrap=10)


def test_forecast_repr_is_one_short_line_though_it_holds_a_390k_step_schedule(hero_forecast):
    text = repr(hero_forecast)
    assert len(hero_forecast.target.lr) > 100_000 and len(hero_forecast.model_dump_json()) > 1_000_000
    assert len(text) < 300 and "\n" not in text
    assert "hero" in text and f"{hero_forecast.final_loss:.4f}" in text and hero_forecast.method in text
    assert str(hero_forecast) == text


def test_forecast_html_frame_and_plot(hero_forecast, marin):
    html = hero_forecast._repr_html_()
    assert html.startswith("<table") and len(html) < 5_000 and f"{hero_forecast.final_loss:.4f}" in html
    frame = hero_forecast.to_frame()
    assert isinstance(frame, pd.DataFrame) and list(frame.columns) == ["step", "tokens", "flops", "loss", "lo", "hi"]
    assert len(frame) == len(hero_forecast.curve) and (frame["lo"] <= frame["loss"]).all() and (frame["loss"] <= frame["hi"]).all()
    _, _, observed = marin
    ax = hero_forecast.plot(actual=observed)
    assert isinstance(ax, Axes)
    assert ax.get_xscale() == "log" and ax.get_ylabel() == "loss"
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert np.allclose(lines["actual"].get_ydata(), observed["loss"])
    assert len(lines[f"forecast v0 ({hero_forecast.method})"].get_xdata()) == len(frame)
    import matplotlib.pyplot as plt

    fig, given = plt.subplots()
    assert hero_forecast.plot(ax=given) is given
    plt.close("all")


def test_a_forecast_still_round_trips_through_json(hero_forecast):
    assert Forecast.from_json(hero_forecast.to_json()) == hero_forecast


def test_ladder_fit_predicts_and_allocates_compute_in_one_call(chinchilla_fit):
    fit = chinchilla_fit
    residual = fit.residuals[0]
    points = chinchilla_points(DATA / "chinchilla_svg_extracted_data.csv")
    final = points.sort_values("step").groupby("run").tail(1).set_index("run")
    row = final.loc[residual["run"]]
    assert float(fit.predict(row["params_active"], row["tokens"])) == pytest.approx(residual["predicted"], rel=1e-9)
    many = fit.predict(np.array([1e9, 7e10]), np.array([2e10, 1.4e12]))
    assert many.shape == (2,) and many[1] < many[0]
    best = fit.compute_optimal(5.76e23)  # Chinchilla's own budget
    assert set(best) == {"flops", "params_active", "tokens", "tokens_per_param", "loss"}
    assert 6 * best["params_active"] * best["tokens"] == pytest.approx(5.76e23, rel=1e-9)
    assert best["tokens_per_param"] == pytest.approx(best["tokens"] / best["params_active"])
    assert best["loss"] == pytest.approx(float(fit.predict(best["params_active"], best["tokens"])))
    # the optimum is a minimum: moving N either way along the iso-FLOP line raises the loss
    for scale in (0.7, 1.4):
        n = best["params_active"] * scale
        assert float(fit.predict(n, 5.76e23 / (6 * n))) > best["loss"]
    with pytest.raises(ValueError, match="params_active and tokens"):
        fit.predict(flops=1e21)


def test_ladder_fit_views(chinchilla_fit):
    fit = chinchilla_fit
    text = repr(fit)
    assert len(text) < 300 and text.startswith("LadderFit(chinchilla on ")
    assert "<table" in fit._repr_html_() and "alpha" in fit._repr_html_()
    frame = fit.to_frame()
    assert list(frame.columns) == ["run", "loss", "predicted", "rel_error"] and len(frame) == fit.n_runs
    ax = fit.plot()
    assert isinstance(ax, Axes) and len(ax.collections[0].get_offsets()) == fit.n_runs
    import matplotlib.pyplot as plt

    plt.close("all")


def test_a_compute_law_predicts_from_flops_and_refuses_an_allocation(marin):
    table, _, _ = marin
    fit = fit_ladder(table, law="matched_progress", n_bootstrap=5)
    last = fit.residuals_table().set_index("run")
    rungs = table.sort_values("step").groupby("run").tail(1).set_index("run")
    finished = rungs[rungs["fraction"] >= 0.999]
    assert len(finished) >= 3
    for run, row in finished.iterrows():  # the law's final loss at a finished rung's compute is its fitted final point
        assert float(fit.predict(flops=row["flops"])) == pytest.approx(last.loc[run, "predicted"], rel=1e-4)
    with pytest.raises(ValueError, match="flops="):
        fit.predict(1e9, 1e10)
    with pytest.raises(ValueError, match="chinchilla fit"):
        fit.compute_optimal(1e22)


def test_backtest_report_views(marin):
    table, _, _ = marin
    report = backtest(table)
    text = repr(report)
    assert len(text) < 300 and "compute" in text and "prefix" in text
    assert "<table" in report._repr_html_()
    frame = report.to_frame()
    assert set(frame["kind"]) == {"compute", "prefix"} and "rms_rel_error" in frame.columns
    ax = report.plot()
    assert isinstance(ax, Axes) and len(ax.collections) == len(report.results)
    import matplotlib.pyplot as plt

    plt.close("all")
