"""`ladder plot`: the tables behind the figures, the PNG, the offline HTML page, Marin's public ladder."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import textwrap
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import typer
from typer.testing import CliRunner

from ladder.views.html import build_html, embedded_data
from ladder.views.plots import MARIN_SOURCE, marin_public_data, plot_command, plot_data
from ladder.views.png import render_png

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
MARIN_RUNG_POINTS = {"d768": 20, "d1024": 20, "d1536": 21, "d2048": 16}


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command("plot")(plot_command)
    app.command("noop")(lambda: None)  # two commands: typer keeps "plot" as a subcommand name
    return app


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def marin():
    return marin_public_data()


# ---------------------------------------------------------------- Marin's public ladder


def test_marin_tables_hold_the_four_rungs_the_hero_band_and_its_published_ten_percent(marin):
    assert marin.rungs.groupby("run").size().to_dict() == MARIN_RUNG_POINTS
    assert sorted(marin.fits["run"].unique()) == sorted(MARIN_RUNG_POINTS)
    # the fitted law runs through each rung: within 3% of every logged point past 5% of training
    for run, rows in marin.rungs.groupby("run"):
        fit = marin.fits[marin.fits["run"] == run]
        late = rows[rows["flops"] >= fit["flops"].min()]
        predicted = np.interp(np.log(late["flops"]), np.log(fit["flops"]), fit["loss"])
        assert np.max(np.abs(predicted / late["loss"] - 1)) < 0.03, run
    band = marin.band
    assert len(band) > 100 and (band["lo"] <= band["loss"]).all() and (band["loss"] <= band["hi"]).all()
    assert band["flops"].max() == pytest.approx(2.6108941613772703e24, rel=1e-3)  # the hero's planned compute
    assert len(marin.actual) == 13 and marin.actual["step"].min() == pytest.approx(3000, abs=1)
    assert marin.actual["step"].max() == pytest.approx(39000, abs=1)
    assert marin.actual["flops"].max() < 0.11 * band["flops"].max()  # the published first 10%
    assert list(marin.history["method"]) == ["blend", "refit"] and list(marin.history["version"]) == [1, 2]
    hist = marin.history
    assert ((hist["final_loss_lo"] < hist["final_loss"]) & (hist["final_loss"] < hist["final_loss_hi"])).all()
    res = marin.residuals
    assert len(res) == 26
    assert np.allclose(res["residual"], res["loss"] / res["predicted"] - 1)
    refit_in_prefix = res[(res["version"] == 2) & (res["step"] <= 18000)]
    assert np.abs(refit_in_prefix["residual"]).max() < 0.01  # the refit saw these points


def test_marin_png_is_a_real_figure(marin, tmp_path):
    out = render_png(marin, tmp_path / "marin.png")
    assert _png_size(out) == (1300, 900)
    assert out.stat().st_size > 50_000  # four drawn panels, not an empty canvas


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.open: list[str] = []
        self.scripts: list[dict] = []
        self.links: list[dict] = []
        self.current: dict | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script":
            self.current = {"attrs": attrs, "text": ""}
        if tag == "link":
            self.links.append(attrs)
        if tag not in ("meta", "link", "br"):
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, f"unbalanced </{tag}>"
        self.open.pop()
        if tag == "script":
            self.scripts.append(self.current)
            self.current = None

    def handle_data(self, data):
        if self.current is not None:
            self.current["text"] += data


def _check_offline_page(page: str) -> _Tags:
    parser = _Tags()
    parser.feed(page)
    parser.close()
    assert parser.open == []
    assert parser.links == [] and all("src" not in s["attrs"] for s in parser.scripts)
    assert "@import" not in page and not re.search(r"url\(\s*['\"]?https?:", page)
    # the only URL in the page is the SVG namespace name, which browsers never fetch
    assert set(re.findall(r"https?://[^\s\"')]+", page)) <= {"http://www.w3.org/2000/svg"}
    return parser


def test_marin_html_is_offline_and_embeds_the_tables(marin, tmp_path):
    page = build_html(marin)
    parser = _check_offline_page(page)
    payload = embedded_data(page)
    assert len(payload["data"]["rungs"]) == sum(MARIN_RUNG_POINTS.values())
    assert len(payload["data"]["actual"]) == 13
    assert [p["id"] for p in payload["panels"]] == ["curves", "zoom", "history", "residuals"]
    zoom = payload["panels"][1]
    assert zoom["xrange"][0] < marin.actual["flops"].min() < zoom["xrange"][1]
    code = [s["text"] for s in parser.scripts if s["attrs"].get("type") != "application/json"]
    assert len(code) == 1 and "addEventListener(\"wheel\"" in code[0]
    if shutil.which("node"):
        script = tmp_path / "plot.js"
        script.write_text(code[0])
        assert subprocess.run(["node", "--check", str(script)], capture_output=True).returncode == 0


@pytest.mark.skipif(not Path(CHROMIUM).exists() and not os.environ.get("CI"), reason="Debian's chromium is not installed (.ci/run installs it; in CI its absence fails)")
def test_marin_html_renders_and_zooms_in_headless_chromium(marin, tmp_path):
    page = build_html(marin)
    # the page as published, plus a probe that records the curves panel, then drives its wheel, drag and reset
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", _EVENT_PROBE + "</body>"))
    dom = subprocess.run(
        [CHROMIUM, *CHROMIUM_FLAGS, "--window-size=1200,900", "--virtual-time-budget=3000", "--dump-dom",
         probe.as_uri() + "#zoom=residuals:1e23:3e24"],
        capture_output=True, text=True, timeout=90,
    ).stdout
    assert 'data-rendered="4"' in dom and 'class="error"' not in dom
    drawn = {panel: int(n) for panel, n in re.findall(r'data-panel="(\w+)"[^>]*data-drawn="(\d+)"', dom)}
    assert set(drawn) == {"curves", "zoom", "history", "residuals"}
    counts = {k: int(v) for k, v in re.findall(r'data-(initial|wheel|drag|reset)="(\d+)"', dom)}
    assert set(counts) == {"initial", "wheel", "drag", "reset"}, dom[-500:]
    assert drawn["history"] == 2 and counts["initial"] > 77 + 13  # rung and hero points plus the curves
    assert 0 < counts["wheel"] < counts["initial"] and 0 < counts["drag"] < counts["initial"]
    assert counts["reset"] == counts["initial"] == drawn["curves"]
    # a #zoom link opens the residuals panel on the late decade: exactly the points Python says are there
    residuals = embedded_data(page)["panels"][3]
    expected = sum(1 for series in residuals["series"] if series["y"] is not None
                   for x, y in zip(series["x"], series["y"]) if x is not None and y is not None and 1e23 <= x <= 3e24)
    assert 0 < expected < len(marin.residuals) and drawn["residuals"] == expected
    shot = tmp_path / "marin_html.png"
    (tmp_path / "marin.html").write_text(page)
    subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--screenshot={shot}", "--window-size=1200,900", (tmp_path / "marin.html").as_uri()],
                   capture_output=True, timeout=90)
    assert _png_size(shot) == (1200, 900)


_EVENT_PROBE = """<script>
(function(){
var svg=document.querySelector('svg[data-panel="curves"]'),r=svg.getBoundingClientRect(),body=document.body;
function at(f){return {clientX:r.left+f*r.width,clientY:r.top+0.5*r.height,bubbles:true,cancelable:true};}
body.setAttribute("data-initial",svg.getAttribute("data-drawn"));
for(var i=0;i<6;i++){svg.dispatchEvent(new WheelEvent("wheel",Object.assign({deltaY:-100},at(0.8))));}
body.setAttribute("data-wheel",svg.getAttribute("data-drawn"));
svg.dispatchEvent(new MouseEvent("dblclick",at(0.5)));
svg.dispatchEvent(new MouseEvent("mousedown",at(0.6)));
svg.dispatchEvent(new MouseEvent("mousemove",at(0.9)));
window.dispatchEvent(new MouseEvent("mouseup",at(0.9)));
body.setAttribute("data-drag",svg.getAttribute("data-drawn"));
svg.dispatchEvent(new MouseEvent("dblclick",at(0.5)));
body.setAttribute("data-reset",svg.getAttribute("data-drawn"));
})();
</script>"""


def test_command_renders_marin_without_a_store(tmp_path):
    result = CliRunner().invoke(_cli(), ["plot", MARIN_SOURCE, "--out", str(tmp_path / "marin.png")])
    assert result.exit_code == 0, result.output
    assert "4 rungs, 13 actual points of d6144, 2 forecast version(s)" in result.output
    assert _png_size(tmp_path / "marin.png") == (1300, 900)


def test_command_refuses_other_suffixes():
    result = CliRunner().invoke(_cli(), ["plot", MARIN_SOURCE, "--out", "marin.svg"])
    assert result.exit_code == 2 and "must end in .png or .html" in result.output


# ---------------------------------------------------------------- a table and a forecast file


def test_table_source_with_forecast_file(marin, tmp_path):
    from forecasting.api import forecast_target
    from forecasting.forecast import TargetSpec
    from forecasting.public_data import data_dir, marin_ladder

    table, _, observed = marin_ladder(data_dir() / "marin_535b_ladder")
    pd.concat([table, observed]).dropna(axis=1).to_csv(tmp_path / "runs.csv", index=False)  # columns both carry
    # a coarse forecast from the rungs (the same target as the Marin plot), written as `ladder forecast --json` would
    target = TargetSpec(**_marin_target_dict())
    forecast = forecast_target(table, target, n_bootstrap=5)
    (tmp_path / "hero.json").write_text(forecast.to_json())
    data = plot_data(str(tmp_path / "runs.csv"), forecast=str(tmp_path / "hero.json"))
    assert data.target == "d6144"
    assert data.rungs.groupby("run").size().to_dict() == MARIN_RUNG_POINTS
    assert len(data.actual) == 13 and len(data.history) == 1 and len(data.residuals) == 13
    assert data.band["loss"].iloc[-1] == pytest.approx(forecast.final_loss)


def _marin_target_dict() -> dict:
    from forecasting.public_data import data_dir, linear_decay_schedule, marin_ladder

    _, hero, _ = marin_ladder(data_dir() / "marin_535b_ladder")
    return {"name": hero["name"], "params_active": hero["params_active"], "params_total": hero["params_total"],
            "tokens": hero["tokens"], "num_steps": hero["num_steps"], "tokens_per_step": hero["tokens_per_step"],
            "total_flops": hero["total_flops"], "lr": linear_decay_schedule(hero["num_steps"]).tolist()}


# ---------------------------------------------------------------- an experiment and its store

EXPERIMENT = textwrap.dedent(
    """
    from ladder import TrainStep, build_ladder
    from trainer.config import ModelConfig, MoEConfig
    from tests.ladder_helpers import tiny_spec


    def rung(name, width, layers, batches):
        model = ModelConfig(hidden_dim=width, num_layers=layers, num_heads=2, seq_len=32,
                            moe=MoEConfig(num_experts=4, top_k=2, expert_dim=width))
        train = tiny_spec().train.model_copy(update={"tokens": 32 * 8 * batches})
        return TrainStep(name=name, spec=tiny_spec(model=model, train=train))


    steps = build_ladder([rung("r32", 32, 2, 20), rung("r48", 48, 2, 30), rung("r64", 64, 3, 40)],
                         hero=rung("hero", 96, 4, 120))  # tokens/param inside the rungs' range: matched progress applies
    """
)


def _write_run(store, dag, name: str, fractions, *, state: str) -> int:
    """A run directory as the trainer leaves it: spec.json with derived numbers, metrics.jsonl of evals."""
    derived = dag[name].derived
    run_dir = store.run_dir(name, dag.fingerprints[name])
    store.write_json(f"{run_dir}/spec.json", {"name": name, "derived": derived.model_dump()})
    flops_full = float(derived.total_flops)
    lines = []
    for g in fractions:
        step = max(1, int(round(g * derived.num_steps)))
        wobble = 1 + 0.004 * np.sin(7 * g + len(name))  # not a perfect law: residuals and bands are not zero
        loss = (1.5 + 40.0 * (g * flops_full) ** -0.12 * (1 + 0.1 * (1 - g))) * wobble
        lines.append({"step": step, "tokens": step * derived.tokens_per_step,
                      "flops": step * derived.tokens_per_step * derived.flops_per_token * 3, "eval/loss": loss})
    with store.fs.open(f"{run_dir}/metrics.jsonl", "w") as handle:
        handle.write("".join(json.dumps(line) + "\n" for line in lines))
    store.acquire_lease(run_dir, "writer")
    if state != "running":
        store.finish(run_dir, "writer", state)
    return len(lines)


@pytest.fixture(scope="module")
def small_ladder(tmp_path_factory):
    from forecasting.api import forecast_target, refit_forecast
    from ladder.fitting import store_forecast, table_from_steps, target_spec
    from ladder.loader import load_experiment
    from ladder.store import Store

    root = tmp_path_factory.mktemp("plots")
    exp_file = root / "tiny_ladder.py"
    exp_file.write_text(EXPERIMENT)
    dag = load_experiment(str(exp_file)).dag
    store = Store(str(root / "store"))
    fractions = np.linspace(0.1, 1.0, 10)
    for name in ("r32", "r48"):
        _write_run(store, dag, name, fractions, state="done")
    _write_run(store, dag, "r64", fractions[:7], state="running")  # a rung still training is drawn too
    n_hero = _write_run(store, dag, "hero", fractions[:4], state="running")
    table = table_from_steps(dag, store, ["r32", "r48", "r64"], require_done=False)
    target = target_spec(dag["hero"])
    first = forecast_target(table, target, method="matched_progress", n_bootstrap=5)
    store_forecast(store, first, meta={"why": "test"})
    hero = table_from_steps(dag, store, ["hero", "r32"], require_done=False)
    refit = refit_forecast(table, target, hero[hero["run"] == "hero"], prior=first, n_bootstrap=5)
    store_forecast(store, refit, meta={"why": "test"})
    return {"experiment": str(exp_file), "root": str(root / "store"), "n_hero": n_hero, "forecasts": [first, refit]}


def test_experiment_tables_read_partial_runs_and_every_forecast_version(small_ladder):
    data = plot_data(small_ladder["experiment"], root=small_ladder["root"])
    assert data.target == "hero"
    assert data.rungs.groupby("run").size().to_dict() == {"r32": 10, "r48": 10, "r64": 7}
    assert len(data.actual) == small_ladder["n_hero"] == 4
    assert list(data.history["version"]) == [1, 2] and list(data.history["method"]) == ["matched_progress", "refit"]
    assert data.history["final_loss"].tolist() == pytest.approx([f.final_loss for f in small_ladder["forecasts"]])
    assert len(data.residuals) == 8 and data.method == "refit (forecast v2)"
    assert sorted(data.fits["run"].unique()) == ["r32", "r48", "r64"]


def test_command_writes_png_and_html_for_an_experiment(small_ladder, tmp_path):
    args = [small_ladder["experiment"], "hero", "--root", small_ladder["root"]]
    png = CliRunner().invoke(_cli(), ["plot", *args, "--out", str(tmp_path / "hero.png"), "--x", "tokens"])
    assert png.exit_code == 0, png.output
    width, height = _png_size(tmp_path / "hero.png")
    assert (width, height) == (1300, 900)
    html_run = CliRunner().invoke(_cli(), ["plot", *args, "--out", str(tmp_path / "hero.html")])
    assert html_run.exit_code == 0, html_run.output
    page = (tmp_path / "hero.html").read_text()
    _check_offline_page(page)
    assert len(embedded_data(page)["data"]["actual"]) == 4


def test_command_exits_2_on_a_target_that_is_not_a_training_step(small_ladder, tmp_path):
    result = CliRunner().invoke(
        _cli(), ["plot", small_ladder["experiment"], "nope", "--root", small_ladder["root"], "--out", str(tmp_path / "x.png")]
    )
    assert result.exit_code == 2 and "'nope' is not a training step" in result.output
    assert not (tmp_path / "x.png").exists()


def test_command_exits_1_when_nothing_has_run_yet(small_ladder, tmp_path):
    result = CliRunner().invoke(
        _cli(), ["plot", small_ladder["experiment"], "--root", str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]
    )
    assert result.exit_code == 1 and "nothing to plot yet for hero" in result.output


def test_a_final_loss_forecast_is_one_point_and_scores_no_early_residuals(tmp_path):
    from forecasting.api import forecast_target
    from forecasting.forecast import TargetSpec
    from forecasting.public_data import data_dir, marin_ladder
    from ladder.views.html import panel_specs
    from ladder.views.plots import assemble

    table, _, observed = marin_ladder(data_dir() / "marin_535b_ladder")
    table = table.sort_values("step").groupby("run").tail(1)  # final points only: no curve to learn a shape from
    target = {k: v for k, v in _marin_target_dict().items() if k not in ("lr", "params_total")}
    forecast = forecast_target(table, TargetSpec(**target), method="compute", n_bootstrap=5)
    data = assemble(table, [forecast], observed, target="d6144", title="compute law")
    assert len(data.band) == 1 and data.residuals.empty  # the hero is at 10%: the law says nothing about it yet
    newest = [s for s in panel_specs(data)[0]["series"] if "newest" in s["name"]]
    assert [s["kind"] for s in newest] == ["errorbar"] and newest[0]["x"] == [pytest.approx(target["total_flops"])]
    assert _png_size(render_png(data, tmp_path / "law.png")) == (1300, 900)
