"""Accounting: analytic counts match what the model allocates, and Marin's published ladder numbers
are reproduced from ModelConfigs declared here (marin_hero_specs.md §1, §2, §4)."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from trainer import accounting
from trainer.accounting import count_params, forward_flops_per_token, train_flops
from trainer.config import ModelConfig, MoEConfig
from trainer.model import init_params, param_shapes

# ------------------------------------------------------------------------------------------
# Analytic total == allocated pytree


SMALL_CONFIGS = {
    "dense": ModelConfig(hidden_dim=32, num_layers=2, num_heads=4, seq_len=16),
    "dense_tied_gqa": ModelConfig(hidden_dim=32, num_layers=3, num_heads=4, num_kv_heads=2, tie_embeddings=True, seq_len=16),
    "moe": ModelConfig(hidden_dim=32, num_layers=2, num_heads=4, seq_len=16, moe=MoEConfig(num_experts=4, top_k=2, expert_dim=24)),
    "moe_shared_latent_dense_lead": ModelConfig(
        hidden_dim=48, num_layers=4, num_heads=4, num_kv_heads=2, global_kv_heads=1, sliding_window=8, global_every=2,
        seq_len=16, dense_ffn_dim=80,
        moe=MoEConfig(num_experts=6, top_k=2, expert_dim=16, num_shared_experts=2, shared_expert_dim=20,
                      latent_dim=24, num_dense_layers=1),
    ),
    "moe_head_dim": ModelConfig(hidden_dim=40, num_layers=2, num_heads=2, head_dim=16, seq_len=16,
                                moe=MoEConfig(num_experts=3, top_k=1, expert_dim=8, num_shared_experts=1)),
}


@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS))
def test_analytic_total_equals_initialised_pytree(name):
    cfg = SMALL_CONFIGS[name]
    params = init_params(cfg, jax.random.key(0))
    allocated = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    counts = count_params(cfg)
    assert counts.total == allocated
    groups = {"embedding": counts.embedding, "lm_head": counts.lm_head}
    assert counts.total == counts.non_embedding_total + sum(groups.values())


def test_active_counts_k_of_e_experts_and_excludes_embeddings():
    cfg = SMALL_CONFIGS["moe_shared_latent_dense_lead"]
    c = count_params(cfg)
    m = cfg.moe
    per_expert = 3 * m.latent_dim * m.expert_dim
    moe_layers = cfg.num_layers - m.num_dense_layers
    assert c.routed_experts == moe_layers * m.num_experts * per_expert
    assert c.routed_experts_active == moe_layers * m.top_k * per_expert
    assert c.total - c.active == c.embedding + c.lm_head + c.routed_experts - c.routed_experts_active


def test_hero_sized_config_is_counted_without_allocating():
    counts = count_params(MARIN["d6144"])
    assert counts.total > 5e11  # 535B-class, computed analytically in microseconds


def test_ladder_flops_scale_with_tokens_and_window():
    cfg = SMALL_CONFIGS["moe_shared_latent_dense_lead"]
    fwd = forward_flops_per_token(cfg)
    assert train_flops(cfg, 1000) == pytest.approx(3 * fwd * 1000)
    assert forward_flops_per_token(cfg, include_lm_head=False) == fwd - 2 * cfg.hidden_dim * cfg.vocab_size
    no_window = cfg.model_copy(update={"sliding_window": None})
    # 2 of 4 layers are local (window 8 of 16): full attention adds 4 * (16 - 8) * H * hd per local layer
    extra = 2 * 4 * (16 - 8) * cfg.num_heads * cfg.resolved_head_dim
    # the 2 local layers become global, with 1 kv head instead of 2: k and v lose 2*d*hd weights, 2 FLOPs each
    kv_change = 2 * 2 * (2 * cfg.hidden_dim * (1 - 2) * cfg.resolved_head_dim)
    assert forward_flops_per_token(no_window) == pytest.approx(fwd + extra + kv_change)


# ------------------------------------------------------------------------------------------
# Marin's five runs


def _marin(d: int, layers: int, local_kv: int, global_kv: int) -> ModelConfig:
    half = d // 2
    return ModelConfig(
        vocab_size=128_256, hidden_dim=d, num_layers=layers, num_heads=d // 128, head_dim=128,
        num_kv_heads=local_kv, global_kv_heads=global_kv, seq_len=4096, sliding_window=2048, global_every=4,
        tie_embeddings=False,
        moe=MoEConfig(num_experts=384, top_k=8, expert_dim=half, latent_dim=half, num_shared_experts=2,
                      shared_expert_dim=half, router_score="sigmoid", balancing="quantile", capacity_factor=1.15),
    )


MARIN = {
    "d768": _marin(768, 8, 1, 1),
    "d1024": _marin(1024, 12, 2, 1),
    "d1536": _marin(1536, 16, 3, 1),
    "d2048": _marin(2048, 22, 4, 2),
    "d6144": _marin(6144, 48, 12, 6),
}
# Published (marin_hero_specs.md §1): active, naming total, tokens, run FLOPs.
PUBLISHED = {
    "d768": (60.6e6, 1.588e9, 47_898_951_680, 5.48e19),
    "d1024": (162.0e6, 3.973e9, 128_144_375_808, 2.74e20),
    "d1536": (481.3e6, 11.52e9, 380_708_585_472, 1.83e21),
    "d2048": (1.171e9, 27.72e9, 926_068_768_768, 9.20e21),
    "d6144": (22.76e9, 535.3e9, 18_005_144_633_344, 2.70e24),
}


@pytest.mark.parametrize("rung", sorted(PUBLISHED))
def test_marin_active_total_and_run_flops_within_half_percent(rung):
    cfg = MARIN[rung]
    active, total, tokens, flops = PUBLISHED[rung]
    assert accounting.marin_active_params(cfg) == pytest.approx(active, rel=5e-3)
    assert accounting.marin_total_params(cfg) == pytest.approx(total, rel=5e-3)
    assert train_flops(cfg, tokens, convention="marin") == pytest.approx(flops, rel=5e-3)


def test_marin_exact_integers_from_the_worked_arithmetic():
    """§4a/§4b/§4d give exact integers for d768 and the hero; they match to the unit."""
    assert accounting.marin_active_params(MARIN["d768"]) == 60_555_264
    assert accounting.marin_total_params(MARIN["d768"]) == 1_588_199_424
    assert accounting.marin_active_params(MARIN["d6144"]) == 22_762_487_808
    assert accounting.marin_total_params(MARIN["d6144"]) == 535_305_388_032
    assert forward_flops_per_token(MARIN["d768"], convention="marin") == 381_394_944
    # the forecast x-axis drops the lm_head term
    assert forward_flops_per_token(MARIN["d768"], convention="marin", include_lm_head=False) == 381_394_944 - 2 * 768 * 128_256


def test_marin_model_allocates_more_global_layers_than_its_flops_code_counts():
    cfg = MARIN["d2048"]
    assert sum(cfg.is_global_layer(i) for i in range(cfg.num_layers)) == 6  # every 4th plus the last
    assert cfg.num_layers // cfg.global_every == 5  # what _compute_flops counts


# ------------------------------------------------------------------------------------------
# Peak FLOP/s


def test_peak_table_resolves_jax_device_kinds():
    assert accounting.peak_flops_per_second("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert accounting.peak_flops_per_second("NVIDIA H200") == pytest.approx(989.4e12)
    assert accounting.peak_flops_per_second("NVIDIA GB200") == pytest.approx(2.5e15)
    assert accounting.peak_flops_per_second("TPU v4") == pytest.approx(275e12)
    assert accounting.peak_flops_per_second("TPU v5p") == pytest.approx(459e12)
    assert accounting.peak_flops_per_second("TPU v6 lite") == pytest.approx(918e12)
    with pytest.raises(ValueError, match="no peak FLOP/s known"):
        accounting.peak_flops_per_second("abacus")


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LADDER_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(accounting, "measure_cpu_matmul_peak", lambda: calls.append(1) or 123e9)
    assert accounting.peak_flops_per_second(None) == 123e9
    assert accounting.peak_flops_per_second("cpu") == 123e9
    assert len(calls) == 1
    assert json.loads((tmp_path / "cpu_matmul_peak.json").read_text())["flops_per_second"] == 123e9


def test_cpu_matmul_measurement_is_plausible():
    peak = accounting.measure_cpu_matmul_peak(size=256, repeats=3)
    assert 1e8 < peak < 1e14 and math.isfinite(peak)


def test_mfu_is_model_flops_over_peak():
    cfg = SMALL_CONFIGS["moe"]
    assert accounting.mfu(cfg, 1000.0, 1e12) == pytest.approx(3 * forward_flops_per_token(cfg) * 1000 / 1e12)


@pytest.mark.parametrize("rung", sorted(PUBLISHED))
def test_marin_shapes_as_allocated_match_count_params_without_allocating(rung):
    """What our model would allocate for each Marin rung (shapes only) equals the analytic total; it is
    below Marin's naming total because global layers use fewer KV heads than Marin's max(local, global)."""
    cfg = MARIN[rung]
    shapes = jax.tree.leaves(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple) and all(isinstance(n, int) for n in s))
    allocated = sum(int(np.prod(s)) for s in shapes)
    assert allocated == count_params(cfg).total
    naming = accounting.marin_total_params(cfg)
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_dim
    assert allocated - norms <= naming
    assert allocated == pytest.approx(naming, rel=5e-3)
