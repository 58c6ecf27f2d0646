"""Multi-process gangs on this machine: tokens/s of 2 processes x 4 CPU devices against 1 process x 8, and
gang start-up through Ray.

Both layouts run the same MoE on the same data 4 x expert 2 mesh through `ladder submit` (executor ->
placement group -> member actors -> `python -m ladder.gang_worker`), so the only difference is whether
the mesh's collectives stay inside one process (XLA's in-process CPU collectives) or cross two
processes (gloo over TCP loopback). Throughput is the median of the trainer's own
`throughput/tokens_per_second` after the first 5 steps (compilation excluded). Start-up is read from
`gang/attempts.jsonl` (placement group placed, worker processes started) and the first metrics line
(JAX and jax.distributed initialised, data ready, first step compiled and run).

    .venv/bin/python bench/bench_gang.py [--steps 40] [--out bench/RESULTS_gang.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

EXPERIMENT = '''
from ladder import ExperimentSpec, ResourceSpec, TrainStep
from trainer.config import (DataConfig, MixturePhase, ModelConfig, MoEConfig, OptimizerConfig, ScheduleConfig,
                            SourceConfig, TrainConfig)


def spec(hosts, d, layers, experts):
    return ExperimentSpec(
        model=ModelConfig(hidden_dim=d, num_layers=layers, num_heads=4, seq_len=128,
                          moe=MoEConfig(num_experts=experts, top_k=2, expert_dim=d)),
        data=DataConfig(sources=[SourceConfig(name="code", kind="stdlib_code")], phases=[MixturePhase(weights={{"code": 1.0}})],
                        max_tokens_per_source=2_000_000),
        optimizer=OptimizerConfig(learning_rate=3e-3, schedule=ScheduleConfig(kind="cosine", warmup=5)),
        train=TrainConfig(tokens={steps} * 32 * 128, batch_size=32, eval_every=10**9, log_every=1,
                          checkpoint_every=None, checkpoint_every_seconds=None, wandb="disabled", progress=False,
                          mesh={{"data": 4, "expert": 2}}),
        resources=ResourceSpec(cpus=1, hosts=hosts, cpu_devices_per_host=8 // hosts),
    )


small_1x8 = TrainStep(name="small-1x8", spec=spec(1, 64, 2, 8))
small_2x4 = TrainStep(name="small-2x4", spec=spec(2, 64, 2, 8))
large_1x8 = TrainStep(name="large-1x8", spec=spec(1, 192, 4, 8))
large_2x4 = TrainStep(name="large-2x4", spec=spec(2, 192, 4, 8))
'''


ALLREDUCE_PROBE = r"""
import sys, time, json
import numpy as np
from trainer import distributed
rank, count, port, floats = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
distributed.initialize(f"127.0.0.1:{port}", count, rank, cpu_devices=8 // count)
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ("data",))
local = np.ones((8 // count, floats), np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local, (8, floats))
allreduce = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=NamedSharding(mesh, P()))
allreduce(x).block_until_ready()
times = []
for _ in range(20):
    start = time.perf_counter(); allreduce(x).block_until_ready(); times.append(time.perf_counter() - start)
if rank == 0:
    print("PROBE" + json.dumps({"median_s": float(np.median(times))}))
"""


def allreduce_seconds(processes: int, floats: int) -> float:
    """Median time of an all-reduce of `floats` float32 values over the 8 devices, in 1 or 2 processes."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, "-c", ALLREDUCE_PROBE, str(rank), str(processes), port, str(floats)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
             for rank in range(processes)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    return json.loads(outputs[0].split("PROBE", 1)[1])["median_s"]


def measure(root: Path, name: str) -> dict:
    [run_dir] = root.glob(f"runs/{name}-*")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = [r["throughput/tokens_per_second"] for r in rows if "throughput/tokens_per_second" in r and r["step"] > 5]
    attempt = json.loads((run_dir / "gang" / "attempts.jsonl").read_text().splitlines()[-1])
    first_step = min(r["time"] for r in rows if "train/loss" in r)
    host_keys = sorted({k for r in rows for k in r if k.startswith("throughput/host")})
    per_host = {k: statistics.median(r[k] for r in rows if k in r and r["step"] > 5) for k in host_keys}
    return {
        "tokens_per_second": statistics.median(steady),
        "placed_s": attempt["placed_s"],
        "spawned_s": attempt["spawned_s"],
        "first_step_s": first_step - attempt["started_at"],
        "total_s": attempt["ended_at"] - attempt["started_at"],
        "per_host": per_host,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=str(REPO / "bench" / "RESULTS_gang.md"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        experiment = Path(tmp) / "bench_gang_exp.py"
        experiment.write_text(EXPERIMENT.format(steps=args.steps))
        root = Path(tmp) / "root"
        results = {}
        for name in ("small-1x8", "small-2x4", "large-1x8", "large-2x4"):  # one at a time: nothing else competes
            started = time.time()
            proc = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", str(experiment), name, "--root", str(root)],
                                  capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            results[name] = {**measure(root, name), "submit_s": time.time() - started}
            print(name, json.dumps(results[name]), flush=True)
    probe = {(processes, floats): allreduce_seconds(processes, floats) for processes in (1, 2) for floats in (2**16, 2**20)}
    print("all-reduce probe", probe, flush=True)
    lines = [
        "# Multi-process gangs: 2 processes x 4 CPU devices vs 1 process x 8 (bench/bench_gang.py)",
        "",
        f"Command: `.venv/bin/python bench/bench_gang.py --steps {args.steps}`; measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        "on this machine (2 cores, CPU JAX, gloo over TCP loopback between the processes).",
        "",
        "| model | layout | tokens/s (median, steps > 5) | 2x4 / 1x8 | placement group placed | workers started | first step done | whole attempt |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for size in ("small", "large"):
        one, two = results[f"{size}-1x8"], results[f"{size}-2x4"]
        for layout, r in (("1x8", one), ("2x4", two)):
            ratio = f"{two['tokens_per_second'] / one['tokens_per_second']:.3f}" if layout == "2x4" else ""
            lines.append(
                f"| {size} | {layout} | {r['tokens_per_second']:,.0f} | {ratio} | {r['placed_s']:.2f} s | {r['spawned_s']:.2f} s "
                f"| {r['first_step_s']:.1f} s | {r['total_s']:.1f} s |"
            )
    lines += ["", "Per-host tokens/s of the 2x4 runs (each process's own clock): " + "; ".join(
        f"{size}: " + ", ".join(f"{k.split('/')[1]} {v:,.0f}" for k, v in results[f'{size}-2x4']['per_host'].items())
        for size in ("small", "large")), ""]
    lines += [
        "What limits 2x4 here: every collective of the step (gradient all-reduces over data, expert-weight gathers and",
        "dispatch over expert) crosses the two processes through gloo over TCP loopback instead of XLA's in-process",
        "CPU collectives, and both processes' 4 device threads share the same 2 cores. An all-reduce of float32 values",
        "over the 8 devices (median of 20, same run): "
        + "; ".join(f"{floats * 4 / 2**20:g} MiB: 1 process {probe[(1, floats)] * 1e3:.2f} ms, 2 processes "
                    f"{probe[(2, floats)] * 1e3:.2f} ms ({probe[(2, floats)] / probe[(1, floats)]:.1f}x)"
                    for floats in (2**16, 2**20)) + ".",
        "",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
