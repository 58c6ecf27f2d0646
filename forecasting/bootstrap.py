"""Bootstrap over runs: the uncertainty a user should believe.

Why over runs and not only over points: points of one training curve are strongly correlated (same
seed, same data order), so resampling points pretends we have far more independent evidence than we
do. We resample whole runs (groups) with replacement; each resample becomes a weight vector
(multiplicity per row), so refits reuse the same arrays and no data is copied.

`percentile_interval` turns a bootstrap sample into (lo, hi); `Interval` is the typed carrier that
every user-facing number in a Forecast or LadderFit uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")


class Interval(BaseModel):
    """A point estimate with its (by default 95%) interval."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    value: float = Field(description="Point estimate (full-data fit).")
    lo: float = Field(description="Lower bound of the interval.")
    hi: float = Field(description="Upper bound of the interval.")
    level: float = Field(0.95, description="Coverage level of [lo, hi].")


def run_weights(groups: Sequence, n_boot: int, seed: int = 0, min_distinct: int = 1) -> np.ndarray:
    """(n_boot, n_rows) multiplicities from resampling whole groups (runs) with replacement.

    `min_distinct`: resamples with fewer distinct groups are redrawn (a law with k size-parameters
    cannot be fitted on fewer than k distinct runs; dropping them would bias the sample, redrawing
    conditions on identifiability, which is the honest choice and is documented in the Forecast).
    """
    codes, uniques = _codes(groups)
    n_groups = len(uniques)
    if n_groups < min_distinct:
        raise ValueError(f"bootstrap over runs needs at least {min_distinct} runs; got {n_groups}")
    rng = np.random.default_rng(seed)
    out = np.empty((n_boot, len(codes)))
    for b in range(n_boot):
        for _ in range(1000):
            counts = rng.multinomial(n_groups, np.full(n_groups, 1.0 / n_groups))
            if np.count_nonzero(counts) >= min_distinct:
                break
        out[b] = counts[codes]
    return out


def _codes(groups: Sequence) -> tuple[np.ndarray, np.ndarray]:
    uniques, codes = np.unique(np.asarray(groups, dtype=str), return_inverse=True)
    return codes, uniques


def bootstrap(
    fit: Callable[[np.ndarray], T], groups: Sequence, n_boot: int, seed: int = 0, min_distinct: int = 1
) -> list[T]:
    """Refit `fit(weights)` on `n_boot` run-level resamples; failed refits are skipped (and counted by caller)."""
    results = []
    for w in run_weights(groups, n_boot, seed, min_distinct):
        try:
            results.append(fit(w))
        except (ValueError, FloatingPointError, np.linalg.LinAlgError):
            continue
    return results


def percentile_interval(samples: np.ndarray, value: float, level: float = 0.95) -> Interval:
    s = np.asarray(samples, dtype=float)
    s = s[np.isfinite(s)]
    if len(s) == 0:
        return Interval(value=value, lo=float("-inf"), hi=float("inf"), level=level)
    q = (1 - level) / 2
    lo, hi = np.quantile(s, [q, 1 - q])
    return Interval(value=float(value), lo=float(min(lo, value)), hi=float(max(hi, value)), level=level)
