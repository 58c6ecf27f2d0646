"""Marin's block pieces (trainer/blocks.py and their wiring in trainer/model.py): each against its formula on
small inputs, the attention with every piece against a naive full-mask reference, the pieces' pass-through
initialisation, exact parameter accounting, unchanged fingerprints at the defaults, and the sharded step
(8 fake devices, every piece on) against the single-device step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydantic import ValidationError

from trainer import accounting, blocks, model
from trainer.config import ModelConfig, MoEConfig, identity_payload

ALL_PIECES = dict(
    gated_norm_rank=8, embed_norm=True, sconv_kernel=4, sconv_sites=("k", "v", "attn", "mlp"), qk_norm=True,
    qk_mult=1.3, rope_global_layers=False, rope_fraction=0.5, xsa=True, head_gate=True, kv_heads_layout="stored_max",
)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ------------------------------------------------------------------------------------------
# Each piece against its formula


def test_gated_norm_is_x_times_sigmoid_of_low_rank_silu():
    r = _rng()
    x, w_down, w_up = r.normal(size=(5, 6)), r.normal(size=(6, 3)), r.normal(size=(3, 6))
    h = x @ w_down
    expected = x / (1 + np.exp(-((h / (1 + np.exp(-h))) @ w_up)))
    got = blocks.gated_norm({"w_down": jnp.asarray(w_down, jnp.float32), "w_up": jnp.asarray(w_up, jnp.float32)},
                            jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)


def test_short_causal_conv_is_the_depthwise_causal_sum():
    r = _rng(1)
    x, kernel = r.normal(size=(2, 7, 3)), r.normal(size=(4, 3))
    expected = np.zeros_like(x)
    for t in range(7):
        for j in range(4):
            if t - j >= 0:
                expected[:, t] += kernel[j] * x[:, t - j]
    got = np.asarray(blocks.short_causal_conv(jnp.asarray(x, jnp.float32), jnp.asarray(kernel, jnp.float32)))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # causal: changing position 5 leaves every earlier output alone
    x2 = x.copy()
    x2[:, 5] += 10.0
    got2 = np.asarray(blocks.short_causal_conv(jnp.asarray(x2, jnp.float32), jnp.asarray(kernel, jnp.float32)))
    np.testing.assert_allclose(got2[:, :5], got[:, :5], rtol=0, atol=0)
    assert not np.allclose(got2[:, 5], got[:, 5])
    # the identity kernel (Marin's init) passes the input through
    ident = blocks.identity_conv_kernel((4, 3))
    np.testing.assert_array_equal(np.asarray(blocks.short_causal_conv(jnp.asarray(x, jnp.float32), ident)),
                                  np.asarray(x, np.float32))


def test_qk_rms_gives_unit_root_mean_square_per_head():
    x = jnp.asarray(_rng(2).normal(size=(2, 3, 4, 16)) * 7.0, jnp.float32)
    rms = np.sqrt(np.mean(np.square(np.asarray(blocks.qk_rms(x))), axis=-1))
    np.testing.assert_allclose(rms, 1.0, rtol=1e-4)


def test_xsa_removes_exactly_the_component_along_the_own_value():
    r = _rng(3)
    y, v = r.normal(size=(2, 5, 4, 8)), r.normal(size=(2, 5, 4, 8))
    z = np.asarray(blocks.exclusive_self_attention(jnp.asarray(y, jnp.float32), jnp.asarray(v, jnp.float32)))
    coef = np.sum(y * v, -1, keepdims=True) / (np.sum(v * v, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(z, y - coef * v, rtol=1e-5, atol=1e-6)
    assert np.max(np.abs(np.sum(z * v, -1))) < 1e-4  # what is left is orthogonal to the head's own value
    # a y already orthogonal to v is unchanged
    y_perp = y - np.sum(y * v, -1, keepdims=True) / np.sum(v * v, -1, keepdims=True) * v
    z_perp = blocks.exclusive_self_attention(jnp.asarray(y_perp, jnp.float32), jnp.asarray(v, jnp.float32))
    np.testing.assert_allclose(np.asarray(z_perp), y_perp, rtol=1e-4, atol=1e-5)


def test_head_gate_is_two_sigmoid_and_one_at_zero_weights():
    r = _rng(4)
    x, w = r.normal(size=(6, 5)), r.normal(size=(5, 3))
    np.testing.assert_allclose(np.asarray(blocks.head_gate(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))),
                               2 / (1 + np.exp(-(x @ w))), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(blocks.head_gate(jnp.asarray(x, jnp.float32), jnp.zeros((5, 3)))), 2 * 0.5)


# ------------------------------------------------------------------------------------------
# The attention with every piece, against a naive full-mask reference written from the formulas


def _reference_attention(p, x_BxLxD, cfg: ModelConfig, layer: int) -> np.ndarray:
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x_BxLxD, np.float64)
    b, length, _ = x.shape
    _, h, k = p["wq"].shape
    stored, g = p["wk"].shape[1], model.layer_kv_heads(cfg, layer)

    def conv(flat, kernel):
        out = np.zeros_like(flat)
        for j in range(kernel.shape[0]):
            out[:, j:] += kernel[j] * flat[:, : length - j]
        return out

    def kv(w, site):
        flat = np.einsum("bld,dgk->blgk", x, w).reshape(b, length, stored * k)
        if cfg.sconv_at(site):
            flat = conv(flat, p[f"sconv_{site}"])
        return flat.reshape(b, length, stored, k)[:, :, :g]

    q = np.einsum("bld,dhk->blhk", x, p["wq"])
    key, value = kv(p["wk"], "k"), kv(p["wv"], "v")
    if cfg.qk_norm:
        q = q / np.sqrt(np.mean(q**2, -1, keepdims=True) + 1e-6)
        key = key / np.sqrt(np.mean(key**2, -1, keepdims=True) + 1e-6)
    if cfg.rope_global_layers or not cfg.is_global_layer(layer):
        rd = cfg.rotary_dim
        freq = cfg.rope_theta ** (-np.arange(rd // 2) * 2.0 / rd)
        ang = np.arange(length)[:, None] * freq[None, :]
        cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]

        def rot(t):
            a, c, rest = t[..., : rd // 2], t[..., rd // 2 : rd], t[..., rd:]
            return np.concatenate([a * cos - c * sin, c * cos + a * sin, rest], -1)

        q, key = rot(q), rot(key)
    q = q * cfg.qk_mult / np.sqrt(k)
    kh, vh = np.repeat(key, h // g, axis=2), np.repeat(value, h // g, axis=2)
    scores = np.einsum("blhk,bmhk->bhlm", q, kh)
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    allowed = j <= i
    window = model.layer_window(cfg, layer)
    if window is not None:
        allowed &= i - j < window
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = np.einsum("bhlm,bmhk->blhk", probs, vh)
    if cfg.xsa:
        y = y - np.sum(y * vh, -1, keepdims=True) / (np.sum(vh * vh, -1, keepdims=True) + 1e-6) * vh
    if cfg.head_gate:
        y = y * (2 / (1 + np.exp(-np.einsum("bld,dh->blh", x, p["head_gate"]))))[..., None]
    return np.einsum("blhk,hkd->bld", y, p["wo"])


def _random_params(cfg: ModelConfig, seed: int) -> dict:
    """init_params with the deterministic leaves (gains, identity convs, zero gates) replaced by random draws,
    so a test sees every piece act."""
    params = model.init_params(cfg, jax.random.key(seed))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [
        leaf + 0.3 * jax.random.normal(key, leaf.shape, leaf.dtype) for leaf, key in zip(leaves, keys)])


@pytest.mark.parametrize("layer", [0, 1, 3], ids=["local", "global-mid", "global-last"])
def test_attention_with_every_piece_matches_the_naive_reference(layer):
    # 80 positions: two query blocks, so the blocked, windowed core is exercised
    cfg = ModelConfig(hidden_dim=32, num_layers=4, num_heads=4, num_kv_heads=2, global_kv_heads=1, seq_len=80,
                      sliding_window=24, global_every=2, **ALL_PIECES)
    p = _random_params(cfg, 0)["blocks"][f"{layer:03d}"]["attention"]
    x = jnp.asarray(_rng(5).normal(size=(2, 80, 32)), jnp.float32)
    got = model.attention(p, x.reshape(-1, 32), 2, cfg, model.layer_window(cfg, layer),
                          kv_heads=model.layer_kv_heads(cfg, layer),
                          rope=cfg.rope_global_layers or not cfg.is_global_layer(layer))
    assert p["wk"].shape[1] == 2  # stored max(local, global) on every layer
    np.testing.assert_allclose(np.asarray(got).reshape(2, 80, 32), _reference_attention(p, x, cfg, layer),
                               rtol=2e-4, atol=2e-5)


def test_attention_pieces_off_is_todays_attention():
    """The same reference with every piece off: the default path is the plain rotary GQA it was."""
    cfg = ModelConfig(hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=80, sliding_window=24,
                      global_every=2)
    p = _random_params(cfg, 3)["blocks"]["000"]["attention"]
    x = jnp.asarray(_rng(6).normal(size=(2, 80, 32)), jnp.float32)
    got = model.attention(p, x.reshape(-1, 32), 2, cfg, model.layer_window(cfg, 0))
    np.testing.assert_allclose(np.asarray(got).reshape(2, 80, 32), _reference_attention(p, x, cfg, 0),
                               rtol=2e-4, atol=2e-5)


def test_block_order_norm_gatednorm_attention_conv_residual():
    """A dense block with every piece, against the composition written out (Marin's Block.__call__ order)."""
    cfg = ModelConfig(hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=16, dense_ffn_dim=48,
                      sliding_window=8, global_every=2, **ALL_PIECES)
    blk = _random_params(cfg, 7)["blocks"]["000"]
    x = jnp.asarray(_rng(8).normal(size=(2 * 16, 32)), jnp.float32)
    got, _ = model._block(blk, x, None, cfg=cfg, layer=0, batch=2, dispatch="dense")
    h = blocks.gated_norm(blk["attn_gated_norm"], blocks.rms_norm(x, blk["attn_norm"], cfg.norm_eps))
    a = _reference_attention(blk["attention"], np.asarray(h).reshape(2, 16, 32), cfg, 0).reshape(-1, 32)
    x1 = x + blocks.short_causal_conv_tokens(jnp.asarray(a, jnp.float32), blk["sconv_attn"], 2)
    h = blocks.gated_norm(blk["ffn_gated_norm"], blocks.rms_norm(x1, blk["ffn_norm"], cfg.norm_eps))
    f = model.dense_ffn(blk["ffn"], h)
    expected = x1 + blocks.short_causal_conv_tokens(f, blk["sconv_ffn"], 2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-4, atol=2e-5)


def test_convs_and_head_gates_start_as_pass_through():
    """Identity convolutions and zero head gates at init: the model computes what the plain model computes with
    the same other weights (Marin's init; so adding them costs nothing at step 0)."""
    plain = ModelConfig(hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=16,
                        moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, dispatch="dense"))
    pieces = plain.model_copy(update={"sconv_kernel": 4, "sconv_sites": ("k", "v", "attn", "mlp"), "head_gate": True})
    base = model.init_params(plain, jax.random.key(0))
    fresh = model.init_params(pieces, jax.random.key(0))
    merged = jax.tree_util.tree_map(lambda a: a, fresh)
    for name, blk in base["blocks"].items():
        for key, value in blk.items():
            if isinstance(value, dict):
                merged["blocks"][name][key].update(value)
            else:
                merged["blocks"][name][key] = value
    merged["embed"], merged["lm_head"], merged["final_norm"] = base["embed"], base["lm_head"], base["final_norm"]
    conv = fresh["blocks"]["000"]["sconv_attn"]
    assert float(conv[0].min()) == 1.0 and float(jnp.abs(conv[1:]).max()) == 0.0
    assert float(jnp.abs(fresh["blocks"]["000"]["attention"]["head_gate"]).max()) == 0.0
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 256)
    state = model.init_router_state(plain)
    want, _ = model.forward(base, state, tokens, plain)
    got, _ = model.forward(merged, state, tokens, pieces)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# Accounting, groups, defaults


