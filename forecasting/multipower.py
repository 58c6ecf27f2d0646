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

(S1 includes the warmup; S2 counts LR changes after the warmup only; lam is fixed, 0.999 by default.)

Fitting: Huber (delta = 1e-3) on log-loss residuals over every point of every curve, bounded trust-region
least squares with an analytic Jacobian, a few starts (all reach the same optimum on the public data).
Uncertainty (``multipower_bands`` -> ``CurveBands.predict_band``): bootstrap replicates (moving-block
resampling of each curve's residuals; curves resampled too when there are >= 4), training residual
scatter, and a systematic ``ModelError`` calibrated on the training curves (leave-one-curve-out and a
first-half/second-half time backtest), combined in quadrature on the log scale.

Arrays: ``lr`` is the LR of every optimizer step 1..T (``lr[i]`` is the LR of step ``i+1``); ``steps``
are 1-based step numbers <= T at which the loss was logged / is wanted.

Cost: LD needs, for each requested step, a sum over all decay steps before it (O(n_steps * n_decays)).
Decay steps are compressed into groups of consecutive steps that no requested step splits; a group is
represented by its total LR drop and its drop-weighted mean position. ``group=1`` is exact and the
default for ``predict``; fits use ``group=16`` (the approximation changes predictions by < 2e-5
relative on the public schedules; see the tests). Rows are processed in blocks that skip the decay groups
lying after the block's last step.

Data of the public backtest (``forecasting/data/multipowerlaw``): files log (step, lr, loss) every 128
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
    "ModelError",
    "calibrate_model_error",
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
    "binned",
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


def binned(curve: CurveData, max_points: int) -> CurveData:
    """``curve`` with its points averaged (geometric mean of the loss) into ``max_points`` runs of consecutive points.

    Each bin is placed at its middle point's step. Averaging, unlike picking every n-th point, keeps the noise
    reduction of a per-step training loss; within a bin of a smooth curve it moves the loss by far less than
    the noise.
    """
    n = curve.steps.size
    if max_points < 1:
        raise ValueError(f"max_points must be >= 1; got {max_points}.")
    if n <= max_points:
        return curve
    edges = np.linspace(0, n, max_points + 1).round().astype(int)
    bins = np.repeat(np.arange(max_points), np.diff(edges))
    log_loss = np.bincount(bins, np.log(curve.loss)) / np.diff(edges)
    middle = curve.steps[(edges[:-1] + edges[1:] - 1) // 2]
    return CurveData(curve.name, curve.lr, middle, np.exp(log_loss))


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
    blocks: tuple[tuple[int, int, int], ...] = ()  # (row start, row stop, groups seen by any of those rows)


def _row_blocks(idx: np.ndarray, first_k: np.ndarray, n_blocks: int = 6) -> tuple[tuple[int, int, int], ...]:
    """Split rows so each block only touches the decay groups that start before its last requested step."""
    n = idx.size
    if n == 0 or np.any(np.diff(idx) < 0):
        return ((0, n, first_k.size),)
    edges = np.unique(np.linspace(0, n, min(n_blocks, n) + 1).round().astype(int))
    return tuple(
        (int(lo), int(hi), int(np.searchsorted(first_k, idx[hi - 1], side="right"))) for lo, hi in zip(edges[:-1], edges[1:])
    )


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
    first_k = k
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
        first_k = k[np.r_[True, gid[1:] != gid[:-1]]]
    s_matrix = np.maximum(cum[idx][:, None] - prev_area[None, :], 0.0)
    blocks = _row_blocks(idx, first_k)
    return _DropDesign(cum[idx], s_matrix, delta, log_eta, float(lr[: last + 1].max()), blocks)


def _drop_and_grad(design: _DropDesign, c: float, beta: float, gamma: float, with_grad: bool):
    """Unscaled loss drop D = sum_k delta_k G(x_k) (LD = B*D) and its derivatives in (C, beta, gamma)."""
    n = design.area.size
    if design.delta.size == 0:
        z = np.zeros(n)
        return (z, z, z, z) if with_grad else (z,)
    scale = np.exp(-gamma * design.log_eta)  # eta_k^-gamma
    out = [np.zeros(n) for _ in range(4 if with_grad else 1)]
    for lo, hi, cols in design.blocks or ((0, n, design.delta.size),):
        if cols == 0:
            continue
        delta = design.delta[:cols]
        x = design.s_matrix[lo:hi, :cols] * scale[:cols]
        log_u = np.log1p(x * c)
        p = np.exp(log_u * -beta)  # (Cx+1)^-beta
        out[0][lo:hi] = delta.sum() - p @ delta
        if with_grad:
            x *= np.exp(log_u * -1.0)  # x / (Cx+1); dG/dC = beta * p * x / (Cx+1)
            x *= p
            out[1][lo:hi] = beta * (x @ delta)
            p *= log_u  # dG/dbeta = p * log(Cx+1)
            out[2][lo:hi] = p @ delta
            out[3][lo:hi] = -c * beta * (x @ (delta * design.log_eta[:cols]))  # dG/dgamma = dG/dx * x * (-log eta)
    return tuple(out)


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
        if data.get("law", "multi_power") != "multi_power":
            raise ValueError(f"expected a multi_power law, got {data['law']!r}.")
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
        if data.get("law", "lr_annealing") != "lr_annealing":
            raise ValueError(f"expected a lr_annealing law, got {data['law']!r}.")
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


def _validate_curves(curves: Sequence[CurveData], what: str, n_params: int = 7) -> list[CurveData]:
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
    if n_points < 2 * n_params + 6:
        raise ValueError(f"{what}: {n_points} logged points in all; need at least {2 * n_params + 6} to fit {n_params} parameters.")
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
    """Bounds in the solver's coordinates (L0, A, alpha, B*beta, C, beta, gamma)."""
    lower = np.array([0.0, 1e-8, 1e-3, 0.0, 1e-6, 1e-3, 0.0])
    upper = np.array([problem.min_loss, 1e4, 3.0, 1e4 / problem.peak, 1e5, 10.0, 3.0])
    return lower, upper


def _to_solver(theta: np.ndarray) -> np.ndarray:
    # As beta -> 0 with B*beta fixed, G/beta -> log(1 + C x): B and beta form a curved valley that slows the
    # solver; B*beta as a coordinate straightens it.
    phi = np.array(theta, dtype=np.float64)
    phi[3] = theta[3] * theta[5]
    return phi


def _from_solver(phi: np.ndarray) -> np.ndarray:
    theta = np.array(phi, dtype=np.float64)
    theta[3] = phi[3] / phi[5]
    return theta


def _solve(problem: _Problem, theta0: np.ndarray, max_nfev: int) -> tuple[np.ndarray, float, bool]:
    lower, upper = _lower_upper(problem)
    phi0 = np.clip(_to_solver(theta0), lower + 1e-12, upper - 1e-12)

    def residuals(phi):
        pred, _ = _mpl_predict_all(problem, _from_solver(phi), False)
        return np.log(np.maximum(pred, 1e-8)) - problem.log_loss

    def jacobian(phi):
        theta = _from_solver(phi)
        pred, jac = _mpl_predict_all(problem, theta, True)
        d_b = jac[:, 3].copy()
        jac[:, 3] = d_b / phi[5]  # d/d(B*beta) at fixed beta
        jac[:, 5] = jac[:, 5] - d_b * theta[3] / phi[5]  # d/dbeta at fixed B*beta
        return jac / np.maximum(pred, 1e-8)[:, None]

    res = least_squares(
        residuals,
        phi0,
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
    return _from_solver(res.x), float(res.cost), bool(res.status > 0)


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
    n_starts: int = 3,
    seed: int = 0,
    group: int = FIT_GROUP,
    max_points_per_curve: int | None = 400,
    init: MultiPowerLaw | None = None,
    max_nfev: int = 400,
) -> MultiPowerLaw:
    """Fit the Multi-Power Law on whole curves with their LR schedules.

    Robust objective: Huber (delta = 1e-3) on log-loss residuals, bounded trust-region least squares with an
    analytic Jacobian, started from a grid over (C, beta, gamma) around a variable-projection fit of the
    4-parameter reduction (the paper's initialisation). Curves with more than ``max_points_per_curve``
    points (per-step train losses, say) are averaged into that many bins of consecutive points (``binned``).
    ``init`` (e.g. a previous fit) adds a warm start and is what the bootstrap uses.
    """
    curves = _validate_curves(curves, "fit_multipower")
    if max_points_per_curve is not None:
        curves = [binned(c, max_points_per_curve) for c in curves]
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
    names = ("L0", "A", "alpha", "B*beta", "C", "beta", "gamma")
    at_bound = [n for n, v, lo, hi in zip(names, _to_solver(best[1]), lower, upper) if n != "gamma" and (v <= lo * 1.0001 or v >= hi * 0.9999)]
    if at_bound:
        warnings.warn(f"fit_multipower: parameter(s) {at_bound} ended at a bound; the fit may be unreliable.", stacklevel=2)
    return law


# ----------------------------------------------------------------------------------------------
# Fitting the LR-annealing law
# ----------------------------------------------------------------------------------------------


def fit_lr_annealing(curves: Sequence[CurveData], *, lam: float = 0.999, seed: int = 0, n_starts: int = 1) -> LRAnnealingLaw:
    """Fit Tissue et al.'s law: scan alpha with (L0, A, C) by non-negative least squares, then Huber-polish."""
    del seed, n_starts  # deterministic: a dense alpha scan replaces random starts
    curves = _validate_curves(curves, "fit_lr_annealing", n_params=4)
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
    group: int = 2 * FIT_GROUP,
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
        return fit_multipower(boot, n_starts=1, init=p, group=group, max_nfev=60)

    return _bootstrap(curves, n_boot, seed, refit, point, min_curves_for_curve_resampling, block_fraction)


def bootstrap_lr_annealing(
    curves: Sequence[CurveData], n_boot: int = 50, seed: int = 0, *, point: LRAnnealingLaw | None = None,
    min_curves_for_curve_resampling: int = 4, block_fraction: float = 0.1,
) -> list[LRAnnealingLaw]:
    """Same resampling scheme as ``bootstrap_multipower`` for the LR-annealing law."""
    curves = _validate_curves(curves, "bootstrap_lr_annealing", n_params=4)
    if point is None:
        point = fit_lr_annealing(curves)
    lam = point.lam
    return _bootstrap(curves, n_boot, seed, lambda boot, p: fit_lr_annealing(boot, lam=lam), point,
                      min_curves_for_curve_resampling, block_fraction)


@dataclass(frozen=True)
class ModelError:
    """Systematic error of a curve law beyond its parameter uncertainty, calibrated on the training curves.

    The relative error of a prediction is modelled as normal in log-loss with standard deviation
    ``sqrt(sigma_schedule**2 + (kappa * rho)**2)``, where ``rho = max(0, log(area / area_seen))`` is how far
    the LR area of the predicted step lies beyond the largest area of any training point. ``sigma_schedule``
    is the RMS error of leave-one-curve-out fits on the held-out curve's points whose LR history differs
    from every kept curve (the error of transferring to an unseen schedule); ``kappa`` comes from a time backtest (fit every curve's first half, predict the rest).
    """

    sigma_schedule: float = 0.0
    kappa: float = 0.0
    area_seen: float = float("inf")

    def sigma(self, area: np.ndarray) -> np.ndarray:
        rho = np.maximum(0.0, np.log(np.asarray(area) / self.area_seen))
        return np.sqrt(self.sigma_schedule**2 + (self.kappa * rho) ** 2)


def _area_seen(curves: Sequence[CurveData]) -> float:
    return float(max(np.cumsum(c.lr)[c.steps[-1] - 1] for c in curves))


def _novel_points(held: CurveData, others: Sequence[CurveData]) -> np.ndarray:
    """Mask of ``held``'s points whose LR history up to that step differs from every curve in ``others``."""
    novel = np.ones(held.steps.size, dtype=bool)
    for other in others:
        n = min(held.lr.size, other.lr.size)
        differs = np.abs(held.lr[:n] - other.lr[:n]) > 1e-9 * held.lr[:n]
        first = int(np.argmax(differs)) if differs.any() else n  # 0-based index of the first differing step
        novel &= held.steps - 1 >= first
    return novel


def calibrate_model_error(curves: Sequence[CurveData], fit, *, min_points: int = 10) -> ModelError:
    """Estimate ``ModelError`` by refitting on parts of the training curves (``fit(curves) -> law``).

    Leave-one-curve-out needs >= 2 curves and a decaying curve among those kept; the time backtest needs
    >= ``min_points`` points in each half. Parts that cannot be formed are skipped (their term stays 0).
    """
    curves = list(curves)
    sched_sq: list[np.ndarray] = []
    for i, held in enumerate(curves):
        rest = curves[:i] + curves[i + 1 :]
        if not rest or not any(c.has_decay for c in rest) or sum(c.steps.size for c in rest) < 20:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                law = fit(rest)
        except (RuntimeError, ValueError):
            continue
        err_sq = np.log(held.loss / law.predict(held.lr, held.steps, group=FIT_GROUP)) ** 2
        novel = _novel_points(held, rest)
        if novel.any():
            sched_sq.append(err_sq[novel])
    halves, rests = [], []
    for c in curves:
        cut = c.steps[-1] // 2
        first = c.steps <= cut
        if first.sum() >= min_points and (~first).sum() >= min_points:
            halves.append(c.subset(np.nonzero(first)[0]))
            rests.append(c.subset(np.nonzero(~first)[0]))
    num = den = 0.0
    if halves and any(h.has_decay for h in halves):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                law = fit(halves)
            seen = _area_seen(halves)
            for c in rests:
                rho = np.maximum(0.0, np.log(np.cumsum(c.lr)[c.steps - 1] / seen))
                err_sq = np.log(c.loss / law.predict(c.lr, c.steps, group=FIT_GROUP)) ** 2
                num += float(np.sum(rho**2 * err_sq))
                den += float(np.sum(rho**4))
        except (RuntimeError, ValueError):
            pass
    sigma_schedule = float(np.sqrt(np.mean(np.concatenate(sched_sq)))) if sched_sq else 0.0
    kappa = float(np.sqrt(num / den)) if den > 0 else 0.0
    return ModelError(sigma_schedule=sigma_schedule, kappa=kappa, area_seen=_area_seen(curves))


@dataclass(frozen=True)
class CurveBands:
    """A point law, bootstrap replicates, training log-residuals and a model-error term: curves with bands.

    ``predict_band`` returns (point prediction, lo, hi). The band combines, in quadrature on the log scale,
    (1) parameter uncertainty and residual scatter (quantiles of the replicates' predictions, each shifted by
    a training log-residual drawn at random) and (2) the systematic ``model_error`` (leave-one-curve-out and
    time-backtest errors, growing with LR-area extrapolation). It is a band for *observed* losses.
    """

    point: Any
    replicates: list = field(default_factory=list)
    log_residuals: np.ndarray = field(default_factory=lambda: np.zeros(0))
    model_error: ModelError = field(default_factory=ModelError)

    def predict(self, lr: np.ndarray, steps: np.ndarray) -> np.ndarray:
        return self.point.predict(lr, steps)

    def predict_band(
        self, lr: np.ndarray, steps: np.ndarray, q: tuple[float, float] = (0.025, 0.975), *,
        include_residuals: bool = True, include_model_error: bool = True, group: int = FIT_GROUP, seed: int = 0,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        from scipy.stats import norm

        if not (0.0 < q[0] < q[1] < 1.0):
            raise ValueError(f"q must be two increasing probabilities strictly between 0 and 1; got {q}.")
        if not self.replicates:
            raise ValueError("CurveBands has no bootstrap replicates; build it with multipower_bands(..., n_boot>=2).")
        lr = _check_schedule(lr)
        steps = _check_steps(steps, lr.size)
        log_point = np.log(self.point.predict(lr, steps))
        preds = np.log(np.vstack([r.predict(lr, steps, group=group) for r in self.replicates]))
        if include_residuals and self.log_residuals.size:
            rng = np.random.default_rng(seed)
            preds = preds + rng.choice(self.log_residuals, size=(preds.shape[0], 1))
            preds = np.vstack([preds, log_point[None, :] + np.quantile(self.log_residuals, q)[:, None]])
        lo_boot, hi_boot = np.quantile(preds, q, axis=0)
        down = np.maximum(log_point - lo_boot, 0.0)
        up = np.maximum(hi_boot - log_point, 0.0)
        if include_model_error:
            sigma = self.model_error.sigma(np.cumsum(lr)[steps - 1])
            down = np.sqrt(down**2 + (norm.ppf(q[0]) * sigma) ** 2)
            up = np.sqrt(up**2 + (norm.ppf(q[1]) * sigma) ** 2)
        return np.exp(log_point), np.exp(log_point - down), np.exp(log_point + up)


def multipower_bands(
    curves: Sequence[CurveData], n_boot: int = 50, seed: int = 0, *, law: str = "multi_power",
    calibrate: bool = True, **kwargs: Any,
) -> CurveBands:
    """Fit a curve law, its bootstrap and (``calibrate``) its model error; return a ``CurveBands``."""
    curves = list(curves)
    if law == "multi_power":
        point = fit_multipower(curves, seed=seed)
        reps = bootstrap_multipower(curves, n_boot, seed, point=point, **kwargs)

        def refit(part):
            return fit_multipower(part, n_starts=1, init=point, group=2 * FIT_GROUP, max_nfev=200, max_points_per_curve=100)

    elif law == "lr_annealing":
        point = fit_lr_annealing(curves)
        reps = bootstrap_lr_annealing(curves, n_boot, seed, point=point, **kwargs)

        def refit(part):
            return fit_lr_annealing(part, lam=point.lam)

    else:
        raise ValueError(f"law must be 'multi_power' or 'lr_annealing'; got {law!r}.")
    res = np.concatenate([np.log(c.loss) - np.log(point.predict(c.lr, c.steps, group=FIT_GROUP)) for c in curves])
    model_error = calibrate_model_error(curves, refit) if calibrate else ModelError()
    return CurveBands(point=point, replicates=reps, log_residuals=res, model_error=model_error)


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
    table's num_steps column, else the last logged step); zero LRs at the very start of a warmup become
    1e-6 * peak (later zeros are an error). Rows with a missing loss are used for the LR only; rows at step 0
    carry no loss for the laws and are dropped.
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
    positive = lr > 0
    if positive.any() and not positive[0]:
        # A warmup that starts at exactly 0 (optax's default): the first steps moved nothing; give them a tiny LR.
        first = int(np.argmax(positive))
        lr[:first] = np.where(lr[:first] > 0, lr[:first], 1e-6 * lr.max())
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
    """All curves of one model size (e.g. ``forecasting/data/multipowerlaw/csv_100``), keyed by file stem."""
    return {p.stem: load_multipowerlaw_curve(p) for p in sorted(Path(folder).glob("*.csv"))}


# ----------------------------------------------------------------------------------------------
# Backtest on the public Multi-Power-Law data (``python -m forecasting.multipower [DATA_DIR]``)
# ----------------------------------------------------------------------------------------------

MPL_TRAIN = ("cosine_24000", "constant_24000", "wsdcon_9")
# Parameters published in the paper's repository (README "Best Parameters"); their formulation adds the warmup's
# LR rise to LD, which is a constant B*peak once the warmup is over, so L0 + B*peak is the equivalent L0 here.
MPL_PUBLISHED = {
    "csv_25": (3.040, 0.525, 0.508, 363.788, 2.066, 0.583, 0.641),
    "csv_100": (2.651, 0.601, 0.453, 437.946, 2.132, 0.598, 0.655),
    "csv_400": (2.375, 0.654, 0.429, 523.425, 2.025, 0.594, 0.635),
}


def backtest_multipowerlaw_data(root: str | Path, *, n_boot: int = 0, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Fit on ``MPL_TRAIN`` per model size and score every held-out curve; optionally band coverage."""
    results: dict[str, dict[str, Any]] = {}
    for size_dir in sorted(Path(root).glob("csv_*"), key=lambda p: int(p.name.split("_")[1])):
        curves = load_multipowerlaw_dir(size_dir)
        train = [curves[n] for n in MPL_TRAIN]
        test = {n: c for n, c in curves.items() if n not in MPL_TRAIN}
        laws: dict[str, Any] = {"mpl": fit_multipower(train, seed=seed), "lr_annealing": fit_lr_annealing(train)}
        if size_dir.name in MPL_PUBLISHED:
            l0, a, alpha, b, c, beta, gamma = MPL_PUBLISHED[size_dir.name]
            laws["mpl_published_params"] = MultiPowerLaw(L0=l0 + b * MPL_PEAK, A=a, alpha=alpha, B=b, C=c, beta=beta, gamma=gamma)
        entry: dict[str, Any] = {"laws": {k: v.to_dict() for k, v in laws.items()}, "errors": {}, "train_errors": {}}
        for key, law in laws.items():
            entry["errors"][key] = {n: mean_abs_rel_error(law, c) for n, c in test.items()}
            entry["train_errors"][key] = {n: mean_abs_rel_error(law, c) for n, c in zip(MPL_TRAIN, train)}
        if n_boot:
            bands = multipower_bands(train, n_boot, seed)
            entry["model_error"] = {"sigma_schedule": bands.model_error.sigma_schedule, "kappa": bands.model_error.kappa}
            cover = {}
            for n, c in test.items():
                mid, lo, hi = bands.predict_band(c.lr, c.steps)
                cover[n] = (float(np.mean((c.loss >= lo) & (c.loss <= hi))), float(np.mean((hi - lo) / mid)))
            entry["coverage"] = cover
        results[size_dir.name] = entry
    return results


def _markdown(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    for size, entry in results.items():
        keys = list(entry["errors"])
        lines.append(f"\n### {size}: fit on {', '.join(MPL_TRAIN)}\n")
        lines.append("| held-out curve | " + " | ".join(f"{k} MARE % (max %)" for k in keys) + " |")
        lines.append("|---|" + "---|" * len(keys))
        names = list(entry["errors"][keys[0]])
        for n in names:
            lines.append(f"| {n} | " + " | ".join(f"{100 * entry['errors'][k][n][0]:.3f} ({100 * entry['errors'][k][n][1]:.2f})" for k in keys) + " |")
        lines.append("| **mean** | " + " | ".join(f"**{100 * np.mean([v[0] for v in entry['errors'][k].values()]):.3f}**" for k in keys) + " |")
        lines.append("| train curves, mean | " + " | ".join(f"{100 * np.mean([v[0] for v in entry['train_errors'][k].values()]):.3f}" for k in keys) + " |")
        if "coverage" in entry:
            me = entry["model_error"]
            lines.append(f"\nModel-error term: sigma_schedule = {100 * me['sigma_schedule']:.3f}%, kappa = {100 * me['kappa']:.3f}% per unit log-area extrapolation.")
            lines.append("\n| held-out curve | 95% band coverage | mean band width % |\n|---|---|---|")
            for n, (cov, width) in entry["coverage"].items():
                lines.append(f"| {n} | {cov:.2f} | {100 * width:.3f} |")
        lines.append("\nFitted: " + "; ".join(f"`{k}`: " + ", ".join(f"{p}={v:.4g}" for p, v in d.items() if p != "law") for k, d in entry["laws"].items()))
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - report generator
    import sys

    from forecasting.public_data import data_dir

    root = sys.argv[1] if len(sys.argv) > 1 else str(data_dir() / "multipowerlaw")
    n_boot = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    print(_markdown(backtest_multipowerlaw_data(root, n_boot=n_boot)))
