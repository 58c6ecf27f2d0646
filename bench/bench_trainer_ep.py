"""Benchmark: expert parallelism (shard_map + all-to-all) against today's plain-jit capacity dispatch.

Same model, same mesh, same global batch, the trainer's own jitted step (``trainer.step.jit_train_step``:
loss + grad + AdamW + router-bias update); only ``moe.dispatch`` differs ("alltoall" vs "capacity").
Prints, measured side by side in one run (steps interleaved, so load on a shared machine hits both alike):

  - steady tokens/s of the step (median over --steps) and the ratio alltoall / capacity;
  - XLA temp memory of the compiled step per device (``memory_analysis().temp_size_in_bytes`` of the
    SPMD program, which is one device's) and the ratio;

on 8 fake CPU devices for meshes expert=8 and data=2 x expert=4, and with --processes 2 also across
2 processes x 4 devices (gloo collectives over loopback), mesh expert=8.

Usage: .venv/bin/python bench/bench_trainer_ep.py [--steps 10] [--batch 32] [--seq 128] [--processes 1|2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MESHES = ({"expert": 8}, {"data": 2, "expert": 4})


def make_job(dispatch: str, mesh: dict[str, int], *, batch: int, seq: int):
    from trainer.config import (DataConfig, MixturePhase, ModelConfig, MoEConfig, OptimizerConfig, SourceConfig,
                                TrainConfig, TrainJob)

    return TrainJob(
        model=ModelConfig(hidden_dim=64, num_layers=2, num_heads=4, seq_len=seq,
                          moe=MoEConfig(num_experts=8, top_k=2, expert_dim=128, capacity_factor=1.25, dispatch=dispatch)),
        data=DataConfig(sources=[SourceConfig(name="code", kind="stdlib_code")], phases=[MixturePhase(weights={"code": 1.0})]),
        optimizer=OptimizerConfig(learning_rate=1e-3),
        train=TrainConfig(tokens=batch * seq * 100, batch_size=batch, mesh=mesh),
    )


class Runner:
    """One dispatch's compiled step and state on the global mesh."""

    def __init__(self, dispatch: str, mesh_axes: dict[str, int], *, batch: int, seq: int):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from trainer import model, sharding
        from trainer import step as step_lib

        self.job = job = make_job(dispatch, mesh_axes, batch=batch, seq=seq)
        cfg = job.model
        mesh = sharding.make_mesh(mesh_axes)
        jitted = step_lib.jit_train_step(job, model, mesh)

        def init(key):
            params = model.init_params(cfg, key)
            return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": jitted.optimizer.init(params),
                    "router_state": model.init_router_state(cfg)}

        self.state = jax.jit(init, out_shardings=jitted.state_shardings)(jax.random.key(0))
        batch_struct = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=jitted.batch_sharding)
        compiled = jitted.train_step.lower(jitted.abstract_state, batch_struct, False, 1.0).compile()
        self.temp_bytes = int(compiled.memory_analysis().temp_size_in_bytes)
        self.step = compiled
        rng = np.random.default_rng(0)
        self.batches = [
            jax.make_array_from_callback(
                (batch, seq + 1), jitted.batch_sharding,
                lambda index, b=rng.integers(0, cfg.vocab_size, (batch, seq + 1), dtype=np.int32): b[index],
            )
            for _ in range(4)
        ]
        self.skip, self.scale = np.bool_(False), np.float32(1.0)
        self.calls = 0
        for _ in range(2):
            self.run()

    def run(self) -> float:
        batch = self.batches[self.calls % len(self.batches)]
        self.calls += 1
        start = time.perf_counter()
        self.state, metrics = self.step(self.state, batch, self.skip, self.scale)
        metrics["train/loss"].block_until_ready()
        self.last_metrics = metrics
        return time.perf_counter() - start


def measure(mesh_axes: dict[str, int], *, steps: int, batch: int, seq: int) -> dict:
    runners = {d: Runner(d, mesh_axes, batch=batch, seq=seq) for d in ("capacity", "alltoall")}
    times: dict[str, list[float]] = {d: [] for d in runners}
    for _ in range(steps):
        for d, runner in runners.items():
            times[d].append(runner.run())
    row = {}
    for d, runner in runners.items():
        median = sorted(times[d])[len(times[d]) // 2]
        row[d] = {"tokens_per_s": batch * seq / median, "temp_mib": runner.temp_bytes / 2**20,
                  "drop_fraction": float(runner.last_metrics["train/router/drop_fraction"])}
    return row


def report(rows: dict[str, dict], header: str) -> None:
    print(header)
    print("| mesh | dispatch | tokens/s | XLA temp MiB / device | drop fraction |")
    print("|---|---|---|---|---|")
    for mesh, row in rows.items():
        for d in ("capacity", "alltoall"):
            r = row[d]
            print(f"| {mesh} | {d} | {r['tokens_per_s']:,.0f} | {r['temp_mib']:.2f} | {r['drop_fraction']:.3f} |")
        print(f"| {mesh} | **alltoall / capacity** | **{row['alltoall']['tokens_per_s'] / row['capacity']['tokens_per_s']:.2f}x** "
              f"| **{row['alltoall']['temp_mib'] / row['capacity']['temp_mib']:.2f}x** | |")


def worker(args) -> None:
    """One process of the gang (or the only process): join, measure, rank 0 prints."""
    import jax

    from trainer import distributed

    distributed.initialize(args.coordinator, args.processes, args.rank, cpu_devices=8 // args.processes)
    meshes = MESHES if args.processes == 1 else ({"expert": 8},)
    rows = {json.dumps(m): measure(m, steps=args.steps, batch=args.batch, seq=args.seq) for m in meshes}
    if jax.process_index() == 0:
        print("RESULT" + json.dumps(rows), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--processes", type=int, default=1, choices=(1, 2))
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        return worker(args)

    import jax

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    coordinator = None
    if args.processes > 1:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            coordinator = f"127.0.0.1:{sock.getsockname()[1]}"
    common = [sys.executable, __file__, "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
              "--processes", str(args.processes)]
    procs = [
        subprocess.Popen([*common, "--rank", str(rank), *(["--coordinator", coordinator] if coordinator else [])],
                         env=env, stdout=subprocess.PIPE, text=True)
        for rank in range(args.processes)
    ]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"a benchmark process failed: return codes {[p.returncode for p in procs]}")
    rows = json.loads(outputs[0].split("RESULT", 1)[1])
    where = "8 fake CPU devices in 1 process" if args.processes == 1 else "2 processes x 4 fake CPU devices (gloo)"
    report(rows, f"jax {jax.__version__}; {where}; d64 L2 E8 k2 F128 cf1.25, batch {args.batch} x seq {args.seq}, "
                 f"median of {args.steps} interleaved steps")


if __name__ == "__main__":
    main()
