"""Marin's 535B-A23B hero and its four-rung ladder, declared as typed specs (as launched, August 2026).

Every number follows ``docs/marin_recipe.md`` (the "reference" below; § are its sections), which
is drawn from Marin's ``experiments/grug/moe_hero_ep/`` launcher, heuristic, FLOP code and the
hero's W&B config. Nothing here is tuned: widths, depths, the LR law, the phase switch and the 200-cell
mixtures are Marin's, and the derived numbers (``ladder plan``) come from ``trainer.accounting`` with
``accounting="marin"`` and reproduce the published names to the digit.

| step  | name tag                 | d    | L  | H  | KV local/global | racks | GPUs | batch  | steps   | tokens  | active | total  | run FLOPs | W&B run             |
|-------|--------------------------|-----:|---:|---:|----------------:|------:|-----:|-------:|--------:|--------:|-------:|-------:|----------:|---------------------|
| d768  | 1.6B-A61M · 48B tok      |  768 |  8 |  6 | 1 / 1           |     1 |   64 |  1,024 |  11,420 |   47.9B |  60.6M | 1.588B |   5.48e19 | rav-ladder-d768-v2  |
| d1024 | 4.0B-A162M · 128B tok    | 1024 | 12 |  8 | 2 / 1           |     2 |  128 |  2,048 |  15,276 |  128.1B | 162.0M | 3.973B |   2.74e20 | rav-ladder-d1024    |
| d1536 | 11.5B-A481M · 381B tok   | 1536 | 16 | 12 | 3 / 1           |     6 |  384 |  6,144 |  15,128 |  380.7B | 481.3M | 11.52B |   1.83e21 | rav-ladder-d1536    |
| d2048 | 27.7B-A1.2B · 926B tok   | 2048 | 22 | 16 | 4 / 2           |    11 |  704 | 11,264 |  20,072 |  926.1B | 1.171B | 27.72B |   9.20e21 | rav-ladder-d2048-v3 |
| hero  | 535B-A23B · 18T tok      | 6144 | 48 | 48 | 12 / 6          |    11 |  704 | 11,264 | 390,251 | 18.005T | 22.76B | 535.3B |   2.70e24 | hero-12d8b6f0-dee637|

Shared by all five (reference §2, §3, §5): head_dim 128; 384 routed experts, top-8, expert width d/2 run
in a LatentMoE latent of width d/2; two always-on shared SwiGLU experts of width d/2; sigmoid router
with quantile-balancing bias (10,000-bin histogram estimator), no auxiliary loss, capacity factor 1.15;
Marin's block: RMSNorm then a rank-128 GatedNorm before attention and before the MLP (and on the embedding and
final norms), short causal convolutions (kernel 4) on K, on the attention output and on the MLP output,
non-parametric q/k RMS with qk_mult 1.3, half-RoPE on sliding-window layers only, XSA and the per-head
2*sigmoid gate before w_o, every layer storing max(local, global) KV heads (global layers use the first
global_kv_heads), and an RMSNorm on the LatentMoE latent;
vocab 128,256, untied; sequence 4,096; sliding window 2,048 with every 4th layer (and the last) global;
init std 0.5/sqrt(d); z-loss 1e-4; linear LR schedule, 1% warmup, decay to 5% of peak; beta1 0.9; no
weight decay; no clipping; seed 0; 791 tokens per active parameter.

Constants and their reasons:
- ``LADDER_RACKS`` 1/2/6/11/11 and ``BATCH_PER_RACK`` 1,024: Marin scales the batch with the racks so
  each GPU keeps 16 sequences (reference §3, ``hero_recipe.HERO_EP_BATCH_SIZE``).
- ``TOKENS_PER_ACTIVE_PARAM`` 791: Marin's launcher constant; steps = max(1, round(791 * active /
  (batch * 4096))) with ``active`` in Marin's convention (§3), giving 11,420/15,276/15,128/20,072/390,251.
- ``ADAM_LR_*``: the "Aug hero LR-sweep refit" (§5a), the coefficients that actually ran (the May
  coefficients do not reproduce the logged LRs). The optimizer is Marin's (``OptimizerConfig(name="muonh")``,
  trainer/muon.py): MuonH (Nesterov momentum 0.95, 5 quintic Newton-Schulz steps in bf16, muon eps 1e-8,
  then the Frobenius hyperball step) for every matrix and the GatedNorm gates, AdamH for the lm_head, both
  at min(0.05, 13/3 x the Adam LR), which is the peak ``learning_rate`` (and what ``optim/learning_rate``
  logs, as Levanter does); Adam at the Adam LR (``adam_learning_rate``) for embeddings, router, per-head
  gates, 1-D gains and conv kernels. Both follow the same linear schedule.
- epsilon = 9.676e-18 * sqrt(steps) and beta2 = clip(0.999^(tokens per step / 131,072), 0.95, 0.9999): §5a.
- beta1 0.9: the hero's W&B config (the heuristic file says 0.9062; 0.9 is what ran, §5c).
- weight decay 0: the config says 0.1 but Marin's MuonH build never applies it (§5c); no clipping
  (``max_grad_norm=None``); z-loss 1e-4 on the final logits; no router z-loss.
- Phase switch: ``requested = int(0.8 * steps)``; ``m = 49,152 / gcd(49,152, batch)``; start =
  max(m, (requested // m) * m) (§6a), i.e. 9,120/12,216/12,096/16,032/312,192 (§6b); our mixture phases
  start at that step's fraction of the run.
- Mixture weights (§6d, Appendix A): the rungs ran the 2026.08.17.1 fit, the hero ran PR #8452's weights;
  both are transcribed as data in ``marin_535b_mixture.json``. Cell ``cNNqM`` reads
  ``{store}/cluster=NN/quality=M``. The hero read ``store_4d2e363d`` (W&B); which store each rung read
  is not verified (same weights either way), so all five use the hero's store. The bucket of
  ``store_4d2e363d`` is the one named for its sibling ``store_81e7e39a`` (an assumption).
- Evals: rungs every round(steps/20) (every 5%, what the matched-progress forecast reads), the hero every
  3,000 steps (§3). Checkpoints: rungs only the final one, the hero every 6,000 steps; all also every
  hour (Marin's rolling temp checkpoint).
- Resources: racks x 16 hosts x 4 GB200 (Marin uses 64 GPUs of each NVL72 rack); mesh expert 64 x
  replica racks (``expert_axis_size=64``, ``replica_axis_size=racks``).

Published results: ``ladder import experiments/marin_535b.py marin-published`` (``ladder.importer``)
registers Marin's four rungs (d2048 as the failed run it is, 5%..80%) and the hero's published first
10% as run directories of these very steps, on Marin's forecast x-axis (C without the lm_head).

The block pieces are ``ModelConfig`` fields (``trainer/blocks.py``): with them the trainer's allocated
parameters plus the router bias are Marin's exact count, 535,477,106,688 for the hero (#9277, reference
§4c); ``accounting="marin"`` still counts what Marin's own counts count (no norms, gates or convolutions).
Small differences that remain in the block: Marin's hero uses the fused RoPE, which pairs adjacent channels
(i, i+1) where ours pairs (i, i + 32) within the rotated half (the same rotation up to a fixed permutation of
q/k channels, which a model trained from scratch absorbs); Marin draws weights from a normal truncated at
3 sigma, ours untruncated.

The optimizer is Marin's as well (MuonH / AdamH / Adam, above). The one difference there: Marin's MuonH
momentum buffer follows its parameter's sharding through explicit reshards and its expert Newton-Schulz uses
QuACK's symmetric GEMM (``use_syrk``); ours is plain jit (GSPMD keeps the expert axis local) with ordinary
matmuls, the same arithmetic.

Marin features our trainer cannot express (the numbers above are not adjusted for them):
bf16 parameters with an fp32 host master
(ours keeps fp32 parameters and computes in bf16); Marin's pooled-wave all-to-all (3 waves, sender cf
1.15) and its dropless ``sonic_cute`` eval backend; simulated epoching of the rungs' data to the
18.75T-token target budget (§6c); Marin's Paloma/uncheatable validation sets (our ``eval/loss`` is the
held-out part of the training mixture); whether Marin renormalised the top-k combine weights at launch
is unverified (ours renormalise to 1). Exact parameter counts with these extras are in §4c.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ladder import ExperimentSpec, ResourceSpec, TrainStep, build_ladder
from trainer import accounting
from trainer.config import (
    DataConfig,
    MixturePhase,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ScheduleConfig,
    SourceConfig,
    TrainConfig,
)

# (d, layers, local KV heads, global KV heads, racks, W&B run name, name tag): reference §1, §2.
LADDER = {
    "d768": (768, 8, 1, 1, 1, "rav-ladder-d768-v2", "1.6B-A61M · 48B tok"),
    "d1024": (1024, 12, 2, 1, 2, "rav-ladder-d1024", "4.0B-A162M · 128B tok"),
    "d1536": (1536, 16, 3, 1, 6, "rav-ladder-d1536", "11.5B-A481M · 381B tok"),
    "d2048": (2048, 22, 4, 2, 11, "rav-ladder-d2048-v3", "27.7B-A1.2B · 926B tok"),
}
HERO = ("hero", (6144, 48, 12, 6, 11, "hero-12d8b6f0-dee637", "535B-A23B · 18T tok"))

VOCAB_SIZE = 128_256  # marin-community/marin-tokenizer (Llama-3 vocabulary), untied embedding and lm_head
SEQ_LEN = 4096
HEAD_DIM = 128
SLIDING_WINDOW = 2048
GLOBAL_EVERY = 4
NUM_EXPERTS = 384
TOP_K = 8
NUM_SHARED_EXPERTS = 2
CAPACITY_FACTOR = 1.15  # Marin's _EP_CAPACITY_FACTOR (receiver and pooled sender)
QUANTILE_BINS = 10_000  # Marin's QB histogram estimator (qb_hist_bins)
Z_LOSS_WEIGHT = 1e-4  # logsumexp z-loss on the final logits; #8435 credits it with fixing grad-norm growth
GATED_NORM_RANK = 128  # model._GATED_NORM_RANK
SCONV_KERNEL = 4  # sconv_kernel
SCONV_SITES = ("k", "attn", "mlp")  # the hero's W&B sconv_sites
QK_MULT = 1.3
ROPE_FRACTION = 0.5  # "half-RoPE": the first half of each head's channels rotate, the rest carry no position

BATCH_PER_RACK = 1024  # sequences; 16 per GPU on 64 GPUs of one NVL72 rack
GPUS_PER_HOST = 4
HOSTS_PER_RACK = 16
TOKENS_PER_ACTIVE_PARAM = 791

# Aug hero LR-sweep refit (heuristic.py, issues #7856/#8003): the Adam-group LR.
ADAM_LR_COEFFICIENT = 0.087571
ADAM_LR_TOKENS_EXPONENT = -0.3461
ADAM_LR_WIDTH_EXPONENT = -0.3448
MAX_LR = 0.05
MUONH_LR_MULTIPLIER = 13 / 3  # Marin's MuonH and AdamH (lm_head) groups run at 13/3 of the Adam group's LR
MUON_MOMENTUM = 0.95  # GrugMoeMuonHConfig: momentum 0.95, nesterov, 5 quintic steps, muon_epsilon 1e-8, bf16 NS
MUON_EPSILON = 1e-8
NS_STEPS = 5
EPSILON_COEFFICIENT = 9.676e-18
BETA1 = 0.9
MIN_LR_FRACTION = 0.05
WARMUP_FRACTION = 0.01

PHASE_1_START_FRACTION = 0.8  # launch_datakit_moe_mix._PHASE_1_START_FRACTION
MIXTURE_BLOCK_SIZE = 49_152  # sequences per mixture block; the switch is aligned to whole blocks
STORE = "s3://marin-us-east-02a/marin/datakit/store_4d2e363d"
TOKENIZER = "hf://marin-community/marin-tokenizer/tokenizer.json"
MIXTURE_FILE = Path(__file__).with_name("marin_535b_mixture.json")

HERO_EVAL_EVERY = 3000
HERO_CHECKPOINT_EVERY = 6000
HOURLY = 3600.0


def marin_model(d: int, layers: int, local_kv: int, global_kv: int) -> ModelConfig:
    half = d // 2
    return ModelConfig(
        vocab_size=VOCAB_SIZE,
        hidden_dim=d,
        num_layers=layers,
        num_heads=d // HEAD_DIM,
        head_dim=HEAD_DIM,
        num_kv_heads=local_kv,
        global_kv_heads=global_kv,
        seq_len=SEQ_LEN,
        sliding_window=SLIDING_WINDOW,
        global_every=GLOBAL_EVERY,
        rope_theta=10_000.0,
        tie_embeddings=False,
        logit_z_loss_weight=Z_LOSS_WEIGHT,
        norm_eps=1e-5,
        compute_dtype="bfloat16",
        # Marin's block (reference §2): GatedNorm, short convs, q/k RMS with qk_mult, half-RoPE on local layers only,
        # XSA, the per-head gate, and every layer storing max(local, global) KV heads
        gated_norm_rank=GATED_NORM_RANK,
        embed_norm=True,
        sconv_kernel=SCONV_KERNEL,
        sconv_sites=SCONV_SITES,
        qk_norm=True,
        qk_mult=QK_MULT,
        rope_global_layers=False,
        rope_fraction=ROPE_FRACTION,
        xsa=True,
        head_gate=True,
        kv_heads_layout="stored_max",
        moe=MoEConfig(
            num_experts=NUM_EXPERTS,
            top_k=TOP_K,
            expert_dim=half,
            latent_dim=half,
            latent_norm=True,
            num_shared_experts=NUM_SHARED_EXPERTS,
            shared_expert_dim=half,
            router_score="sigmoid",
            balancing="quantile",
            quantile_bins=QUANTILE_BINS,
            aux_loss="none",
            router_z_loss_weight=0.0,
            capacity_factor=CAPACITY_FACTOR,
        ),
    )


def marin_steps(model: ModelConfig, batch: int) -> int:
    """Marin's ``build_ladder_run``: max(1, round(791 * active / (batch * 4096))), active in Marin's convention."""
    return max(1, round(TOKENS_PER_ACTIVE_PARAM * accounting.marin_active_params(model) / (batch * SEQ_LEN)))


def adam_lr(tokens: int, d: int, tokens_per_step: int) -> float:
    """Marin's Adam-group LR (§5a): embeddings, router, gates, gains and conv kernels."""
    return min(MAX_LR, ADAM_LR_COEFFICIENT * tokens**ADAM_LR_TOKENS_EXPONENT * d**ADAM_LR_WIDTH_EXPONENT * math.sqrt(tokens_per_step))


