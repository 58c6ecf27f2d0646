"""Schedule-aware whole-loss-curve laws: the Multi-Power Law and the LR-annealing law.

Why this module exists: a final-loss law (Chinchilla) says nothing about the *shape* of a training
curve, and the learning-rate schedule moves the loss by about 1%, the size of the error we care about.
A WSD run's cooldown drop, a cosine run's slow bend and a constant run's plateau all come from one
model whose parameters are fitted on a few curves of one model size and then predict the whole curve
of any other schedule (longer horizons and cooldowns included).

Multi-Power Law (Luo et al. 2025, arXiv:2503.12811)::

    L(t)   = L0 + A * (S1(t) + S_W)^(-alpha) - LD(t)
    LD(t)  = B * sum_{k=1..t} (eta_{k-1} - eta_k) * G(eta_k^(-gamma) * S_k(t))
    G(x)   = 1 - (C*x + 1)^(-beta),      S_k(t) = sum_{tau=k..t} eta_tau

Conventions (as in the paper): ``S_W`` is the area under the warmup, so ``S1(t) + S_W`` is simply the
LR area of every step up to ``t``; the loss-drop sum runs over the steps *after* the warmup only (the
warmup ramp is not a "decay"). The warmup is detected as the leading run of strictly increasing LRs.
LR *increases* after the warmup enter LD with the opposite sign (a re-warm raises the loss).

LR-annealing law (Tissue et al. 2024, arXiv:2408.11029), a 4-parameter cousin with the same API::

    L(s) = L0 + A * S1(s)^(-alpha) - C * S2(s),   S2(s) = sum_{i<=s} m_i,  m_i = lam*m_{i-1} + (eta_{i-1}-eta_i)

Arrays: ``lr`` is the LR of every optimizer step 1..T (``lr[i]`` is the LR of step ``i+1``); ``steps``
are 1-based step numbers <= T at which the loss was logged / is wanted.

Cost: LD needs, for each requested step, a sum over all decay steps before it (O(n_steps * n_decays)).
Decay steps are compressed into groups of consecutive steps that no requested step splits; a group is
represented by its total LR drop and its drop-weighted mean position. ``group=1`` is exact and the
default for ``predict``; fits use ``group=16`` (the approximation changes predictions by < 1e-5
relative on the public curves; see the tests).

Data of the public backtest (``shared/data/multipowerlaw``): files log (step, lr, loss) every 128
steps after a 2,160-step linear warmup; ``multipowerlaw_schedule`` rebuilds the per-step schedule from
the file name exactly as the paper's repository describes its runs (peak 3e-4, cosine/WSD to 3e-5,
``wsdcon_N``: 3e-4 until step 8,000 then N*1e-5) and ``load_multipowerlaw_curve`` checks the rebuilt
LR against the file's lr column. ``curve_from_table`` handles any table: it interpolates logged LRs
linearly between logged steps and assumes a linear warmup from 0 before the first logged step.

Pure numerics: numpy, scipy, pandas. Nothing here imports ladder/ or trainer/.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy.optimize import least_squares, nnls

HUBER_DELTA = 1e-3  # on log-loss residuals, as in the paper and Chinchilla approach 3
FIT_GROUP = 16  # decay steps merged per group during fits

__all__ = [
    "CurveData",
    "MultiPowerLaw",
    "LRAnnealingLaw",
    "CurveBands",
    "fit_multipower",
    "fit_lr_annealing",
    "bootstrap_multipower",
    "bootstrap_lr_annealing",
    "multipower_bands",
    "curve_from_table",
    "multipowerlaw_schedule",
    "load_multipowerlaw_curve",
    "load_multipowerlaw_dir",
    "mean_abs_rel_error",
]


# ----------------------------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------------------------


def _check_schedule(lr: np.ndarray, what: str = "lr") -> np.ndarray:
    lr = np.asarray(lr, dtype=np.float64)
    if lr.ndim != 1 or lr.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D array of per-step learning rates; got shape {lr.shape}.")
    if not np.all(np.isfinite(lr)):
        raise ValueError(f"{what} contains NaN or inf; give a finite learning rate for every step.")
    if np.any(lr <= 0):
        first = int(np.argmax(lr <= 0)) + 1
        raise ValueError(
            f"{what} has a non-positive learning rate at step {first}; the laws need eta > 0 at every step "
            "(for a decay-to-zero schedule clip the LR to a small positive floor, e.g. 1e-3 * peak)."
        )
    return lr


def _check_steps(steps: np.ndarray, n_lr: int, what: str = "steps") -> np.ndarray:
    raw = np.asarray(steps)
    if raw.ndim != 1 or raw.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D array of step numbers; got shape {raw.shape}.")
    if not np.all(np.isfinite(raw.astype(np.float64))):
        raise ValueError(f"{what} contains NaN or inf.")
    out = raw.astype(np.int64)
    if np.any(out != raw):
        raise ValueError(f"{what} must be whole step numbers.")
    if out.min() < 1 or out.max() > n_lr:
        raise ValueError(
            f"{what} must lie in 1..{n_lr} (the length of the LR schedule); got {out.min()}..{out.max()}. "
            "Give the LR of every step up to the last step you ask about."
        )
    return out


@dataclass(frozen=True)
class CurveData:
    """One training curve: the LR of every step 1..T and the losses logged at ``steps``."""

    name: str
    lr: np.ndarray
    steps: np.ndarray
    loss: np.ndarray

    def __post_init__(self) -> None:
        lr = _check_schedule(self.lr, f"curve {self.name!r}: lr")
        steps = _check_steps(self.steps, lr.size, f"curve {self.name!r}: steps")
        loss = np.asarray(self.loss, dtype=np.float64)
        if loss.shape != steps.shape:
            raise ValueError(
                f"curve {self.name!r}: steps and loss have mismatched lengths ({steps.size} vs {loss.size})."
            )
        if not np.all(np.isfinite(loss)) or np.any(loss <= 0):
            raise ValueError(f"curve {self.name!r}: loss must be finite and positive at every logged step.")
        if np.any(np.diff(steps) <= 0):
            raise ValueError(f"curve {self.name!r}: steps must be strictly increasing (no duplicates).")
        object.__setattr__(self, "lr", lr)
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "loss", loss)

    @property
    def has_decay(self) -> bool:
        """True when the LR changes after the warmup before the last logged step."""
        w = warmup_end_index(self.lr)
        seg = self.lr[w : int(self.steps[-1])]
        return bool(seg.size > 1 and np.ptp(seg) > 1e-12 * seg.max())

    def subset(self, index: np.ndarray) -> "CurveData":
        return CurveData(self.name, self.lr, self.steps[index], self.loss[index])


def warmup_end_index(lr: np.ndarray) -> int:
    """0-based index of the last step of the warmup (the leading run of strictly increasing LRs)."""
    lr = np.asarray(lr)
    if lr.size < 2:
        return 0
    not_rising = np.nonzero(np.diff(lr) <= 0)[0]
    return int(not_rising[0]) if not_rising.size else int(lr.size - 1)


# ----------------------------------------------------------------------------------------------
# Loss-drop kernel
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _DropDesign:
    """Everything about (schedule, requested steps) that does not depend on the law's parameters."""

    area: np.ndarray  # S1 + S_W at each requested step
    s_matrix: np.ndarray  # (n_steps, n_groups): S_k(t), 0 where the group lies after t
    delta: np.ndarray  # (n_groups,): eta_{k-1} - eta_k summed over the group
    log_eta: np.ndarray  # (n_groups,)
    peak: float


