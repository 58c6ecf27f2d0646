"""experiments/marin_535b.py: the plan's derived numbers are Marin's published figures (marin_hero_specs.md §1, §5b, §6b)."""

from __future__ import annotations

import json

import pytest

from ladder.dag import FitStep, TrainStep
from ladder.executor import plan
from ladder.loader import load_experiment
from ladder.store import Store

RUNS = ("d768", "d1024", "d1536", "d2048", "hero")
PUBLISHED_ACTIVE = dict(zip(RUNS, (60.6e6, 162.0e6, 481.3e6, 1.171e9, 22.76e9)))
PUBLISHED_TOTAL = dict(zip(RUNS, (1.588e9, 3.973e9, 11.52e9, 27.72e9, 535.3e9)))
PUBLISHED_FLOPS = dict(zip(RUNS, (5.48e19, 2.74e20, 1.83e21, 9.20e21, 2.70e24)))
# C without the lm_head: the FLOPS constants of Marin's plot_scaling_ladder.py (rungs.csv)
PUBLISHED_C_NO_HEAD = dict(zip(RUNS, (2.649679880270119e19, 1.7261182741798453e20, 1.3813258500033133e21,
                                      7.741814947656449e21, 2.6108941613772703e24)))
STEPS = dict(zip(RUNS, (11_420, 15_276, 15_128, 20_072, 390_251)))
MUONH_LR = dict(zip(RUNS, (0.0158190, 0.0144112, 0.0148894, 0.0134217, 0.003290470163)))
ADAM_LR = dict(zip(RUNS, (0.0036505, 0.0033257, 0.0034360, 0.0030973, 0.000759339268)))
EPSILON = dict(zip(RUNS, (1.034e-15, 1.196e-15, 1.190e-15, 1.371e-15, 6.0446e-15)))
BETA2 = dict(zip(RUNS, (0.96849, 0.95, 0.95, 0.95, 0.95)))
PHASE_1_START = dict(zip(RUNS, (9_120, 12_216, 12_096, 16_032, 312_192)))
RACKS = dict(zip(RUNS, (1, 2, 6, 11, 11)))


@pytest.fixture(scope="module")
def exp():
    return load_experiment("experiments/marin_535b.py")


def test_dag_is_four_rungs_fit_then_hero(exp):
    assert exp.dag.order == ["d768", "d1024", "d1536", "d2048", "fit", "hero"]
    fit = exp.dag["fit"]
    assert isinstance(fit, FitStep) and fit.target == "hero" and fit.deps == ("d768", "d1024", "d1536", "d2048")


@pytest.mark.parametrize("run", RUNS)
def test_derived_numbers_are_the_published_figures(exp, run):
    d = exp.dag[run].derived
    assert d.accounting == "marin"
    assert d.params_active == pytest.approx(PUBLISHED_ACTIVE[run], rel=5e-3)
    assert d.params_total == pytest.approx(PUBLISHED_TOTAL[run], rel=5e-3)
    assert d.total_flops == pytest.approx(PUBLISHED_FLOPS[run], rel=5e-3)
    assert 3 * d.flops_per_token_no_lm_head * d.tokens == pytest.approx(PUBLISHED_C_NO_HEAD[run], rel=1e-9)
    assert d.num_steps == STEPS[run]
    assert d.tokens_per_step == 1024 * RACKS[run] * 4096


def test_hero_exact_integers(exp):
    d = exp.dag["hero"].derived
    assert (d.params_active, d.params_total, d.tokens) == (22_762_487_808, 535_305_388_032, 18_005_144_633_344)


@pytest.mark.parametrize("run", RUNS)
def test_optimizer_is_the_lr_heuristic_as_run(exp, run):
    spec = exp.dag[run].spec
    o = spec.optimizer
    assert o.name == "muonh" and (o.momentum, o.nesterov, o.ns_steps, o.ns_dtype) == (0.95, True, 5, "bfloat16")
    assert o.learning_rate == pytest.approx(MUONH_LR[run], rel=2e-5)  # MuonH and AdamH (lm_head)
    assert o.resolved_adam_learning_rate == pytest.approx(ADAM_LR[run], rel=2e-5)  # embeddings, router, gains
    assert o.epsilon == pytest.approx(EPSILON[run], rel=1e-3)
    assert o.beta2 == pytest.approx(BETA2[run], abs=5e-6)
    assert (o.beta1, o.weight_decay, o.max_grad_norm) == (0.9, 0.0, None)
    assert (o.schedule.kind, o.schedule.warmup, o.schedule.min_lr_fraction) == ("linear", 0.01, 0.05)
    assert spec.model.logit_z_loss_weight == 1e-4