def _moe_all_pieces() -> ModelConfig:
    return ModelConfig(hidden_dim=32, num_layers=5, num_heads=4, num_kv_heads=2, global_kv_heads=1, seq_len=16,
                       sliding_window=8, global_every=2, dense_ffn_dim=48, **ALL_PIECES,
                       moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, num_shared_experts=1, latent_dim=24,
                                     latent_norm=True, num_dense_layers=1))


def test_count_params_counts_every_piece_as_allocated():
    cfg = _moe_all_pieces()
    shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    counts = accounting.count_params(cfg)
    assert counts.total == sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))
    d, r, L = 32, 8, 5
    assert counts.gated_norms == (2 * L + 2) * 2 * d * r  # two per layer, embed and final
    assert counts.attention_gates == L * d * 4
    assert counts.convs == L * 4 * (2 * 2 * 8 + 2 * d)  # k and v at the stored 2 KV heads, attn and mlp at d
    assert counts.norms == (2 * L + 2) * d + 4 * 24  # + embed_norm, + latent_norm on the 4 MoE layers
    plain = ModelConfig(**{k: v for k, v in cfg.model_dump().items() if k not in ALL_PIECES and k != "moe"},
                        moe=cfg.moe.model_copy(update={"latent_norm": False}))
    extra = counts.gated_norms + counts.attention_gates + counts.convs
    # the pieces' matmul-like weights cost 2 FLOPs each per token (ladder convention); so do the extra KV heads
    kv_extra = 2 * (accounting.count_params(cfg).attention - accounting.count_params(plain).attention)
    assert accounting.forward_flops_per_token(cfg) == pytest.approx(
        accounting.forward_flops_per_token(plain) + 2 * extra + kv_extra)
    # Marin's convention counts none of them (its published counts do not)
    assert accounting.marin_total_params(cfg) == accounting.marin_total_params(plain)