def _drop_design(lr: np.ndarray, steps: np.ndarray, group: int = 1) -> _DropDesign:
    idx = steps - 1
    cum = np.cumsum(lr)
    w = warmup_end_index(lr)
    last = int(idx.max())
    drops = lr[w : last] - lr[w + 1 : last + 1]  # drop at index k = w+1..last
    k = np.nonzero(drops != 0.0)[0] + w + 1
    delta = drops[k - w - 1]
    if k.size == 0:
        return _DropDesign(cum[idx], np.zeros((idx.size, 0)), np.zeros(0), np.zeros(0), float(lr[: last + 1].max()))
    prev_area = cum[k - 1]  # area of steps before k (index k-1 is within range: k >= 1)
    log_eta = np.log(lr[k])
    if group > 1:
        # Group consecutive decay steps that every requested step sees entirely or not at all, and of one sign.
        order = np.sort(idx)
        segment = np.searchsorted(order, k, side="left") * 2 + (delta > 0)
        new_seg = np.r_[True, segment[1:] != segment[:-1]]
        seg_id = np.cumsum(new_seg) - 1
        seg_start = np.nonzero(new_seg)[0]
        pos_in_seg = np.arange(k.size) - seg_start[seg_id]
        gid = np.cumsum(np.r_[True, (segment[1:] != segment[:-1]) | (pos_in_seg[1:] % group == 0)]) - 1
        weight = np.abs(delta)
        wsum = np.bincount(gid, weight)
        delta = np.bincount(gid, delta)
        log_eta = np.bincount(gid, weight * log_eta) / wsum
        prev_area = np.bincount(gid, weight * prev_area) / wsum
    s_matrix = np.maximum(cum[idx][:, None] - prev_area[None, :], 0.0)
    return _DropDesign(cum[idx], s_matrix, delta, log_eta, float(lr[: last + 1].max()))