@pytest.mark.parametrize("run", RUNS)
def test_mixture_switches_at_marins_phase_1_step(exp, run):
    spec = exp.dag[run].spec
    phases = spec.data.phases
    assert len(phases) == 2 and len(spec.data.sources) == 200
    assert phases[1].start_fraction * STEPS[run] == pytest.approx(PHASE_1_START[run], abs=1e-6)
    assert spec.tags["phase_1_start_step"] == str(PHASE_1_START[run])


def test_ladder_and_hero_mixtures_are_appendix_a(exp):
    table = json.loads(open("experiments/marin_535b_mixture.json").read())
    rung, hero = exp.dag["d768"].spec.data, exp.dag["hero"].spec.data
    # spot values from the reference (§6d, Appendix A): the two mixtures differ, e.g. c00q0
    assert rung.phases[0].weights["c00q0"] == 0.0002759551045798378
    assert hero.phases[0].weights["c00q0"] == 4.657781023742571e-06
    assert hero.phases[1].weights["c13q3"] == 0.0520169205245205
    assert rung.phases[0].weights == {c: w[0] for c, w in table["weights"].items()}
    assert hero.phases[1].weights == {c: w[3] for c, w in table["weights"].items()}
    # L1 distances between ladder and hero mixtures (§6d): 0.41 in phase 0, 0.81 in phase 1
    l1 = [sum(abs(rung.phases[p].weights[c] - hero.phases[p].weights[c]) for c in table["weights"]) for p in (0, 1)]
    assert l1 == pytest.approx([0.41, 0.81], abs=0.005)
    assert next(s for s in hero.sources if s.name == "c07q3").paths[0].endswith("store_4d2e363d/cluster=07/quality=3")


@pytest.mark.parametrize("run", RUNS)
def test_architecture_and_resources(exp, run):
    spec = exp.dag[run].spec
    m = spec.model
    assert m.num_heads * 128 == m.hidden_dim and m.resolved_head_dim == 128
    assert (m.vocab_size, m.seq_len, m.sliding_window, m.global_every, m.tie_embeddings) == (128_256, 4096, 2048, 4, False)
    e = m.moe
    assert (e.num_experts, e.top_k, e.expert_dim, e.latent_dim, e.num_shared_experts, e.shared_expert_dim) == (
        384, 8, m.hidden_dim // 2, m.hidden_dim // 2, 2, m.hidden_dim // 2)
    assert (e.router_score, e.balancing, e.quantile_bins, e.capacity_factor, e.aux_loss) == ("sigmoid", "quantile", 10_000, 1.15, "none")
    r = spec.resources
    assert (r.accelerator_type, r.gpus, r.hosts) == ("GB200", 4, 16 * RACKS[run])
    assert r.gpus * r.hosts == 64 * RACKS[run] == spec.train.mesh["data"] * spec.train.mesh["expert"]


def test_accounting_is_not_identity(exp):
    spec = exp.dag["d768"].spec
    ours = spec.model_copy(update={"accounting": "ladder"})
    assert ours.identity() == spec.identity()
    assert ours.derived().params_active != spec.derived().params_active  # same job, other convention


def test_plan_hero_accelerator_hours_at_23_percent_mfu(exp, tmp_path):
    """The reference: ~3 months on 704 GB200s at ~23% MFU. 2.696e24 / (704 x 2.5e15 x 0.23) = 77 days."""
    from trainer.accounting import peak_flops_per_second

    rows = {row.name: row for row in plan(exp.dag, Store(str(tmp_path)))}
    assert [rows[n].state for n in RUNS] == ["pending"] * 5
    hero = exp.dag["hero"]
    gpus = hero.spec.resources.gpus * hero.spec.resources.hosts
    gpu_hours = rows["hero"].flops / (peak_flops_per_second("GB200") * 0.23) / 3600
    days = gpu_hours / gpus / 24
    assert gpus == 704 and 70 < days < 95  # "about 3 months"
    assert isinstance(hero, TrainStep)


# Marin's exact counts (reference §4c, #9277 for the hero): every norm, GatedNorm, gate and convolution, plus the
# router bias (E per layer; in our trainer it is router state, not a parameter, so both trees are summed).
EXACT_PARAMS = dict(zip(RUNS, (1_591_848_448, 3_980_116_480, 11_534_398_464, 27_742_902_528, 535_477_106_688)))


@pytest.mark.parametrize("run", RUNS)
def test_allocated_tree_is_marins_exact_count(exp, run):
    """The trainer's real init, traced with jax.eval_shape (nothing is allocated), has Marin's exact count."""
    import jax
    import numpy as np

    from trainer import accounting, model

    cfg = exp.dag[run].spec.model
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    router_state = jax.eval_shape(lambda: model.init_router_state(cfg))
    size = lambda tree: sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))  # noqa: E731
    assert size(params) + size(router_state) == EXACT_PARAMS[run]
    assert size(router_state) == cfg.num_layers * cfg.moe.num_experts
    assert accounting.count_params(cfg).total == size(params)
