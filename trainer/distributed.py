"""Multi-process JAX: one training process per host, one global mesh over every host's devices.

A multi-host step is the same ``train(job, run_dir)`` call in every process of a gang, after
``initialize`` has connected the processes through ``jax.distributed`` (rank 0's host runs the
coordination service). From then on ``jax.devices()`` lists every device of every process, the mesh in
``train`` spans them all, and XLA's collectives cross hosts (NCCL on GPUs, the TPU ICI/DCN, gloo on CPUs,
which is how the multi-process tests run on one machine).

What stays per process and what must agree:

- each process feeds only its rows of the global batch (``DataPipeline.train_batch(process_index=...)``),
  still a pure function of (seed, step), so any process can be restarted and reproduce its slice;
- host-side decisions that gate a collective (stop now? save a checkpoint now?) must be identical in
  every process or the gang deadlocks; ``agree`` makes process 0's decision everyone's, every
  ``SYNC_EVERY`` steps (a stop takes effect within that many steps);
- metrics.jsonl, W&B, faults.json and hooks belong to process 0 alone (``is_primary``); per-host
  throughput reaches it through ``gather``.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

log = logging.getLogger(__name__)

# Steps between the host-side agreements of a multi-process run (stop? time-based save? per-host clocks).
# Each one is a small collective whose result the host waits for, which stalls the one-step-ahead
# dispatch of the train step; doing it every step would cost that stall every step.
SYNC_EVERY = 10


def initialize(
    coordinator_address: str | None,
    num_processes: int,
    process_id: int,
    *,
    cpu_devices: int | None = None,
    initialization_timeout: int = 300,
) -> None:
    """Configure this process's JAX and join the gang; call before anything touches a JAX device.

    ``cpu_devices`` gives the CPU backend that many devices (how a CPU machine stands in for a host
    with several accelerators). With ``num_processes == 1`` nothing is joined.
    """
    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    if num_processes <= 1:
        return
    if not coordinator_address:
        raise ValueError(f"process {process_id} of {num_processes}: a coordinator address (host:port) is required.")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} is outside [0, num_processes={num_processes}).")
    # Only the CPU backend reads this; GPUs and TPUs bring their own collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=initialization_timeout,
    )
    log.info(
        "process %d/%d joined %s: %d local of %d devices",
        jax.process_index(), jax.process_count(), coordinator_address, jax.local_device_count(), jax.device_count(),
    )


def is_primary() -> bool:
    return jax.process_index() == 0


def agree(flags: list[bool]) -> list[bool]:
    """Process 0's flags, on every process (a no-op with one process)."""
    if jax.process_count() == 1:
        return [bool(f) for f in flags]
    from jax.experimental import multihost_utils

    values = multihost_utils.broadcast_one_to_all(np.asarray(flags, dtype=np.int32))
    return [bool(v) for v in np.asarray(values)]


def gather(value: float) -> list[float]:
    """``value`` from every process, in process order (a one-element list with one process)."""
    if jax.process_count() == 1:
        return [float(value)]
    from jax.experimental import multihost_utils

    values = multihost_utils.process_allgather(np.asarray([value], dtype=np.float64))
    return [float(v) for v in np.asarray(values).reshape(-1)]