def _drop_and_grad(design: _DropDesign, c: float, beta: float, gamma: float, with_grad: bool):
    """Unscaled loss drop D = sum_k delta_k G(x_k) (LD = B*D) and its derivatives in (C, beta, gamma)."""
    n = design.area.size
    if design.delta.size == 0:
        z = np.zeros(n)
        return (z, z, z, z) if with_grad else (z,)
    scale = np.exp(-gamma * design.log_eta)  # eta_k^-gamma
    x = design.s_matrix * scale[None, :]
    log_u = np.log1p(c * x)
    p = np.exp(-beta * log_u)  # (Cx+1)^-beta
    drop = (1.0 - p) @ design.delta
    if not with_grad:
        return (drop,)
    q = beta * p * x / (1.0 + c * x)  # dG/dC
    d_c = q @ design.delta
    d_beta = (p * log_u) @ design.delta
    d_gamma = (q * (-c)) @ (design.delta * design.log_eta)  # dG/dgamma = dG/dx * x * (-log eta)
    return drop, d_c, d_beta, d_gamma


def _chunked_drop(lr: np.ndarray, steps: np.ndarray, c: float, beta: float, gamma: float, group: int) -> np.ndarray:
    """D at ``steps`` without building matrices larger than ~4M entries."""
    order = np.argsort(steps, kind="stable")
    sorted_steps = steps[order]
    out = np.empty(steps.size)
    n_decay = max(1, int(np.count_nonzero(np.diff(lr))) // max(group, 1))
    rows = max(1, 4_000_000 // n_decay)
    for start in range(0, steps.size, rows):
        part = sorted_steps[start : start + rows]
        design = _drop_design(lr, part, group)
        out[order[start : start + rows]] = _drop_and_grad(design, c, beta, gamma, False)[0]
    return out


# ----------------------------------------------------------------------------------------------
# Laws
# ----------------------------------------------------------------------------------------------


class MultiPowerLaw(BaseModel):
    """Multi-Power Law of Luo et al. 2025; 7 parameters, all positive."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    L0: float = Field(description="irreducible loss (asymptote at infinite LR area)")
    A: float = Field(description="amplitude of the power law in LR area")
    alpha: float = Field(description="exponent of the power law in LR area (S1 + S_W)")
    B: float = Field(description="amplitude of the loss drop per unit of LR decay")
    C: float = Field(description="rate inside the saturating drop function G")
    beta: float = Field(description="exponent of the saturating drop function G")
    gamma: float = Field(description="exponent of the LR rescaling of the post-decay area, eta_k^-gamma")

    def predict(self, lr: np.ndarray, steps: np.ndarray, *, group: int = 1) -> np.ndarray:
        """Loss at ``steps`` (1-based, <= len(lr)) of a run with per-step LR schedule ``lr``."""
        lr = _check_schedule(lr)
        steps = _check_steps(steps, lr.size)
        area = np.cumsum(lr)[steps - 1]
        drop = _chunked_drop(lr, steps, self.C, self.beta, self.gamma, group)
        return self.L0 + self.A * area ** (-self.alpha) - self.B * drop

    def formula(self) -> str:
        return (
            f"L(t) = {self.L0:.4f} + {self.A:.4f}*(S1(t)+S_W)^-{self.alpha:.4f} - LD(t); "
            f"LD(t) = {self.B:.4g}*sum_k (eta_(k-1)-eta_k)*(1-({self.C:.4g}*eta_k^-{self.gamma:.4f}*S_k(t)+1)^-{self.beta:.4f})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"law": "multi_power", **self.model_dump()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MultiPowerLaw":
        return cls.model_validate({k: v for k, v in data.items() if k != "law"})

    def as_vector(self) -> np.ndarray:
        return np.array([self.L0, self.A, self.alpha, self.B, self.C, self.beta, self.gamma])


_MPL_NAMES = ("L0", "A", "alpha", "B", "C", "beta", "gamma")


class LRAnnealingLaw(BaseModel):
    """LR-annealing law of Tissue et al. 2024; 4 fitted parameters and a fixed momentum ``lam``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    L0: float = Field(description="irreducible loss")
    A: float = Field(description="amplitude of the power law in forward area S1")
    alpha: float = Field(description="exponent of the power law in forward area S1")
    C: float = Field(description="loss drop per unit of annealing area S2")
    lam: float = Field(0.999, description="momentum (decay factor) of the annealing area, fixed during fits")

    def predict(self, lr: np.ndarray, steps: np.ndarray, *, group: int = 1) -> np.ndarray:
        lr = _check_schedule(lr)
        steps = _check_steps(steps, lr.size)
        s1, s2 = _annealing_areas(lr, self.lam)
        return self.L0 + self.A * s1[steps - 1] ** (-self.alpha) - self.C * s2[steps - 1]

    def formula(self) -> str:
        return (
            f"L(s) = {self.L0:.4f} + {self.A:.4f}*S1^-{self.alpha:.4f} - {self.C:.4g}*S2; "
            f"S2 = sum m_i, m_i = {self.lam}*m_(i-1) + (eta_(i-1)-eta_i)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"law": "lr_annealing", **self.model_dump()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LRAnnealingLaw":
        return cls.model_validate({k: v for k, v in data.items() if k != "law"})


def _annealing_areas(lr: np.ndarray, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Forward area S1 (warmup included) and annealing area S2 (drops after the warmup, with momentum)."""
    from scipy.signal import lfilter

    s1 = np.cumsum(lr)
    w = warmup_end_index(lr)
    drops = np.zeros_like(lr)
    drops[w + 1 :] = lr[w:-1] - lr[w + 1 :]
    m = lfilter([1.0], [1.0, -lam], drops)
    return s1, np.cumsum(m)


# ----------------------------------------------------------------------------------------------
# Fitting the Multi-Power Law
# ----------------------------------------------------------------------------------------------


def _validate_curves(curves: Sequence[CurveData], what: str) -> list[CurveData]:
    curves = list(curves)
    if not curves:
        raise ValueError(f"{what}: no curves given.")
    for c in curves:
        if not isinstance(c, CurveData):
            raise TypeError(f"{what}: expected CurveData, got {type(c).__name__}.")
    if not any(c.has_decay for c in curves):
        raise ValueError(
            f"{what}: no curve has any LR change after its warmup, so the loss-drop parameters (B, C, beta, gamma) "
            "cannot be identified. Add a curve with a decay or cooldown (cosine, WSD, a step drop), or use a "
            "final-loss law instead."
        )
    n_points = sum(c.steps.size for c in curves)
    if n_points < 20:
        raise ValueError(f"{what}: {n_points} logged points in all; need at least 20 to fit 7 parameters.")
    if len(curves) == 1:
        warnings.warn(
            f"{what}: fitting on a single curve; the schedule-dependent parameters rest on one schedule and "
            "predictions for other schedules may be poor. Fit on >= 2 schedules (e.g. constant + cosine).",
            stacklevel=3,
        )
    return curves


@dataclass
class _Problem:
    designs: list[_DropDesign]
    log_loss: np.ndarray
    min_loss: float
    peak: float


def _problem(curves: Sequence[CurveData], group: int) -> _Problem:
    designs = [_drop_design(c.lr, c.steps, group) for c in curves]
    log_loss = np.concatenate([np.log(c.loss) for c in curves])
    return _Problem(designs, log_loss, float(min(c.loss.min() for c in curves)), max(d.peak for d in designs))


def _mpl_predict_all(problem: _Problem, theta: np.ndarray, with_grad: bool):
    l0, a, alpha, b, c, beta, gamma = theta
    preds, jacs = [], []
    for d in problem.designs:
        out = _drop_and_grad(d, c, beta, gamma, with_grad)
        power = d.area ** (-alpha)
        pred = l0 + a * power - b * out[0]
        preds.append(pred)
        if with_grad:
            jac = np.column_stack(
                [
                    np.ones_like(pred),
                    power,
                    -a * power * np.log(d.area),
                    -out[0],
                    -b * out[1],
                    -b * out[2],
                    -b * out[3],
                ]
            )
            jacs.append(jac)
    pred = np.concatenate(preds)
    return (pred, np.vstack(jacs)) if with_grad else (pred, None)


def _lower_upper(problem: _Problem) -> tuple[np.ndarray, np.ndarray]:
    lower = np.array([0.0, 1e-8, 1e-3, 0.0, 1e-6, 1e-3, 0.0])
    upper = np.array([problem.min_loss, 1e4, 3.0, 1e3 / problem.peak, 1e5, 10.0, 3.0])
    return lower, upper


def _solve(problem: _Problem, theta0: np.ndarray, max_nfev: int) -> tuple[np.ndarray, float, bool]:
    lower, upper = _lower_upper(problem)
    theta0 = np.clip(theta0, lower + 1e-12, upper - 1e-12)

    def residuals(theta):
        pred, _ = _mpl_predict_all(problem, theta, False)
        return np.log(np.maximum(pred, 1e-8)) - problem.log_loss

    def jacobian(theta):
        pred, jac = _mpl_predict_all(problem, theta, True)
        return jac / np.maximum(pred, 1e-8)[:, None]

    res = least_squares(
        residuals,
        theta0,
        jac=jacobian,
        bounds=(lower, upper),
        loss="huber",
        f_scale=HUBER_DELTA,
        x_scale="jac",
        method="trf",
        max_nfev=max_nfev,
        ftol=1e-12,
        xtol=1e-12,
        gtol=1e-10,
    )
    return res.x, float(res.cost), bool(res.status > 0)


def _reduced_init(problem: _Problem) -> np.ndarray:
    """Initial (L0, A, alpha, B) from the G=1 reduction L = L0 + A*area^-alpha - B*(peak - eta_t).

    For fixed alpha the reduction is linear in (L0, A, B); scan alpha and keep the best least-squares fit.
    """
    area = np.concatenate([d.area for d in problem.designs])
    # eta_t at each requested step equals peak minus the total drop seen so far
    drop_so_far = np.concatenate(
        [(d.s_matrix > 0).astype(float) @ d.delta if d.delta.size else np.zeros(d.area.size) for d in problem.designs]
    )
    loss = np.exp(problem.log_loss)
    best = (np.inf, None)
    for alpha in np.linspace(0.1, 1.5, 29):
        design = np.column_stack([np.ones_like(area), area ** (-alpha), -drop_so_far])
        coef, rnorm = nnls(design / loss[:, None], np.ones_like(loss))  # relative-error least squares
        if rnorm < best[0]:
            best = (rnorm, np.array([coef[0], coef[1], alpha, coef[2]]))
    l0, a, alpha, b = best[1]
    l0 = min(l0, 0.98 * problem.min_loss)
    return np.array([l0, max(a, 1e-3), alpha, max(b, 1.0)])


def _start_points(problem: _Problem, n_starts: int, seed: int) -> list[np.ndarray]:
    l0, a, alpha, b = _reduced_init(problem)
    grid = [(c, beta, gamma) for c in (2.0, 0.5, 8.0) for beta in (0.6, 0.3) for gamma in (0.6, 0.3)]
    starts = [np.array([l0, a, alpha, b, c, beta, gamma]) for c, beta, gamma in grid]
    rng = np.random.default_rng(seed)
    while len(starts) < n_starts:
        base = starts[rng.integers(len(grid))].copy()
        base[4:] *= np.exp(rng.normal(0.0, 0.7, 3))
        base[:4] *= np.exp(rng.normal(0.0, 0.1, 4))
        starts.append(base)
    return starts[:n_starts]


def fit_multipower(
    curves: Sequence[CurveData],
    *,
    n_starts: int = 6,
    seed: int = 0,
    group: int = FIT_GROUP,
    max_points_per_curve: int | None = None,
    init: MultiPowerLaw | None = None,
    max_nfev: int = 400,
) -> MultiPowerLaw:
    """Fit the Multi-Power Law on whole curves with their LR schedules.

    Robust objective: Huber (delta = 1e-3) on log-loss residuals, bounded trust-region least squares with an
    analytic Jacobian, started from a grid over (C, beta, gamma) around a variable-projection fit of the
    4-parameter reduction (the paper's initialisation). ``max_points_per_curve`` thins long curves evenly.
    ``init`` (e.g. a previous fit) adds a warm start and is what the bootstrap uses.
    """
    curves = _validate_curves(curves, "fit_multipower")
    if max_points_per_curve is not None:
        curves = [
            c.subset(np.unique(np.linspace(0, c.steps.size - 1, max_points_per_curve).round().astype(int)))
            if c.steps.size > max_points_per_curve
            else c
            for c in curves
        ]
    problem = _problem(curves, group)
    starts = [init.as_vector()] if init is not None else []
    if init is None or n_starts > 1:
        starts += _start_points(problem, max(1, n_starts - len(starts)), seed)
    best: tuple[float, np.ndarray | None, bool] = (np.inf, None, False)
    for theta0 in starts:
        try:
            theta, cost, ok = _solve(problem, theta0, max_nfev)
        except (FloatingPointError, ValueError, np.linalg.LinAlgError):
            continue
        if np.isfinite(cost) and cost < best[0]:
            best = (cost, theta, ok)
    if best[1] is None:
        raise RuntimeError("fit_multipower: every start failed; check the curves (loss and LR ranges).")
    if not best[2]:
        warnings.warn("fit_multipower: the best start stopped at its evaluation limit before converging.", stacklevel=2)
    law = MultiPowerLaw(**dict(zip(_MPL_NAMES, map(float, best[1]))))
    lower, upper = _lower_upper(problem)
    at_bound = [n for n, v, lo, hi in zip(_MPL_NAMES, best[1], lower, upper) if n != "gamma" and (v <= lo * 1.0001 or v >= hi * 0.9999)]
    if at_bound:
        warnings.warn(f"fit_multipower: parameter(s) {at_bound} ended at a bound; the fit may be unreliable.", stacklevel=2)
    return law


# ----------------------------------------------------------------------------------------------
# Fitting the LR-annealing law
# ----------------------------------------------------------------------------------------------


def fit_lr_annealing(curves: Sequence[CurveData], *, lam: float = 0.999, seed: int = 0, n_starts: int = 1) -> LRAnnealingLaw:
    """Fit Tissue et al.'s law: scan alpha with (L0, A, C) by non-negative least squares, then Huber-polish."""
    del seed, n_starts  # deterministic: a dense alpha scan replaces random starts
    curves = _validate_curves(curves, "fit_lr_annealing")
    s1 = np.concatenate([_annealing_areas(c.lr, lam)[0][c.steps - 1] for c in curves])
    s2 = np.concatenate([_annealing_areas(c.lr, lam)[1][c.steps - 1] for c in curves])
    loss = np.concatenate([c.loss for c in curves])
    best = (np.inf, None)
    for alpha in np.linspace(0.05, 2.0, 79):
        design = np.column_stack([np.ones_like(s1), s1 ** (-alpha), -s2])
        coef, rnorm = nnls(design / loss[:, None], np.ones_like(loss))
        if rnorm < best[0]:
            best = (rnorm, np.array([coef[0], coef[1], alpha, coef[2]]))
    x0 = best[1]
    x0[0] = min(x0[0], 0.98 * loss.min())

    def residuals(theta):
        l0, a, alpha, c = theta
        pred = l0 + a * s1 ** (-alpha) - c * s2
        return np.log(np.maximum(pred, 1e-8)) - np.log(loss)

    lower = np.array([0.0, 1e-8, 1e-3, 0.0])
    upper = np.array([loss.min(), 1e4, 3.0, 1e6])
    res = least_squares(
        residuals, np.clip(x0, lower + 1e-12, upper - 1e-12), bounds=(lower, upper), loss="huber",
        f_scale=HUBER_DELTA, x_scale="jac", ftol=1e-12, xtol=1e-12, gtol=1e-10, max_nfev=2000,
    )
    l0, a, alpha, c = map(float, res.x)
    return LRAnnealingLaw(L0=l0, A=a, alpha=alpha, C=c, lam=lam)


# ----------------------------------------------------------------------------------------------
# Bootstrap and bands
# ----------------------------------------------------------------------------------------------


def _block_resample(residuals: np.ndarray, block: int, rng: np.random.Generator) -> np.ndarray:
    """Moving-block bootstrap of one curve's residual series (keeps their autocorrelation)."""
    n = residuals.size
    block = max(1, min(block, n))
    n_blocks = math.ceil(n / block)
    starts = rng.integers(0, n - block + 1, n_blocks)
    return np.concatenate([residuals[s : s + block] for s in starts])[:n]


def _bootstrap(
    curves: Sequence[CurveData],
    n_boot: int,
    seed: int,
    fit,
    point,
    min_curves_for_curve_resampling: int,
    block_fraction: float,
) -> list:
    """Shared bootstrap: over curves when there are enough, plus moving-block resampling of residuals."""
    curves = list(curves)
    rng = np.random.default_rng(seed)
    fitted = [point.predict(c.lr, c.steps, group=FIT_GROUP) for c in curves]
    log_res = [np.log(c.loss) - np.log(f) for c, f in zip(curves, fitted)]
    out = []
    resample_curves = len(curves) >= min_curves_for_curve_resampling
    for _ in range(n_boot):
        if resample_curves:
            for _attempt in range(100):
                pick = rng.integers(0, len(curves), len(curves))
                if any(curves[i].has_decay for i in pick) and len(set(pick.tolist())) > 1:
                    break
        else:
            pick = np.arange(len(curves))
        boot = []
        for j, i in enumerate(pick):
            c = curves[i]
            block = max(3, int(round(block_fraction * c.steps.size)))
            noisy = fitted[i] * np.exp(_block_resample(log_res[i], block, rng))
            boot.append(CurveData(f"{c.name}#boot{j}", c.lr, c.steps, noisy))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                out.append(fit(boot, point))
            except (RuntimeError, ValueError):
                continue
    if len(out) < max(2, n_boot // 2):
        raise RuntimeError(f"bootstrap: only {len(out)} of {n_boot} refits succeeded; the fit is not stable.")
    return out


def bootstrap_multipower(
    curves: Sequence[CurveData],
    n_boot: int = 50,
    seed: int = 0,
    *,
    point: MultiPowerLaw | None = None,
    min_curves_for_curve_resampling: int = 4,
    block_fraction: float = 0.1,
    group: int = FIT_GROUP,
) -> list[MultiPowerLaw]:
    """Bootstrap replicates of the Multi-Power Law.

    With >= ``min_curves_for_curve_resampling`` curves the curves are resampled with replacement (a draw
    without any LR decay, or of a single distinct curve, is redrawn); in every case each curve's log
    residuals from the point fit are resampled in moving blocks (``block_fraction`` of its points), which
    is all that varies when there are too few curves to resample. Each replicate refits warm-started from
    the point fit.
    """
    curves = _validate_curves(curves, "bootstrap_multipower")
    if point is None:
        point = fit_multipower(curves, group=group)

    def refit(boot, p):
        return fit_multipower(boot, n_starts=1, init=p, group=group, max_nfev=100)

    return _bootstrap(curves, n_boot, seed, refit, point, min_curves_for_curve_resampling, block_fraction)


def bootstrap_lr_annealing(
    curves: Sequence[CurveData], n_boot: int = 50, seed: int = 0, *, point: LRAnnealingLaw | None = None,
    min_curves_for_curve_resampling: int = 4, block_fraction: float = 0.1,
) -> list[LRAnnealingLaw]:
    """Same resampling scheme as ``bootstrap_multipower`` for the LR-annealing law."""
    curves = _validate_curves(curves, "bootstrap_lr_annealing")
    if point is None:
        point = fit_lr_annealing(curves)
    lam = point.lam
    return _bootstrap(curves, n_boot, seed, lambda boot, p: fit_lr_annealing(boot, lam=lam), point,
                      min_curves_for_curve_resampling, block_fraction)


@dataclass(frozen=True)
class CurveBands:
    """A point law plus bootstrap replicates and training log-residuals: predicts curves with bands.

    ``predict_band`` returns (point prediction, lo, hi). The band combines parameter uncertainty (spread of
    the replicates) with the fit's own residual scatter (training log-residuals added to each replicate's
    prediction), so it is a band for *observed* losses, not only for the mean curve.
    """

    point: Any
    replicates: list = field(default_factory=list)
    log_residuals: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def predict(self, lr: np.ndarray, steps: np.ndarray) -> np.ndarray:
        return self.point.predict(lr, steps)

    def predict_band(
        self, lr: np.ndarray, steps: np.ndarray, q: tuple[float, float] = (0.025, 0.975), *,
        include_residuals: bool = True, group: int = 8, seed: int = 0,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not (0.0 <= q[0] < q[1] <= 1.0):
            raise ValueError(f"q must be two increasing probabilities in [0, 1]; got {q}.")
        point = self.point.predict(lr, steps)
        if not self.replicates:
            raise ValueError("CurveBands has no bootstrap replicates; build it with multipower_bands(..., n_boot>=2).")
        preds = np.log(np.vstack([r.predict(lr, steps, group=group) for r in self.replicates]))
        if include_residuals and self.log_residuals.size:
            rng = np.random.default_rng(seed)
            preds = preds + rng.choice(self.log_residuals, size=(preds.shape[0], 1))
            preds = np.vstack([preds, np.log(point)[None, :] + np.quantile(self.log_residuals, q)[:, None]])
        lo, hi = np.exp(np.quantile(preds, q, axis=0))
        return point, np.minimum(lo, point), np.maximum(hi, point)


def multipower_bands(
    curves: Sequence[CurveData], n_boot: int = 50, seed: int = 0, *, law: str = "multi_power", **kwargs: Any
) -> CurveBands:
    """Fit a curve law and its bootstrap; return a ``CurveBands`` ready for ``predict_band``."""
    curves = list(curves)
    if law == "multi_power":
        point = fit_multipower(curves, seed=seed)
        reps = bootstrap_multipower(curves, n_boot, seed, point=point, **kwargs)
    elif law == "lr_annealing":
        point = fit_lr_annealing(curves)
        reps = bootstrap_lr_annealing(curves, n_boot, seed, point=point, **kwargs)
    else:
        raise ValueError(f"law must be 'multi_power' or 'lr_annealing'; got {law!r}.")
    res = np.concatenate([np.log(c.loss) - np.log(point.predict(c.lr, c.steps, group=FIT_GROUP)) for c in curves])
    return CurveBands(point=point, replicates=reps, log_residuals=res)


def mean_abs_rel_error(law: Any, curve: CurveData, *, group: int = 1) -> tuple[float, float]:
    """(mean, max) of |pred/actual - 1| over every logged point of ``curve``."""
    pred = law.predict(curve.lr, curve.steps, group=group)
    rel = np.abs(pred / curve.loss - 1.0)
    return float(rel.mean()), float(rel.max())


# ----------------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------------


def curve_from_table(table: Any, run: str, *, split: str | None = None, num_steps: int | None = None) -> CurveData:
    """Build a ``CurveData`` for ``run`` from a table of runs (columns run, step, loss, lr; optional split, num_steps).

    The per-step LR is the logged LR where logged, linear interpolation between logged steps, a linear warmup
    from 0 before the first logged step, and the last logged LR held until ``num_steps`` (argument, else the
    table's num_steps column, else the last logged step). Rows with a missing loss are used for the LR only.
    """
    import pandas as pd

    if not isinstance(table, pd.DataFrame):
        raise TypeError("curve_from_table: table must be a pandas DataFrame.")
    missing = {"run", "step", "loss", "lr"} - set(table.columns)
    if missing:
        raise ValueError(f"curve_from_table: table lacks column(s) {sorted(missing)}.")
    rows = table[table["run"] == run]
    if rows.empty:
        raise ValueError(f"curve_from_table: no rows for run {run!r}.")
    lr_rows = rows.dropna(subset=["lr"]).groupby("step", as_index=False)["lr"].mean().sort_values("step")
    loss_rows = rows
    if split is not None:
        if "split" not in rows.columns:
            raise ValueError("curve_from_table: split given but the table has no split column.")
        loss_rows = rows[rows["split"] == split]
    loss_rows = loss_rows.dropna(subset=["loss"])
    if loss_rows["step"].duplicated().any():
        raise ValueError(
            f"curve_from_table: run {run!r} has several losses at one step; pass split='train' or 'eval'."
        )
    loss_rows = loss_rows.sort_values("step")
    if lr_rows.empty:
        raise ValueError(f"curve_from_table: run {run!r} has no logged learning rate.")
    if num_steps is None:
        num_steps = int(rows["num_steps"].max()) if "num_steps" in rows.columns and rows["num_steps"].notna().any() else 0
    last = int(max(num_steps, loss_rows["step"].max(), lr_rows["step"].max()))
    lr_steps = lr_rows["step"].to_numpy(dtype=np.float64)
    lr_vals = lr_rows["lr"].to_numpy(dtype=np.float64)
    if lr_steps[0] > 1:
        lr_steps = np.r_[0.0, lr_steps]
        lr_vals = np.r_[0.0, lr_vals]
    lr = np.interp(np.arange(1, last + 1, dtype=np.float64), lr_steps, lr_vals)
    steps = loss_rows["step"].to_numpy()
    keep = steps >= 1
    return CurveData(str(run), lr, steps[keep], loss_rows["loss"].to_numpy(dtype=np.float64)[keep])


MPL_WARMUP = 2160
MPL_PEAK = 3e-4
MPL_END = 3e-5


def multipowerlaw_schedule(name: str, *, warmup: int = MPL_WARMUP, peak: float = MPL_PEAK, end: float = MPL_END) -> np.ndarray:
    """Per-step LR (steps 1..T) of a run of the public Multi-Power-Law data, rebuilt from its file name.

    Names: ``constant_T``, ``cosine_T``, ``wsd_D_T`` (exponential decay from step D to T),
    ``wsdld_D_T`` (linear decay from D to T), ``wsdcon_N`` (3e-4 until step 8000, then N*1e-5, T = 16000).
    All start with a linear warmup over ``warmup`` steps from 0. Index s of the returned array is step s+1.
    """
    stem = Path(name).stem

    def with_warmup(total: int, after) -> np.ndarray:
        idx = np.arange(total + 1, dtype=np.float64)
        lr = after(idx)
        lr[:warmup] = np.linspace(0.0, peak, warmup)
        return lr[1:]

    if m := re.fullmatch(r"constant_(\d+)", stem):
        total = int(m.group(1))
        return with_warmup(total, lambda s: np.full_like(s, peak))
    if m := re.fullmatch(r"cosine_(\d+)", stem):
        total = int(m.group(1))
        return with_warmup(total, lambda s: end + 0.5 * (peak - end) * (1 + np.cos(np.pi * (s - warmup) / (total - warmup))))
    if m := re.fullmatch(r"wsdcon_(\d+)", stem):
        low = int(m.group(1)) * 1e-5
        return with_warmup(16000, lambda s: np.where(s < 8000, peak, low))
    if m := re.fullmatch(r"wsd_(\d+)_(\d+)", stem):
        decay, total = int(m.group(1)), int(m.group(2))
        frac = lambda s: np.clip((s - decay) / (total - decay), 0.0, None)  # noqa: E731
        return with_warmup(total, lambda s: peak ** (1 - frac(s)) * end ** frac(s))
    if m := re.fullmatch(r"wsdld_(\d+)_(\d+)", stem):
        decay, total = int(m.group(1)), int(m.group(2))
        frac = lambda s: np.clip((s - decay) / (total - decay), 0.0, None)  # noqa: E731
        return with_warmup(total, lambda s: peak * (1 - frac(s)) + end * frac(s))
    raise ValueError(f"multipowerlaw_schedule: unknown schedule name {stem!r}.")


def load_multipowerlaw_curve(path: str | Path) -> CurveData:
    """Read one csv (step, lr, loss) of the public Multi-Power-Law data with its rebuilt per-step schedule.

    Raises if the rebuilt LR disagrees with the file's lr column at any logged step (relative 1e-6).
    """
    import pandas as pd

    path = Path(path)
    frame = pd.read_csv(path)
    lr = multipowerlaw_schedule(path.name)
    steps = frame["step"].to_numpy(dtype=np.int64)
    keep = steps <= lr.size
    steps, frame = steps[keep], frame[keep]
    logged = frame["lr"].to_numpy(dtype=np.float64)
    rebuilt = lr[steps - 1]
    if not np.allclose(rebuilt, logged, rtol=1e-6, atol=0.0):
        worst = int(np.argmax(np.abs(rebuilt / logged - 1)))
        raise ValueError(
            f"{path}: rebuilt LR {rebuilt[worst]:.6g} differs from the logged {logged[worst]:.6g} at step {steps[worst]}."
        )
    return CurveData(path.stem, lr, steps, frame["loss"].to_numpy(dtype=np.float64))


def load_multipowerlaw_dir(folder: str | Path) -> dict[str, CurveData]:
    """All curves of one model size (e.g. ``shared/data/multipowerlaw/csv_100``), keyed by file stem."""
    return {p.stem: load_multipowerlaw_curve(p) for p in sorted(Path(folder).glob("*.csv"))}
