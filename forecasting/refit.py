"""Mid-run refits: combine the ladder's forecast with the live run's own prefix.

Why: a ladder cannot see what differs between the rungs and the target (a mixture change, another LR,
a new kernel); the target's own first evals can. A refit fits a schedule-aware curve to the live
prefix, with the ladder forecast entering as Gaussian pseudo-observations at the grid points beyond
the prefix (a Bayesian update with a Gaussian prior on the future curve, written as weighted least
squares). Early in the run the ladder dominates the far future; as the prefix grows it takes over.

Curve form (Tissue et al. 2024, LR-annealing law), in normalised LR units (lr / peak lr):
    L(s) = E + B * (S1(s)/1000)^-b - C * S2(s)/1000,   S1 = sum_{i<=s} eta_i,
    S2 = sum_{i<=s} m_i,  m_i = lambda*m_{i-1} + max(eta_{i-1} - eta_i, 0),  lambda = 0.999
(only LR decreases count as annealing; a warmup's rising LR does not)
Without a schedule S1 = step and S2 = 0 (a plain power law in steps). Fitted on log-loss.

Band: the posterior spread (Laplace: Jacobian at the optimum, residual variance estimated from the
live points), the live points' own scatter (eval noise), and the method's prefix-backtest error on
this ladder scaled by how far past the prefix the step is. Each refit returns a new Forecast; the
caller's store versions it.
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


def fit_curve(
    steps: np.ndarray,
    loss: np.ndarray,
    s1: np.ndarray,
    s2: np.ndarray,
    *,
    prior_steps: np.ndarray | None = None,
    prior_loss: np.ndarray | None = None,
    prior_rel_sigma: np.ndarray | None = None,
    obs_rel_sigma: float | None = None,
) -> tuple[CurveModel, float]:
    """Fit the live-curve law on (steps, loss) plus optional prior pseudo-observations.

    Returns (model, live residual RMS in log space). `obs_rel_sigma` is the relative noise of one live
    eval; by default it is estimated from the live residuals of an unweighted fit.
    """
    st = np.asarray(steps, dtype=int)
    y = np.asarray(loss, dtype=float)
    if len(st) < 3:
        raise FitError(f"a live refit needs at least 3 evals of the target; got {len(st)}")
    if not (np.all(np.isfinite(y)) and np.all(y > 0)):
        raise FitError("live losses must be finite and positive")
    use_anneal = bool(np.any(s2 > 0))
    has_prior = prior_steps is not None and len(prior_steps) > 0
    if not has_prior and len(st) < (4 if use_anneal else 3) + 1:
        use_anneal = False
    model = CurveModel(np.zeros(4), np.zeros((4, 4)), s1, s2, use_anneal)
    all_steps = np.r_[st, prior_steps] if has_prior else st
    all_y = np.r_[y, prior_loss] if has_prior else y

    def residuals(theta: np.ndarray, sig: np.ndarray) -> np.ndarray:
        pred = model.predict(all_steps, theta)
        return (np.log(np.maximum(pred, 1e-9)) - np.log(all_y)) / sig

    lo = [0.0, -30.0, 1e-4, 0.0]
    hi = [float(all_y.min()) * (1 - 1e-6), 30.0, 3.0, 10.0 if use_anneal else 1e-12]
    best = None
    ymin = float(all_y.min())
    for e0 in (0.5 * ymin, 0.9 * ymin):
        for b0 in (0.3, 1.0):
            x1 = model._features(st)[0]
            log_b0 = float(np.log(max(np.median((y - e0) * x1**b0), 1e-6)))
            th0 = np.clip([e0, log_b0, b0, 0.0], lo, [h - 1e-12 if h > 1e-9 else h for h in hi])
            if not use_anneal:
                th0[3] = 0.0
            sig_live = obs_rel_sigma if obs_rel_sigma is not None else 1e-3
            sig = np.r_[np.full(len(st), sig_live), prior_rel_sigma] if has_prior else np.full(len(st), sig_live)
            try:
                res = least_squares(residuals, th0, args=(sig,), bounds=(lo, hi), x_scale="jac", xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=5000)
            except ValueError:
                continue
            if best is None or res.cost < best.cost:
                best = res
    if best is None:
        raise FitError("the live-curve refit did not converge from any start")
    theta = best.x
    model.theta = theta
    live_resid = np.log(model.predict(st)) - np.log(y)
    n_free = 4 if use_anneal else 3
    dof = len(st) - (0 if has_prior else n_free)
    live_rms = float(np.sqrt(np.sum(live_resid**2) / max(dof, 1)))
    if obs_rel_sigma is None and has_prior:
        # second pass with the live noise estimated from the data (not a constant)
        return fit_curve(
            st, y, s1, s2, prior_steps=prior_steps, prior_loss=prior_loss, prior_rel_sigma=prior_rel_sigma,
            obs_rel_sigma=max(live_rms, 1e-4),
        )
    jac = best.jac
    scale = 1.0 if has_prior else max(live_rms / 1e-3, 1e-6) ** 2  # unweighted fit: sigma was a placeholder
    try:
        cov = np.linalg.pinv(jac.T @ jac) * scale
    except np.linalg.LinAlgError:
        cov = np.full((4, 4), np.inf)
    if not use_anneal:
        cov[3, :] = cov[:, 3] = 0.0
    model.cov = cov
    return model, live_rms
