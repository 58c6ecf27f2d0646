"""Benchmark: MoE dispatch backends and model FLOP/s of a full train step on this CPU.

Prints, measured side by side in one run:
  1. the ~2M-parameter MoE (d=128, 4 layers, 8 experts top-2, seq 256, byte vocab): steady tokens/s of a
     full train step (loss + grad + AdamW + router-bias update) and model FLOP/s as a fraction of the
     measured f32 matmul peak (trainer.accounting's convention, lm_head included);
  2. capacity dispatch vs the dense all-experts oracle (and ragged_dot) at E=16, k=2, same step.

Usage: .venv/bin/python bench/bench_trainer_dispatch.py [--steps 20] [--batch 16] [--refresh-peak]
Targets (issue 3): fraction of peak >= 0.25, tokens/s >= 5,000, capacity/dense speed-up >= 3x.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

from trainer import accounting, model
from trainer.config import ModelConfig, MoEConfig


def bench_config(num_experts: int, expert_dim: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=256, hidden_dim=128, num_layers=4, num_heads=4, seq_len=256,
        moe=MoEConfig(num_experts=num_experts, top_k=2, expert_dim=expert_dim, capacity_factor=1.25),
    )


def make_train_step(cfg: ModelConfig, dispatch: str):
    optimizer = optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)

    def step(params, opt_state, router_state, batch):
        (loss, aux), grads = jax.value_and_grad(
            lambda p: model.loss_fn(p, router_state, batch, cfg, dispatch=dispatch), has_aux=True
        )(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, model.update_router_state(router_state, aux, cfg), loss

    return optimizer, jax.jit(step, donate_argnums=(0, 1, 2))


class StepRunner:
    """Holds one backend's train state so that backends can be timed step by step, interleaved."""

    def __init__(self, cfg: ModelConfig, dispatch: str, *, batch_size: int):
        self.cfg, self.batch_size = cfg, batch_size
        optimizer, self.step = make_train_step(cfg, dispatch)
        self.params = model.init_params(cfg, jax.random.key(0))
        self.opt_state = optimizer.init(self.params)
        self.router_state = model.init_router_state(cfg)
        self.calls = 0
        for _ in range(2):  # compile + one warm step
            self.run()

    def run(self) -> float:
        """Seconds of one full train step on a fresh batch."""
        batch = jax.random.randint(
            jax.random.key(100 + self.calls), (self.batch_size, self.cfg.seq_len + 1), 0, self.cfg.vocab_size
        )
        batch.block_until_ready()
        self.calls += 1
        start = time.perf_counter()
        self.params, self.opt_state, self.router_state, loss = self.step(
            self.params, self.opt_state, self.router_state, batch
        )
        loss.block_until_ready()
        return time.perf_counter() - start


def median_step_seconds(runners: dict[str, StepRunner], steps: int) -> dict[str, float]:
    """Median step time per runner, taking one step of each in turn so that load changes on a shared
    machine hit every backend alike."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(steps):
        for name, runner in runners.items():
            times[name].append(runner.run())
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--refresh-peak", action="store_true", help="re-measure the CPU matmul peak")
    args = parser.parse_args()

    cached_peak = accounting.cpu_matmul_peak(refresh=args.refresh_peak)
    # The ratio uses a peak measured in this run, before and after the model (the machine may be shared).
    peak_before = accounting.measure_cpu_matmul_peak()

    cfg = bench_config(num_experts=8, expert_dim=128)
    counts = accounting.count_params(cfg)
    tokens_per_step = args.batch * cfg.seq_len
    seconds = median_step_seconds({"capacity": StepRunner(cfg, "capacity", batch_size=args.batch)}, args.steps)["capacity"]
    tps = tokens_per_step / seconds
    flops = accounting.train_flops(cfg, tokens_per_step) / seconds
    peak = max(peak_before, accounting.measure_cpu_matmul_peak())
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; f32 matmul peak measured now {peak / 1e9:.1f} "
          f"GFLOP/s (cached for MFU logging: {cached_peak / 1e9:.1f})")
    print(f"\n[1] d128 L4 E8 k2 seq256 byte vocab: {counts.total / 1e6:.2f}M params "
          f"({counts.active / 1e6:.2f}M active excl. embeddings), batch {args.batch}")
    print(f"    step {seconds * 1e3:.1f} ms  tokens/s {tps:,.0f}  model GFLOP/s {flops / 1e9:.1f}  "
          f"fraction of matmul peak {flops / peak:.3f}")

    cfg16 = bench_config(num_experts=16, expert_dim=128)  # config 1 with 16 experts
    runners = {d: StepRunner(cfg16, d, batch_size=args.batch) for d in ("capacity", "dense", "ragged")}
    results = median_step_seconds(runners, max(5, args.steps // 2))
    print("\n[2] E16 k2 (config 1 with 16 experts), full train step, median ms (backends interleaved):")
    for d, s in results.items():
        print(f"    {d:9s} {s * 1e3:8.1f} ms  tokens/s {tokens_per_step / s:,.0f}")
    print(f"    capacity speed-up vs dense oracle: {results['dense'] / results['capacity']:.2f}x; "
          f"vs ragged_dot: {results['ragged'] / results['capacity']:.2f}x")


if __name__ == "__main__":
    main()
