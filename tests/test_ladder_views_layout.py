"""The views' place in the package: ladder/views/ is imported only by the entry points, and its modules form no circle.

Every import is read from the source (module level and inside functions alike), so a lazy import that
would close a circle or reach up into the views is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

LADDER = Path(__file__).resolve().parents[1] / "ladder"
ENTRY_POINTS = {"ladder.cli", "ladder.demo"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(LADDER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module an import statement in `path` names (relative imports resolved)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)  # `from ladder.views import plots`
    return out


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(LADDER.rglob("*.py"))}


def _is_views(name: str) -> bool:
    return name == "ladder.views" or name.startswith("ladder.views.")


def test_only_the_entry_points_import_the_views():
    offenders = {
        name: sorted(i for i in _imports(path) if _is_views(i))
        for name, path in _modules().items()
        if not _is_views(name) and name not in ENTRY_POINTS
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"modules below the views import them: {offenders}"


def test_the_views_import_each_other_without_a_circle():
    modules = _modules()
    views = {n for n in modules if _is_views(n) and n != "ladder.views"}
    assert {"ladder.views.common", "ladder.views.plots", "ladder.views.html", "ladder.views.png",
            "ladder.views.report", "ladder.views.watch"} <= views
    graph = {n: {i for i in _imports(modules[n]) if i in views and i != n} for n in views}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the circle
    # the shared module is a leaf: it imports no other view
    assert graph["ladder.views.common"] == set()


def test_no_old_flat_view_modules_are_left_in_ladder():
    for old in ("plots", "plot_html", "report", "watch"):
        assert not (LADDER / f"{old}.py").exists(), f"ladder/{old}.py should live in ladder/views/"
    stale = {name: sorted(i for i in _imports(path) if i in {"ladder.plots", "ladder.plot_html", "ladder.report", "ladder.watch"})
             for name, path in _modules().items()}
    assert not {k: v for k, v in stale.items() if v}


def test_the_check_sees_a_circle_and_an_upward_import(tmp_path):
    """The reading of imports finds the two faults these tests guard against (so they can fail)."""
    a = tmp_path / "a.py"
    a.write_text("import os\n\ndef f():\n    from ladder.views import html\n")
    assert "ladder.views.html" in _imports(a) and _is_views("ladder.views.html")
    try:
        graphlib.TopologicalSorter({"x": {"y"}, "y": {"x"}}).prepare()
    except graphlib.CycleError:
        pass
    else:
        raise AssertionError("graphlib did not report a circle")


# ---------------------------------------------------------------- figures that are right at a glance
#
# Three ladders, each drawn by both renderers: Marin's public 535B ladder, a local ladder (experiments/local_ladder.py
# with written run directories: four rungs done, the hero 30% of the way, two forecast versions)
# and a 3-rung ladder with one eval per rung. The PNG is measured with matplotlib's renderer, the HTML page with
# the browser's own boxes (getBoundingClientRect, written into the DOM by a probe and read back with --dump-dom).

import copy  # noqa: E402
import html  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from ladder.views import common  # noqa: E402
from ladder.views.common import CLIP_LABEL, FIT_LABEL, LAW_LABEL, X_COLUMNS  # noqa: E402
from tests.test_ladder_plots import CHROMIUM, CHROMIUM_FLAGS, EXPERIMENT  # noqa: E402
from tests.test_ladder_plots import _write_run as _write_tiny_run  # noqa: E402
from tests.test_ladder_report import LOCAL  # noqa: E402
from tests.test_ladder_report import _write_run as _write_local_run  # noqa: E402

LADDERS = ("marin", "local", "one_eval")
RUNG_ORDER = {"marin": ["d768", "d1024", "d1536", "d2048"], "local": ["r24", "r32", "r48", "r64"], "one_eval": ["r32", "r48", "r64"]}
needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM) and not os.environ.get("CI"),
                                    reason="Debian's chromium is not installed (.ci/run installs it; in CI its absence fails)")


@pytest.fixture(scope="module")
def ladders(tmp_path_factory):
    from forecasting.api import forecast_target
    from ladder.fitting import store_forecast, table_from_steps, target_spec
    from ladder.loader import load_experiment
    from ladder.store import Store
    from ladder.views.plots import marin_public_data, plot_data

    root = tmp_path_factory.mktemp("views_layout")
    # the local ladder: rungs done, the hero at 30%, forecast v1 from three rungs and v2 from all four
    dag = load_experiment(LOCAL).dag
    store = Store(str(root / "local"))
    fractions = np.linspace(0.05, 1.0, 20)
    for name in ("r64", "r24", "r48", "r32"):  # written out of order: the views order by size, not by arrival
        _write_local_run(store, dag, name, fractions, state="done")
    _write_local_run(store, dag, "hero", fractions[:7], state="running")
    target = target_spec(dag["hero"])
    for rungs in (["r24", "r32", "r48"], ["r24", "r32", "r48", "r64"]):  # v1 before r64 was read, v2 with it
        table = table_from_steps(dag, store, rungs)
        store_forecast(store, forecast_target(table, target, method="matched_progress", n_bootstrap=5), meta={"why": "test"})
    local = plot_data(LOCAL, "hero", root=store.url)
    # three rungs with one eval each (their final loss), the hero with three evals and a compute-law forecast
    exp_file = root / "tiny_ladder.py"
    exp_file.write_text(EXPERIMENT)
    tiny = load_experiment(str(exp_file)).dag
    tiny_store = Store(str(root / "one_eval"))
    for name in ("r32", "r48", "r64"):
        _write_tiny_run(tiny_store, tiny, name, [1.0], state="done")
    _write_tiny_run(tiny_store, tiny, "hero", [0.1, 0.2, 0.3], state="running")
    rungs = table_from_steps(tiny, tiny_store, ["r32", "r48", "r64"])
    store_forecast(tiny_store, forecast_target(rungs, target_spec(tiny["hero"]), n_bootstrap=5), meta={"why": "test"})
    one_eval = plot_data(str(exp_file), root=tiny_store.url)
    return {"marin": marin_public_data(), "local": local, "one_eval": one_eval, "local_root": store.url}


def _with_wild_early_band(data):
    """The issue's case: forecast v1 extrapolated backwards to 45 nats before the target's first eval."""
    data = copy.deepcopy(data)
    col = X_COLUMNS["compute"]
    v1 = data.bands["version"] == data.bands["version"].min()
    early = v1 & (data.bands[col] < common.band_from(data, "compute"))
    assert early.sum() >= 2
    data.bands.loc[early, "hi"] = 45.0
    data.bands.loc[early, "lo"] = 0.2
    return data


def _expected_ylim(data, window=None):
    col = X_COLUMNS["compute"]
    inside = (lambda df: df if window is None or df.empty else df[(df[col] >= window[0]) & (df[col] <= window[1])])
    values = [*inside(data.rungs)["loss"], *inside(data.actual)["loss"]]
    for run in data.fits["run"].unique():
        rows = data.fits[data.fits["run"] == run]
        values += list(inside(rows)["loss"]) if common.drawn_line(rows, col) else []
    bands = []
    versions = sorted(data.bands["version"].unique())
    for frame in [common.drawn_band(data, versions[0])] * (len(versions) > 1) + [common.drawn_band(data)]:
        rows = inside(frame)
        rows = rows[rows[col] >= common.band_from(data, "compute")] if len(frame) > 1 else rows
        bands += [*rows["loss"], *rows["lo"], *rows["hi"]]
    return common.y_limits(values, bands)


# ---------------------------------------------------------------- the shared rules


def test_rungs_order_by_size_then_by_natural_name():
    table = pd.DataFrame({"run": ["d1024", "d768", "d2048", "d1536"], "params_active": [162e6, 60e6, 1.17e9, 481e6]})
    assert common.order_runs(table) == ["d768", "d1024", "d1536", "d2048"]
    planned = pd.DataFrame({"run": ["b", "a"], "flops": [1e20, 1e20], "fraction": [0.1, 1.0]})  # b plans 10x more
    assert common.order_runs(planned) == ["a", "b"]
    assert common.order_runs(pd.DataFrame({"run": ["x10", "x9", "x100"]})) == ["x9", "x10", "x100"]


def test_clip_marks_sit_where_a_band_leaves_the_frame():
    x = [1, 2, 3, 4, 5, 6]
    assert common.clip_marks(x, [9, 9, 1, 1, 9, 1], 5, above=True) == [2.0, 5.0]
    assert common.clip_marks(x, [0, 0, 0, 0, 0, 0], 5, above=True) == []
    assert common.clip_marks(x, [0, 0, 0, 0, 0, 0], 1, above=False) == [1.0]  # wholly outside: one mark
    assert common.y_limits([1.0, 2.0], [1.5, 2.5]) == pytest.approx((1.0 - 0.09, 2.5 + 0.09))


@pytest.mark.parametrize("name", LADDERS)
def test_rung_order_and_drawn_fits_in_the_tables(ladders, name):
    data = ladders[name]
    assert data.runs() == RUNG_ORDER[name]
    if name == "one_eval":  # one eval per rung: no curve through a rung, the compute law through all three
        assert list(data.fits["run"].unique()) == ["L(C)"] and common.drawn_line(data.fits, "flops")


# ---------------------------------------------------------------- the PNG


def _png_layout(fig):
    """Boxes (display pixels) of every text a reader sees, and of every plotted marker inside its axes."""
    from matplotlib.lines import Line2D

    from ladder.views.png import tick_labels_drawn

    renderer = fig.canvas.get_renderer()
    texts, points = [], []
    if fig._suptitle is not None:
        texts.append(("suptitle", fig._suptitle.get_window_extent(renderer)))
    for i, ax in enumerate(fig.axes):
        for label in tick_labels_drawn(ax):
            texts.append((f"ax{i} tick {label.get_text()}", label.get_window_extent(renderer)))
        for kind, text in (("xlabel", ax.xaxis.label), ("ylabel", ax.yaxis.label), ("title", ax.title)):
            if text.get_visible() and text.get_text():
                texts.append((f"ax{i} {kind}", text.get_window_extent(renderer)))
        for text in ax.texts:
            texts.append((f"ax{i} text {text.get_text()!r}", text.get_window_extent(renderer)))
        if ax.get_legend() is not None:
            texts.append((f"ax{i} legend", ax.get_legend().get_window_extent(renderer)))
        frame = ax.get_window_extent(renderer)
        for line in ax.get_lines():
            if not isinstance(line, Line2D) or line.get_marker() in (None, "None", "", " ") or not line.get_visible():
                continue
            half = line.get_markersize() * fig.dpi / 72 / 2
            for px, py in ax.transData.transform(np.asarray(line.get_xydata(), float)):
                if np.isfinite(px) and np.isfinite(py) and frame.x0 <= px <= frame.x1 and frame.y0 <= py <= frame.y1:
                    points.append((f"ax{i} {line.get_label()}", (px - half, py - half, px + half, py + half)))
    return texts, points


def _box_overlap(a, b, tol=0.5):
    ax0, ay0, ax1, ay1 = a
    bx0, by0, bx1, by1 = b
    return ax0 < bx1 - tol and bx0 < ax1 - tol and ay0 < by1 - tol and by0 < ay1 - tol


def _extents(box):
    return (box.x0, box.y0, box.x1, box.y1) if hasattr(box, "x0") else box


def _assert_no_overlaps(texts, points):
    texts = [(n, _extents(b)) for n, b in texts]
    clashes = [(a[0], b[0]) for i, a in enumerate(texts) for b in texts[i + 1:] if _box_overlap(a[1], b[1])]
    assert not clashes, clashes
    covered = [(t[0], p[0]) for t in texts for p in points if _box_overlap(t[1], p[1])]
    assert not covered, covered[:10]


def _drawn_artists(ax) -> dict[str, bool]:
    """Each legend label of an axes and whether its artist shows anything inside the axes' limits."""
    from matplotlib.collections import PolyCollection
    from matplotlib.container import ErrorbarContainer

    x0, x1 = sorted(ax.get_xlim())
    y0, y1 = sorted(ax.get_ylim())
    out = {}
    for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
        if isinstance(handle, ErrorbarContainer):
            handle = handle.lines[0]
        if isinstance(handle, PolyCollection):
            xy = np.vstack([p.vertices for p in handle.get_paths()]) if handle.get_paths() else np.empty((0, 2))
        else:
            xy = np.asarray(handle.get_xydata(), float)
        inside = xy[(xy[:, 0] >= x0) & (xy[:, 0] <= x1) & (xy[:, 1] >= y0 - 1e-9) & (xy[:, 1] <= y1 + 1e-9)] if len(xy) else xy
        if label == CLIP_LABEL:  # drawn on the frame's edge, on purpose
            inside = xy[(xy[:, 0] >= x0) & (xy[:, 0] <= x1)]
        is_line = not isinstance(handle, PolyCollection) and handle.get_marker() in (None, "None", "", " ")
        shown = len(np.unique(inside[:, 0])) >= 2 if is_line else len(inside) >= 1
        out[label] = out.get(label, False) or bool(shown)
    return out


