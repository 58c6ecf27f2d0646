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
