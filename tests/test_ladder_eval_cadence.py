"""Default eval cadence follows a run's length, and `ladder plan` warns before a rung logs too few evals to fit."""

from pathlib import Path

from typer.testing import CliRunner

from ladder.cli import app
from trainer.config import eval_interval, evals_logged

EXPERIMENT = '''
from ladder import ExperimentSpec, ResourceSpec, TrainStep, build_ladder
from trainer.config import ModelConfig, MoEConfig, OptimizerConfig, ScheduleConfig, TrainConfig
from trainer.data import stdlib_data_config


def rung(name, width, every):
    model = ModelConfig(hidden_dim=width, num_layers=2, num_heads=1, seq_len=128,
                        moe=MoEConfig(num_experts=8, top_k=2, expert_dim=width, num_shared_experts=1))
    spec = ExperimentSpec(model=model, data=stdlib_data_config(code_weight=0.8),
                          optimizer=OptimizerConfig(learning_rate=3e-3, schedule=ScheduleConfig(kind="cosine")),
                          train=TrainConfig(tokens=ExperimentSpec.tokens_for(model, 8.0), batch_size=16, eval_every=every),
                          resources=ResourceSpec(cpus=1))
    return TrainStep(name=name, spec=spec)


steps = build_ladder([rung("r16", 16, 100), rung("r24", 24, None), rung("r32", 32, None)], hero=rung("hero", 48, None))
'''


def test_default_cadence_gives_tens_of_evals_whatever_the_length():
    for steps in (27, 60, 300, 3_000, 390_000):
        assert 10 <= evals_logged(None, steps) <= 30, steps
    assert eval_interval(100, 300) == 100 and evals_logged(100, 300) == 3
    assert evals_logged(100, 250) == 3  # every 100 steps and the last one


def test_plan_warns_about_a_rung_that_will_log_too_few_evals(tmp_path: Path):
    exp = tmp_path / "few_evals.py"
    exp.write_text(EXPERIMENT)
    result = CliRunner().invoke(app, ["plan", str(exp), "--root", str(tmp_path / "root")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "r16 will log only 1 eval(s)" in text and "lower train.eval_every" in text
    assert "r24 will log" not in text and "r32 will log" not in text
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").rglob("*.json"))  # plan writes nothing
