"""`ladder report`: one offline HTML page per experiment; Marin's imported ladder and a half-run local ladder."""

from __future__ import annotations

import json
import os
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from ladder.views.report import report_command, write_report
from tests.test_ladder_plots import CHROMIUM, CHROMIUM_FLAGS, _check_offline_page, _png_size

MARIN = "experiments/marin_535b.py"
LOCAL = "experiments/local_ladder.py"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
PANELS = ("curves", "zoom", "history", "residuals")


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command("report")(report_command)
    app.command("noop")(lambda: None)  # two commands: typer keeps "report" as a subcommand name
    return app


class _Cells(HTMLParser):
    """Rows of every <table id=...>: a list of {data-col: (text, data-value)} per table id, plus row attributes."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[dict]] = {}
        self.table: str | None = None
        self.row: dict | None = None
        self.col: tuple[str, str | None] | None = None
        self.text = ""

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table" and attrs.get("id"):
            self.table = attrs["id"]
            self.tables[self.table] = []
        elif tag == "tr" and self.table and any(k.startswith("data-") for k in attrs):
            self.row = {"_attrs": attrs}
        elif tag == "td" and self.row is not None and attrs.get("data-col"):
            self.col, self.text = (attrs["data-col"], attrs.get("data-value")), ""

    def handle_endtag(self, tag):
        if tag == "td" and self.col is not None:
            self.row[self.col[0]] = (self.text.strip(), self.col[1])
            self.col = None
        elif tag == "tr" and self.row is not None:
            self.tables[self.table].append(self.row)
            self.row = None
        elif tag == "table":
            self.table = None

    def handle_data(self, data):
        if self.col is not None:
            self.text += data


def _tables(page: str) -> dict[str, list[dict]]:
    parser = _Cells()
    parser.feed(page)
    return parser.tables


def _section(page: str, section_id: str) -> str:
    start = page.index(f'<section id="{section_id}"')
    return page[start: page.index("</section>", start)]


# ---------------------------------------------------------------- Marin's 535B ladder, imported


@pytest.fixture(scope="module")
def marin(tmp_path_factory):
    """`ladder import experiments/marin_535b.py marin-published`, two forecast versions of the hero
    (from the rungs, then a refit on its published prefix), one alert in the hero's alerts.jsonl, the report."""
    from forecasting.api import backtest, forecast_target, refit_forecast
    from forecasting.table import from_run_dirs
    from ladder.alerts import Alert, append_alerts
    from ladder.fitting import ladder_runs_for, store_forecast, table_from_steps, target_spec
    from ladder.importer import import_marin_hero_prefix, import_marin_published
    from ladder.loader import load_experiment
    from ladder.store import Store

    root = tmp_path_factory.mktemp("marin_report")
    store = Store(str(root / "store"))
    dag = load_experiment(MARIN).dag
    import_marin_published(store, dag)
    hero_dir = import_marin_hero_prefix(store, dag)
    table = table_from_steps(dag, store, ladder_runs_for(dag, "hero"), allow_partial=True, warnings=[])
    target = target_spec(dag["hero"])
    first = forecast_target(table, target, n_bootstrap=5)
    store_forecast(store, first, meta={"why": "test: from the rungs"})
    live = from_run_dirs([hero_dir])
    refit = refit_forecast(table, target, live[live["step"] <= 18000], prior=first, n_bootstrap=5)
    store_forecast(store, refit, meta={"why": "test: refit", "refit": True})
    append_alerts(hero_dir, [Alert(kind="grad_spike", step=21000, severity="warning", message="grad/norm/total jumped (test)")])
    out = root / "report"
    result = CliRunner().invoke(_cli(), ["report", MARIN, "--out", str(out), "--root", str(root / "store")])
    assert result.exit_code == 0, result.output
    return {"page": (out / "index.html").read_text(), "path": out / "index.html", "dag": dag, "forecasts": [first, refit],
            "backtest": backtest(table), "output": result.output}


