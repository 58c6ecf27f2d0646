"""Marin's recipe against the local ladder's AdamW recipe at equal compute: loss, stability, router-bias norm.

    .venv/bin/python bench/bench_marin_recipe.py ROOT [--widths 24,32,48]

For each width of the local ladder (experiments/local_ladder.py: 4 layers, 8 experts top-2 with one
shared expert, bias balancing, AdamW at 3e-3 * sqrt(64 / width), linear schedule, 8 tokens per active
parameter) three runs are trained in this process, one after the other, on the same data:

- ``adamw``: the local ladder's rung as shipped;
- ``muonh``: the same model and tokens with Marin's optimizer only (MuonH / AdamH / Adam, LRs from Marin's
  heuristic of tokens, width and tokens per step; no weight decay, no clipping: ``marin_535b.marin_optimizer``);
- ``marin``: Marin's whole recipe at this width and depth: its block (GatedNorm rank 8, short convs,
  q/k RMS with qk_mult 1.3, half-RoPE on local layers, XSA, head gate, window 64 with every 4th layer
  global), LatentMoE d/2 with two shared experts, quantile balancing, capacity 1.15, and Marin's optimizer,
  with the tokens cut so its FLOPs (trainer.accounting, lm_head included) equal the adamw run's.

Per run: final dropless eval loss; stability as the largest grad norm after warmup and the largest rise
of the logged train loss between consecutive logs (a spike), and non-finite steps; the router-bias norm
(``params/norm/router_bias``) at the end. Run directories stay under ROOT (a rerun reuses finished runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np

from experiments import local_ladder, marin_535b as marin
from trainer import accounting
from trainer.loop import train
from trainer.metrics import read_metrics


def specs(width: int) -> dict:
    base = local_ladder.local_spec(width, 4)
    base = base.model_copy(update={"train": base.train.model_copy(update={"wandb": "disabled"})})
    tokens_per_step = base.train.batch_size * base.model.seq_len
    steps = base.derived().num_steps
    adam = marin.adam_lr(base.train.tokens, width, tokens_per_step)
    optimizer = marin.marin_optimizer(marin.muonh_lr_for(adam), adam, steps=steps, tokens_per_step=tokens_per_step)
    optimizer = optimizer.model_copy(update={"ns_dtype": "float32"})
    muonh = base.model_copy(update={"optimizer": optimizer})

    m = base.model
    block = m.model_copy(update=dict(
        sliding_window=64, global_every=4, gated_norm_rank=8, embed_norm=True, sconv_kernel=4,
        sconv_sites=("k", "attn", "mlp"), qk_norm=True, qk_mult=1.3, rope_global_layers=False, rope_fraction=0.5,
        xsa=True, head_gate=True, kv_heads_layout="stored_max",
        moe=m.moe.model_copy(update=dict(latent_dim=width // 2, latent_norm=True, num_shared_experts=2,
                                         balancing="quantile", capacity_factor=marin.CAPACITY_FACTOR)),
    ))
    fpt_base = base.derived().flops_per_token
    probe = base.model_copy(update={"model": block})
    fpt_marin = probe.derived().flops_per_token
    marin_steps = max(1, round(base.train.tokens * fpt_base / fpt_marin / tokens_per_step))
    marin_tokens = marin_steps * tokens_per_step
    adam_m = marin.adam_lr(marin_tokens, width, tokens_per_step)
    opt_m = marin.marin_optimizer(marin.muonh_lr_for(adam_m), adam_m, steps=marin_steps, tokens_per_step=tokens_per_step)
    full = base.model_copy(update={
        "model": block,
        "optimizer": opt_m.model_copy(update={"ns_dtype": "float32"}),
        "train": base.train.model_copy(update={
            "tokens": marin_tokens,
            "eval_every": max(1, marin_steps // local_ladder.EVALS_PER_RUN),
            "log_every": max(1, marin_steps // 100),
            "checkpoint_every": max(1, marin_steps // 4),
        }),
    })
    return {"adamw": base, "muonh": muonh, "marin": full}


def summarise(run_dir: str, spec) -> dict:
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    trains = [r for r in rows if r.get("train/loss") is not None]
    evals = [r for r in rows if isinstance(r.get("eval/loss"), float)]
    warm = max(1, round(0.01 * spec.derived().num_steps))
    losses = [r["train/loss"] for r in trains]
    rises = [b - a for a, b in zip(losses, losses[1:])]
    last = trains[-1]
    return {
        "steps": spec.derived().num_steps,
        "flops": spec.derived().flops_per_token * spec.train.tokens,
        "final_eval": evals[-1]["eval/loss"],
        "max_grad_norm": max(r["grad/norm/total"] for r in trains if r["step"] > warm),
        "max_loss_rise": max(rises) if rises else 0.0,
        "nonfinite": sum(1 for r in rows if "train/nonfinite" in r),
        "router_bias_norm": last.get("params/norm/router_bias"),
        "lr": spec.optimizer.learning_rate,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--widths", default="24,32,48")
    args = ap.parse_args()
    results = []
    for width in [int(w) for w in args.widths.split(",")]:
        for arm, spec in specs(width).items():
            run_dir = os.path.join(args.root, f"w{width}-{arm}")
            train(spec.job(), run_dir)
            results.append({"width": width, "arm": arm, **summarise(run_dir, spec)})
            print(json.dumps(results[-1]), flush=True)
    print("| width | recipe | steps | FLOPs | peak LR | final eval loss | vs adamw | max grad norm | max loss rise | non-finite | router-bias norm |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ref = next(x for x in results if x["width"] == r["width"] and x["arm"] == "adamw")
        print(f"| {r['width']} | {r['arm']} | {r['steps']} | {r['flops']:.3g} | {r['lr']:.4g} | {r['final_eval']:.4f} | "
              f"{100 * (r['final_eval'] / ref['final_eval'] - 1):+.2f}% | {r['max_grad_norm']:.3g} | {r['max_loss_rise']:.3f} | "
              f"{r['nonfinite']} | {r['router_bias_norm'] if r['router_bias_norm'] is None else format(r['router_bias_norm'], '.3g')} |")


if __name__ == "__main__":
    main()
