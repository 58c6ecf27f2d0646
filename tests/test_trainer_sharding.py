"""Sharding: a jitted loss+grad with params and batch placed on an 8-device CPU mesh matches the
single-device values. Runs in a subprocess because the fake device count must be set before JAX
initialises its backend, which other tests in this pytest process may already have done."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from trainer import model, sharding
    from trainer.config import ModelConfig, MoEConfig

    cfg = ModelConfig(hidden_dim=32, num_layers=3, num_heads=4, num_kv_heads=2, seq_len=16, sliding_window=8,
                      global_every=2, dense_ffn_dim=64,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, num_shared_experts=1, latent_dim=24,
                                    num_dense_layers=1, capacity_factor=1.0))
    params = model.init_params(cfg, jax.random.key(0))
    state = model.init_router_state(cfg)
    batch = jax.random.randint(jax.random.key(1), (8, cfg.seq_len + 1), 0, cfg.vocab_size)

    def loss_and_grad(p, s, b):
        (loss, aux), grads = jax.value_and_grad(lambda q: model.loss_fn(q, s, b, cfg), has_aux=True)(p)
        return loss, aux["drop_fraction"], grads

    ref_loss, ref_drop, ref_grads = jax.jit(loss_and_grad)(params, state, batch)
    out = {"devices": len(jax.devices()), "ref_loss": float(ref_loss), "ref_drop": float(ref_drop), "meshes": {}}
    for axes in ({"data": 2, "fsdp": 2, "expert": 2},):
        mesh = sharding.make_mesh(axes)
        p_sh = sharding.param_shardings(params, cfg, mesh)
        sharded_params = jax.device_put(params, p_sh)
        sharded_batch = jax.device_put(batch, sharding.batch_sharding(mesh))
        sharded_state = jax.device_put(state, sharding.replicated(mesh))
        fn = jax.jit(loss_and_grad, in_shardings=(p_sh, sharding.replicated(mesh), sharding.batch_sharding(mesh)))
        loss, drop, grads = fn(sharded_params, sharded_state, sharded_batch)
        w = sharded_params["blocks"]["001"]["ffn"]["experts"]["w_gate"]
        diffs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))]
        scale = max(float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(ref_grads))
        out["meshes"][json.dumps(axes)] = {
            "loss": float(loss), "drop": float(drop), "max_grad_diff": max(diffs), "grad_scale": scale,
            "expert_spec": [str(a) for a in w.sharding.spec],
            "expert_shard_shape": list(w.addressable_shards[0].data.shape),
            "batch_shard_rows": int(sharded_batch.addressable_shards[0].data.shape[0]),
        }
    print("RESULT" + json.dumps(out))
    """
)


def test_sharded_loss_and_grads_match_single_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["devices"] == 8
    assert result["ref_drop"] > 0  # capacity factor 1.0 drops: the sharded run must drop the same tokens
    for axes, r in result["meshes"].items():
        assert r["loss"] == pytest.approx(result["ref_loss"], rel=1e-5), axes
        assert r["drop"] == pytest.approx(result["ref_drop"]), axes
        assert r["max_grad_diff"] <= 1e-4 * r["grad_scale"] + 1e-7, axes
        assert r["expert_spec"][0] == "expert" and r["expert_shard_shape"][0] == 2, axes
        assert r["batch_shard_rows"] == 1, axes
        assert r["expert_spec"].count("fsdp") == 1, axes
