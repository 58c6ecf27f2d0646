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
| hero-quick |    64 |      3 |       106,432 | 851,968 | 8.8e11  |

The rungs span 38x in compute and the hero is 5.9x the largest rung.

Measured on this 2-core machine (shared with other jobs), from an empty store: `ladder submit
experiments/local_ladder_quick.py` took 1m22s end to end including Ray's start (rungs and fit ~45 s,
hero ~35 s); the fit forecast the hero at 1.6916 [1.2750, 2.1081] and it reached 1.6856 (-0.35%).
`ladder demo --quick` on the finished store: 2-5 s (most of it the report and the figure). On 2026-12-07 (AMD EPYC,
`ladder demo --quick` from an empty store): 74 s, v1 1.8113 [1.3819, 2.3742], actual 1.6851 (-6.97% of the forecast)
with the old eval windows (the first 32 of each source's held-out split); 74 s, v1 2.0354 [1.4967, 2.7681], actual
1.9256 (-5.40%) with 32 windows spread over the split (the held-out loss the ladder now logs).

Its rungs keep the first local recipe's growing depth (2 layers, hero 3), which the full ladder dropped
(see experiments/local_ladder.py). Here a constant depth did not help: rungs of width 16/24/32/40 at 3
layers (final eval 3.131, 2.588, 2.365, 2.187) forecast this same hero at 1.7835 [1.4225, 2.1445], -5.49%
against its 1.6856; the narrowest widths (2 heads of dimension 8-20) still fall more slowly than the
hero's neighbourhood (d ln L / d ln C -0.093 to -0.102 between q24 and q40, -0.157 from q40 to the hero).
"""

from __future__ import annotations

from experiments.local_ladder import local_ladder

QUICK_RUNGS = {"q16": (16, 2), "q24": (24, 2), "q32": (32, 2), "q48": (48, 2)}
QUICK_HERO = ("hero-quick", (64, 3))

# 4 eval batches per source, not the full ladder's 16: an eval costs the same at every size, and these runs are so
# short that 16 made `ladder demo --quick` take 113 s instead of 74 s (one run each, 2026-12-07); the windows are
# spread over the held-out split either way.
QUICK_EVAL_BATCHES = 4

steps = local_ladder(QUICK_RUNGS, QUICK_HERO, eval_batches=QUICK_EVAL_BATCHES)

if __name__ == "__main__":  # `python experiments/local_ladder_quick.py [COMMAND ...]` is `ladder COMMAND experiments/local_ladder_quick.py ...` (default: plan)
    from ladder.cli import run_as_script

    run_as_script(__file__)
