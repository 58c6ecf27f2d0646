"""GPU checks of the expert-parallel MoE that XLA:CPU cannot run: one short script for a session with a GPU.

Why a separate script: ``jax.lax.ragged_all_to_all`` does not compile on XLA:CPU (``trainer.expert_parallel.
CPU_RAGGED_REFUSAL``), so the dropless EP dispatch (``moe.dispatch="ragged_alltoall"``) is tested on CPU only
with a gather-based stand-in for the primitive. This script runs the real primitive and a real train step:

  1. one MoE layer, dispatch "ragged_alltoall" with the real ragged all-to-all, against the dense oracle
     (outputs and gradients w.r.t. tokens, router logits and experts, fp32) on a mesh expert = all GPUs;
     on a single GPU the exchange is forced (``always_exchange``) so the primitive and its transpose still run
     inside the real layout (offsets from real routing);
  2. the primitive alone against ``ragged_all_to_all_by_gather`` on random ragged sizes (its documented
     semantics), forward and transposed;
  3. the trainer's jitted step (``trainer.step.jit_train_step``: loss + grad + AdamW + bias update) of a
     mid-size MoE (d1024 L8 E32 k4 F512, seq 1024, bf16) for dispatches capacity, ragged, alltoall and
     ragged_alltoall: tokens/s and MFU (``trainer.accounting``'s FLOP convention and peak table).

Usage (on the GPU machine, from the repo root): ``python bench/gpu_checks.py [--steps 10] [--batch 16]``.
Exit 0 when every check passes, 1 when one fails, 2 (with the reason) on a machine without a GPU.
Not run yet: no GPU was lent to the session that wrote it.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time


def check_layer(jax, jnp, np) -> dict:
    from trainer import expert_parallel as ep
    from trainer import moe as moe_lib
    from trainer import sharding
    from trainer.config import MoEConfig

    devices = jax.device_count()
    cfg = MoEConfig(num_experts=8 * devices, top_k=2, expert_dim=64, capacity_factor=4.0)
    tokens, width = 512 * devices, 128
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (tokens, width))
    logits = jax.random.normal(keys[1], (tokens, cfg.num_experts))
    experts = {
        "w_gate": 0.1 * jax.random.normal(keys[2], (cfg.num_experts, width, cfg.expert_dim)),
        "w_up": 0.1 * jax.random.normal(keys[3], (cfg.num_experts, width, cfg.expert_dim)),
        "w_down": 0.1 * jax.random.normal(keys[4], (cfg.num_experts, cfg.expert_dim, width)),
    }

    def loss(fn):
        def f(x, logits, e):
            y, _ = fn(x, moe_lib.route(logits, jnp.zeros(cfg.num_experts), cfg), e, cfg)
            return jnp.sum(jnp.sin(y)), y
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

    with jax.default_matmul_precision("highest"):
        (_, y_ref), g_ref = jax.jit(loss(moe_lib.dispatch_dense))(x, logits, experts)
        mesh = sharding.make_mesh({"expert": devices})
        fn = functools.partial(ep.dispatch_ragged_alltoall, always_exchange=True)

        def traced(*args):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return loss(fn)(*args)

        tokens = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert"))
        (_, y), g = jax.jit(traced, in_shardings=(tokens, tokens, tokens))(x, logits, experts)
    y_err = float(jnp.max(jnp.abs(y - y_ref)) / jnp.max(jnp.abs(y_ref)))
    g_err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
                for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)))
    return {"expert_shards": devices, "y_rel_err": y_err, "grad_rel_err": g_err, "ok": y_err < 1e-4 and g_err < 1e-4}


def check_primitive(jax, jnp, np) -> dict:
    from jax.sharding import PartitionSpec as P

    from trainer import expert_parallel as ep
    from trainer import sharding

    devices = jax.device_count()
    mesh = sharding.make_mesh({"expert": devices})
    rows, width = 64, 8
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, rows // devices + 1, (devices, devices)).astype(np.int32)  # [sender, receiver]
    send_offsets = np.cumsum(sizes, axis=1) - sizes
    out_offsets = (np.cumsum(sizes, axis=0) - sizes)  # receiver's buffer: lower-ranked senders first
    operand = jnp.asarray(rng.normal(size=(devices * rows, width)), jnp.float32)
    args = [jnp.asarray(a.reshape(-1)) for a in (send_offsets, sizes, out_offsets, sizes.T)]

    def run(exchange):
        def f(a, in_off, send, out_off, recv):
            return exchange(a, jnp.zeros((devices * rows, width), a.dtype), in_off, send, out_off, recv, axis_name="expert")
        spec = P("expert")
        mapped = jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
        value, vjp = jax.vjp(lambda a: mapped(a, *args), operand)
        return value, vjp(jnp.sin(value))[0]

    real, real_t = jax.jit(lambda: run(jax.lax.ragged_all_to_all))()
    ref, ref_t = jax.jit(lambda: run(ep.ragged_all_to_all_by_gather))()
    err = float(jnp.max(jnp.abs(real - ref)))
    err_t = float(jnp.max(jnp.abs(real_t - ref_t)))
    return {"max_abs_err": err, "transpose_max_abs_err": err_t, "ok": err == 0.0 and err_t < 1e-6}


def bench_step(jax, jnp, np, *, steps: int, batch: int) -> dict:
    from trainer import accounting, model, sharding
    from trainer import step as step_lib
    from trainer.config import (DataConfig, MixturePhase, ModelConfig, MoEConfig, OptimizerConfig, SourceConfig,
                                TrainConfig, TrainJob)

    devices = jax.device_count()
    peak = accounting.peak_flops_per_second(jax.devices()[0].device_kind) * devices
    out = {"device_kind": jax.devices()[0].device_kind, "devices": devices, "peak_flops": peak, "dispatch": {}}
    for dispatch in ("capacity", "ragged", "alltoall", "ragged_alltoall"):
        cfg = ModelConfig(vocab_size=32768, hidden_dim=1024, num_layers=8, num_heads=16, num_kv_heads=4, seq_len=1024,
                          compute_dtype="bfloat16",
                          moe=MoEConfig(num_experts=32, top_k=4, expert_dim=512, capacity_factor=1.25, dispatch=dispatch))
        job = TrainJob(model=cfg, data=DataConfig(sources=[SourceConfig(name="code", kind="stdlib_code")],
                                                  phases=[MixturePhase(weights={"code": 1.0})]),
                       optimizer=OptimizerConfig(learning_rate=1e-3),
                       train=TrainConfig(tokens=batch * 1024 * 100, batch_size=batch, mesh={"expert": devices}))
        mesh = sharding.make_mesh({"expert": devices})
        jitted = step_lib.jit_train_step(job, model, mesh)

        def init(key):
            params = model.init_params(cfg, key)
            return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": jitted.optimizer.init(params),
                    "router_state": model.init_router_state(cfg)}

        state = None
        try:
            state = jax.jit(init, out_shardings=jitted.state_shardings)(jax.random.key(0))
            tokens = jax.device_put(jax.random.randint(jax.random.key(1), (batch, 1025), 0, cfg.vocab_size),
                                    jitted.batch_sharding)
            times = []
            for i in range(steps + 2):
                start = time.perf_counter()
                state, metrics = jitted.train_step(state, tokens, False, 1.0)
                metrics["train/loss"].block_until_ready()
                if i >= 2:
                    times.append(time.perf_counter() - start)
            seconds = sorted(times)[len(times) // 2]
            tps = batch * cfg.seq_len / seconds
            flops = accounting.train_flops(cfg, batch * cfg.seq_len) / seconds
            out["dispatch"][dispatch] = {"tokens_per_s": tps, "mfu": flops / peak,
                                         "loss": float(metrics["train/loss"]),
                                         "drop_fraction": float(metrics["train/router/drop_fraction"])}
        except Exception as err:  # one failing backend must not hide the others' numbers
            out["dispatch"][dispatch] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
        del state
    out["ok"] = all("error" not in r for r in out["dispatch"].values())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    if jax.default_backend() == "cpu":
        print("bench/gpu_checks.py needs a GPU (or TPU): jax.default_backend() is 'cpu', where the ragged "
              "all-to-all cannot compile; the CPU tests are tests/test_trainer_expert_parallel.py.", file=sys.stderr)
        return 2
    results = {"jax": jax.__version__, "devices": [d.device_kind for d in jax.devices()]}
    for name, check in (("layer", check_layer), ("primitive", check_primitive)):
        try:
            results[name] = check(jax, jnp, np)
        except Exception as err:
            results[name] = {"ok": False, "error": f"{type(err).__name__}: {str(err)[:600]}"}
        print(name, json.dumps(results[name]), flush=True)
    results["step"] = bench_step(jax, jnp, np, steps=args.steps, batch=args.batch)
    for dispatch, row in results["step"]["dispatch"].items():
        print(f"step {dispatch:16s} " + (row["error"] if "error" in row else
              f"tokens/s {row['tokens_per_s']:,.0f}  MFU {row['mfu']:.3f}  loss {row['loss']:.3f}  "
              f"drop {row['drop_fraction']:.3f}"), flush=True)
    print("RESULT" + json.dumps(results))
    return 0 if all(results[k]["ok"] for k in ("layer", "primitive", "step")) else 1


if __name__ == "__main__":
    sys.exit(main())
