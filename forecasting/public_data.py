"""The public data that ships inside the package (forecasting/data/) and loaders that turn it into tables of runs.

Why here: the must-pass tests, the benches, `ladder import ... marin-published` and `ladder plot
marin-535b-public` read the same files; one loader each keeps the column conventions (D = FLOP/(6N)
for Chinchilla, compute without lm_head for Marin) in one place. The files are package data, found
with importlib.resources, so a fresh clone, an editable install and an installed wheel all read the
same copy. Provenance of every file (source repository, path, commit, licence): forecasting/data/PROVENANCE.md.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from forecasting.table import validate_table


def data_dir() -> Path:
    """The public data shipped inside the package (forecasting/data/, provenance in its PROVENANCE.md)."""
    return Path(str(resources.files("forecasting") / "data"))


def chinchilla_points(path: str | Path, *, drop_highest: int = 5) -> pd.DataFrame:
    """Epoch's 245 Chinchilla points as a table of final-loss runs (one row per run), highest losses dropped."""
    raw = pd.read_csv(path)
    raw = raw.sort_values("loss", kind="stable")
    if drop_highest:
        raw = raw.iloc[:-drop_highest]
    n = raw["Model Size"].to_numpy(float)
    c = raw["Training FLOP"].to_numpy(float)
    df = pd.DataFrame(
        {
            "run": [f"chinchilla_{i}" for i in range(len(raw))],
            "step": 1,
            "loss": raw["loss"].to_numpy(float),
            "params_active": n,
            "tokens": c / (6 * n),
            "flops": c,
            "fraction": 1.0,
        }
    )
    return validate_table(df)


MARIN_HERO = "d6144"


def marin_ladder(directory: str | Path) -> tuple[pd.DataFrame, dict, pd.DataFrame]:
    """(rung table, hero constants, hero observed table) from a folder laid out as data_dir() / "marin_535b_ladder".

    Rung table rows: every 5% eval of `eval_dropless/paloma/macro_loss`; flops = step * compute per
    step (lm_head excluded, Marin's convention); fraction = step / planned steps.
    lr: the recipe's shape (1% linear warmup, linear decay to zero; an assumption: the grid does not
    log LR) scaled by the peak LR noted in rungs.csv.
    Hero observed: the dropless Paloma macro loss of the live 535B run, steps 3k-39k (step 0 dropped).
    """
    d = Path(directory)
    rungs = pd.read_csv(d / "rungs.csv").set_index("rung")
    grid = json.loads((d / "ladder_eval_grid.json").read_text())
    rows = []
    for rung, points in grid.items():
        r = rungs.loc[rung]
        tokens_per_step = float(r["batch_seqs"] * r["seq_len"])
        lr = linear_decay_schedule(int(r["steps"]), peak=_peak_lr(str(r["peak_lr_note"])))
        for step, loss in points:
            rows.append(
                {
                    "run": rung,
                    "step": int(step),
                    "loss": float(loss),
                    "fraction": step / float(r["steps"]),
                    "num_steps": int(r["steps"]),
                    "tokens": step * tokens_per_step,
                    "tokens_per_step": tokens_per_step,
                    "flops": step * float(r["compute_per_step_flops_no_lm_head"]),
                    "params_active": float(r["active_params"]),
                    "params_total": float(r["total_params"]),
                    "lr": float(lr[min(int(step), len(lr)) - 1]),
                }
            )
    table = validate_table(pd.DataFrame(rows))
    h = rungs.loc[MARIN_HERO]
    hero = {
        "name": MARIN_HERO,
        "params_active": float(h["active_params"]),
        "params_total": float(h["total_params"]),
        "num_steps": int(h["steps"]),
        "tokens_per_step": float(h["batch_seqs"] * h["seq_len"]),
        "tokens": float(h["steps"] * h["batch_seqs"] * h["seq_len"]),
        "flops_per_step": float(h["compute_per_step_flops_no_lm_head"]),
        "total_flops": float(h["compute_full_flops_no_lm_head"]),
    }
    obs = pd.read_csv(d / "hero_eval_paloma_subset.csv")
    obs = obs[obs["step"] > 0]
    hero_obs = pd.DataFrame(
        {
            "run": MARIN_HERO,
            "step": obs["step"].astype(int),
            "loss": obs["eval_dropless_paloma_macro_loss"].astype(float),
            "fraction": obs["step"] / hero["num_steps"],
            "num_steps": hero["num_steps"],
            "tokens": obs["step"] * hero["tokens_per_step"],
            "flops": obs["step"] * hero["flops_per_step"],
            "params_active": hero["params_active"],
            "params_total": hero["params_total"],
        }
    )
    return table, hero, validate_table(hero_obs)


def _peak_lr(note: str) -> float:
    try:
        return float(note.split()[0])
    except (ValueError, IndexError):
        return 1.0


def linear_decay_schedule(num_steps: int, warmup_fraction: float = 0.01, peak: float = 1.0) -> np.ndarray:
    """LR per step 1..T: linear warmup then linear decay to zero (the Marin recipe's shape)."""
    s = np.arange(1, num_steps + 1, dtype=float)
    w = max(1.0, warmup_fraction * num_steps)
    return peak * np.where(s <= w, s / w, np.clip((num_steps - s) / (num_steps - w), 0.0, 1.0))
