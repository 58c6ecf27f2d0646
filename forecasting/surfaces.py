"""Final-loss surfaces beyond Chinchilla: forms that extrapolate in tokens per parameter and in sparsity.

Why more than one surface: a ladder is usually trained near one tokens-per-parameter ratio while the
hero is often far from it (over-trained for inference, or a MoE with many more total than active
parameters). Chinchilla's form fits the ladder but says little about those directions; each form
below adds one assumption about them, and `forecasting.api` picks among them by how well each one
predicted the ladder's own larger runs (a backtest), never by which columns happen to exist.

Forms (N = active parameters, D = tokens, N_t = total parameters, U = unique tokens):
- `overtrain`  Gadre et al. 2024: L = E + A/N^eta + B/D^eta, one exponent for both terms. Written in
  compute C = 6ND and the token multiplier M = D/N it is L = E + (a M^(eta/2) + b M^(-eta/2)) C^(-eta/2):
  at a fixed M the loss is a power law in C with the same exponent for every M, which is what their
  over-training ladders show and what makes extrapolation in M stable.
- `farseer`    a data exponent that moves with model size (Farseer, Li et al. 2025, simplified):
  L = E + A/N^alpha + B/D^(beta(N)),  beta(N) = beta0 + beta1 * ln(N / N_ref).
- `moe`        active and total parameters (sparsity; Ludziejewski et al. 2025 and Krajewski et al.
  2024 read through an effective size): N_eff = N * (N_t / N)^kappa, L = E + A/N_eff^alpha + B/D^beta.
  kappa = 0: only active parameters count; kappa = 1: total parameters count fully.
- `data_constrained`  Muennighoff et al. 2023: repeated tokens are worth less,
  D_eff = U + U R* (1 - exp(-(D/U - 1)/R*)) for D > U (D_eff = D otherwise), L = E + A/N^alpha + B/D_eff^beta.

Every form is fitted like Chinchilla (Epoch's protocol): Huber (delta 1e-3) on log-loss residuals,
several starts, bounded trust-region least squares to tight tolerances with each form's analytic Jacobian
(`grad_fn`; finite differences cost 5-7 predictions per iteration, and the fits take hundreds). Pure numerics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from forecasting.fitting import HUBER_DELTA, FitError, fit_chinchilla

N_REF = 1e9  # the size at which farseer's beta(N) equals beta0 (a fixed reference keeps parameters readable)
# Below this spread of D/N (decades) Chinchilla's alpha and beta are one direction, not two: its fit walks a flat
# valley (thousands of BFGS iterations, a few seconds per fit, every bootstrap replicate) and is not used as a start.
MIN_RATIO_SPREAD = 0.05
# least_squares' stopping tolerances. A fit (the forecast's own, a backtest split's) runs to tight ones; a bootstrap
# refit, warm-started at that fit's optimum, stops when the cost moves by under 1e-8 (relative): where a resample's
# optimum sits along a flat valley, the tight tolerances walked it to the 4,000-evaluation limit, the refit counted as
# unconverged and was dropped after a second multi-start (Porian's Farseer refits: 6 of 100 dropped, 84 s for 100),
# while the refits that converge either way predict the target within 2e-4 of each other (median 1e-6).
FIT_TOL = {"xtol": 1e-12, "ftol": 1e-14, "gtol": 1e-12}
REFIT_TOL = {"xtol": 1e-8, "ftol": 1e-8, "gtol": 1e-8}


@dataclass(frozen=True)
class Surface:
    """A named final-loss form: parameter names, a predictor and a starting-point generator."""

    name: str
    names: tuple[str, ...]
    predict_fn: Callable[[np.ndarray, dict], np.ndarray]
    starts_fn: Callable[[dict], list[np.ndarray]]
    bounds: tuple[np.ndarray, np.ndarray]
    grad_fn: Callable[[np.ndarray, dict], dict[str, np.ndarray]]  # d prediction / d each parameter, per point
    needs: tuple[str, ...] = ()
    formula_fn: Callable[[dict], str] = field(default=lambda p: "")

    def applicable(self, final: pd.DataFrame) -> str | None:
        """None when the form can be fitted to these final points, else the reason it cannot."""
        for c in ("params_active", "tokens", *self.needs):
            if c not in final.columns:
                return f"needs column {c!r}"
        if len(final) < len(self.names) + 1:
            return f"{len(self.names)} parameters need at least {len(self.names) + 1} finished runs; got {len(final)}"
        if final["params_active"].nunique() < 2:
            return "needs at least two model sizes"
        if self.name == "moe":
            return _sparsity_unidentifiable(final)
        if self.name == "data_constrained" and not (final["tokens"] > 1.01 * final["unique_tokens"]).any():
            return "no run repeats its data (tokens <= unique_tokens everywhere)"
        if self.name == "farseer" and final["params_active"].nunique() < 3:
            return "a size-dependent data exponent needs at least three model sizes"
        return None


# Below this spread (natural log) the moe law's kappa cannot be told from alpha: of sparsity, or of log total
# parameters around a line in log active parameters
MIN_SPARSITY_SPREAD = 0.1


def _sparsity_unidentifiable(final: pd.DataFrame) -> str | None:
    """Why the moe law's kappa cannot be fitted on these runs, or None.

    N_eff = N (N_t / N)^kappa = N^(1 - kappa) N_t^kappa: where log N_t is a line in log N (one sparsity for every
    run, or one total size for every run, as on Step Law's MoE ladder of 2.15B-total runs at 188M-1.24B active),
    N_eff is a power of N alone, A and alpha absorb any kappa, and the fit runs to a bound of both."""
    log_active = np.log(final["params_active"].to_numpy(float))
    log_total = np.log(final["params_total"].to_numpy(float))
    if np.ptp(log_total - log_active) < MIN_SPARSITY_SPREAD:
        return "the ladder does not vary sparsity (total/active parameters): kappa is not identifiable"
    slope, intercept = np.polyfit(log_active, log_total, 1)
    if np.ptp(log_total - (slope * log_active + intercept)) < MIN_SPARSITY_SPREAD:
        pattern = "one total size" if abs(slope) < 0.1 else f"total parameters growing as active^{slope:.2g}"
        return (f"the ladder's total parameters follow its active ones ({pattern}): how total parameters help (kappa) "
                "cannot be told from how active ones do (alpha); that needs total sizes that vary apart from the active "
                "ones (one active size at two total sizes, say)")
    return None


@dataclass
class SurfaceFit:
    """A fitted surface: its parameters (natural units), objective and convergence."""

    surface: Surface
    params: dict[str, float]
    objective: float
    converged: bool
    at_bounds: tuple[str, ...] = ()  # parameters the optimum sits on a bound of: the points do not pin them

    def predict(self, data: dict[str, np.ndarray]) -> np.ndarray:
        return self.surface.predict_fn(_as_arrays(data), self.params)

    def formula(self) -> str:
        return self.surface.formula_fn(self.params)


def _as_arrays(data) -> dict[str, np.ndarray]:
    if isinstance(data, pd.DataFrame):
        return {c: data[c].to_numpy(float) for c in data.columns if c in _COLS}
    return {k: np.atleast_1d(np.asarray(v, dtype=float)) for k, v in data.items() if v is not None}


_COLS = ("params_active", "tokens", "params_total", "unique_tokens")


def _chin(n, d, p, beta=None):
    b = p["beta"] if beta is None else beta
    return p["E"] + p["A"] / n ** p["alpha"] + p["B"] / d**b


def _pred_overtrain(x, p):
    return p["E"] + p["A"] / x["params_active"] ** p["eta"] + p["B"] / x["tokens"] ** p["eta"]


def _pred_farseer(x, p):
    n = x["params_active"]
    beta = p["beta0"] + p["beta1"] * np.log(n / N_REF)
    return p["E"] + p["A"] / n ** p["alpha"] + p["B"] / x["tokens"] ** np.maximum(beta, 1e-3)


def _pred_moe(x, p):
    n = x["params_active"]
    n_eff = n * (x["params_total"] / n) ** p["kappa"]
    return p["E"] + p["A"] / n_eff ** p["alpha"] + p["B"] / x["tokens"] ** p["beta"]


def _grad_overtrain(x, p):
    f, g = x["params_active"] ** -p["eta"], x["tokens"] ** -p["eta"]
    return {"E": np.ones_like(f), "A": f, "B": g,
            "eta": -p["A"] * f * np.log(x["params_active"]) - p["B"] * g * np.log(x["tokens"])}


def _grad_farseer(x, p):
    n = x["params_active"]
    beta = p["beta0"] + p["beta1"] * np.log(n / N_REF)
    f, g = n ** -p["alpha"], x["tokens"] ** -np.maximum(beta, 1e-3)
    d_beta = -p["B"] * g * np.log(x["tokens"]) * (beta > 1e-3)
    return {"E": np.ones_like(f), "A": f, "B": g, "alpha": -p["A"] * f * np.log(n), "beta0": d_beta,
            "beta1": d_beta * np.log(n / N_REF)}


def _grad_moe(x, p):
    n = x["params_active"]
    log_ratio = np.log(x["params_total"] / n)
    log_n_eff = np.log(n) + p["kappa"] * log_ratio
    f, g = np.exp(-p["alpha"] * log_n_eff), x["tokens"] ** -p["beta"]
    return {"E": np.ones_like(f), "A": f, "B": g, "alpha": -p["A"] * f * log_n_eff, "beta": -p["B"] * g * np.log(x["tokens"]),
            "kappa": -p["A"] * f * p["alpha"] * log_ratio}


def effective_tokens(tokens: np.ndarray, unique: np.ndarray, r_star: float) -> np.ndarray:
    """Muennighoff et al. 2023: U + U R* (1 - exp(-R/R*)), R = D/U - 1 repetitions (D itself when D <= U)."""
    reps = np.maximum(tokens / unique - 1.0, 0.0)
    return np.where(reps > 0, unique + unique * r_star * (1 - np.exp(-reps / r_star)), tokens)


def _pred_dc(x, p):
    d_eff = effective_tokens(x["tokens"], x["unique_tokens"], p["R_star"])
    return p["E"] + p["A"] / x["params_active"] ** p["alpha"] + p["B"] / d_eff ** p["beta"]


def _grad_dc(x, p):
    u, r_star = x["unique_tokens"], p["R_star"]
    reps = np.maximum(x["tokens"] / u - 1.0, 0.0)
    d_eff = effective_tokens(x["tokens"], u, r_star)
    f, g = x["params_active"] ** -p["alpha"], d_eff ** -p["beta"]
    ratio = reps / r_star
    d_eff_d_r_star = np.where(reps > 0, u * (1 - np.exp(-ratio) * (1 + ratio)), 0.0)
    return {"E": np.ones_like(f), "A": f, "B": g, "alpha": -p["A"] * f * np.log(x["params_active"]),
            "beta": -p["B"] * g * np.log(d_eff), "R_star": -p["B"] * p["beta"] * g / d_eff * d_eff_d_r_star}


def _fmt(p: dict, keys: tuple[str, ...]) -> str:
    return ", ".join(f"{k}={p[k]:.4g}" for k in keys)


def _chin_start(ctx: dict) -> dict:
    law = ctx.get("chinchilla")
    if law is None:
        return {"E": 1.5, "A": 400.0, "B": 400.0, "alpha": 0.34, "beta": 0.28}
    return {"E": law.E, "A": law.A, "B": law.B, "alpha": law.alpha, "beta": law.beta}


def _starts_overtrain(ctx):
    c = _chin_start(ctx)
    out = []
    for eta in sorted({0.5 * (c["alpha"] + c["beta"]), 0.2, 0.35, 0.5}):
        out.append(np.array([c["E"], c["A"], c["B"], eta]))
    return out


def _starts_farseer(ctx):
    c = _chin_start(ctx)
    return [np.array([c["E"], c["A"], c["B"], c["alpha"], c["beta"], b1]) for b1 in (0.0, -0.02, 0.02)]


def _starts_moe(ctx):
    c = _chin_start(ctx)
    return [np.array([c["E"], c["A"], c["B"], c["alpha"], c["beta"], k]) for k in (0.0, 0.2, 0.5)]


def _starts_dc(ctx):
    c = _chin_start(ctx)
    return [np.array([c["E"], c["A"], c["B"], c["alpha"], c["beta"], r]) for r in (5.0, 15.0, 40.0)]


_POS = 1e-9
SURFACES: dict[str, Surface] = {
    "overtrain": Surface(
        "overtrain", ("E", "A", "B", "eta"), _pred_overtrain, _starts_overtrain,
        (np.array([0.0, _POS, _POS, 0.01]), np.array([20.0, 1e12, 1e12, 2.0])),
        grad_fn=_grad_overtrain,
        formula_fn=lambda p: f"L(N, D) = {p['E']:.4g} + {p['A']:.4g}/N^{p['eta']:.4g} + {p['B']:.4g}/D^{p['eta']:.4g}  (Gadre: one exponent; L = E + (a M^(eta/2) + b M^(-eta/2)) C^(-eta/2))",
    ),
    "farseer": Surface(
        "farseer", ("E", "A", "B", "alpha", "beta0", "beta1"), _pred_farseer, _starts_farseer,
        (np.array([0.0, _POS, _POS, 0.01, 0.01, -0.3]), np.array([20.0, 1e12, 1e12, 2.0, 2.0, 0.3])),
        grad_fn=_grad_farseer,
        formula_fn=lambda p: f"L(N, D) = {p['E']:.4g} + {p['A']:.4g}/N^{p['alpha']:.4g} + {p['B']:.4g}/D^(beta(N)),  beta(N) = {p['beta0']:.4g} + {p['beta1']:.4g} ln(N/1e9)",
    ),
    "moe": Surface(
        "moe", ("E", "A", "B", "alpha", "beta", "kappa"), _pred_moe, _starts_moe,
        (np.array([0.0, _POS, _POS, 0.01, 0.01, -0.5]), np.array([20.0, 1e12, 1e12, 2.0, 2.0, 1.5])),
        grad_fn=_grad_moe,
        needs=("params_total",),
        formula_fn=lambda p: f"L = {p['E']:.4g} + {p['A']:.4g}/N_eff^{p['alpha']:.4g} + {p['B']:.4g}/D^{p['beta']:.4g},  N_eff = N (N_total/N)^{p['kappa']:.4g}",
    ),
    "data_constrained": Surface(
        "data_constrained", ("E", "A", "B", "alpha", "beta", "R_star"), _pred_dc, _starts_dc,
        (np.array([0.0, _POS, _POS, 0.01, 0.01, 0.1]), np.array([20.0, 1e12, 1e12, 2.0, 2.0, 1e4])),
        grad_fn=_grad_dc,
        needs=("unique_tokens",),
        formula_fn=lambda p: f"L = {p['E']:.4g} + {p['A']:.4g}/N^{p['alpha']:.4g} + {p['B']:.4g}/D_eff^{p['beta']:.4g},  D_eff = U + U R* (1 - exp(-R/R*)), R* = {p['R_star']:.4g}",
    ),
}


# Each form is E + A f(x; theta) + B g(x; theta): for fixed theta (the exponents and the form's own parameter) it is
# linear in (E, A, B), so a grid over theta with (E, A, B) in closed form finds the basin of the global optimum
# cheaply (variable projection, as fitting.fit_chinchilla does for Chinchilla's form). Without it the starts near
# Chinchilla's own fit can all sit in one local basin: the data-constrained form on the C4 runs of Muennighoff et
# al. stopped at a Huber objective 5.2x the global one (held-out 8.7B finals 5.4% off instead of 1.9%), and which
# basin a run reached depended on the machine's floating point.
_GRID = {
    "alpha": (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.3, 1.7),
    "beta": (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.3, 1.7),
    "eta": (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.3, 1.7),
    "beta0": (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.3, 1.7),
    "beta1": (-0.1, -0.03, 0.0, 0.03, 0.1),
    "kappa": (-0.2, 0.0, 0.25, 0.5, 0.8, 1.0),
    "R_star": (1.0, 3.0, 7.0, 15.0, 40.0, 100.0, 500.0),
}


def _grid_start(surface: Surface, x: dict, y: np.ndarray, w: np.ndarray) -> list[np.ndarray]:
    """The best point of a grid over the form's nonlinear parameters, (E, A, B) solved in closed form there by
    weighted least squares on relative residuals; [] when no grid point gives positive E < min loss, A and B."""
    names = [k for k in surface.names if k not in ("E", "A", "B")]
    mesh = np.meshgrid(*[np.asarray(_GRID[k], dtype=float) for k in names], indexing="ij")
    theta = {k: m.reshape(-1, 1) for k, m in zip(names, mesh, strict=True)}
    f = surface.predict_fn(x, {**theta, "E": 0.0, "A": 1.0, "B": 0.0})  # grid x points
    g = surface.predict_fn(x, {**theta, "E": 0.0, "A": 0.0, "B": 1.0})
    inv = 1.0 / y
    cols = np.stack([np.broadcast_to(inv, f.shape), f * inv, g * inv], axis=-1) * np.sqrt(w)[:, None]  # grid x points x 3
    target = np.sqrt(w)
    gram = np.einsum("gni,gnj->gij", cols, cols)
    gram = gram + 1e-12 * np.einsum("gii->gi", gram)[..., None] * np.eye(3)
    coef = np.linalg.solve(gram, np.einsum("gni,n->gi", cols, target)[..., None])[..., 0]
    resid = np.einsum("gni,gi->gn", cols, coef) - target
    sse = np.where(np.all(coef > 0, axis=1) & (coef[:, 0] < y.min()), np.sum(resid**2, axis=1), np.inf)
    if not np.isfinite(sse).any():
        return []
    best = int(np.argmin(sse))
    p = {k: float(v[best, 0]) for k, v in theta.items()} | dict(zip(("E", "A", "B"), map(float, coef[best]), strict=True))
    return [np.array([p[k] for k in surface.names])]


def fit_surface(
    name: str, final: pd.DataFrame, *, weights: np.ndarray | None = None, start: dict | None = None,
    delta: float = HUBER_DELTA,
) -> SurfaceFit:
    """Fit surface `name` to final points (columns params_active, tokens, loss, and what the form needs).

    Parameters are optimised in log space where they are positive (E, A, B, R*), exponents as they are;
    Huber on log residuals through least_squares(loss="huber", f_scale=delta). Starts: the Chinchilla
    fit on the same points (its varpro grid search finds the basin), a few spread values of the form's
    own extra parameter, and the best point of a grid over the form's own nonlinear parameters (`_grid_start`).
    With `start` (a bootstrap refit, warm-started at the full fit's optimum): that start alone, and the others
    besides it only when it does not converge; a refit stops at REFIT_TOL.
    """
    surface = SURFACES[name]
    reason = surface.applicable(final)
    if reason:
        raise FitError(f"the {name} law cannot be fitted here: {reason}")
    x = _as_arrays(final)
    y = final["loss"].to_numpy(float)
    if not (np.all(np.isfinite(y)) and np.all(y > 0)):
        raise FitError("losses must be finite and positive")
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=float)
    keep = w > 0
    x = {k: v[keep] for k, v in x.items()}
    y, w = y[keep], w[keep]
    if len(y) < len(surface.names) + 1 or len(np.unique(x["params_active"])) < 2:
        raise FitError("too few distinct points with positive weight")
    log_idx = [i for i, k in enumerate(surface.names) if k in ("E", "A", "B", "R_star")]
    lo, hi = surface.bounds
    sw = np.sqrt(w)
    logy = np.log(y)

    def unpack(z):
        th = z.copy()
        th[log_idx] = np.exp(z[log_idx])
        return dict(zip(surface.names, th, strict=True))

    def resid(z):
        pred = surface.predict_fn(x, unpack(z))
        return sw * (np.log(np.maximum(pred, 1e-12)) - logy)

    def jac(z):
        p = unpack(z)
        pred = surface.predict_fn(x, p)
        grad = surface.grad_fn(x, p)
        # d log(pred) / d z; a parameter fitted in log space moves the prediction by its value times its derivative
        scale = np.where(pred > 1e-12, sw / np.maximum(pred, 1e-12), 0.0)
        return np.stack([grad[k] * (p[k] if i in log_idx else 1.0) * scale for i, k in enumerate(surface.names)], axis=1)

    zlo, zhi = lo.astype(float).copy(), hi.astype(float).copy()
    zlo[log_idx] = np.log(np.maximum(lo[log_idx], 1e-12))
    zhi[log_idx] = np.log(hi[log_idx])
    zlo[surface.names.index("E")] = np.log(1e-3)
    zhi[surface.names.index("E")] = np.log(max(float(y.min()) * (1 - 1e-6), 2e-3))

    tol = FIT_TOL if start is None else REFIT_TOL

    def best_of(starts, best=None):
        for s0 in starts:
            z0 = np.asarray(s0, dtype=float).copy()
            z0[log_idx] = np.log(np.maximum(z0[log_idx], 1e-12))
            z0 = np.clip(z0, zlo + 1e-9, zhi - 1e-9)
            try:
                res = least_squares(resid, z0, jac=jac, bounds=(zlo, zhi), loss="huber", f_scale=delta,
                                    max_nfev=4000, **tol)
            except (ValueError, FloatingPointError):
                continue
            if np.isfinite(res.cost) and (best is None or res.cost < best.cost):
                best = res
        return best

    # a bootstrap refit starts from the full fit's optimum alone, and from every start only when that does not
    # converge: on Step Law, Porian and Chinchilla splits the multi-start found the same optimum (forecasts equal to
    # 5 digits) at 4-17x the time; where a fit sits on a bound, refits can settle elsewhere along the flat valley
    # (on the public suite, band half-widths moved by up to 0.03 points: BENCHMARKS.md)
    best = None if start is None else best_of([np.array([start[k] for k in surface.names])])
    if best is None or best.status <= 0:
        ctx: dict = {}
        if np.ptp(np.log10(x["tokens"] / x["params_active"])) >= MIN_RATIO_SPREAD:
            try:
                law, diag = fit_chinchilla(x["params_active"], x["tokens"], y, weights=w, n_polish=2)
                if diag.converged:
                    ctx["chinchilla"] = law
            except FitError:
                pass
        starts = surface.starts_fn(ctx)
        if start is None:
            starts += _grid_start(surface, x, y, w)
        best = best_of(starts, best)
    if best is None:
        raise FitError(f"the {name} law did not converge from any start")
    params = {k: float(v) for k, v in unpack(best.x).items()}
    converged = bool(best.status > 0 and np.all(np.isfinite(best.x)))
    edge = 1e-4 * (zhi - zlo)
    # E at its floor is the form without an irreducible term, a fair reading of a short ladder; any other edge
    # (A or B at 1e12, an exponent at its limit, E at the smallest loss) is a degenerate optimum
    at_bounds = tuple(k for k, z, a, b, e in zip(surface.names, best.x, zlo, zhi, edge, strict=True)
                      if (z <= a + e and k != "E") or z >= b - e)
    return SurfaceFit(surface=surface, params=params, objective=float(best.cost) * delta, converged=converged, at_bounds=at_bounds)
