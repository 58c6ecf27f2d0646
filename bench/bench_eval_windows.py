"""How far a run's logged eval loss is from its loss over the whole held-out split, for the held-out windows the
trainer evaluates (`trainer.data.DataPipeline.eval_batches`: windows spread evenly over the split) against the
baseline of the first windows of the split in a row (what it evaluated before), measured on the same final
checkpoints in the same run.

Why it matters to a forecast: a ladder's law is fitted to the logged eval losses, so a bias of the eval windows that
changes with model size bends the law. The number to read is the spread of the bias across the runs (largest minus
smallest, in points of %): a bias shared by every run moves each forecast and its actual alike.

    .venv/bin/python bench/bench_eval_windows.py ROOT [--eval-batches K]

ROOT is a finished `ladder demo --root ROOT` directory; K batches per source instead of each run's own
`train.eval_batches` (to see what more windows would buy).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import checkpoint, data, model, precision, sharding  # noqa: E402
from trainer.config import TrainJob  # noqa: E402
from trainer.loop import resolve_mesh_axes  # noqa: E402
from trainer.step import jit_eval_loss, jit_train_step  # noqa: E402


def window_losses(job: TrainJob, run_dir: Path) -> tuple[int, dict[str, np.ndarray]]:
    """(step, per source the eval loss of every held-out window, in order) of the run's newest checkpoint."""
    cfg = job.model
    pipeline = data.build_data(job.data, seq_len=cfg.seq_len, num_steps=job.num_steps, model_vocab_size=cfg.vocab_size)
    mesh = sharding.make_mesh(resolve_mesh_axes(job, jax.device_count()))
    abstract = jit_train_step(job, model, mesh).abstract_state
    restored = checkpoint.Checkpointer(str(run_dir / "checkpoints"), every_steps=10**9, every_seconds=None, keep=100,
                                       async_save=False).restore_latest(abstract)
    if restored is None:
        raise SystemExit(f"{run_dir}: no checkpoint to evaluate")
    state, meta = restored
    params = precision.params_on_device(state["params"])
    loss = jit_eval_loss(job, model, mesh)
    out = {}
    for source in pipeline.source_names:
        every = pipeline.eval_batches(source, batch_size=1, num_batches=pipeline.held_out_windows(source), windows="first")
        # one window a call: the loss of each window alone
        out[source] = np.array([float(loss(params, state["router_state"], jax.numpy.asarray(w))) for w in every])
    return int(meta["step"]), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="a finished `ladder demo --root` directory")
    ap.add_argument("--eval-batches", type=int, default=None, help="batches per source (default: each run's own)")
    args = ap.parse_args()
    root = args.root
    rows = []
    for spec_path in sorted(root.glob("runs/*/spec.json")):
        spec = json.loads(spec_path.read_text())
        if spec.get("kind") != "train" or not (spec_path.parent / "checkpoints").is_dir():
            continue
        job = TrainJob(**spec["job"])
        asked = (args.eval_batches or job.train.eval_batches) * job.train.batch_size
        step, losses = window_losses(job, spec_path.parent)
        whole, first, spread = [], [], []
        for per in losses.values():
            whole.append(per.mean())
            first.append(per[data.eval_window_indices(len(per), asked, "first")].mean())
            spread.append(per[data.eval_window_indices(len(per), asked, "spread")].mean())
        w = float(np.mean(whole))
        rows.append((spec["name"], step, w, 100 * (np.mean(first) / w - 1), 100 * (np.mean(spread) / w - 1),
                     {s: len(v) for s, v in losses.items()}, asked))
        print(f"{rows[-1][0]}: step {step}, whole split {w:.4f}", flush=True)
    if not rows:
        raise SystemExit(f"no finished train runs with checkpoints under {root}/runs")
    print("\n| run | step | windows per source | eval windows | loss, whole split | first windows in a row (before) | spread evenly (now) |")
    print("|---|---|---|---|---|---|---|")
    for name, step, w, first, spread, sizes, asked in rows:
        print(f"| {name} | {step} | {', '.join(f'{s} {n}' for s, n in sizes.items())} | {asked} | {w:.4f} | {first:+.2f}% | {spread:+.2f}% |")
    firsts, spreads = [r[3] for r in rows], [r[4] for r in rows]
    print(f"| spread across runs (max - min) | | | | | {max(firsts) - min(firsts):.2f} pts | {max(spreads) - min(spreads):.2f} pts |")


if __name__ == "__main__":
    main()