@pytest.mark.parametrize("name", LADDERS)
def test_png_legend_lists_only_what_is_drawn_in_size_order_and_nothing_overlaps(ladders, name):
    import matplotlib.pyplot as plt

    from ladder.views.png import figure

    data = ladders[name]
    fig = figure(data)
    try:
        fig.canvas.draw()
        ax_all, ax_zoom, ax_legend, ax_hist, ax_res = fig.axes
        legend = [t.get_text() for t in ax_legend.get_legend().get_texts()]
        drawn = {}
        for ax in (ax_all, ax_zoom):
            for label, shown in _drawn_artists(ax).items():
                drawn[label] = drawn.get(label, False) or shown
        assert legend and set(legend) == set(drawn) and all(drawn.values()), {k: v for k, v in drawn.items() if not v}
        rungs = [t.removeprefix("rung ") for t in legend if t.startswith("rung ")]
        assert rungs == RUNG_ORDER[name]
        assert (FIT_LABEL in legend) == (name != "one_eval") and (LAW_LABEL in legend) == (name == "one_eval")
        assert ax_all.get_ylim() == pytest.approx(_expected_ylim(data), rel=1e-9)
        _assert_no_overlaps(*_png_layout(fig))
    finally:
        plt.close(fig)


def test_png_axes_follow_the_data_and_mark_a_band_that_leaves_the_frame(ladders):
    import matplotlib.pyplot as plt

    from ladder.views.png import figure

    data = _with_wild_early_band(ladders["local"])
    fig = figure(data)
    try:
        ax_all = fig.axes[0]
        low, high = ax_all.get_ylim()
        top = max(data.rungs["loss"].max(), data.actual["loss"].max())
        assert high < top + 0.5 * (top - low) and high < 10  # not pushed to 45 nats
        marks = [line for line in ax_all.get_lines() if line.get_label() == CLIP_LABEL or line.get_marker() in ("^", "v")]
        assert any(line.get_marker() == "^" and np.allclose(line.get_ydata(), high) for line in marks)
        assert CLIP_LABEL in [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    finally:
        plt.close(fig)


# ---------------------------------------------------------------- the HTML page, in the browser

_LAYOUT_PROBE = """<script>
(function(){var out={};
function box(e){var r=e.getBoundingClientRect();return {x:r.left,y:r.top,w:r.width,h:r.height,text:e.textContent};}
document.querySelectorAll("svg[data-panel]").forEach(function(svg){
 var f=svg.querySelector("rect.frame").getBoundingClientRect();
 function all(sel){return Array.prototype.map.call(svg.querySelectorAll(sel),box);}
 var pts=Array.prototype.map.call(svg.querySelectorAll("circle.pt"),box).filter(function(b){var cx=b.x+b.w/2,cy=b.y+b.h/2;
  return cx>=f.left&&cx<=f.right&&cy>=f.top&&cy<=f.bottom;});
 out[svg.getAttribute("data-panel")]={svg:box(svg),frame:box(svg.querySelector("rect.frame")),ticks:all(".tick"),labels:all(".axis-label"),
  title:all(".ptitle"),legend:all(".legend-item"),plabels:all(".plabel"),points:pts,
  yrange:svg.getAttribute("data-yrange").split(",").map(Number),clips:Number(svg.getAttribute("data-clips"))};});
document.body.setAttribute("data-layout",JSON.stringify(out));})();
</script>"""


def _browser_layout(page: str, path) -> dict:
    path.write_text(page.replace("</body>", _LAYOUT_PROBE + "</body>"))
    dom = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, "--window-size=1200,1000", "--virtual-time-budget=3000", "--dump-dom",
                          path.as_uri()], capture_output=True, text=True, timeout=90).stdout
    assert 'data-rendered="4"' in dom and 'class="error"' not in dom, dom[-600:]
    return json.loads(html.unescape(re.search(r'data-layout="([^"]*)"', dom).group(1)))