def muonh_lr_for(adam: float) -> float:
    """Marin's MuonH and AdamH (lm_head) LR: min(0.05, 13/3 x the Adam LR) (§5a)."""
    return min(MAX_LR, MUONH_LR_MULTIPLIER * adam)


def marin_optimizer(muonh: float, adam: float, *, steps: int, tokens_per_step: int) -> OptimizerConfig:
    """Marin's MuonH / AdamH / Adam groups (``GrugMoeMuonHConfig``, §5c) with the heuristic's LRs, beta2 and
    epsilon, the linear schedule (1% warmup, to 5% of peak), no weight decay and no clipping."""
    return OptimizerConfig(
        name="muonh",
        learning_rate=muonh,
        adam_learning_rate=adam,
        beta1=BETA1,
        beta2=beta2_for(tokens_per_step),
        epsilon=epsilon_for(steps),
        weight_decay=0.0,
        max_grad_norm=None,
        momentum=MUON_MOMENTUM,
        nesterov=True,
        ns_steps=NS_STEPS,
        ns_epsilon=MUON_EPSILON,
        ns_dtype="bfloat16",
        schedule=ScheduleConfig(kind="linear", warmup=WARMUP_FRACTION, min_lr_fraction=MIN_LR_FRACTION),
    )


def beta2_for(tokens_per_step: int) -> float:
    return min(0.9999, max(0.95, 0.999 ** (tokens_per_step / 131_072)))


