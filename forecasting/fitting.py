"""Fitting the laws: Huber on log-loss, variable projection for speed, tight tolerances for honesty.

Why variable projection: for fixed exponents (alpha, beta) the Chinchilla surface E + A*N^-alpha +
B*D^-beta is linear in (E, A, B). So instead of 4,500 blind L-BFGS starts (Hoffmann; Epoch) we scan
a dense (alpha, beta) grid, solve the linear part in closed form for every grid point at once (one
batched 3x3 solve over all pairs), and polish the few best candidates with BFGS on the real
objective: sum Huber_delta(log Lhat - log L), delta = 1e-3, in log-parameters, analytic gradient.

Why tight tolerances: the Huber sum is ~1e-3; default tolerances stop early (Epoch's finding about
Hoffmann's fit). We scale the objective by 1/delta and use ftol/gtol near machine precision.

A fit that does not converge raises `FitError` (or, where a caller asks, is flagged), never returns
a confident number silently.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize

from forecasting.laws import ChinchillaLaw, ComputeLaw

HUBER_DELTA = 1e-3


class FitError(ValueError):
    """Raised when a law cannot be fitted honestly (too little data, no convergence, degenerate)."""


class MissingColumnsError(FitError):
    """A FitError because the table lacks columns every law needs (its message names them), so a caller can say where
    to get them (the CLI: `ladder import`, whose step spec supplies them)."""


@dataclass(frozen=True)
class FitDiagnostics:
    objective: float  # Huber sum (unscaled) at the optimum
    converged: bool
    n_points: int
    message: str


@dataclass
class _Result:
    x: np.ndarray
    fun: float
    jac: np.ndarray
    success: bool
    message: str


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def _check_points(params: np.ndarray, tokens: np.ndarray, loss: np.ndarray) -> None:
    for name, x in (("params", params), ("tokens", tokens), ("loss", loss)):
        if not np.all(np.isfinite(x)):
            raise FitError(f"{name} contains NaN or inf")
        if np.any(x <= 0):
            raise FitError(f"{name} must be positive")
    if len(loss) < 5:
        raise FitError(f"the Chinchilla surface has 5 parameters; got only {len(loss)} points")
    if len(np.unique(params)) < 2:
        raise FitError("the Chinchilla surface needs at least two model sizes (one N cannot identify A, alpha)")
    if len(np.unique(tokens)) < 2:
        raise FitError("the Chinchilla surface needs at least two token counts")


def chinchilla_objective(
    theta: np.ndarray,
    log_n: np.ndarray,
    log_d: np.ndarray,
    log_l: np.ndarray,
    weights: np.ndarray,
    delta: float = HUBER_DELTA,
) -> tuple[float, np.ndarray]:
    """Huber(delta) of LSE(a - alpha log N, b - beta log D, e) - log L, scaled by 1/delta; with gradient."""
    a, b, e, alpha, beta = theta
    t1 = a - alpha * log_n
    t2 = b - beta * log_d
    m = np.maximum(np.maximum(t1, t2), e)
    x1, x2, x3 = np.exp(t1 - m), np.exp(t2 - m), np.exp(e - m)
    s = x1 + x2 + x3
    r = m + np.log(s) - log_l
    val = float(np.sum(weights * huber(r, delta))) / delta
    psi = weights * np.clip(r, -delta, delta) / delta
    p1, p2, p3 = psi * x1 / s, psi * x2 / s, psi * x3 / s
    grad = np.array([p1.sum(), p2.sum(), p3.sum(), -(p1 * log_n).sum(), -(p2 * log_d).sum()])
    return val, grad


def _objective_grad_hess(theta, log_n, log_d, log_l, w, delta):
    """Objective, gradient and exact Hessian of `chinchilla_objective` (5 x 5, cheap)."""
    a, b, e, alpha, beta = theta
    t = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)], axis=1)
    m = t.max(axis=1, keepdims=True)
    x = np.exp(t - m)
    s = x.sum(axis=1, keepdims=True)
    p = x / s
    r = (m + np.log(s))[:, 0] - log_l
    n = len(r)
    u = np.zeros((n, 3, 5))  # d t_k / d theta
    u[:, 0, 0] = 1.0
    u[:, 0, 3] = -log_n
    u[:, 1, 1] = 1.0
    u[:, 1, 4] = -log_d
    u[:, 2, 2] = 1.0
    g_r = np.einsum("nk,nkj->nj", p, u)
    inside = np.abs(r) <= delta
    psi = w * np.clip(r, -delta, delta) / delta
    dpsi = w * inside / delta
    f = float(np.sum(w * huber(r, delta))) / delta
    grad = psi @ g_r
    hess_r_part = np.einsum("n,nk,nki,nkj->ij", psi, p, u, u) - np.einsum("n,ni,nj->ij", psi, g_r, g_r)
    hess = np.einsum("n,ni,nj->ij", dpsi, g_r, g_r) + hess_r_part
    return f, grad, hess


def _newton_polish(theta0, log_n, log_d, log_l, w, delta, max_iter: int = 200):
    """Damped Newton (Levenberg) with exact Hessian; returns (theta, f, grad, converged)."""
    theta = np.asarray(theta0, dtype=float).copy()
    f, g, h = _objective_grad_hess(theta, log_n, log_d, log_l, w, delta)
    lam = 1e-6
    scale = max(1.0, float(np.sum(w)))
    for _ in range(max_iter):
        if np.max(np.abs(g)) / scale < 1e-11:
            return theta, f, g, True
        diag = np.abs(np.diag(h)) + 1e-12
        accepted = False
        for _ in range(40):
            try:
                step = np.linalg.solve(h + lam * np.diag(diag), -g)
            except np.linalg.LinAlgError:
                lam *= 10
                continue
            cand = theta + step
            f_new, g_new, h_new = _objective_grad_hess(cand, log_n, log_d, log_l, w, delta)
            if np.isfinite(f_new) and f_new <= f:
                small = f - f_new <= 1e-15 * max(abs(f), 1e-300) and np.max(np.abs(step)) < 1e-10
                theta, f, g, h = cand, f_new, g_new, h_new
                lam = max(lam / 10, 1e-12)
                accepted = True
                if small:
                    return theta, f, g, True
                break
            lam *= 10
        if not accepted:
            # no descent step at any damping: a (numerically) stationary point
            return theta, f, g, bool(np.max(np.abs(g)) / scale < 1e-6)
    return theta, f, g, bool(np.max(np.abs(g)) / scale < 1e-6)


def _varpro_grid(
    params: np.ndarray, tokens: np.ndarray, loss: np.ndarray, weights: np.ndarray, alphas: np.ndarray, betas: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Closed-form (E, A, B) for every (alpha, beta) pair; returns (coef[na, nb, 3], rel_sse[na, nb]).

    Linear part solved by weighted least squares on relative residuals (Lhat - L)/L, the first-order
    form of the log residual; the Huber polish afterwards does the robust part.
    """
    inv = 1.0 / loss
    x1 = params[:, None] ** (-alphas[None, :]) * inv[:, None]  # n x na
    x2 = tokens[:, None] ** (-betas[None, :]) * inv[:, None]  # n x nb
    w = weights
    g00 = np.sum(w * inv * inv)
    g01 = (w * inv) @ x1  # na
    g02 = (w * inv) @ x2  # nb
    g11 = (w[:, None] * x1 * x1).sum(0)  # na
    g22 = (w[:, None] * x2 * x2).sum(0)  # nb
    g12 = (w[:, None] * x1).T @ x2  # na x nb
    y0 = np.sum(w * inv)
    y1 = w @ x1
    y2 = w @ x2
    na, nb = len(alphas), len(betas)
    gram = np.empty((na, nb, 3, 3))
    gram[..., 0, 0] = g00
    gram[..., 0, 1] = gram[..., 1, 0] = g01[:, None]
    gram[..., 0, 2] = gram[..., 2, 0] = g02[None, :]
    gram[..., 1, 1] = g11[:, None]
    gram[..., 2, 2] = g22[None, :]
    gram[..., 1, 2] = gram[..., 2, 1] = g12
    rhs = np.empty((na, nb, 3))
    rhs[..., 0] = y0
    rhs[..., 1] = y1[:, None]
    rhs[..., 2] = y2[None, :]
    # Scale-free ridge so near-singular corners do not blow up.
    diag = np.einsum("...ii->...i", gram)
    gram = gram + 1e-12 * diag[..., :, None] * np.eye(3)
    coef = np.linalg.solve(gram, rhs[..., None])[..., 0]
    sw = np.sum(w)
    sse = sw - 2 * np.einsum("...i,...i->...", coef, rhs) + np.einsum("...i,...ij,...j->...", coef, gram, coef)
    bad = np.any(coef <= 0, axis=-1)
    sse = np.where(bad, np.inf, sse)
    return coef, sse