def _assert_panel_is_clean(panel_id: str, panel: dict) -> None:
    as_box = (lambda b: (b["x"], b["y"], b["x"] + b["w"], b["y"] + b["h"]))
    texts = [(f"{panel_id} {kind} {b['text']!r}", as_box(b)) for kind in ("ticks", "labels", "title", "legend", "plabels")
             for b in panel[kind] if b["w"] > 0]
    points = [(f"{panel_id} point", as_box(b)) for b in panel["points"]]
    _assert_no_overlaps(texts, points)
    svg, frame = as_box(panel["svg"]), as_box(panel["frame"])
    for name, (x0, y0, x1, y1) in texts:  # nothing cut off at the panel's edges
        assert svg[0] - 0.5 <= x0 and x1 <= svg[2] + 0.5 and svg[1] - 0.5 <= y0 and y1 <= svg[3] + 0.5, name
    for b in panel["legend"]:  # the legend sits above the plot area, never on it
        assert b["y"] + b["h"] <= frame[1] + 0.5, b["text"]


@needs_chromium
@pytest.mark.parametrize("name", LADDERS)
def test_html_legend_labels_and_ticks_never_overlap_each_other_or_the_points(ladders, name, tmp_path):
    from ladder.views.html import build_html

    data = ladders[name]
    layout = _browser_layout(build_html(data), tmp_path / f"{name}.html")
    assert set(layout) == {"curves", "zoom", "history", "residuals"}
    for panel_id, panel in layout.items():
        _assert_panel_is_clean(panel_id, panel)
    legend = [b["text"] for b in layout["curves"]["legend"]]
    assert [t.removeprefix("rung ") for t in legend if t.startswith("rung ")] == RUNG_ORDER[name]
    assert (FIT_LABEL in legend) == (name != "one_eval") and (LAW_LABEL in legend) == (name == "one_eval")
    assert layout["curves"]["yrange"] == pytest.approx(_expected_ylim(data), rel=1e-6)
    assert len(layout["curves"]["ticks"]) >= 5 and len(layout["residuals"]["ticks"]) >= (0 if data.residuals.empty else 5)


