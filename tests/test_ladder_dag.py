"""The DAG rejects what cannot run and wires a ladder in one call."""

from __future__ import annotations

import pytest

from ladder.dag import DAG, DagError, FitStep, FunctionStep, TrainStep, build_ladder
from ladder.loader import ExperimentError, load_experiment
from tests.ladder_helpers import tiny_spec


def noop(ctx):
    return {}


def test_cycle_is_named():
    steps = [FunctionStep(name="a", fn=noop, deps=("c",)), FunctionStep(name="b", fn=noop, deps=("a",)), FunctionStep(name="c", fn=noop, deps=("b",))]
    with pytest.raises(DagError, match=r"cycle: (a|b|c) -> .* -> (a|b|c)"):
        DAG(steps)


def test_duplicate_names_rejected():
    with pytest.raises(DagError, match="two steps are named 'a'"):
        DAG([FunctionStep(name="a", fn=noop), FunctionStep(name="a", fn=noop, version="2")])


def test_unknown_dependency_rejected():
    with pytest.raises(DagError, match="depends on 'missing', which is not a step"):
        DAG([FunctionStep(name="a", fn=noop, deps=("missing",))])


def test_bad_name_rejected():
    with pytest.raises(DagError, match="not allowed"):
        FunctionStep(name="has space", fn=noop)


def test_build_ladder_wires_rungs_fit_hero():
    rungs = [TrainStep(name=f"r{i}", spec=tiny_spec(train=tiny_spec().train.model_copy(update={"seed": i}))) for i in range(3)]
    hero = TrainStep(name="hero", spec=tiny_spec())
    dag = DAG(build_ladder(rungs, hero))
    assert dag.order[:3] == ["r0", "r1", "r2"]
    assert dag.order[3:] == ["fit", "hero"]
    assert dag["fit"].deps == ("r0", "r1", "r2") and dag["fit"].target == "hero"
    assert dag.waits_for("hero") == ("fit",)
    # ordering-only: the forecast must not fork the hero's run directory
    alone = DAG([*rungs, TrainStep(name="hero", spec=tiny_spec())])
    assert alone.fingerprints["hero"] == dag.fingerprints["hero"]
    assert dag.upstream(["fit"]) == ["r0", "r1", "r2", "fit"]


def test_fit_needs_two_runs_and_a_train_target():
    with pytest.raises(DagError, match="at least 2"):
        FitStep(name="fit", deps=("a",), target="hero")
    with pytest.raises(DagError, match="not a TrainStep"):
        DAG([FunctionStep(name="a", fn=noop), FunctionStep(name="b", fn=noop), FitStep(name="fit", deps=("a", "b"), target="b")])


def test_loader_reads_file_and_module(tmp_path):
    path = tmp_path / "exp.py"
    path.write_text(
        "from ladder.dag import FunctionStep\n"
        "def f(ctx):\n    return {}\n"
        "steps = [FunctionStep(name='x', fn=f), FunctionStep(name='y', fn=f, deps=('x',))]\n"
    )
    exp = load_experiment(str(path))
    assert exp.dag.order == ["x", "y"]


def test_loader_errors_are_clear(tmp_path):
    with pytest.raises(ExperimentError, match="does not exist"):
        load_experiment(str(tmp_path / "nope.py"))
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ExperimentError, match="defines no steps"):
        load_experiment(str(empty))
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from ladder.spec import ExperimentSpec\n"
        "from tests.ladder_helpers import tiny_spec\n"
        "d = tiny_spec().model_dump(); d['model']['num_heads'] = 3\n"
        "spec = ExperimentSpec.model_validate(d)\n"
    )
    with pytest.raises(ExperimentError, match=r"bad.py line 4 builds an invalid spec: model: num_heads=3 does not divide hidden_dim=32"):
        load_experiment(str(bad))
    with pytest.raises(ExperimentError, match="no experiment module named"):
        load_experiment("experiments.does_not_exist")
