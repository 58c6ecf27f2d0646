# experiments/my_ladder.py
from ladder import ExperimentSpec, ResourceSpec, TrainStep, build_ladder
from trainer.config import ModelConfig, MoEConfig, OptimizerConfig, ScheduleConfig, TrainConfig
from trainer.data import stdlib_data_config


def rung(name: str, width: int, layers: int, tokens_per_param: float = 8.0) -> TrainStep:
    model = ModelConfig(hidden_dim=width, num_layers=layers, num_heads=width // 32, seq_len=128,
                        moe=MoEConfig(num_experts=8, top_k=2, expert_dim=width, num_shared_experts=1))
    spec = ExperimentSpec(
        model=model,
        data=stdlib_data_config(code_weight=0.8),           # the stdlib's code and docs: offline, real text
        optimizer=OptimizerConfig(learning_rate=3e-3, schedule=ScheduleConfig(kind="linear", min_lr_fraction=0.05)),
        train=TrainConfig(tokens=ExperimentSpec.tokens_for(model, tokens_per_param), batch_size=16),
        resources=ResourceSpec(cpus=1),
    )
    return TrainStep(name=name, spec=spec)


steps = build_ladder([rung("r32", 32, 2), rung("r48", 48, 2), rung("r64", 64, 3)], hero=rung("hero", 96, 4))

if __name__ == "__main__":  # `python experiments/readme_example.py [COMMAND ...]` is `ladder COMMAND experiments/readme_example.py ...` (default: plan)
    from ladder.cli import run_as_script

    run_as_script(__file__)
