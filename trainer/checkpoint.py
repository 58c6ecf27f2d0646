"""Checkpoints: orbax, saved at a step interval, a time interval and at the end; newest complete one restored.

A checkpoint is ``checkpoints/<step>/{state, meta}``: ``state`` is the whole train state pytree
(step, params, opt_state, router_state) through ``StandardSave``; ``meta`` is JSON (job fingerprint,
tokens seen, rollbacks and skipped steps, accumulated train time, a checksum of the state).

Why the checksum: orbax commits a checkpoint atomically (a temporary directory renamed when done), so
a half-written one never shows up as a step; but a file damaged after the commit (truncated copy, bad
disk) may still restore without an error. ``restore_latest`` therefore verifies the restored state
against the checksum saved with it and, on any failure, warns, moves the bad checkpoint aside to
``checkpoints_corrupt/`` and tries the previous one. The checksum is a wrap-around sum of every leaf's
raw 32-bit words computed on device: exact, order-independent (so independent of sharding) and cheap.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


@jax.jit
def _leaf_checksums(tree: Any) -> list[jax.Array]:
    sums = []
    for leaf in jax.tree.leaves(tree):
        leaf = jnp.asarray(leaf)
        if leaf.dtype.itemsize == 8:
            leaf = leaf.astype(jnp.float32 if jnp.issubdtype(leaf.dtype, jnp.floating) else jnp.int32)
        if leaf.dtype == jnp.bool_:
            words = leaf.astype(jnp.uint32)
        else:
            unsigned = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[leaf.dtype.itemsize]
            words = jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32)
        sums.append(jnp.sum(words.ravel(), dtype=jnp.uint32))
    return sums


def state_checksum(tree: Any) -> int:
    """Exact, sharding-independent checksum of every array in ``tree`` (an int < 2**32 * leaves)."""
    return int(sum(int(s) * (i + 1) for i, s in enumerate(jax.device_get(_leaf_checksums(tree)))))


class Checkpointer:
    """Policy (when to save) plus orbax (how); one per run directory."""

    def __init__(
        self,
        directory: str,
        *,
        every_steps: int | None,
        every_seconds: float | None,
        keep: int,
        async_save: bool = True,
    ):
        self.directory = os.path.abspath(directory)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.force_next = False  # set by a multi-process loop: process 0's clock said a save is due
        self._last_save_time = time.monotonic()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                create=True,
                cleanup_tmp_directories=True,  # half-written checkpoints of a killed run
                enable_async_checkpointing=async_save,
            ),
            item_names=("state", "meta"),
        )

    # -- policy -------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether the step or time cadence asks for a checkpoint after ``step`` completed steps.

        With several processes, the time cadence is ``force_next`` (process 0's ``due_by_time``, agreed
        before the step): each process's own clock could disagree and one process would save alone.
        """
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        if jax.process_count() > 1:
            return self.force_next
        return self.due_by_time()

    def due_by_time(self) -> bool:
        return self.every_seconds is not None and time.monotonic() - self._last_save_time >= self.every_seconds

    # -- orbax --------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Save ``state`` and JSON ``meta`` as checkpoint ``step`` (replacing one at the same step)."""
        self._manager.wait_until_finished()
        if step in self._manager.all_steps():
            self._manager.delete(step)
        meta = dict(meta, step=int(step), checksum=state_checksum(state), saved_at=time.time())
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self._last_save_time = time.monotonic()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def restore_latest(self, abstract_state: Any) -> tuple[Any, dict[str, Any]] | None:
        """Newest checkpoint that restores and verifies, as (state, meta); None if there is none.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` (with shardings) of the state.
        A checkpoint that fails is moved to ``checkpoints_corrupt/`` with a warning.
        """
        self._manager.wait_until_finished()
        for step in reversed(self.steps()):
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                    ),
                )
                state, meta = restored["state"], dict(restored["meta"])
                if meta.get("checksum") is not None and state_checksum(state) != meta["checksum"]:
                    raise ValueError("state checksum does not match the one saved with the checkpoint")
                return state, meta
            except Exception as err:  # noqa: BLE001 - any failure means: not usable, try the previous one
                log.warning(
                    "checkpoint %s/%d is corrupt or incomplete (%s: %s); skipping it and trying the previous one",
                    self.directory,
                    step,
                    type(err).__name__,
                    str(err).splitlines()[0][:300] if str(err) else "",
                )
                self._quarantine(step)
        return None

    def _quarantine(self, step: int) -> None:
        if jax.process_index() != 0:  # every process fails on the same files; one of them moves them
            self._manager.reload()
            return
        source = os.path.join(self.directory, str(step))
        target_dir = os.path.join(os.path.dirname(self.directory), "checkpoints_corrupt")
        os.makedirs(target_dir, exist_ok=True)
        target = os.path.join(target_dir, f"{step}-{int(time.time() * 1000)}")
        try:
            shutil.move(source, target)
        except OSError as err:
            log.warning("could not move corrupt checkpoint %s aside: %s", source, err)
        self._manager.reload()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(state: Any) -> Any:
    """Shape/dtype/sharding skeleton of ``state`` for ``restore_latest``."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)


def host_copy(tree: Any) -> Any:
    """A numpy copy of ``tree`` (for tests and debugging)."""
    return jax.tree.map(np.asarray, jax.device_get(tree))