def test_marin_report_is_one_offline_page(marin):
    parser = _check_offline_page(marin["page"])  # no external script, style, image, link or URL in the text
    assert "wrote" in marin["output"] and str(marin["path"]) in marin["output"].replace("\n", "")
    assert not re.search(r"""\s(?:src|href)\s*=\s*["'](?!#)""", marin["page"])  # only in-page anchors
    assert [s["attrs"].get("type") for s in parser.scripts] == ["application/json", None]
    assert [m for m in re.findall(r'<section id="(\w+)"', marin["page"])] == [
        "summary", "ladder", "mixture", "configs", "curves", "forecast", "backtest", "alerts"]
    about = re.search(r'<details id="about">.*?</details>', marin["page"], re.S).group(0)
    assert "Marin&#x27;s 535B-A23B hero and its four-rung ladder" in about  # the experiment's docstring


def test_marin_ladder_table_holds_every_step_with_its_numbers_and_state(marin):
    rows = {r["name"][0]: r for r in _tables(marin["page"])["ladder-table"]}
    assert list(rows) == ["d768", "d1024", "d1536", "d2048", "fit", "hero"]
    assert [rows[n]["params_active"][0] for n in ("d768", "d1024", "d1536", "d2048", "hero")] == ["60.6M", "162M", "481M", "1.17B", "22.8B"]
    assert [rows[n]["params_total"][0] for n in ("d768", "d1024", "d1536", "d2048", "hero")] == ["1.59B", "3.97B", "11.5B", "27.7B", "535B"]
    for name in ("d768", "d1024", "d1536", "d2048", "hero"):
        derived = marin["dag"][name].derived
        assert int(rows[name]["params_active"][1]) == derived.params_active
        assert int(rows[name]["tokens"][1]) == derived.tokens
        assert float(rows[name]["flops"][1]) == pytest.approx(marin["dag"][name].flops)
    assert {n: r["state"][1] for n, r in rows.items()} == {
        "d768": "done", "d1024": "done", "d1536": "done", "d2048": "failed", "fit": "blocked", "hero": "blocked"}
    assert "step 16,063 of 20,072 (80.0%)" in rows["d2048"]["status"][0]
    assert "step 38,999 of 390,251 (10.0%)" in rows["hero"]["status"][0]  # the imported published prefix
    assert rows["fit"]["params_active"] == ("", None) and "d2048 (failed)" in rows["fit"]["status"][0]
    assert "not finished: d2048, fit, hero" in _section(marin["page"], "ladder")


def test_marin_mixture_tokens_per_source_and_phase(marin):
    from ladder.views.report import mixture_tokens

    summary = {r["name"][0]: r for r in _tables(marin["page"])["mixture-table"]}
    assert "phase 1: steps 312,192-390,251" in summary["hero"]["phases"][0]  # Marin's block-aligned switch
    assert "phase 1: steps 9,120-11,420" in summary["d768"]["phases"][0]
    hero = marin["dag"]["hero"]
    mix = mixture_tokens(hero)
    assert [p["tokens"] for p in mix["phases"]] == [312_192 * hero.derived.tokens_per_step, (390_251 - 312_192) * hero.derived.tokens_per_step]
    assert sum(mix["totals"].values()) == pytest.approx(hero.derived.tokens, rel=1e-9)
    # the per-source table of the hero: 200 cells, each phase's tokens = weight x the phase's tokens
    block = re.search(r'<details data-step="hero">.*?</details>', marin["page"], re.S).group(0)
    cells = re.findall(r'<tr data-source="(c\d\dq\d)">(.*?)</tr>', block)
    assert len(cells) == 200
    name, row = cells[0]
    weight0 = float(re.search(r'data-col="weight0" data-value="([^"]+)"', row).group(1))
    tokens0 = float(re.search(r'data-col="tokens0" data-value="([^"]+)"', row).group(1))
    assert tokens0 == pytest.approx(weight0 * mix["phases"][0]["tokens"])
    assert name == max(mix["totals"], key=mix["totals"].get)  # largest source first


