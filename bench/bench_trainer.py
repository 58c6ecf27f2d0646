"""Trainer benchmark: steady tokens/s and MFU of the ~2M-parameter MoE, and start-up time with and
without JAX's persistent compilation cache (issue 3, benchmark items 1, 3 and 4).

Every number comes from ``trainer.train`` itself, run in fresh Python processes so start-up includes
importing JAX. Throughput is read from metrics.jsonl (``throughput/tokens_per_second`` of the log
intervals after the first, which carries the compile); MFU divides the model FLOP/s (3 x forward
FLOPs per token, lm_head included, from ``trainer.accounting``) by the f32 matmul peak measured in the
same run (the better of before and after the throughput run).
Start-up is wall time from just before the process starts to the ``time`` of the first train line
(written once step 1's metrics are on the host); the token cache is warm in every case so only
compilation differs.

    .venv/bin/python bench/bench_trainer.py            # full run (a few minutes on 2 cores)
    .venv/bin/python bench/bench_trainer.py --steps 40 # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from trainer.config import (  # noqa: E402
    DataConfig,
    MixturePhase,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ScheduleConfig,
    SourceConfig,
    TrainConfig,
    TrainJob,
)

RUN_SCRIPT = """
import sys
from trainer.config import TrainJob
from trainer.loop import train
train(TrainJob.model_validate_json(open(sys.argv[1]).read()), sys.argv[2])
"""


def bench_job(steps: int, *, cache: bool, cache_dir: str | None, log_every: int = 10) -> TrainJob:
    """d=128, 4 layers, 8 experts top-2, seq 256, byte vocab, batch 16."""
    return TrainJob(
        model=ModelConfig(
            vocab_size=256,
            hidden_dim=128,
            num_layers=4,
            num_heads=4,
            seq_len=256,
            moe=MoEConfig(num_experts=8, top_k=2, expert_dim=128),
        ),
        data=DataConfig(
            sources=[SourceConfig(name="code", kind="stdlib_code")],
            phases=[MixturePhase(weights={"code": 1.0})],
            max_tokens_per_source=2_000_000,
        ),
        optimizer=OptimizerConfig(learning_rate=3e-3, schedule=ScheduleConfig(kind="cosine", warmup=0.05)),
        train=TrainConfig(
            tokens=steps * 16 * 256,
            batch_size=16,
            eval_every=10_000,
            eval_batches=1,
            log_every=log_every,
            checkpoint_every=None,
            wandb="disabled",
            progress=False,
            compilation_cache=cache,
            compilation_cache_dir=cache_dir,
        ),
    )


def run(job: TrainJob, workdir: str, name: str) -> tuple[float, list[dict]]:
    """Train ``job`` in a fresh process; (start-up seconds to the first train line, metrics rows)."""
    from trainer.metrics import read_metrics

    run_dir = os.path.join(workdir, name)
    job_path = run_dir + "-job.json"
    with open(job_path, "w") as f:
        f.write(job.model_dump_json())
    env = dict(os.environ, PYTHONPATH=REPO)
    started = time.time()
    subprocess.run([sys.executable, "-c", RUN_SCRIPT, job_path, run_dir], env=env, cwd=REPO, check=True)
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    first = next(r for r in rows if "train/loss" in r)
    return first["time"] - started, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="Steps of the throughput run.")
    parser.add_argument("--startup-steps", type=int, default=3, help="Steps of each start-up run.")
    args = parser.parse_args()

    from trainer.accounting import count_params, forward_flops_per_token, measure_cpu_matmul_peak

    workdir = tempfile.mkdtemp(prefix="bench_trainer_")
    cache_dir = os.path.join(workdir, "jax_cache")
    job = bench_job(args.steps, cache=True, cache_dir=cache_dir)
    counts = count_params(job.model)
    peak = measure_cpu_matmul_peak()  # in this run, so the ratio shares the machine's current load
    print(f"model: {counts.total / 1e6:.2f}M total, {counts.active / 1e6:.2f}M active (non-embedding) params; "
          f"forward {forward_flops_per_token(job.model) / 1e6:.2f} MFLOP/token; measured matmul peak {peak / 1e9:.0f} GFLOP/s")
    load_before = os.getloadavg()[0]

    # start-up: the cold-cache run also warms the token cache for every later run, so tokenize first
    run(bench_job(args.startup_steps, cache=False, cache_dir=None), workdir, "tokenize")
    no_cache, _ = run(bench_job(args.startup_steps, cache=False, cache_dir=None, log_every=1), workdir, "no_cache")
    cold, _ = run(bench_job(args.startup_steps, cache=True, cache_dir=cache_dir, log_every=1), workdir, "cold_cache")
    warm, _ = run(bench_job(args.startup_steps, cache=True, cache_dir=cache_dir, log_every=1), workdir, "warm_cache")

    _, rows = run(job, workdir, "throughput")
    steady = [r for r in rows if "throughput/tokens_per_second" in r][1:]  # drop the interval after compile
    tokens_per_second = sorted(r["throughput/tokens_per_second"] for r in steady)[len(steady) // 2]
    model_flops_per_second = 3 * forward_flops_per_token(job.model) * tokens_per_second
    load_after = os.getloadavg()[0]
    peak = max(peak, measure_cpu_matmul_peak())

    result = {
        "params_total": counts.total,
        "params_active": counts.active,
        "steady_tokens_per_second_median": tokens_per_second,
        "model_gflops_per_second": model_flops_per_second / 1e9,
        "matmul_peak_gflops_per_second": peak / 1e9,
        "mfu_vs_measured_peak": model_flops_per_second / peak,
        "startup_to_first_step_seconds": {"no_cache": no_cache, "cold_cache": cold, "warm_cache": warm},
        "startup_ratio_no_cache_over_warm": no_cache / warm,
        "load_average_1min": [load_before, load_after],
        "steps": args.steps,
    }
    print(json.dumps(result, indent=2))
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
