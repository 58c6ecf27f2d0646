"""Small builders shared by the orchestrator tests."""

from __future__ import annotations

from ladder.spec import ExperimentSpec, ResourceSpec
from trainer.config import DataConfig, MixturePhase, ModelConfig, MoEConfig, OptimizerConfig, SourceConfig, TrainConfig


def tiny_spec(**overrides) -> ExperimentSpec:
    """A small but real MoE spec on the built-in corpora; `overrides` replace whole sections."""
    sections = dict(
        model=ModelConfig(hidden_dim=32, num_layers=2, num_heads=2, seq_len=32, moe=MoEConfig(num_experts=4, top_k=2, expert_dim=32)),
        data=DataConfig(
            sources=[SourceConfig(name="code", kind="stdlib_code"), SourceConfig(name="docs", kind="stdlib_docs")],
            phases=[MixturePhase(weights={"code": 0.7, "docs": 0.3})],
            max_tokens_per_source=200_000,
        ),
        optimizer=OptimizerConfig(learning_rate=3e-3),
        train=TrainConfig(tokens=32 * 8 * 20, batch_size=8, eval_every=10, checkpoint_every=10, progress=False, wandb="disabled"),
        resources=ResourceSpec(cpus=1),
    )
    sections.update(overrides)
    return ExperimentSpec(**sections)