def epsilon_for(steps: int) -> float:
    return EPSILON_COEFFICIENT * math.sqrt(steps)


def phase_1_start_step(steps: int, batch: int) -> int:
    """``_phase_1_start_step``: 80% of the run rounded down to whole 49,152-sequence mixture blocks."""
    requested = int(PHASE_1_START_FRACTION * steps)
    block = MIXTURE_BLOCK_SIZE // math.gcd(MIXTURE_BLOCK_SIZE, batch)
    return max(block, (requested // block) * block)


def mixture(which: str, phase_1_start: float) -> DataConfig:
    """The 200-cell two-phase mixture; `which` is 'ladder' (2026.08.17.1 fit) or 'hero' (PR #8452)."""
    table = json.loads(MIXTURE_FILE.read_text())
    columns = table["columns"]
    phase0 = columns.index(f"{which}_phase0")
    phase1 = columns.index(f"{which}_phase1")
    cells = list(table["weights"])
    sources = [
        SourceConfig(name=cell, paths=[f"{STORE}/cluster={cell[1:3]}/quality={cell[4]}"], kind="parquet")
        for cell in cells
    ]
    return DataConfig(
        sources=sources,
        phases=[
            MixturePhase(start_fraction=0.0, weights={c: table["weights"][c][phase0] for c in cells}),
            MixturePhase(start_fraction=phase_1_start, weights={c: table["weights"][c][phase1] for c in cells}),
        ],
        tokenizer=TOKENIZER,
    )


def marin_run(name: str, shape: tuple, *, hero: bool) -> TrainStep:
    d, layers, local_kv, global_kv, racks, wandb_run, name_tag = shape
    model = marin_model(d, layers, local_kv, global_kv)
    batch = BATCH_PER_RACK * racks
    tokens_per_step = batch * SEQ_LEN
    steps = marin_steps(model, batch)
    tokens = steps * tokens_per_step
    lr = adam_lr(tokens, d, tokens_per_step)
    muonh_lr = muonh_lr_for(lr)
    switch = phase_1_start_step(steps, batch)
    spec = ExperimentSpec(
        model=model,
        data=mixture("hero" if hero else "ladder", switch / steps),
        optimizer=marin_optimizer(muonh_lr, lr, steps=steps, tokens_per_step=tokens_per_step),
        train=TrainConfig(
            tokens=tokens,
            batch_size=batch,
            seed=0,
            eval_every=HERO_EVAL_EVERY if hero else round(steps / 20),
            log_every=1,
            checkpoint_every=HERO_CHECKPOINT_EVERY if hero else steps,
            checkpoint_every_seconds=HOURLY,
            keep_checkpoints=steps // HERO_CHECKPOINT_EVERY + 1 if hero else 1,  # the hero's are permanent
            wandb_project="marin_moe",
            mesh={"data": racks, "expert": 64},
            remat="full",  # Marin: remat_mode=recompute_all (an execution field: not identity)
        ),
        # per host: the hero's W&B task (4 GB200, 120 CPU, 890 GB); the rungs' hosts are assumed the same
        resources=ResourceSpec(
            accelerator_type="GB200", gpus=GPUS_PER_HOST, hosts=HOSTS_PER_RACK * racks, cpus=120, memory_gb=890
        ),
        tags={
            "wandb_run": wandb_run,
            "name_tag": name_tag,
            "racks": str(racks),
            "phase_1_start_step": str(switch),
            "mixture": "hero: PR #8452 PI weights" if hero else "ladder: harrier 2026.08.17.1",
            # Marin's memory policy (reference §2-3): bf16 params on device, fp32 master on pinned host, optimizer
            # state offloaded, remat recompute_all; `ladder plan` also prints what our trainer's own policy needs
            "memory_policy": "marin",
        },
        accounting="marin",
    )
    return TrainStep(name=name, spec=spec)


rungs = [marin_run(name, shape, hero=False) for name, shape in LADDER.items()]
steps = build_ladder(rungs, hero=marin_run(HERO[0], HERO[1], hero=True))

if __name__ == "__main__":  # `python experiments/marin_535b.py [COMMAND ...]` is `ladder COMMAND experiments/marin_535b.py ...` (default: plan)
    from ladder.cli import run_as_script

    run_as_script(__file__)
