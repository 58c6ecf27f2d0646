"""The training loop: ``train(job, run_dir)`` turns a TrainJob into a run directory.

Shape of the loop (nanodo/grug style):

* **State is one pytree** ``{"step", "params", "opt_state", "router_state"}`` and one ``jax.jit`` train
  step donates it: loss and grads, AdamW (LR written into optax's state from the schedule of the step),
  then the router-bias update, all in one compiled program. Metrics come back as device scalars and are
  read one step late, so the device always has the next step queued while the host logs.
* **Faults are data.** The step checks that loss and gradient norm are finite; if not, ``jnp.where``
  keeps the old state (the step still consumes its batch). The host sees the flag one step late, logs
  every bad step, and after ``max_bad_steps`` in a row rolls back to the newest checkpoint and marks the
  offending steps as skipped (their batches are fed with ``skip=True`` and never applied). The
  skips and rollbacks live in ``run_dir/faults.json`` and in checkpoint metadata, so they survive
  restarts. After ``max_rollbacks`` rollbacks the run fails with ``TrainingDiverged`` naming the steps.
* **Resume is just the step.** Batches are a pure function of (seed, step) and the state is restored
  from the newest checkpoint that verifies, so a run killed with SIGKILL and restarted reproduces the
  uninterrupted run bit for bit on the same machine (tested on CPU; on GPU also set
  ``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` before JAX starts, or scatter-adds may differ).

Step numbering, everywhere a user sees it (metrics, ``lr_at_steps``, skipped steps, errors, the fault
injector): step ``s`` is the update that completes ``s`` optimizer steps, 1..num_steps; the metrics line
``"step": s`` reports it. Internally the batch of step ``s`` is ``DataPipeline.train_batch(s - 1)``.
Skipped and non-finite steps still count: ``tokens`` and ``flops`` are ``step`` times the per-step
amounts.

Besides the metric lines, metrics.jsonl gets ``{"step": s, "train/nonfinite": 1, ...}`` for a rejected
step, ``{"step": s, "train/skipped": 1, ...}`` for a skipped one, and ``{"event": "resume", "step": s}``
after a restart or rollback to step s (``metrics.read_metrics`` drops the lines it supersedes).

``train/loss`` is the plain cross-entropy (comparable with ``eval/loss``); ``train/objective`` adds the
z-losses and auxiliary losses that the gradient sees. ``throughput/mfu`` is a fraction (not Levanter's
percentage) of the peak: the device table of ``accounting.peak_flops_per_second`` times the number of
accelerators, a measured matmul peak on CPU, or ``TrainConfig.peak_flops_per_second``.

The persistent compilation cache (``TrainConfig.compilation_cache``, on by default) keeps compiled
train/eval steps in ``$LADDER_CACHE_DIR/jax`` (or ``~/.cache/ladder/jax``, or
``TrainConfig.compilation_cache_dir``), which cuts start-up of a repeated config (tests, retries,
resumes) by the compile time; see bench/RESULTS_trainer.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import traceback
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from pydantic import BaseModel, ConfigDict, Field

from trainer import checkpoint as checkpoint_lib
from trainer import distributed
from trainer import metrics as metrics_lib
from trainer import precision
from trainer.step import jit_eval_loss, jit_train_step
from trainer.config import TrainConfig, TrainJob

log = logging.getLogger(__name__)

Hook = Callable[[int, dict], "dict | None"]


class TrainResult(BaseModel):
    """What one call of ``train`` did."""

    model_config = ConfigDict(frozen=True)

    completed: bool = Field(..., description="True when all num_steps are done (False after should_stop).")
    steps: int = Field(..., description="Completed steps at return.")
    num_steps: int = Field(..., description="Steps of the whole job.")
    tokens: int = Field(..., description="Training tokens consumed at return.")
    flops: float = Field(..., description="Model FLOPs (fwd+bwd, lm_head included) at return.")
    final_train_loss: float | None = Field(..., description="Last finite train/loss seen.")
    final_eval_loss: float | None = Field(..., description="Last eval/loss (mean over sources).")
    wall_seconds: float = Field(..., description="Wall time of this call.")
    resumed_from_step: int | None = Field(..., description="Checkpoint step this call resumed from, if any.")
    skipped_steps: list[int] = Field(default_factory=list, description="Steps skipped after rollbacks (1-based).")
    rollbacks: int = Field(0, description="Rollbacks so far (all attempts of the run).")


class TrainingDiverged(RuntimeError):
    """Non-finite loss or gradients persisted through ``max_rollbacks`` rollbacks."""


def job_fingerprint(job: TrainJob) -> str:
    """Hash of what changes results (execution-only TrainConfig fields left out)."""
    return hashlib.sha256(json.dumps(job.identity(), sort_keys=True).encode()).hexdigest()


def default_compilation_cache_dir() -> str:
    root = os.environ.get("LADDER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ladder")
    return os.path.join(root, "jax")


def enable_compilation_cache(cfg: TrainConfig) -> str | None:
    """Point JAX's persistent compilation cache at the configured directory (process-wide)."""
    if not cfg.compilation_cache:
        return None
    directory = cfg.compilation_cache_dir or default_compilation_cache_dir()
    os.makedirs(directory, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != directory:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", directory)
        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def resolve_mesh_axes(job: TrainJob, device_count: int) -> dict[str, int]:
    """TrainConfig.mesh, or every device on "data" when the batch divides, else a single device."""
    if job.train.mesh is not None:
        return dict(job.train.mesh)
    if job.train.batch_size % device_count == 0:
        return {"data": device_count}
    log.warning(
        "batch_size=%d does not divide over %d devices; training on one device (set train.mesh to choose)",
        job.train.batch_size,
        device_count,
    )
    return {"data": 1}


def peak_flops(job: TrainJob, accounting: Any, mesh: jax.sharding.Mesh) -> float | None:
    """Peak FLOP/s of the mesh for MFU, or None when unknown."""
    if job.train.peak_flops_per_second is not None:
        return job.train.peak_flops_per_second
    device = mesh.devices.flat[0]
    try:
        if device.platform == "cpu":
            return float(accounting.peak_flops_per_second(None))  # the host's measured matmul peak
        return float(accounting.peak_flops_per_second(device.device_kind)) * mesh.devices.size
    except Exception as err:  # noqa: BLE001 - MFU is a view; never fail a run over it
        log.warning("no peak FLOP/s for %s (%s); throughput/mfu will not be logged", device.device_kind, err)
        return None


class _FaultLedger:
    """Skipped step indices and rollbacks, persisted in run_dir/faults.json and checkpoint metadata."""

    def __init__(self, path: str, *, writable: bool = True):
        self.path = path
        self.writable = writable
        self.skipped: set[int] = set()
        self.rollbacks: list[dict[str, Any]] = []
        if os.path.exists(path):
            with open(path) as f:
                self.merge(json.load(f))

    def merge(self, record: dict[str, Any]) -> None:
        self.skipped |= {int(s) for s in record.get("skipped_steps", [])}
        known = {json.dumps(r, sort_keys=True) for r in self.rollbacks}
        for r in record.get("rollbacks", []):
            if json.dumps(r, sort_keys=True) not in known:
                self.rollbacks.append(r)

    def as_meta(self) -> dict[str, Any]:
        return {"skipped_steps": sorted(self.skipped), "rollbacks": self.rollbacks}

    def save(self) -> None:
        if not self.writable:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.as_meta(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def train(
    job: TrainJob,
    run_dir: str,
    *,
    hooks: Sequence[Hook] = (),
    should_stop: Callable[[], bool] | None = None,
    _fault_injector: Callable[[int], bool] | None = None,
) -> TrainResult:
    """Train ``job`` in ``run_dir``, resuming from its newest complete checkpoint.

    Writes ``run_dir/metrics.jsonl`` (append-only), ``run_dir/checkpoints/`` (orbax),
    ``run_dir/faults.json`` and, unless W&B is disabled, ``run_dir/wandb/``. ``hooks`` are called
    after each eval as ``hook(step, metrics)``; a returned dict is logged on the eval line (a hook that
    raises is logged with its traceback and training continues). ``should_stop()`` is checked before
    each step; when it returns True the state is checkpointed and the result has ``completed=False``.

    ``_fault_injector`` is TEST-ONLY: ``f(step) -> bool`` (step 1..num_steps); True makes that step's
    loss and gradients NaN, to exercise the non-finite handling.
    """
    from trainer import accounting, data as data_lib, model, sharding

    wall_start = time.time()
    tcfg, cfg = job.train, job.model
    num_steps = job.num_steps
    eval_every = job.eval_interval  # train.eval_every, or a cadence that follows the run's length
    os.makedirs(run_dir, exist_ok=True)
    enable_compilation_cache(tcfg)

    # ---- data, mesh, model ------------------------------------------------------------------
    pipeline = data_lib.build_data(job.data, seq_len=cfg.seq_len, num_steps=num_steps, model_vocab_size=cfg.vocab_size)
    mesh_axes = resolve_mesh_axes(job, jax.device_count())
    mesh = sharding.make_mesh(mesh_axes)
    batch_sharding = sharding.batch_sharding(mesh)
    try:
        batch_sharding.shard_shape((tcfg.batch_size, cfg.seq_len + 1))
    except ValueError as err:
        raise ValueError(
            f"train.batch_size={tcfg.batch_size} does not split evenly over the mesh {mesh_axes} "
            f"({mesh.devices.size} devices); pick a batch size divisible by the batch-sharded axes or change train.mesh."
        ) from err
    replicated = NamedSharding(mesh, PartitionSpec())
    process_index, process_count = jax.process_index(), jax.process_count()
    primary = process_index == 0

    jitted = jit_train_step(job, model, mesh)
    train_step, optimizer, state_shardings = jitted.train_step, jitted.optimizer, jitted.state_shardings
    abstract_state, router_state0 = jitted.abstract_state, jitted.router_state0
    param_shardings, opt_shardings = state_shardings["params"], state_shardings["opt_state"]
    key = jax.random.key(tcfg.seed)

    def init_params_and_opt(k):
        params = model.init_params(cfg, k)
        return params, optimizer.init(params)

    _init_params_and_opt = jax.jit(init_params_and_opt, out_shardings=(param_shardings, opt_shardings))

    def initial_state():
        # Built anew on every call: the train step donates its state, so an array kept from an earlier
        # call (router_state0 itself, when device_put hands it back unchanged) may already be deleted.
        # A rollback with no checkpoint yet starts again from here.
        params, opt_state = _init_params_and_opt(key)
        router_state = jax.tree.map(lambda a: jnp.array(a, copy=True), router_state0)  # never router_state0 itself
        return {
            "step": jax.device_put(jnp.zeros((), jnp.int32), replicated),
            "params": params,
            "opt_state": opt_state,
            "router_state": jax.device_put(router_state, state_shardings["router_state"]),
        }

    eval_loss = jit_eval_loss(job, model, mesh)

    def to_device(local_batch: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(batch_sharding, np.asarray(local_batch, dtype=np.int32))

    def local_slice(global_batch: np.ndarray) -> np.ndarray:
        rows = global_batch.shape[0] // process_count
        return global_batch[process_index * rows : (process_index + 1) * rows]

    # ---- accounting -------------------------------------------------------------------------
    tokens_per_step = job.tokens_per_step
    flops_per_step = float(accounting.train_flops(cfg, tokens_per_step, include_lm_head=True))
    peak = peak_flops(job, accounting, mesh)
    fingerprint = job_fingerprint(job)

    # ---- sinks, checkpoints, faults ---------------------------------------------------------
    # Every process trains; only process 0 writes metrics, W&B and faults.json and runs the hooks.
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    had_metrics = os.path.exists(metrics_path) and os.path.getsize(metrics_path) > 0
    jsonl = metrics_lib.JsonlSink(metrics_path) if primary else metrics_lib.NullSink()
    wandb_sink = metrics_lib.WandbSink(
        mode=tcfg.wandb if primary else "disabled",
        project=tcfg.wandb_project,
        run_dir=run_dir,
        config=job.model_dump(mode="json"),
    )
    checkpointer = checkpoint_lib.Checkpointer(
        os.path.join(run_dir, "checkpoints"),
        every_steps=tcfg.checkpoint_every,
        every_seconds=tcfg.checkpoint_every_seconds,
        keep=tcfg.keep_checkpoints,
        async_save=tcfg.async_checkpointing,
    )
    faults = _FaultLedger(os.path.join(run_dir, "faults.json"), writable=primary)
    on_cpu = mesh.devices.flat[0].platform == "cpu"

    def emit(record: dict[str, Any]) -> None:
        jsonl.write(record)
        wandb_sink.write(record)

    def base_record(step: int) -> dict[str, Any]:
        return {"step": step, "tokens": step * tokens_per_step, "flops": step * flops_per_step, "time": time.time()}

    last = {"train_loss": None, "eval_loss": None, "train_values": {}}
    last_saved_step = -1
    train_seconds = 0.0

    def restore_or_init() -> tuple[Any, int, dict[str, Any] | None]:
        restored = checkpointer.restore_latest(abstract_state)
        if restored is None:
            return initial_state(), 0, None
        state, meta = restored
        if meta.get("fingerprint") not in (None, fingerprint):
            raise ValueError(
                f"{run_dir} holds checkpoints of a different job (fingerprint {meta.get('fingerprint', '')[:12]} "
                f"!= {fingerprint[:12]}); use a fresh run_dir or the original job."
            )
        faults.merge(meta)
        return state, int(meta["step"]), meta

    def save(state: Any, step: int) -> None:
        nonlocal last_saved_step
        if step == last_saved_step:
            return
        to_save = jax.tree.map(jnp.copy, state) if (on_cpu and tcfg.async_checkpointing) else state
        checkpointer.save(
            step,
            to_save,
            {
                "fingerprint": fingerprint,
                "tokens": step * tokens_per_step,
                "num_steps": num_steps,
                "final_train_loss": last["train_loss"],
                "final_eval_loss": last["eval_loss"],
                "train_seconds": train_seconds,
                **faults.as_meta(),
            },
        )
        last_saved_step = step

    eval_cache: dict[str, list[jax.Array]] = {}

    def run_eval(state: Any, step: int) -> None:
        record = base_record(step)
        losses = []
        params = precision.params_on_device(state["params"])  # train.offload may keep the master on the host
        for source in pipeline.source_names:
            if source not in eval_cache:
                batches = pipeline.eval_batches(source, batch_size=tcfg.batch_size, num_batches=tcfg.eval_batches,
                                                windows=tcfg.eval_windows)
                eval_cache[source] = [to_device(local_slice(b)) for b in batches]
            values = [eval_loss(params, state["router_state"], b) for b in eval_cache[source]]
            loss = float(np.mean(jax.device_get(values)))
            record[f"eval/{source}/loss"] = loss
            losses.append(loss)
        record["eval/loss"] = float(np.mean(losses))
        last["eval_loss"] = record["eval/loss"]
        for hook in hooks if primary else ():
            try:
                extra = hook(step, {**last["train_values"], **record})
            except Exception:  # noqa: BLE001
                log.warning("hook %r failed at step %d; continuing:\n%s", hook, step, traceback.format_exc())
                continue
            if extra:
                record.update(extra)
        emit(record)

    # ---- start or resume --------------------------------------------------------------------
    state, step, meta = restore_or_init()
    resumed_from = step if meta is not None else None
    if meta is not None:
        train_seconds = float(meta.get("train_seconds", 0.0))
        last["train_loss"] = meta.get("final_train_loss")
        last["eval_loss"] = meta.get("final_eval_loss")
        last_saved_step = step
    if had_metrics:
        jsonl.write({"event": "resume", "step": step, "time": time.time(), "reason": "restart"})
    if step >= num_steps:
        checkpointer.close()
        jsonl.close()
        wandb_sink.close()
        return _result(job, step, flops_per_step, last, wall_start, resumed_from, faults, completed=True)

    progress = metrics_lib.ProgressBar(total=num_steps, start=step, enabled=tcfg.progress and primary)
    bad_streak: list[int] = []
    pending: tuple[int, dict] | None = None
    interval = {"step": None, "time": None, "excluded": 0.0}
    stopped = False

    def process(done_step: int, device_metrics: dict) -> bool:
        """Read one step's metrics (one step late); log; return True if a rollback is due."""
        nonlocal train_seconds
        values = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        finite, skipped = bool(values.pop("_finite")), bool(values.pop("_skipped"))
        now = time.time()
        if skipped:
            emit({**base_record(done_step), "train/skipped": 1})
            return False
        if not finite:
            bad_streak.append(done_step)
            log.warning(
                "non-finite loss or gradients at step %d (%d in a row); update not applied", done_step, len(bad_streak)
            )
            emit({**base_record(done_step), "train/nonfinite": 1, "train/loss": values["train/loss"]})
            return len(bad_streak) >= tcfg.max_bad_steps
        bad_streak.clear()
        last["train_loss"] = values["train/loss"]
        last["train_values"] = values
        if interval["time"] is None:  # the first step includes compilation: time from its end
            interval.update(step=done_step, time=now, excluded=0.0)
        elif done_step % tcfg.log_every == 0 or done_step == num_steps:
            seconds = max(1e-9, now - interval["time"] - interval["excluded"])
            steps_done = done_step - interval["step"]
            train_seconds += seconds
            values["throughput/tokens_per_second"] = steps_done * tokens_per_step / seconds
            if peak:
                values["throughput/mfu"] = steps_done * flops_per_step / seconds / peak
            if process_count > 1 and (done_step % distributed.SYNC_EVERY == 0 or done_step == num_steps):
                # every host's own clock (a slow host shows here first), gathered only at the sync cadence
                for host, host_seconds in enumerate(distributed.gather(seconds)):
                    values[f"throughput/host{host}/tokens_per_second"] = steps_done * tokens_per_step / max(1e-9, host_seconds)
            interval.update(step=done_step, time=now, excluded=0.0)
        if done_step % tcfg.log_every == 0 or done_step == num_steps:
            record = base_record(done_step)
            record.update(values)
            record["throughput/total_tokens"] = record["tokens"]
            record["throughput/total_gflops"] = record["flops"] / 1e9
            emit(record)
            progress.update(done_step, f"loss {values['train/loss']:.4f}")
        return False

    def rollback() -> tuple[Any, int]:
        nonlocal last_saved_step
        bad = list(bad_streak)
        if len(faults.rollbacks) >= tcfg.max_rollbacks:
            history = "; ".join(f"rollback to step {r['to_step']} skipping {r['skipped']}" for r in faults.rollbacks)
            raise TrainingDiverged(
                f"training diverged: non-finite loss or gradients at steps {bad} "
                f"({tcfg.max_bad_steps} in a row) after {len(faults.rollbacks)} rollback(s) "
                f"(max_rollbacks={tcfg.max_rollbacks}; {history or 'none before'}). Check the data at these "
                "steps, lower the learning rate or raise train.max_rollbacks."
            )
        checkpointer.wait()
        restored_state, to_step, _ = restore_or_init()
        faults.skipped |= set(bad)
        faults.rollbacks.append({"at_step": bad[-1], "to_step": to_step, "skipped": bad})
        faults.save()
        log.warning("rolled back to step %d after non-finite steps %s; those batches will be skipped", to_step, bad)
        emit({**base_record(to_step), "event": "resume", "reason": "rollback", "skipped_steps": bad})
        bad_streak.clear()
        last_saved_step = to_step
        return restored_state, to_step

    try:
        while step < num_steps:
            if process_count == 1:
                stop_now = should_stop is not None and should_stop()
            elif step % distributed.SYNC_EVERY == 0:  # a stop or a save is collective: process 0 decides
                stop_now, checkpointer.force_next = distributed.agree(
                    [should_stop is not None and should_stop(), checkpointer.due_by_time()]
                )
            else:
                stop_now, checkpointer.force_next = False, False
            if stop_now:
                stopped = True
                break
            skip = (step + 1) in faults.skipped
            poison = bool(_fault_injector(step + 1)) if _fault_injector is not None else False
            batch = to_device(
                pipeline.train_batch(
                    step,
                    batch_size=tcfg.batch_size,
                    seed=tcfg.seed,
                    process_index=process_index,
                    process_count=process_count,
                )
            )
            state, device_metrics = train_step(
                state, batch, jnp.asarray(skip), jnp.asarray(float("nan") if poison else 1.0, jnp.float32)
            )
            step += 1
            needs_rollback = process(*pending) if pending is not None else False
            pending = (step, device_metrics)
            at_end = step == num_steps
            eval_due = step % eval_every == 0 or at_end
            save_due = at_end or checkpointer.due(step)
            if not needs_rollback and (eval_due or save_due):
                needs_rollback = process(*pending)
                pending = None
            if needs_rollback:
                pending = None
                state, step = rollback()
                continue
            if eval_due or save_due:
                paused = time.time()
                if eval_due:
                    run_eval(state, step)
                if save_due and (not bad_streak or at_end):
                    save(state, step)
                interval["excluded"] += time.time() - paused
        if pending is not None:
            if process(*pending):
                state, step = rollback()
            pending = None
        if stopped:
            save(state, step)
        checkpointer.wait()
    except KeyboardInterrupt:
        # Best effort: the state's own step counter is authoritative (the interrupt may land between
        # the dispatch of a step and the host's bookkeeping); a donated, half-dispatched state fails
        # to save and the newest periodic checkpoint stays the resume point.
        try:
            if pending is not None:
                process(*pending)
            saved_step = int(jax.device_get(state["step"]))
            log.warning("interrupted; saving a checkpoint at step %d before exiting", saved_step)
            save(state, saved_step)
            checkpointer.wait()
        except Exception as err:  # noqa: BLE001
            log.warning("could not checkpoint the interrupted state (%s); resume uses the newest checkpoint", err)
        raise
    finally:
        progress.close()
        checkpointer.close()
        jsonl.close()
        wandb_sink.close()
    return _result(job, step, flops_per_step, last, wall_start, resumed_from, faults, completed=not stopped)


def _result(job, step, flops_per_step, last, wall_start, resumed_from, faults, *, completed) -> TrainResult:
    return TrainResult(
        completed=completed and step >= job.num_steps,
        steps=step,
        num_steps=job.num_steps,
        tokens=step * job.tokens_per_step,
        flops=step * flops_per_step,
        final_train_loss=last["train_loss"],
        final_eval_loss=last["eval_loss"],
        wall_seconds=time.time() - wall_start,
        resumed_from_step=resumed_from,
        skipped_steps=sorted(faults.skipped),
        rollbacks=len(faults.rollbacks),
    )
