"""The public data ships inside the package, every file has its provenance, and nothing points outside the project.

Why: a user's clone (or an installed wheel) holds only what the project ships. These tests fail when a data
file lacks a provenance row, when a provenance row names a file that is not there, when the package-data
globs would leave a file out of the wheel, or when a tracked file points at a folder beside the repository.
"""

from __future__ import annotations

import fnmatch
import itertools
import re
import subprocess
import tomllib
from pathlib import Path, PurePosixPath

import pytest

import forecasting
from forecasting.public_data import MARIN_HERO, chinchilla_points, data_dir, marin_ladder

REPO = Path(__file__).resolve().parents[1]
PROVENANCE = "PROVENANCE.md"


def _expand_braces(pattern: str) -> list[str]:
    """`a/{x,y}/*.csv` -> [`a/x/*.csv`, `a/y/*.csv`] (one level of braces per group, as a shell does)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _provenance_paths() -> list[str]:
    """The backticked paths in the first column of PROVENANCE.md's table."""
    rows = [line for line in (data_dir() / PROVENANCE).read_text().splitlines() if line.startswith("| `")]
    return [p for row in rows for p in re.findall(r"`([^`]+)`", row.split("|")[1])]


def _data_files() -> list[str]:
    root = data_dir()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def test_data_dir_is_the_package_folder():
    assert data_dir() == Path(forecasting.__file__).resolve().parent / "data"
    assert (data_dir() / PROVENANCE).is_file()


def test_every_provenance_row_names_existing_files_and_every_file_has_a_row():
    listed = _provenance_paths()
    assert len(listed) >= 10
    covered: set[str] = set()
    for entry in listed:
        matches = [f for pattern in _expand_braces(entry) for f in sorted(p.relative_to(data_dir()).as_posix()
                                                                          for p in data_dir().glob(pattern) if p.is_file())]
        assert matches, f"PROVENANCE.md lists {entry!r}, but no such file is under {data_dir()}"
        covered.update(matches)
    unlisted = [f for f in _data_files() if f != PROVENANCE and f not in covered]
    assert not unlisted, f"data files without a provenance row in PROVENANCE.md: {unlisted}"


def test_data_folder_holds_data_files_only():
    suffixes = {PurePosixPath(f).suffix for f in _data_files()}
    assert suffixes <= {".csv", ".json", ".md"}, suffixes


def test_package_data_globs_put_every_data_file_in_the_wheel():
    """setuptools matches each package-data glob against paths relative to the package, one part per `*`."""
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["forecasting"]

    def shipped(rel: str) -> bool:
        parts = PurePosixPath(rel).parts
        return any(len(g.split("/")) == len(parts) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, g.split("/")))
                   for g in globs)

    missed = [f for f in _data_files() if not shipped(f"data/{f}")]
    assert not missed, f"pyproject.toml [tool.setuptools.package-data] leaves these out of the wheel: {missed}"


def test_loaders_read_the_shipped_data():
    chin = chinchilla_points(data_dir() / "chinchilla_svg_extracted_data.csv")
    assert len(chin) == 240  # 245 points, the 5 highest losses dropped (Epoch)
    table, hero, observed = marin_ladder(data_dir() / "marin_535b_ladder")
    assert sorted(table["run"].unique()) == ["d1024", "d1536", "d2048", "d768"]
    assert hero["name"] == MARIN_HERO and hero["num_steps"] == 390_251
    assert observed["step"].min() > 0 and observed["step"].max() == 38_999


# Built by concatenation so that this file does not match itself.
FORBIDDEN = ("../" + "shared", "shared" + "/data", "shared" + "/reference", "LADDER_" + "SHARED_DATA")


def test_no_tracked_file_points_outside_the_project():
    """A user's clone has no folder beside it; no code, test, doc or CI file may point at one."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"not a git checkout ({error}); the guard runs in a clone")
    files = [f for f in out.decode().split("\0") if f and not f.startswith(("forecasting/data/", "docs/"))]
    assert len(files) > 20
    hits = []
    for rel in files:
        path = REPO / rel
        if not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            hits += [f"{rel}:{lineno}: {s}" for s in FORBIDDEN if s in line]
    assert not hits, "tracked files point outside the project:\n" + "\n".join(hits)