@needs_chromium
def test_html_axes_follow_the_data_and_mark_a_band_that_leaves_the_frame(ladders, tmp_path):
    from ladder.views.html import build_html

    data = _with_wild_early_band(ladders["local"])
    layout = _browser_layout(build_html(data), tmp_path / "wild.html")
    low, high = layout["curves"]["yrange"]
    assert high < 10 and (low, high) == pytest.approx(_expected_ylim(data), rel=1e-6)
    assert layout["curves"]["clips"] >= 1 and CLIP_LABEL in [b["text"] for b in layout["curves"]["legend"]]
    _assert_panel_is_clean("curves", layout["curves"])
    assert math.isfinite(low)


@needs_chromium
def test_report_charts_are_as_clean_as_the_plot_page_and_list_rungs_by_size(ladders, tmp_path):
    from ladder.views.report import write_report

    page = write_report(LOCAL, str(tmp_path / "report"), root=ladders["local_root"]).read_text()
    backtest = page[page.index('<section id="backtest"'):]
    assert "on 4 runs (r24, r32, r48, r64)" in backtest[: backtest.index("</p>")]
    layout = _browser_layout(page, tmp_path / "report.html")
    for panel_id, panel in layout.items():
        _assert_panel_is_clean(panel_id, panel)
    assert [b["text"].removeprefix("rung ") for b in layout["curves"]["legend"] if b["text"].startswith("rung ")] == RUNG_ORDER["local"]