def test_param_groups_tell_the_pieces_apart():
    cfg = _moe_all_pieces()
    groups = model.param_groups(jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0))))
    blk = groups["blocks"]["002"]
    assert blk["attn_gated_norm"] == {"w_down": "gated_norm", "w_up": "gated_norm"}
    assert groups["embed_gated_norm"]["w_up"] == groups["final_gated_norm"]["w_down"] == "gated_norm"
    assert (groups["embed_norm"], blk["attn_norm"], blk["ffn"]["latent_norm"]) == ("norm",) * 3
    assert blk["attention"]["head_gate"] == "attention_gate"
    assert {blk["attention"]["sconv_k"], blk["attention"]["sconv_v"], blk["sconv_attn"], blk["sconv_ffn"]} == {"conv"}
    assert blk["attention"]["wq"] == "attention" and groups["lm_head"] == "lm_head" and groups["embed"] == "embedding"


def test_adamw_does_not_decay_the_pass_through_convolutions():
    from trainer import optim

    cfg = _moe_all_pieces()
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    decays = optim.weight_decay_mask(params, model.param_groups(params))
    blk = decays["blocks"]["002"]
    assert not any([blk["attention"]["sconv_k"], blk["attention"]["sconv_v"], blk["sconv_attn"], blk["sconv_ffn"]])
    assert params["blocks"]["002"]["sconv_ffn"].ndim == 2  # a matrix: the ndim rule alone would decay it
    assert blk["attention"]["wq"] and not blk["attn_norm"]