DEFAULT_ALPHAS = np.linspace(0.02, 1.2, 60)
DEFAULT_BETAS = np.linspace(0.02, 1.2, 60)


def fit_chinchilla(
    params: np.ndarray,
    tokens: np.ndarray,
    loss: np.ndarray,
    *,
    weights: np.ndarray | None = None,
    n_polish: int = 4,
    delta: float = HUBER_DELTA,
    alphas: np.ndarray = DEFAULT_ALPHAS,
    betas: np.ndarray = DEFAULT_BETAS,
    start: np.ndarray | None = None,
    candidate_radius: float = 0.02,
) -> tuple[ChinchillaLaw, FitDiagnostics]:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta by Huber(delta) on log-loss.

    Variable projection over an (alpha, beta) grid picks `n_polish` starting points (plus `start`, a
    log-parameter vector (a, b, e, alpha, beta), if given); each is polished by BFGS (analytic
    gradient, gtol 1e-9 on the 1/delta-scaled objective); the lowest objective wins. `weights` are per-point multiplicities (a bootstrap uses
    resample counts instead of copying rows). A grid candidate whose (alpha, beta) lies within
    `candidate_radius` of an optimum already polished is skipped (bootstrap refits warm-started from
    the full fit use a wider radius: only a clearly different basin is worth a second polish).
    """
    n = np.asarray(params, dtype=float)
    d = np.asarray(tokens, dtype=float)
    y = np.asarray(loss, dtype=float)
    _check_points(n, d, y)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=float)
    keep = w > 0
    n, d, y, w = n[keep], d[keep], y[keep], w[keep]
    if len(np.unique(n)) < 2 or len(y) < 5:
        raise FitError("too few distinct points with positive weight to fit 5 parameters")
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(y)

    coef, sse = _varpro_grid(n, d, y, w, alphas, betas)
    flat = np.argsort(sse, axis=None)
    starts = []
    for idx in flat[: max(n_polish * 6, n_polish)]:
        i, j = np.unravel_index(idx, sse.shape)
        if not np.isfinite(sse[i, j]):
            break
        e_, a_, b_ = coef[i, j]
        cand = np.array([np.log(a_), np.log(b_), np.log(e_), alphas[i], betas[j]])
        if all(np.max(np.abs(cand[3:] - s[3:])) > 0.03 for s in starts):
            starts.append(cand)
        if len(starts) >= n_polish:
            break
    if start is not None:
        starts.insert(0, np.asarray(start, dtype=float))
    if not starts:
        # every grid point had a non-positive linear coefficient: fall back to a generic start
        starts.append(np.array([5.0, 5.0, np.log(max(y.min() * 0.5, 1e-3)), 0.3, 0.3]))

    best = None
    for s0 in starts:
        if best is not None and np.max(np.abs(best.x[3:] - s0[3:])) < candidate_radius:
            continue  # a candidate next to an optimum already polished adds cost, not information
        # Damped Newton with the exact Hessian (a few ms); BFGS as the fallback when it stalls.
        th, f, g, ok = _newton_polish(s0, log_n, log_d, log_l, w, delta)
        if ok:
            res = _Result(x=th, fun=f, jac=g, success=True, message="Newton: converged")
        else:
            res = minimize(
                chinchilla_objective,
                s0,
                args=(log_n, log_d, log_l, w, delta),
                jac=True,
                method="BFGS",
                options={"gtol": 1e-9, "maxiter": 5000, "xrtol": 1e-12},
            )
        if best is None or res.fun < best.fun:
            best = res
    assert best is not None
    a, b, e, alpha, beta = best.x
    sane = bool(np.all(np.isfinite(best.x)) and 0 < alpha < 5 and 0 < beta < 5 and -30 < e < 10)
    grad_norm = float(np.max(np.abs(best.jac))) / max(1.0, float(np.sum(w)))
    converged = bool(best.success or grad_norm < 1e-6) and sane
    law = ChinchillaLaw(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=float(alpha), beta=float(beta))
    diag = FitDiagnostics(
        objective=float(best.fun) * delta,
        converged=converged,
        n_points=int(len(y)),
        message=str(best.message) if sane else (f"its optimum lies outside the plausible region (alpha {alpha:.3g}, beta {beta:.3g}, "
                                                f"E {math.exp(min(e, 700.0)):.3g}; the solver said: {best.message})"),
    )
    return law, diag


def chinchilla_log_params(law: ChinchillaLaw) -> np.ndarray:
    return np.array([np.log(law.A), np.log(law.B), np.log(law.E), law.alpha, law.beta])


def fit_compute_law(
    flops: np.ndarray,
    loss: np.ndarray,
    *,
    asymptote: float | str = "profiled",
    weights: np.ndarray | None = None,
) -> ComputeLaw:
    """Fit L(C) = E + A*C^-alpha.

    asymptote: a number fixes E (OLS of log(L - E) on log C, Marin's form); "profiled" scans E on a
    grid below min(L) and keeps the E with the least log-space residual (the fitted-L0 of collapse
    analyses); "free" polishes the profiled solution jointly by least squares in log-loss.
    """
    c = np.asarray(flops, dtype=float)
    y = np.asarray(loss, dtype=float)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=float)
    if not (np.all(np.isfinite(c)) and np.all(np.isfinite(y))):
        raise FitError("compute law: NaN or inf in flops/loss")
    if np.any(c <= 0) or np.any(y <= 0):
        raise FitError("compute law: flops and loss must be positive")
    n_distinct = len(np.unique(c[w > 0]))
    if isinstance(asymptote, (int, float)):
        if n_distinct < 2:
            raise FitError("compute law with fixed E needs at least two distinct compute budgets")
        e_fixed = float(asymptote)
        if np.any(y <= e_fixed):
            raise FitError(f"fixed asymptote E={e_fixed} is not below every loss")
        slope, icpt = np.polyfit(np.log(c), np.log(y - e_fixed), 1, w=np.sqrt(w))
        return ComputeLaw(E=e_fixed, A=float(np.exp(icpt)), alpha=float(-slope), asymptote_mode="fixed")
    if n_distinct < 3:
        raise FitError("compute law with a fitted E has 3 parameters and needs at least three distinct budgets")
    e_grid = np.linspace(0.0, y.min() * (1 - 1e-4), 400)
    best = (np.inf, 0.0, 0.0, 0.0)
    lc = np.log(c)
    for e_try in e_grid:
        slope, icpt = np.polyfit(lc, np.log(y - e_try), 1, w=np.sqrt(w))
        pred = e_try + np.exp(icpt + slope * lc)
        sse = float(np.sum(w * (np.log(pred) - np.log(y)) ** 2))
        if sse < best[0]:
            best = (sse, e_try, float(np.exp(icpt)), float(-slope))
    _, e_hat, a_hat, al_hat = best
    if asymptote == "profiled":
        return ComputeLaw(E=e_hat, A=a_hat, alpha=al_hat, asymptote_mode="profiled")
    if asymptote != "free":
        raise ValueError(f"asymptote must be a number, 'profiled' or 'free'; got {asymptote!r}")

    def obj(th: np.ndarray) -> float:
        e_, la_, al_ = th
        pred = e_ + np.exp(la_ - al_ * lc)
        if np.any(pred <= 0):
            return 1e10
        return float(np.sum(w * (np.log(pred) - np.log(y)) ** 2))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = minimize(obj, [e_hat, np.log(a_hat), al_hat], method="Nelder-Mead", options={"xatol": 1e-10, "fatol": 1e-14, "maxiter": 20000})
    e_, la_, al_ = res.x
    return ComputeLaw(E=float(e_), A=float(np.exp(la_)), alpha=float(al_), asymptote_mode="free")
