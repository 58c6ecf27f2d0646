"""Specs fail loudly on what users get wrong, and their identity ignores where they run."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from ladder.dag import DAG, TrainStep
from ladder.spec import ExperimentSpec, ResourceSpec, explain_validation_error
from ladder.store import Store
from tests.ladder_helpers import tiny_spec
from trainer.config import DataConfig, MixturePhase, ModelConfig, MoEConfig, SourceConfig, TrainConfig


def _error_text(build) -> str:
    with pytest.raises(ValidationError) as info:
        build()
    return explain_validation_error(info.value)


def test_heads_must_divide_hidden_size():
    text = _error_text(lambda: ModelConfig(hidden_dim=100, num_heads=3))
    assert "num_heads=3 does not divide hidden_dim=100" in text


def test_top_k_cannot_exceed_experts():
    text = _error_text(lambda: MoEConfig(num_experts=4, top_k=8))
    assert "top_k=8 exceeds moe.num_experts=4" in text


@pytest.mark.parametrize("tokens", [0, -5])
def test_tokens_must_be_positive(tokens):
    text = _error_text(lambda: TrainConfig(tokens=tokens))
    assert text == f"train.tokens={tokens} must be > 0"  # its place in the spec, the bad value, the bound


def test_mixture_weights_must_sum_to_one():
    text = _error_text(lambda: MixturePhase(weights={"a": 0.5, "b": 0.6}))
    assert "sum to 1.1, not 1" in text


def test_unknown_field_is_named():
    base = tiny_spec().model_dump()
    base["train"]["learning_rate"] = 1e-3
    text = _error_text(lambda: ExperimentSpec.model_validate(base))
    assert "train.learning_rate: unknown field; it belongs in optimizer.learning_rate" in text


def test_batch_larger_than_budget():
    spec = tiny_spec().model_dump()
    spec["train"]["tokens"] = 100  # batch 8 x seq 32 = 256 tokens per step
    text = _error_text(lambda: ExperimentSpec.model_validate(spec))
    assert "256 tokens per step exceeds train.tokens=100" in text


def test_mixture_names_unknown_source():
    text = _error_text(lambda: DataConfig(sources=[SourceConfig(name="a")], phases=[MixturePhase(weights={"b": 1.0})]))
    assert "unknown sources ['b']" in text


def test_spec_round_trips_through_json_and_exports_schema():
    spec = tiny_spec()
    again = ExperimentSpec.model_validate_json(spec.model_dump_json())
    assert again == spec
    schema = ExperimentSpec.model_json_schema()
    assert schema["additionalProperties"] is False
    assert "description" in schema["properties"]["resources"] or "$ref" in json.dumps(schema["properties"]["resources"])
    assert schema["$defs"]["MoEConfig"]["properties"]["top_k"]["description"]


def _path(spec: ExperimentSpec, root: str) -> str:
    dag = DAG([TrainStep(name="rung", spec=spec)])
    return Store(root).run_dir("rung", dag.fingerprints["rung"]).rsplit("/runs/", 1)[1]


def test_fingerprint_ignores_where_and_how_it_runs(tmp_path):
    base = tiny_spec()
    moved = base.model_copy(update={
        "resources": ResourceSpec(cpus=8, gpus=4, accelerator_type="H100", custom={"fake_accel": 1}, hosts=2,
                                  cpu_devices_per_host=4, max_restarts=5),
        "tags": {"owner": "someone"},
        "train": base.train.model_copy(update={"log_every": 1, "wandb": "online", "eval_every": 3, "checkpoint_every": 7,
                                               "progress": True, "remat": "full", "mesh": {"data": 2}}),
    })
    assert _path(base, str(tmp_path / "a")) == _path(base, str(tmp_path / "a"))
    assert _path(base, str(tmp_path / "a")) == _path(moved, "memory://elsewhere")


@pytest.mark.parametrize(
    "change",
    [
        lambda s: {"optimizer": s.optimizer.model_copy(update={"learning_rate": 1e-3})},
        lambda s: {"train": s.train.model_copy(update={"seed": 1})},
        lambda s: {"train": s.train.model_copy(update={"tokens": s.train.tokens * 2})},
        lambda s: {"train": s.train.model_copy(update={"microbatch_size": s.train.batch_size // 2})},
        lambda s: {"model": s.model.model_copy(update={"moe": s.model.moe.model_copy(update={"top_k": 1})})},
        lambda s: {"data": s.data.model_copy(update={"phases": [MixturePhase(weights={"code": 0.5, "docs": 0.5})]})},
    ],
)
def test_fingerprint_changes_with_what_changes_results(change, tmp_path):
    base = tiny_spec()
    assert _path(base, str(tmp_path)) != _path(base.model_copy(update=change(base)), str(tmp_path))


def test_an_identity_field_added_later_leaves_earlier_fingerprints_alone():
    """`train.microbatch_size` came after runs existed: at its default it is not in the identity, so
    every earlier run keeps its directory and its checkpoints stay compatible."""
    identity = tiny_spec().identity()
    assert "microbatch_size" not in identity["train"]
    assert "microbatch_size" in tiny_spec(train=TrainConfig(tokens=5120, batch_size=8, microbatch_size=4)).identity()["train"]


def test_dependency_fingerprints_propagate():
    from ladder.dag import FunctionStep

    def fn(ctx, n):
        return {"n": n}

    one = DAG([FunctionStep(name="a", fn=fn, config={"n": 1}), FunctionStep(name="b", fn=fn, config={"n": 0}, deps=("a",))])
    two = DAG([FunctionStep(name="a", fn=fn, config={"n": 2}), FunctionStep(name="b", fn=fn, config={"n": 0}, deps=("a",))])
    assert one.fingerprints["b"] != two.fingerprints["b"]
