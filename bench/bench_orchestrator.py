"""Orchestrator overheads, each against a baseline measured in the same run.

1. Planning a 1,000-step DAG (build + fingerprint + classify from status files), against the bare
   I/O floor of checking 1,000 status files with os.path.exists.
2. Ray overhead per no-op step (the full executor path: lease, spec.json, status, result) against
   calling the same function in-process.
3. Re-submitting a fully finished 6-step ladder (4 rungs -> fit -> hero shape) through the CLI,
   everything skipped, against the bare interpreter start-up plus `import ladder.cli`.

Run: .venv/bin/python bench/bench_orchestrator.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time

from ladder.dag import DAG, FunctionStep
from ladder.executor import plan, run
from ladder.store import Store


def noop(ctx, index=0):
    return {"index": index}


def bench_plan(n: int = 1000) -> None:
    with tempfile.TemporaryDirectory() as root:
        store = Store(root)
        start = time.perf_counter()
        steps = [FunctionStep(name=f"s{i}", fn=noop, config={"index": i}, deps=(f"s{i - 1}",) if i and i % 10 else ()) for i in range(n)]
        dag = DAG(steps)
        rows = plan(dag, store)
        elapsed = time.perf_counter() - start
        start = time.perf_counter()
        for row in rows:
            os.path.exists(os.path.join(row.path, "status.json"))
        floor = time.perf_counter() - start
    print(f"plan {n}-step DAG: {elapsed:.3f} s (target < 1 s); bare status-file checks {floor * 1e3:.1f} ms; ratio {elapsed / floor:.0f}x the I/O floor")


def bench_ray_overhead(n: int = 40) -> None:
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with tempfile.TemporaryDirectory() as root:
        store = Store(root)
        dag = DAG([FunctionStep(name=f"n{i}", fn=noop, config={"index": i}) for i in range(n)])
        run(dag, Store(tempfile.mkdtemp()), ["n0"], log=lambda line: None)  # start Ray and warm a worker
        start = time.perf_counter()
        report = run(dag, store, log=lambda line: None)
        per_step = (time.perf_counter() - start) / n
        assert report.ok
        start = time.perf_counter()
        for i in range(n):
            noop(None, index=i)
        in_process = (time.perf_counter() - start) / n
    ray.shutdown()
    print(f"no-op step through the executor on Ray: {per_step * 1e3:.1f} ms/step; in-process call {in_process * 1e6:.2f} us; "
          f"ratio {per_step / in_process:,.0f}x (what a step costs beyond its work)")


LADDER = textwrap.dedent('''
    from ladder.dag import FunctionStep
    def work(ctx, i=0):
        return {"i": i}
    rungs = [FunctionStep(name=f"rung{i}", fn=work, config={"i": i}) for i in range(4)]
    fit = FunctionStep(name="fit", fn=work, deps=tuple(r.name for r in rungs))
    hero = FunctionStep(name="hero", fn=work, after=("fit",))
''')


def bench_resubmit() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        exp = os.path.join(tmp, "ladder6.py")
        with open(exp, "w") as handle:
            handle.write(LADDER)
        env = {**os.environ, "LADDER_ROOT": os.path.join(tmp, "root")}
        first = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", exp], env=env, capture_output=True, text=True)
        assert first.returncode == 0, first.stdout + first.stderr
        start = time.perf_counter()
        again = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", exp], env=env, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
        assert again.returncode == 0 and "6 skipped" in again.stdout, again.stdout
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import ladder.cli"], check=True)
        floor = time.perf_counter() - start
    print(f"re-submit finished 6-step ladder: {elapsed:.2f} s (target < 10 s); interpreter + import ladder.cli {floor:.2f} s; ratio {elapsed / floor:.2f}x")


if __name__ == "__main__":
    bench_plan()
    bench_ray_overhead()
    bench_resubmit()
