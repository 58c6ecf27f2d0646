"""One process of a multi-host training gang: ``python -m ladder.gang_worker TASK_FILE RANK COUNT COORDINATOR``.

Started by a ``ladder.gang`` member actor on its host, in a fresh interpreter so that JAX is configured
(device count, collectives, ``jax.distributed``) before anything else touches it. Every rank runs the
same ``trainer.train``; rank 0 also runs the step's hooks (live forecast overlay) and writes
``gang/result.json``. A stop is asked for by the controller with the file ``gang/stop``; the trainer
makes rank 0's reading of it everyone's, checkpoints and returns.

Exit codes: 0 done or stopped cleanly, 1 an exception in training, also written to ``gang/error<rank>.json``
(type, message, traceback) so the controller can report it and decide whether a restart can help.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback


def main(argv: list[str]) -> int:
    task_file, rank, count, coordinator = argv[0], int(argv[1]), int(argv[2]), argv[3]
    with open(task_file, "rb") as f:
        gang_task = pickle.load(f)
    gang_dir = os.path.dirname(task_file)
    with open(os.path.join(gang_dir, f"host{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))

    from trainer import distributed

    distributed.initialize(coordinator, count, rank, cpu_devices=gang_task["cpu_devices"])

    from trainer import train

    stop_file = os.path.join(gang_dir, "stop")
    hooks = []
    if rank == 0 and gang_task.get("overlay_args") is not None:
        hooks.extend(_overlay_hook(gang_task["overlay_args"]))
    try:
        result = train(gang_task["job"], gang_task["run_dir"], hooks=hooks, should_stop=lambda: os.path.exists(stop_file))
    except Exception as error:
        _write_json(os.path.join(gang_dir, f"error{rank}.json"), {
            "attempt": gang_task["attempt"], "type": type(error).__name__, "message": str(error)[:2000],
            "traceback": traceback.format_exc()[-6000:],
        })
        raise
    for hook in hooks:  # the overlay: a refit in flight stores its version before the gang reports done
        if hasattr(hook, "drain"):
            hook.drain()
    if rank == 0:
        payload = result.model_dump(mode="json")
        _write_json(os.path.join(gang_dir, "result.json"), {**payload, "attempt": gang_task["attempt"], "finished_at": time.time()})
    return 0


def _write_json(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def _overlay_hook(args: dict) -> list:
    """The live forecast overlay of the step, as ``ladder.executor`` attaches it to a single-host run."""
    try:
        from ladder.overlay import overlay_for_step

        hook = overlay_for_step(
            args["step"], args["store_url"], args["run_dir"], args["ladder_run_dirs"], args["refit_every"],
            has_fit_step=args["has_fit_step"],
        )
        return [hook] if hook is not None else []
    except Exception:  # noqa: BLE001 - a forecast view must never stop training
        traceback.print_exc()
        return []


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
