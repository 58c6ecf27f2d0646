"""The shared JAX MoE trainer: every rung and the hero run through `trainer.train(job, run_dir)`.

Exports resolve lazily (PEP 562), so ``import trainer`` (or ``trainer.config``) does not import JAX,
and one module that fails to import does not take the others down with it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "train": "trainer.loop",
    "TrainResult": "trainer.loop",
    "TrainingDiverged": "trainer.loop",
    "lr_at_steps": "trainer.optim",
    "read_metrics": "trainer.metrics",
    "apply_resume_markers": "trainer.metrics",
    "TrainJob": "trainer.config",
    "ModelConfig": "trainer.config",
    "MoEConfig": "trainer.config",
    "DataConfig": "trainer.config",
    "SourceConfig": "trainer.config",
    "MixturePhase": "trainer.config",
    "OptimizerConfig": "trainer.config",
    "ScheduleConfig": "trainer.config",
    "TrainConfig": "trainer.config",
    "count_params": "trainer.accounting",
    "forward_flops_per_token": "trainer.accounting",
    "train_flops": "trainer.accounting",
    "peak_flops_per_second": "trainer.accounting",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