def test_marin_configs_are_collapsible_json(marin):
    configs = _section(marin["page"], "configs")
    hero = re.search(r'<details class="config" data-step="hero">(.*?)</details></details>', configs, re.S).group(1)
    model = json.loads(re.search(r"<summary>model</summary><pre>(.*?)</pre>", hero, re.S).group(1).replace("&quot;", '"'))
    assert model["hidden_dim"] == 6144 and model["num_layers"] == 48 and model["moe"]["num_experts"] == 384
    schedule = json.loads(re.search(r"<summary>schedule</summary><pre>(.*?)</pre>", hero, re.S).group(1).replace("&quot;", '"'))
    assert schedule["kind"] == "linear" and schedule["min_lr_fraction"] == 0.05
    for part in ("optimizer", "train", "data", "resources", "derived"):
        assert f"<summary>{part}</summary>" in hero


def test_marin_forecast_versions_with_final_loss_intervals(marin):
    first, refit = marin["forecasts"]
    rows = _tables(marin["page"])["forecast-table"]
    assert [r["version"][0] for r in rows] == ["v1", "v2"] and [r["method"][0] for r in rows] == [first.method, "refit"]
    for row, forecast in zip(rows, (first, refit), strict=True):
        assert float(row["final_loss"][1]) == pytest.approx(forecast.final_loss, rel=1e-12)
        assert (row["final_loss_lo"][0], row["final_loss"][0], row["final_loss_hi"][0]) == (
            f"{forecast.final_loss_lo:.4f}", f"{forecast.final_loss:.4f}", f"{forecast.final_loss_hi:.4f}")
        assert row["final_error"][0] == "-"  # the hero is at 10%: its final loss is unknown
    assert 0 < abs(float(rows[1]["latest_residual"][1])) < 0.05
    headline = re.search(r'id="forecast-headline">(.*?)</p>', marin["page"], re.S).group(1)
    assert f"<b>{refit.final_loss:.4f}</b> [{refit.final_loss_lo:.4f}, {refit.final_loss_hi:.4f}]" in headline
    assert "13 evals, latest at step 38,999 of 390,251 (10.0%)" in _section(marin["page"], "forecast")


def test_marin_backtest_rows_are_the_forecasting_librarys(marin):
    rows = _tables(marin["page"])["backtest-table"]
    expected = marin["backtest"].results
    assert [r["kind"][0] for r in rows] == [r.kind for r in expected] == ["compute", "prefix"]
    for row, result in zip(rows, expected, strict=True):
        assert float(row["rms_rel_error"][1]) == pytest.approx(result.rms_rel_error)
        assert float(row["mean_rel_error"][1]) == pytest.approx(result.mean_rel_error)
        assert int(row["n_points"][1]) == result.n_points
    assert rows[0]["held_out"][0] == "d2048" and float(rows[0]["final_actual"][1]) == pytest.approx(2.4745, abs=1e-4)
    # the held-out runs each error came from, worst first within each backtest
    runs = _tables(marin["page"])["backtest-runs-table"]
    shown = [(r["kind"][0], r["run"][0]) for r in runs]
    assert shown == [(res.kind, h.run) for res in expected for h in res.worst_runs(8)]
    assert shown[0] == ("compute", "d2048") and any(kind == "prefix" for kind, _ in shown)
    for row, h in zip(runs, [h for res in expected for h in res.worst_runs(8)], strict=True):
        assert float(row["error"][1]) == pytest.approx(h.error) and float(row["actual"][1]) == pytest.approx(h.actual)
    assert "d2048 is failed; its partial curve is used" in _section(marin["page"], "backtest")
    assert "on 4 runs (d768, d1024, d1536, d2048)" in _section(marin["page"], "backtest")  # by size, not by name


def test_marin_alerts_include_the_runs_alert_stream(marin):
    rows = _tables(marin["page"])["alerts-table"]
    streamed = [r for r in rows if r["source"][0] == "alerts.jsonl"]
    assert [(r["run"][0], r["step"][1], r["kind"][0]) for r in streamed] == [("hero", "21000", "grad_spike")]
    assert "5 run(s) (d768, d1024, d1536, d2048, hero)" in _section(marin["page"], "alerts")


