"""Mid-run refits: combine the ladder's forecast with the live run's own prefix.

Why: a ladder cannot see what differs between the rungs and the target (a mixture change, another LR,
a new kernel); the target's own first evals can. A refit fits a schedule-aware curve law to the live
prefix alone, then combines it, step by step, with the ladder forecast as a product of two Gaussians
(inverse-variance weights; `forecasting.api.refit_forecast`). Each side's variance is its own measured
error: the live curve's grows with the distance past the prefix at the rate its law showed on this
ladder's rungs (prefix backtest), the ladder forecast's is its band. So near the prefix the live run
dominates, and far ahead (the final loss) the ladder does until the prefix is long.

Curve form (Tissue et al. 2024, LR-annealing law), in normalised LR units (lr / peak lr):
    L(s) = E + B * (S1(s)/1000)^-b - C * S2(s)/1000,   S1 = sum_{i<=s} eta_i,
    S2 = sum_{i<=s} m_i,  m_i = lambda*m_{i-1} + max(eta_{i-1} - eta_i, 0),  lambda = 0.999
(only LR decreases count as annealing; a warmup's rising LR does not). Without a schedule S1 = step
and S2 = 0 (a plain power law in steps). Fitted by least squares on log-loss, a few starts; the
parameter covariance is the Laplace (Gauss-Newton) one scaled by the live residual variance.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import least_squares

from forecasting.fitting import FitError

ANNEAL_MOMENTUM = 0.999


def schedule_features(lr: np.ndarray | None, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(S1, S2) per step 1..num_steps, in normalised LR units; steps and zeros when lr is None."""
    if lr is None:
        s = np.arange(1, num_steps + 1, dtype=float)
        return s, np.zeros(num_steps)
    eta = np.asarray(lr, dtype=float)
    if eta.ndim != 1 or len(eta) == 0 or not np.all(np.isfinite(eta)) or np.any(eta < 0) or eta.max() <= 0:
        raise FitError("the LR schedule must be a non-empty 1-D array of finite, non-negative values")
    eta = eta / eta.max()
    s1 = np.cumsum(eta)
    drops = np.maximum(np.r_[0.0, eta[:-1] - eta[1:]], 0.0)  # warmup (rising LR) is not annealing
    from scipy.signal import lfilter

    m = lfilter([1.0], [1.0, -ANNEAL_MOMENTUM], drops)  # m_i = lambda*m_{i-1} + drop_i
    return s1, np.cumsum(m)


def lr_per_step(steps: np.ndarray, lr: np.ndarray, num_steps: int) -> np.ndarray:
    """Per-step LR 1..num_steps from LR logged at some steps (linear interpolation, ends held)."""
    order = np.argsort(steps)
    return np.interp(np.arange(1, num_steps + 1), np.asarray(steps, dtype=float)[order], np.asarray(lr, dtype=float)[order])


class CurveModel:
    """The fitted live-curve law; `predict(steps)` and `band(steps)` give loss and relative sigma."""

    def __init__(self, theta: np.ndarray, cov: np.ndarray, s1: np.ndarray, s2: np.ndarray, use_anneal: bool):
        self.theta, self.cov, self.s1, self.s2, self.use_anneal = theta, cov, s1, s2, use_anneal

    def _features(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.clip(np.asarray(steps, dtype=int) - 1, 0, len(self.s1) - 1)
        return self.s1[idx] / 1000.0, self.s2[idx] / 1000.0

    def predict(self, steps: np.ndarray, theta: np.ndarray | None = None) -> np.ndarray:
        e, log_b, b, c = self.theta if theta is None else theta
        x1, x2 = self._features(steps)
        return e + np.exp(log_b) * np.maximum(x1, 1e-12) ** (-b) - (c * x2 if self.use_anneal else 0.0)

    def log_sigma(self, steps: np.ndarray) -> np.ndarray:
        """Posterior sd of log L at `steps` (delta method)."""
        eps = 1e-6
        base = np.log(self.predict(steps))
        jac = np.empty((len(base), 4))
        for k in range(4):
            th = self.theta.copy()
            th[k] += eps
            jac[:, k] = (np.log(np.maximum(self.predict(steps, th), 1e-12)) - base) / eps
        var = np.einsum("ij,jk,ik->i", jac, self.cov, jac)
        return np.sqrt(np.maximum(var, 0.0))

    def formula(self) -> str:
        e, log_b, b, c = self.theta
        tail = f" - {c:.4g}*S2/1e3" if self.use_anneal else ""
        return f"L(s) = {e:.4g} + {np.exp(log_b):.4g}*(S1/1e3)^-{b:.4g}{tail}"


def fit_curve(steps: np.ndarray, loss: np.ndarray, s1: np.ndarray, s2: np.ndarray) -> tuple[CurveModel, float]:
    """Fit the live-curve law on (steps, loss); returns (model, live residual RMS in log space).

    The annealing term is used only when the schedule decays somewhere and there are at least 5 evals
    (4 parameters need one spare point to estimate the noise).
    """
    st = np.asarray(steps, dtype=int)
    y = np.asarray(loss, dtype=float)
    if len(st) < 4:
        raise FitError(f"a live refit needs at least 4 evals of the target (3 parameters + noise); got {len(st)}")
    if not (np.all(np.isfinite(y)) and np.all(y > 0)):
        raise FitError("live losses must be finite and positive")
    use_anneal = bool(np.any(s2 > 0)) and len(st) >= 5
    model = CurveModel(np.zeros(4), np.zeros((4, 4)), s1, s2, use_anneal)

    def residuals(theta: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(model.predict(st, theta), 1e-9)) - np.log(y)

    ymin = float(y.min())
    lo = [0.0, -30.0, 1e-4, 0.0]
    hi = [ymin * (1 - 1e-6), 30.0, 3.0, 10.0 if use_anneal else 1e-12]
    x1 = model._features(st)[0]
    best = None
    for e0 in (0.5 * ymin, 0.9 * ymin):
        for b0 in (0.3, 1.0):
            log_b0 = float(np.log(max(np.median((y - e0) * np.maximum(x1, 1e-12) ** b0), 1e-6)))
            th0 = np.clip([e0, log_b0, b0, 0.0], lo, hi)
            try:
                res = least_squares(residuals, th0, bounds=(lo, hi), x_scale="jac", xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=5000)
            except ValueError:
                continue
            if best is None or res.cost < best.cost:
                best = res
    if best is None:
        raise FitError("the live-curve refit did not converge from any start")
    model.theta = best.x
    n_free = 4 if use_anneal else 3
    live_rms = float(np.sqrt(np.sum(best.fun**2) / max(len(st) - n_free, 1)))
    jac = best.jac
    try:
        cov = np.linalg.pinv(jac.T @ jac) * live_rms**2
    except np.linalg.LinAlgError:
        cov = np.full((4, 4), np.inf)
    if not use_anneal:
        cov[3, :] = cov[:, 3] = 0.0
    model.cov = cov
    return model, live_rms
