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


def stratified_run_weights(groups: Sequence, strata: Sequence, n_boot: int, seed: int = 0) -> np.ndarray:
    """(n_boot, n_rows) multiplicities from resampling runs WITHIN each stratum (e.g. each model size).

    Why: a ladder's sizes are the experimenter's design, not a sample. Resampling runs across sizes
    can drop a whole size, and with two or three sizes the refit then extrapolates a size exponent
    from one size (the Hitchhiker's data-constrained ladder: a +-300% band from two such redraws).
    Within a size the token budgets are resampled, so the fit's noise is measured and the design kept;
    what the sizes themselves leave unknown is the backtest term's job.
    """
    codes, uniques = _codes(groups)
    run_stratum: dict[int, str] = {}
    for c, s in zip(codes, np.asarray(strata, dtype=str)):
        run_stratum.setdefault(int(c), s)
    by_stratum: dict[str, list[int]] = {}
    for c, s in run_stratum.items():
        by_stratum.setdefault(s, []).append(c)
    rng = np.random.default_rng(seed)
    out = np.empty((n_boot, len(codes)))
    for b in range(n_boot):
        counts = np.zeros(len(uniques))
        for members in by_stratum.values():
            counts[members] = rng.multinomial(len(members), np.full(len(members), 1.0 / len(members)))
        out[b] = counts[codes]
    return out


def robust_sigma(samples: np.ndarray) -> float:
    """A normal sigma from the 16th-84th percentile half-range: with 20 refits the 2.5/97.5% quantiles are
    the extreme draws, so one refit that lost a parameter would set the whole band."""
    s = np.asarray(samples, dtype=float)
    s = s[np.isfinite(s)]
    lo, hi = np.quantile(s, [0.158655, 0.841345])
    return float((hi - lo) / 2)


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