def test_defaults_add_nothing_to_identity_or_params():
    plain = ModelConfig(hidden_dim=32, num_layers=2, num_heads=4, moe=MoEConfig(num_experts=4, latent_dim=16))
    payload = identity_payload(plain)
    new_fields = set(ALL_PIECES) | {"scan_layers"}
    assert not new_fields & set(payload) and "latent_norm" not in payload["moe"]
    assert set(model.param_shapes(plain)) == {"embed", "blocks", "final_norm", "lm_head"}
    assert set(model.param_shapes(plain)["blocks"]["000"]) == {"attn_norm", "attention", "ffn_norm", "ffn"}
    assert set(model.param_shapes(plain)["blocks"]["000"]["attention"]) == {"wq", "wk", "wv", "wo"}
    on = plain.model_copy(update={"xsa": True})
    assert identity_payload(on)["xsa"] is True  # a piece that is on is part of the identity


# Fingerprints of the shipped experiments before the block pieces existed (a23780d^), which adding pieces must not
# move; and what the eval windows moved on purpose (trainer.config.TrainConfig.eval_windows: every eval read the
# split's first windows in a row before, and the local ladder read 4 batches per source, not 16). The local ladder's
# hero then had three heads and the quick ladder's hero three layers of width 64; since 2026-12-07 both take their
# rungs' heads and depth (experiments/local_ladder.py, experiments/local_ladder_quick.py).
LEGACY_FINGERPRINTS = {
    "experiments/local_ladder.py": {"r24": "9088dfa328f106d9", "r32": "02b6a4a4218f3959", "r48": "06ec2d73f83f3f04",
                                    "r64": "363abdd1221cdc0e", "fit": "b3e45e99df5005c2", "hero": "7ee5046e8c17fe48"},
    "experiments/local_ladder_quick.py": {"q16": "46ba83d32e2cc418", "q24": "461d3000845fd8eb",
                                          "q32": "b3a691e32f9af744", "q48": "db3aa78ce12924ee",
                                          "fit": "454130b55dcc5c6b", "hero-quick": "38b8f99feb601513"},
    "experiments/readme_example.py": {"r32": "ee5ec30d74f6e3f9", "r48": "f5a391c30065815b", "r64": "d029546f81ec83a6",
                                      "fit": "21e7f55e31aa2254", "hero": "cb4d5cb939644d9d"},
}
SHIPPED_FINGERPRINTS = {
    "experiments/local_ladder.py": {"r24": "f69468d525fe0b3f", "r32": "21e6936ebc63c974", "r48": "b4b9bfa4ef9c5a55",
                                    "r64": "693d3b596892a6eb", "fit": "990ff3b6ac6b1c69", "hero": "c1663f928d81fdc3"},
    "experiments/local_ladder_quick.py": {"q16": "8829bd557e1582a2", "q24": "44c093fb5ca7c6e5",
                                          "q32": "45b35a41c628255b", "q48": "c67bbb0fabff1ac5",
                                          "fit": "e7d1e93a7e0b0c9d", "hero-quick": "c5446834e9eea5a5"},
    "experiments/readme_example.py": {"r32": "01a948da41871128", "r48": "3e062feef57c0fe2", "r64": "135f3a2ef7f40b61",
                                      "fit": "fd36fa51cdd817fc", "hero": "97963abecfdea333"},
}