def test_marin_charts_embed_the_plot_tables(marin):
    from ladder.views.html import embedded_data

    payload = embedded_data(marin["page"])
    assert [p["id"] for p in payload["panels"]] == list(PANELS)
    assert len(payload["data"]["rungs"]) == 77 and len(payload["data"]["actual"]) == 13
    assert [h["version"] for h in payload["data"]["history"]] == [1, 2]


@pytest.mark.skipif(not Path(CHROMIUM).exists() and not os.environ.get("CI"),
                    reason="Debian's chromium is not installed (.ci/run installs it; in CI its absence fails)")
def test_marin_report_renders_in_headless_chromium_without_console_errors(marin, tmp_path):
    # a collector installed before any other script: errors and console.error calls are written into the DOM
    probe = tmp_path / "probe.html"
    probe.write_text(marin["page"].replace("<head>", "<head>" + _ERROR_COLLECTOR, 1))
    run = subprocess.run(
        [CHROMIUM, *CHROMIUM_FLAGS, "--enable-logging=stderr", "--v=0", "--window-size=1300,2200",
         "--virtual-time-budget=3000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=90,
    )
    dom = run.stdout
    assert 'data-rendered="4"' in dom and 'class="error"' not in dom, dom[-800:]
    assert 'data-page-errors="' not in dom, re.search(r'data-page-errors="([^"]*)"', dom).group(1)
    assert "Uncaught" not in run.stderr and not re.search(r"CONSOLE.*(?:Error|error)", run.stderr)
    for panel in PANELS:
        svg = re.search(rf'<svg[^>]*data-panel="{panel}"[^>]*>(.*?)</svg>', dom, re.S)
        assert svg, panel
        drawn = int(re.search(r'data-drawn="(\d+)"', svg.group(0)).group(1))
        marks = len(re.findall(r"<circle|<path", svg.group(1)))
        assert drawn > 0 and marks > 0, (panel, drawn, marks)
    assert re.search(r'data-panel="history"[^>]*data-drawn="2"', dom)  # two forecast versions
    assert dom.count("<details") >= 5 + 6  # mixture per step, configs per step
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report_marin_535b.png"
    shot.unlink(missing_ok=True)
    subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--screenshot={shot}", "--window-size=1200,1800", marin["path"].as_uri()],
                   capture_output=True, timeout=90)
    assert _png_size(shot) == (1200, 1800) and shot.stat().st_size > 50_000


_ERROR_COLLECTOR = """<script>
(function(){var seen=[];function note(m){seen.push(String(m));document.documentElement.setAttribute("data-page-errors",seen.join(" | "));}
window.addEventListener("error",function(e){note(e.message||e);});
window.addEventListener("unhandledrejection",function(e){note(e.reason);});
var original=console.error;console.error=function(){note(Array.prototype.join.call(arguments," "));return original.apply(console,arguments);};})();
</script>"""


# ---------------------------------------------------------------- the local ladder


def test_local_ladder_before_anything_ran_says_what_is_missing(tmp_path):
    page = write_report(LOCAL, str(tmp_path / "out"), root=str(tmp_path / "empty")).read_text()
    _check_offline_page(page)
    assert not (tmp_path / "empty").exists()  # a report reads, never writes the store
    rows = {r["name"][0]: r["state"][1] for r in _tables(page)["ladder-table"]}
    assert rows == {"r24": "pending", "r32": "pending", "r48": "pending", "r64": "pending", "fit": "pending", "hero": "pending"}
    for section in ("curves", "forecast", "backtest", "alerts"):
        assert 'class="missing"' in _section(page, section), section
    assert "no stored forecast of hero; run `ladder forecast experiments/local_ladder.py hero`" in page
    assert "data-rendered" not in page and 'id="plot-data"' not in page  # no charts, and no script to fail


