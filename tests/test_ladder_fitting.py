"""The orchestrator's side of forecasting: run directories as tables, targets from specs, stored versions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ladder import TrainStep
from ladder.dag import DAG, build_ladder
from ladder.fitting import FitInputError, load_forecast, store_forecast, table_from_steps, target_spec
from ladder.store import Store
from tests.ladder_helpers import tiny_spec


def _write_run(store: Store, dag: DAG, name: str, lines: list[dict], state: str = "done") -> None:
    run_dir = store.run_dir(name, dag.fingerprints[name])
    step = dag[name]
    store.write_json(f"{run_dir}/spec.json", {"name": name, "derived": step.derived.model_dump()})
    with store.fs.open(f"{run_dir}/metrics.jsonl", "w") as handle:
        handle.write("".join(json.dumps(line) + "\n" for line in lines))
    store.acquire_lease(run_dir, "writer")
    store.finish(run_dir, "writer", state)


def _ladder() -> DAG:
    rungs = [TrainStep(name=f"r{i}", spec=tiny_spec(train=tiny_spec().train.model_copy(update={"seed": i}))) for i in range(3)]
    return DAG(build_ladder(rungs, TrainStep(name="hero", spec=tiny_spec())))


def test_resumed_runs_load_without_duplicated_steps(tmp_path):
    dag = _ladder()
    store = Store(str(tmp_path))
    lines = [{"step": 10, "tokens": 10, "flops": 1e9, "eval/loss": 4.0}, {"step": 20, "tokens": 20, "flops": 2e9, "eval/loss": 3.5},
             {"event": "resume", "step": 10}, {"step": 20, "tokens": 20, "flops": 2e9, "eval/loss": 3.4}]
    for name in ("r0", "r1", "r2"):
        _write_run(store, dag, name, lines)
    table = table_from_steps(dag, store, ["r0", "r1", "r2"])
    assert len(table) == 6
    assert sorted(table[table["run"] == "r0"]["loss"]) == [3.4, 4.0]


def test_fit_refuses_unfinished_runs(tmp_path):
    dag = _ladder()
    store = Store(str(tmp_path))
    _write_run(store, dag, "r0", [{"step": 10, "eval/loss": 4.0}])
    _write_run(store, dag, "r1", [{"step": 10, "eval/loss": 4.0}], state="failed")
    with pytest.raises(FitInputError, match=r"r1 \(failed\), r2 \(not started\)"):
        table_from_steps(dag, store, ["r0", "r1", "r2"])


def test_target_spec_carries_the_schedule_and_flops(tmp_path):
    dag = _ladder()
    target = target_spec(dag["hero"])
    derived = dag["hero"].derived
    assert target.num_steps == derived.num_steps and len(target.lr) == derived.num_steps
    assert target.planned_flops() == pytest.approx(derived.total_flops)
    peak = tiny_spec().optimizer.learning_rate
    assert 0.9 * peak < max(target.lr) <= peak and target.lr[-1] < target.lr[len(target.lr) // 2]


def test_forecasts_are_versioned_and_round_trip(tmp_path):
    from forecasting.forecast import Forecast

    dag = _ladder()
    store = Store(str(tmp_path))
    forecast = Forecast(target=target_spec(dag["hero"]), method="compute", inputs_fingerprint="x", final_loss=2.0,
                        final_loss_lo=1.9, final_loss_hi=2.1, law="L = E + A C^-a")
    assert store_forecast(store, forecast, meta={"why": "test"}) == 1
    assert store_forecast(store, forecast, meta={"why": "again"}) == 1  # the same forecast is not filed twice
    changed = forecast.model_copy(update={"final_loss": 1.95})
    assert store_forecast(store, changed, meta={"why": "test"}) == 2 and store.list_forecasts("hero") == [1, 2]
    again = load_forecast(store, "hero", 1)
    assert again.final_loss == 2.0 and again.version == 1
    assert store.read_forecast("hero", 2)["ladder"] == {"why": "test"}