@pytest.mark.parametrize("path", sorted(SHIPPED_FINGERPRINTS))
def test_shipped_fingerprints_unchanged(path):
    from ladder.loader import load_experiment

    dag = load_experiment(path).dag
    assert {name: fp[:16] for name, fp in dag.fingerprints.items()} == SHIPPED_FINGERPRINTS[path]


@pytest.mark.parametrize("path", sorted(LEGACY_FINGERPRINTS))
def test_a_ladder_started_before_the_spread_eval_windows_keeps_its_fingerprints_by_asking_for_the_first(path):
    import dataclasses

    from ladder.dag import DAG, TrainStep
    from ladder.loader import load_experiment

    def legacy(step):
        if not isinstance(step, TrainStep):
            return step
        spec = step.spec
        if path == "experiments/local_ladder.py" and step.name == "hero":  # three heads until the ladder took one rule
            spec = spec.model_copy(update={"model": spec.model.model_copy(update={"num_heads": 3})})
        if path == "experiments/local_ladder_quick.py" and step.name == "hero-quick":  # three layers of 64 until then
            from experiments.local_ladder import local_spec

            spec = local_spec(64, 3)
        train = spec.train.model_copy(update={"eval_windows": "first", "eval_batches": 4})
        return dataclasses.replace(step, spec=spec.model_copy(update={"train": train}))

    dag = DAG([legacy(step) for step in load_experiment(path).dag])
    assert {name: fp[:16] for name, fp in dag.fingerprints.items()} == LEGACY_FINGERPRINTS[path]