def _write_run(store, dag, name: str, fractions, *, state: str, spike_at: int | None = None) -> str:
    """A run directory as the trainer leaves it: spec.json with derived numbers, evals (and train losses)."""
    derived = dag[name].derived
    run_dir = store.run_dir(name, dag.fingerprints[name])
    store.write_json(f"{run_dir}/spec.json", {"name": name, "derived": derived.model_dump()})
    lines = []
    for g in fractions:
        step = max(1, int(round(g * derived.num_steps)))
        wobble = 1 + 0.004 * np.sin(7 * g + len(name))
        loss = (1.5 + 40.0 * (g * derived.total_flops) ** -0.12 * (1 + 0.1 * (1 - g))) * wobble
        lines.append({"step": step, "tokens": step * derived.tokens_per_step,
                      "flops": step * derived.tokens_per_step * derived.flops_per_token * 3, "eval/loss": loss,
                      "train/loss": loss * (3.0 if step == spike_at else 1.0 + 0.001 * np.cos(40 * g))})
    with store.fs.open(f"{run_dir}/metrics.jsonl", "w") as handle:
        handle.write("".join(json.dumps(line) + "\n" for line in lines))
    store.acquire_lease(run_dir, "writer")
    if state != "running":
        store.finish(run_dir, "writer", state)
    return run_dir


@pytest.mark.parametrize("where", ["folder", "memory"])
def test_local_ladder_mid_run_report(tmp_path, where):
    """Rungs done, the hero running with a loss spike: every section filled, the spike found in its metrics;
    the same from a local folder and from an fsspec store (memory://)."""
    from forecasting.api import forecast_target
    from ladder.fitting import store_forecast, table_from_steps, target_spec
    from ladder.loader import load_experiment
    from ladder.store import Store

    dag = load_experiment(LOCAL).dag
    root = str(tmp_path / "store") if where == "folder" else f"memory://report-{tmp_path.name}"
    store = Store(root)
    fractions = np.linspace(0.05, 1.0, 20)
    for name in ("r24", "r32", "r48", "r64"):
        _write_run(store, dag, name, fractions, state="done")
    hero_steps = [max(1, int(round(g * dag["hero"].derived.num_steps))) for g in fractions[:9]]
    _write_run(store, dag, "hero", fractions[:9], state="running", spike_at=hero_steps[7])
    table = table_from_steps(dag, store, ["r24", "r32", "r48", "r64"])
    forecast = forecast_target(table, target_spec(dag["hero"]), n_bootstrap=5)
    store_forecast(store, forecast, meta={"why": "test"})

    result = CliRunner().invoke(_cli(), ["report", LOCAL, "--out", str(tmp_path / "out"), "--root", root])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "out" / "index.html").read_text()
    _check_offline_page(page)
    tables = _tables(page)
    states = {r["name"][0]: r["state"][1] for r in tables["ladder-table"]}
    assert states == {"r24": "done", "r32": "done", "r48": "done", "r64": "done", "fit": "pending", "hero": "running"}
    mixture = {r["name"][0]: r for r in tables["mixture-table"]}
    r24 = dag["r24"].derived
    switch = int(round(0.8 * r24.num_steps))
    assert f"phase 1: steps {switch:,}-{r24.num_steps:,}" in mixture["r24"]["phases"][0]
    [row] = tables["forecast-table"]
    assert float(row["final_loss"][1]) == pytest.approx(forecast.final_loss) and row["inside_band"][1] is not None
    assert [r["kind"][0] for r in tables["backtest-table"]][0] == "compute"
    spikes = [r for r in tables["alerts-table"] if r["kind"][0] == "loss_spike"]
    assert [(r["run"][0], int(r["step"][1]), r["source"][0]) for r in spikes] == [("hero", hero_steps[7], "metrics")]
    assert 'id="plot-data"' in page and 'class="missing"' not in _section(page, "backtest")


def test_command_exits_2_on_a_target_that_is_not_a_training_step(tmp_path):
    result = CliRunner().invoke(_cli(), ["report", LOCAL, "--out", str(tmp_path / "out"), "--target", "fit"])
    assert result.exit_code == 2 and "'fit' is not a training step" in result.output
    assert not (tmp_path / "out").exists()

