"""The local ladder's top rung and hero again at other seeds: how far a run's final eval moves with its seed alone.

A forecast of one run's loss cannot be closer than that run's own seed-to-seed spread, so this is the floor under
the local ladder's final-loss bar (within 1% of the hero) and the scale of `forecasting.final_laws.NOISE_FLOOR`.
Each step is `experiments.local_ladder`'s spec with only `train.seed` changed (the ladder's own runs are seed 0),
and none depends on another, so they run side by side:

    ladder submit experiments/local_ladder_seeds.py --root ROOT

Measured on an AMD EPYC host, 2026-12-07 (final eval loss; seed 0 from `ladder demo` on the same host, the same
code): r64 1.7402 / 1.7531 / 1.7144 (seeds 0 / 1 / 2: standard deviation 1.1% of the mean), hero 1.4609 / 1.4624 /
1.4325 (1.2%). v1 of that demo root, 1.4333, is -1.9%, -2.0% and +0.1% off the three heroes, -1.3% off their mean.
"""

from __future__ import annotations

from experiments.local_ladder import HERO, RUNGS, local_spec
from ladder import TrainStep

SEEDS = (1, 2)
REPLICATED = {"r64": RUNGS["r64"], HERO[0]: HERO[1]}


def at_seed(name: str, shape: tuple[int, int], seed: int) -> TrainStep:
    """`name`'s spec from the local ladder with `train.seed` = `seed`, as step `<name>_s<seed>`."""
    spec = local_spec(*shape)
    return TrainStep(name=f"{name}_s{seed}", spec=spec.model_copy(update={"train": spec.train.model_copy(update={"seed": seed})}))


steps = [at_seed(name, shape, seed) for name, shape in REPLICATED.items() for seed in SEEDS]

if __name__ == "__main__":  # `python experiments/local_ladder_seeds.py [COMMAND ...]` is `ladder COMMAND experiments/local_ladder_seeds.py ...`
    from ladder.cli import run_as_script

    run_as_script(__file__)