@pytest.mark.parametrize(
    "update, field",
    [({"rope_fraction": 0.3}, "rope_fraction"), ({"sconv_kernel": 4, "sconv_sites": ()}, "sconv_sites"),
     ({"sconv_sites": ("k", "k")}, "sconv_sites"), ({"kv_heads_layout": "max"}, "kv_heads_layout")],
)
def test_bad_piece_settings_name_the_field(update, field):
    with pytest.raises(ValidationError, match=field):
        ModelConfig(hidden_dim=32, num_heads=4, **update)


# ------------------------------------------------------------------------------------------
# Sharded step with every piece on

SHARDED = textwrap.dedent(
    """
    import json
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from trainer import model, sharding
    from trainer.config import ModelConfig, MoEConfig

    # layer 0: sliding-window, dense FFN; layer 1: global (fewer KV heads), MoE
    cfg = ModelConfig(hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, global_kv_heads=1, seq_len=16,
                      sliding_window=8, global_every=2, dense_ffn_dim=64, **PIECES,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, num_shared_experts=1, latent_dim=24,
                                    latent_norm=True, num_dense_layers=1, capacity_factor=1.0))
    params = model.init_params(cfg, jax.random.key(0))
    # move the pass-through leaves off their init so every piece's gradient path is live
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    params = jax.tree_util.tree_unflatten(treedef, [l + 0.1 * jax.random.normal(k, l.shape) for l, k in zip(leaves, keys)])
    state = model.init_router_state(cfg)
    batch = jax.random.randint(jax.random.key(1), (8, cfg.seq_len + 1), 0, cfg.vocab_size)

    def loss_and_grad(p, s, b):
        (loss, aux), grads = jax.value_and_grad(lambda q: model.loss_fn(q, s, b, cfg), has_aux=True)(p)
        return loss, grads

    ref_loss, ref_grads = jax.jit(loss_and_grad)(params, state, batch)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "expert": 2})
    p_sh = sharding.param_shardings(params, cfg, mesh)
    fn = jax.jit(loss_and_grad, in_shardings=(p_sh, sharding.replicated(mesh), sharding.batch_sharding(mesh)))
    loss, grads = fn(jax.device_put(params, p_sh), jax.device_put(state, sharding.replicated(mesh)),
                     jax.device_put(batch, sharding.batch_sharding(mesh)))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ref_grads)[0]]
    rel = {path: float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / (float(np.max(np.abs(np.asarray(b)))) + 1e-12))
           for path, a, b in zip(paths, jax.tree.leaves(grads), jax.tree.leaves(ref_grads))}
    nonzero = {path: float(np.max(np.abs(np.asarray(b)))) > 0 for path, b in zip(paths, jax.tree.leaves(ref_grads))}
    print("RESULT" + json.dumps({"devices": len(jax.devices()), "ref_loss": float(ref_loss), "loss": float(loss),
                                 "rel": rel, "nonzero": nonzero}))
    """
)


@pytest.mark.slow  # about 25 s: an 8-device subprocess
def test_sharded_step_with_every_piece_matches_single_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = Path(__file__).resolve().parents[1]
    script = f"PIECES = {ALL_PIECES!r}\n" + SHARDED
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["devices"] == 8
    assert result["loss"] == pytest.approx(result["ref_loss"], rel=1e-5)
    pieces = [p for p in result["rel"] if any(n in p for n in ("gated_norm", "sconv_", "head_gate", "latent_norm"))]
    assert len(pieces) >= 20 and all(result["nonzero"][p] for p in pieces)
    worst = max(result["rel"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-4, worst
