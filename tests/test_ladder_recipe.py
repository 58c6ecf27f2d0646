"""A target that changes what its rungs all share is named before anything runs and in the stored forecast."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ladder import TrainStep
from ladder.cli import app
from ladder.dag import DAG, FitConfig, build_ladder
from ladder.executor import DependencyInfo, StepContext, StepTask
from ladder.fitting import run_fit_step
from ladder.loader import load_experiment
from ladder.recipe import departures_for, recipe_departures
from ladder.store import Store
from tests.ladder_helpers import tiny_spec
from trainer.config import MoEConfig, ScheduleConfig

REPO = Path(__file__).resolve().parents[1]


def _spec(width: int, *, heads: int = 2, lr: float = 3e-3, **changes):
    base = tiny_spec()
    model = base.model.model_copy(update={"hidden_dim": width, "num_heads": heads, **changes.pop("model", {})})
    optimizer = base.optimizer.model_copy(update={"learning_rate": lr, **changes.pop("optimizer", {})})
    train = base.train.model_copy(update=changes.pop("train", {}))
    return tiny_spec(model=model, optimizer=optimizer, train=train, **changes)


def test_the_shipped_heroes_change_nothing_their_rungs_share_and_a_third_head_is_named():
    local = load_experiment(str(REPO / "experiments" / "local_ladder.py"))
    # what the rungs vary (width, the LR scaled with width, the head dimension two heads give, tokens) is the
    # ladder's axis, not a departure
    assert departures_for(local.dag, "hero") is None
    assert departures_for(load_experiment(str(REPO / "experiments" / "marin_535b.py")).dag, "hero") is None
    rungs = {name: local.dag[name].spec for name in ("r24", "r32", "r48", "r64")}
    hero = local.dag["hero"].spec
    three_heads = hero.model_copy(update={"model": hero.model.model_copy(update={"num_heads": 3})})
    warning = recipe_departures(rungs, "hero", three_heads)
    assert warning is not None and "model.num_heads 3 (every rung: 2)" in warning
    assert "hidden_dim" not in warning and "learning_rate" not in warning


def test_settings_that_change_what_is_learned_are_named_and_execution_settings_are_not():
    rungs = {f"r{w}": _spec(w, lr=3e-3 * 32 / w) for w in (16, 24, 32)}
    same_recipe = _spec(64, lr=1.5e-3, model={"scan_layers": True, "num_layers": 2},
                        train={"tokens": 10 * rungs["r32"].train.tokens, "seed": 7, "remat": "full", "eval_every": 3})
    assert recipe_departures(rungs, "hero", same_recipe) is None
    changed = _spec(64, lr=1.5e-3, optimizer={"schedule": ScheduleConfig(kind="cosine", warmup=0.1)}, train={"batch_size": 16},
                    model={"moe": MoEConfig(num_experts=8, top_k=2, expert_dim=32)})
    warning = recipe_departures(rungs, "hero", changed)
    assert warning.startswith("hero changes what its 3 rungs hold fixed: ")
    for expected in ("optimizer.schedule.warmup 0.1", "train.batch_size 16 (every rung: 8)", "model.moe.num_experts 8 (every rung: 4)"):
        assert expected in warning, warning
    assert recipe_departures({"r16": rungs["r16"]}, "hero", changed) is None  # one rung shares nothing to compare
    # a hero that reads other held-out windows than its rungs (a ladder finished before, a hero started after) is named
    other_windows = _spec(64, lr=1.5e-3, train={"eval_windows": "first"})
    assert "train.eval_windows first (every rung: spread)" in recipe_departures(rungs, "hero", other_windows)
    dense = _spec(64, lr=1.5e-3, model={"moe": None})  # a dense target of MoE rungs: the section, not its fields
    assert recipe_departures(rungs, "hero", dense).startswith("hero changes what its 3 rungs hold fixed: model.moe dense (every rung: MoE).")


def test_plan_warns_before_anything_runs(tmp_path: Path):
    # the quick ladder with the third layer its hero had until 2026-12-07
    experiment = tmp_path / "deeper_hero.py"
    experiment.write_text("from experiments.local_ladder import local_ladder\n"
                          "from experiments.local_ladder_quick import QUICK_RUNGS\n"
                          "steps = local_ladder(QUICK_RUNGS, ('hero-quick', (64, 3)), eval_batches=4)\n")
    result = CliRunner().invoke(app, ["plan", str(experiment), "--root", str(tmp_path / "root"), "--json"])
    assert result.exit_code == 0, result.output
    warnings = json.loads(result.output)["warnings"]
    assert any(w.startswith("hero-quick changes what its 4 rungs hold fixed: model.num_layers 3 (every rung: 2)") for w in warnings)
    shipped = CliRunner().invoke(app, ["plan", str(REPO / "experiments" / "local_ladder_quick.py"), "--root", str(tmp_path / "root"), "--json"])
    assert shipped.exit_code == 0 and not any("hold fixed" in w for w in json.loads(shipped.output)["warnings"])


def test_the_fit_steps_stored_forecast_carries_the_departure(tmp_path: Path):
    rungs = [TrainStep(name=f"r{w}", spec=_spec(w)) for w in (16, 24, 32)]
    dag = DAG(build_ladder(rungs, TrainStep(name="hero", spec=_spec(48, heads=4)), fit=FitConfig(n_bootstrap=20)))
    store = Store(str(tmp_path / "root"))
    deps = {}
    for i, rung in enumerate(rungs):
        run_dir = store.run_dir(rung.name, dag.fingerprints[rung.name])
        n = rung.derived.num_steps
        store.write_json(f"{run_dir}/spec.json", {"name": rung.name, "derived": rung.derived.model_dump()})
        final = 3.0 - 0.3 * i
        lines = [{"step": s, "eval/loss": final * (1 + 0.6 * (1 - s / n) ** 2)} for s in range(2, n + 1, 2)]
        with store.fs.open(f"{run_dir}/metrics.jsonl", "w") as handle:
            handle.write("".join(json.dumps(line) + "\n" for line in lines))
        deps[rung.name] = DependencyInfo(name=rung.name, run_dir=store.url_of(run_dir), result=None)
    fit = dag["fit"]
    fit_dir = store.run_dir("fit", dag.fingerprints["fit"])
    store.fs.makedirs(fit_dir, exist_ok=True)
    task = StepTask(step=fit, fingerprint=dag.fingerprints["fit"], store_url=store.url, owner="test", deps=deps,
                    dependency_fingerprints={}, target=dag["hero"], target_fingerprint=dag.fingerprints["hero"],
                    recipe_warning=departures_for(dag, "hero"))
    context = StepContext(name="fit", fingerprint=task.fingerprint, run_dir=store.url_of(fit_dir), store_url=store.url, deps=deps)
    run_fit_step(fit, context, task, store)
    stored = json.loads((tmp_path / "root" / "forecasts" / "hero" / "1.json").read_text())
    assert any("hero changes what its 3 rungs hold fixed: model.num_heads 4 (every rung: 2)" in w for w in stored["warnings"])
