"""The local ladder's quick variant: the same recipe, smaller shapes, for tests and `ladder demo --quick`.

Built by `experiments.local_ladder.local_ladder` (MoE top-2 of 8 with a shared expert, router-bias
balancing, z-loss, linear schedule with 1% warmup to 5% of peak, the two-phase stdlib mixture, 8 tokens
per active parameter, sequence 128, batch 8); only the widths and depths shrink. Its steps have their own
names (q16..q48, hero-quick), so its run directories and its target's forecast versions never mix with the
full ladder's when both share a store root.

| step       | width | layers | active params | tokens  | FLOPs   |
|------------|------:|-------:|--------------:|--------:|--------:|
| q16        |    16 |      2 |         4,688 |  37,888 | 3.8e9   |
| q24        |    24 |      2 |        10,296 |  81,920 | 1.4e10  |
| q32        |    32 |      2 |        18,080 | 144,384 | 3.7e10  |
| q48        |    48 |      2 |        40,176 | 321,536 | 1.5e11  |
| hero-quick |    80 |      2 |       110,320 | 884,736 | 9.1e11  |

The rungs span 38x in compute and the hero is 6.1x the largest rung. Every step has two layers and two heads: the
ladder varies width alone, as the full one does.

`ladder demo --quick` from an empty store (AMD EPYC, 2026-12-07): 68 s end to end, v1 2.0296 [1.4894, 2.7657],
actual 1.9472 (-4.06% of the forecast, inside the band; with the earlier three-layer hero -5.40%, and -6.97% on the
old eval windows). On the finished store: 2-5 s (most of it the report and the figure).

Until 2026-12-07 the hero had a third layer (width 64, 106,432 active parameters, 8.8e11 FLOPs) where every rung
has two, a departure `ladder plan` and the stored forecast named (ladder/recipe.py). On the same rungs and the
spread eval (AMD EPYC, `bench/bench_local_forecast.py ROOT --experiment ... --target hero-quick --n-bootstrap 50`;
worst eval / MAE / evals in band / median half-width / forecast over actual final - 1, %, auto's blend):
- three layers, width 64 (before): actual 1.9256, v1 2.0354 [1.4967, 2.7681]: 10.67 / 4.75 / 100 / 35.6 / +5.70;
- two layers, width 80 (now: about the same size and distance from the rungs): actual 1.9472, v1 2.0296
  [1.4894, 2.7657]: 9.31 / 3.91 / 100 / 36.1 / +4.23;
- two layers, width 64 (2.8x the largest rung, a shorter extrapolation): actual 2.2114, v1 2.1662: 7.36 / 4.63 /
  100 / 26.0 / -2.05.
At about the same compute the third layer gave a 1.1% lower loss, which the rungs' law could not know; without it
the forecast is closer.
Earlier (old eval windows, rungs of width 16/24/32/40 at 3 layers against the three-layer hero) a constant depth
had not helped (-5.49% against -0.35%); the narrowest widths (2 heads of dimension 8-20) fall more slowly than the
hero's neighbourhood, which is why the quick ladder's forecast stays the less accurate of the two.
"""

from __future__ import annotations

from experiments.local_ladder import local_ladder

QUICK_RUNGS = {"q16": (16, 2), "q24": (24, 2), "q32": (32, 2), "q48": (48, 2)}
QUICK_HERO = ("hero-quick", (80, 2))

# 4 eval batches per source, not the full ladder's 16: an eval costs the same at every size, and these runs are so
# short that 16 made `ladder demo --quick` take 113 s instead of 74 s (one run each, 2026-12-07); the windows are
# spread over the held-out split either way.
QUICK_EVAL_BATCHES = 4

steps = local_ladder(QUICK_RUNGS, QUICK_HERO, eval_batches=QUICK_EVAL_BATCHES)

if __name__ == "__main__":  # `python experiments/local_ladder_quick.py [COMMAND ...]` is `ladder COMMAND experiments/local_ladder_quick.py ...` (default: plan)
    from ladder.cli import run_as_script

    run_as_script(__file__)
