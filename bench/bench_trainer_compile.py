"""Compile time of the loss-and-gradient program: layers under ``lax.scan`` against the unrolled loop.

    .venv/bin/python bench/bench_trainer_compile.py [--layers 4 16 32] [--repeats 2]

Model: a Marin-shaped MoE at toy width (d=64, 4 heads, local layers with 2 KV heads in a 32-token window,
every 4th layer and the last global with 1 KV head, the first 2 layers dense, E=8 top-2, seq 128, batch 8),
remat "full" as a hero runs. For each depth it lowers and compiles ``jax.value_and_grad(model.loss_fn)``
(the bulk of the train step) three ways, interleaved within one run so drift hits all alike:

- unrolled: today's Python loop over per-layer params;
- scan: ``ModelConfig.scan_layers`` with the stacked param layout (what the trainer runs);
- stack-in-step: per-layer params stacked inside the jitted program, then scanned (the alternative to a
  stacked layout: no checkpoint change, but every weight is copied on every step; its cost shows in
  XLA's temp bytes).

Prints compile seconds (median of ``--repeats``, each in a fresh jit with the persistent cache off),
XLA temp bytes, and the ratios unrolled / scan. Timing is in-process wall time of lower() + compile().
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

jax.config.update("jax_enable_compilation_cache", False)

import jax.numpy as jnp  # noqa: E402

from trainer import model  # noqa: E402
from trainer.config import ModelConfig, MoEConfig  # noqa: E402

BATCH, SEQ = 8, 128


def config(layers: int, scan: bool) -> ModelConfig:
    return ModelConfig(
        hidden_dim=64, num_layers=layers, num_heads=4, num_kv_heads=2, global_kv_heads=1, sliding_window=32,
        global_every=4, seq_len=SEQ, scan_layers=scan,
        moe=MoEConfig(num_experts=8, top_k=2, expert_dim=64, num_dense_layers=2),
    )


def compile_once(layers: int, variant: str) -> tuple[float, int]:
    cfg = config(layers, scan=variant != "unrolled")
    params_cfg = cfg if variant == "scan" else config(layers, scan=False)
    params = jax.eval_shape(lambda k: model.init_params(params_cfg, k), jax.random.key(0))
    router = jax.eval_shape(lambda: model.init_router_state(cfg))
    batch = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)

    def loss(p, r, b):
        if variant == "stack-in-step":
            p = model.stack_params(p, cfg)
        return model.loss_fn(p, r, b, cfg, remat="full")

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options={"xla_disable_hlo_passes": "cse_barrier_expander"})
    start = time.perf_counter()
    compiled = fn.lower(params, router, batch).compile()
    seconds = time.perf_counter() - start
    return seconds, int(compiled.memory_analysis().temp_size_in_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stack-in-step-at", type=int, default=16, help="Depth at which stack-in-step is also measured.")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, d=64 E=8 seq {SEQ} batch {BATCH}, remat full")
    results: dict[tuple[int, str], list[tuple[float, int]]] = {}
    for _ in range(args.repeats):
        for layers in args.layers:
            variants = ["unrolled", "scan"] + (["stack-in-step"] if layers == args.stack_in_step_at else [])
            for variant in variants:
                results.setdefault((layers, variant), []).append(compile_once(layers, variant))
    print(f"{'layers':>6} {'variant':>14} {'compile s':>10} {'temp MiB':>9}")
    for (layers, variant), runs in sorted(results.items()):
        seconds = statistics.median(s for s, _ in runs)
        print(f"{layers:>6} {variant:>14} {seconds:>10.2f} {runs[0][1] / 2**20:>9.2f}")
    print("ratios (median compile time):")
    for layers in args.layers:
        unrolled = statistics.median(s for s, _ in results[(layers, "unrolled")])
        scan = statistics.median(s for s, _ in results[(layers, "scan")])
        print(f"  {layers:>2} layers: unrolled / scan = {unrolled / scan:.2f}")
    base = statistics.median(s for s, _ in results[(args.layers[0], "scan")])
    for layers in args.layers[1:]:
        scan = statistics.median(s for s, _ in results[(layers, "scan")])
        unrolled = statistics.median(s for s, _ in results[(layers, "unrolled")])
        first = statistics.median(s for s, _ in results[(args.layers[0], "unrolled")])
        print(f"  {layers} vs {args.layers[0]} layers: scan x{scan / base:.2f}, unrolled x{unrolled / first:.2f}")
    if (args.stack_in_step_at, "stack-in-step") in results:
        d = args.stack_in_step_at
        print(f"  {d} layers temp bytes: stack-in-step / scan = "
              f"{results[(d, 'stack-in-step')][0][1] / results[(d, 'scan')][0][1]:.2f}")


if __name__ == "__main__":
    main()
