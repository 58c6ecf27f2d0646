"""A table that holds several ladders (two corpora, two recipes) at the same sizes and tokens: the forecast says so and
names the column, and `--where` / `select_rows` forecasts one of them; columns that do not split the ladder are not
reported."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from forecasting import api
from forecasting.forecast import TargetSpec
from forecasting.table import TableError, mixed_groups, select_rows
from ladder.cli import app

SIZES = (2e7, 4e7, 8e7, 1.6e8, 3.2e8)
RATIOS = (5, 10, 20, 40, 80)


def _loss(n: float, d: float, e: float) -> float:
    """A Chinchilla-shaped surface; the two corpora differ in their irreducible loss."""
    return e + 400.0 / n**0.34 + 2000.0 / d**0.36


def _ladder(corpus_e: dict[str, float], *, seed: int = 0, noise: float = 0.002) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for corpus, e in corpus_e.items():
        for n in SIZES:
            for ratio in RATIOS:
                d = n * ratio
                rows.append({"run": f"{corpus}/N={n:.3g}/D={d:.3g}", "step": 1, "loss": _loss(n, d, e) * (1 + noise * rng.standard_normal()),
                             "params_active": n, "tokens": d, "flops": 6 * n * d, "corpus": corpus})
    return pd.DataFrame(rows)


TARGET = TargetSpec(name="big", params_active=1.28e9, tokens=1.28e9 * 20)


def test_two_corpora_in_one_table_are_named_and_selecting_one_forecasts_it():
    table = _ladder({"web": 1.9, "code": 1.6})
    mixed = api.forecast_target(table, TARGET, method="chinchilla", n_bootstrap=20)
    warning = next(w for w in mixed.warnings if "'corpus'" in w)
    assert "code: 25 runs, web: 25 runs" in warning and "--where corpus=VALUE" in warning
    gap = mixed_groups(table)[0]["median_gap"]
    assert 0.08 < gap < 0.2 and f"{gap:.1%}" in warning

    web = select_rows(table, {"corpus": "web"})
    assert set(web["corpus"]) == {"web"} and len(web) == 25
    alone = api.forecast_target(web, TARGET, method="chinchilla", n_bootstrap=20)
    assert not any("'corpus'" in w for w in alone.warnings)
    truth = _loss(TARGET.params_active, TARGET.tokens, 1.9)
    # one corpus's ladder forecasts its target; the mixed fit lands between the corpora
    assert abs(alone.final_loss / truth - 1) < 0.01
    assert abs(mixed.final_loss / truth - 1) > 3 * abs(alone.final_loss / truth - 1)


def test_columns_that_do_not_split_the_ladder_are_not_reported():
    table = _ladder({"web": 1.9})
    table["size"] = table["params_active"].map(lambda n: f"{n / 1e6:.0f}M")  # a label of a column the laws read
    table["seed"] = np.where(np.arange(len(table)) % 2 == 0, "s0", "s1")  # no runs of equal inputs to compare
    assert mixed_groups(table) == []
    # two seeds of every run: equal inputs, losses within noise
    seeds = pd.concat([_ladder({"web": 1.9}, seed=0).assign(seed="s0"), _ladder({"web": 1.9}, seed=1).assign(seed="s1")])
    seeds["run"] = seeds["run"] + "/" + seeds["seed"]
    assert mixed_groups(seeds) == []
    # two schedules whose logged LR tells them apart: the curve laws read it
    schedules = _ladder({"cosine": 1.9, "constant": 1.95}).rename(columns={"corpus": "schedule"})
    schedules["lr"] = np.where(schedules["schedule"] == "cosine", 1e-4, 1e-3)
    assert mixed_groups(schedules) == []
    assert [g["column"] for g in mixed_groups(schedules.drop(columns=["lr"]))] == ["schedule"]


def test_select_rows_names_what_exists_when_nothing_matches():
    table = _ladder({"web": 1.9, "code": 1.6})
    with pytest.raises(TableError, match=r"no column 'corpora' to select on; the table's other columns: \['corpus'\]"):
        select_rows(table, {"corpora": "web"})
    with pytest.raises(TableError, match=r"no row has corpus = 'books'; its values: code, web"):
        select_rows(table, {"corpus": "books"})
    assert len(select_rows(table, {"corpus": "code", "params_active": "8e7"})) == 5  # a number column compares as one
    with pytest.raises(TableError, match="holds numbers"):
        select_rows(table, {"params_active": "large"})


def test_cli_where_selects_the_rows_and_refuses_what_it_cannot_apply(tmp_path):
    path = tmp_path / "runs.csv"
    _ladder({"web": 1.9, "code": 1.6}).to_csv(path, index=False)
    runner = CliRunner()
    base = ["forecast", str(path), "--params-active", "1.28e9", "--tokens", "2.56e10", "--method", "chinchilla",
            "--n-bootstrap", "20", "--json"]
    mixed = json.loads(runner.invoke(app, base).stdout)
    assert any("'corpus'" in w for w in mixed["warnings"])
    picked = runner.invoke(app, [*base, "--where", "corpus=web"])
    assert picked.exit_code == 0, picked.output
    web = json.loads(picked.stdout)
    expected = api.forecast_target(select_rows(api.load_table(str(path)), {"corpus": "web"}), TARGET, method="chinchilla", n_bootstrap=20)
    assert web["final_loss"] == pytest.approx(expected.final_loss, rel=1e-9) and not any("'corpus'" in w for w in web["warnings"])

    bad = runner.invoke(app, [*base, "--where", "corpus"])
    assert bad.exit_code == 2 and "--where takes COLUMN=VALUE; got 'corpus'" in bad.output
    missing = runner.invoke(app, ["backtest", str(path), "--where", "corpus=books"])
    assert missing.exit_code != 0 and "no row has corpus = 'books'; its values: code, web" in missing.output
    experiment = runner.invoke(app, ["fit", "experiments/readme_example.py", "--where", "corpus=web"])
    assert experiment.exit_code == 2 and "--where selects rows of a table of runs" in experiment.output
