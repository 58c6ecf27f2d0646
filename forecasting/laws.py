"""Scaling laws as small typed objects: parameters, `predict`, a readable `formula()`.

Why objects and not bare tuples: a fitted law travels (into a Forecast, a JSON file, a CLI table), and
whoever reads it later must know which form and which units it was fitted in. Each law is a frozen
pydantic model, so `model_dump()` / `model_validate()` round-trip it exactly.

Laws here:
- `ChinchillaLaw`  L(N, D) = E + A/N^alpha + B/D^beta   (approach 3; N = active parameters for MoE)
- `ComputeLaw`     L(C) = E + A*C^-alpha                 (E free, fixed or profiled by the fitter)
- compute-optimal allocation for a Chinchilla law, and the isoFLOP (approach 2) helper.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class ChinchillaLaw(BaseModel):
    """Final-loss surface L(N, D) = E + A/N^alpha + B/D^beta (Hoffmann et al. 2022, approach 3)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: str = Field("chinchilla", description="Law identifier, fixed.")
    E: float = Field(description="Irreducible loss (the loss of an infinite model on infinite data).")
    A: float = Field(description="Coefficient of the parameter term.")
    B: float = Field(description="Coefficient of the data term.")
    alpha: float = Field(description="Exponent of N (parameters).")
    beta: float = Field(description="Exponent of D (tokens).")

    def predict(self, params: np.ndarray | float, tokens: np.ndarray | float) -> np.ndarray:
        n = np.asarray(params, dtype=float)
        d = np.asarray(tokens, dtype=float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def formula(self) -> str:
        return (
            f"L(N, D) = {self.E:.4g} + {self.A:.4g}/N^{self.alpha:.4g} + {self.B:.4g}/D^{self.beta:.4g}"
        )

    def compute_optimal(self, flops: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(N_opt, D_opt) minimising L at compute C = 6*N*D (Hoffmann et al. eq. 4)."""
        c = np.asarray(flops, dtype=float)
        a, b = self.alpha, self.beta
        g = (a * self.A / (b * self.B)) ** (1.0 / (a + b))
        n_opt = g * (c / 6.0) ** (b / (a + b))
        d_opt = (1.0 / g) * (c / 6.0) ** (a / (a + b))
        return n_opt, d_opt


class ComputeLaw(BaseModel):
    """Loss against compute L(C) = E + A*C^-alpha (e.g. the loss of compute-optimal runs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: str = Field("compute", description="Law identifier, fixed.")
    E: float = Field(description="Asymptote (fitted, fixed by the caller, or profiled).")
    A: float = Field(description="Coefficient.")
    alpha: float = Field(description="Exponent of compute.")
    asymptote_mode: str = Field("free", description="How E was obtained: free, fixed or profiled.")

    def predict(self, flops: np.ndarray | float) -> np.ndarray:
        return self.E + self.A * np.asarray(flops, dtype=float) ** (-self.alpha)

    def formula(self) -> str:
        return f"L(C) = {self.E:.4g} + {self.A:.4g}*C^-{self.alpha:.4g}  (E {self.asymptote_mode})"


def compute_optimal_allocation(law: ChinchillaLaw, flops: float | np.ndarray) -> dict[str, np.ndarray]:
    """N_opt, D_opt, tokens per parameter and predicted loss at the optimum for each budget."""
    n_opt, d_opt = law.compute_optimal(flops)
    return {
        "flops": np.asarray(flops, dtype=float),
        "params_opt": n_opt,
        "tokens_opt": d_opt,
        "tokens_per_param": d_opt / n_opt,
        "loss_opt": law.predict(n_opt, d_opt),
    }


class IsoFlopResult(BaseModel):
    """Approach 2: the optimum of a parabola in log N per compute budget, and N_opt ~ C^a."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    budgets: list[float] = Field(description="Compute budgets (FLOPs), one per parabola.")
    params_opt: list[float] = Field(description="Loss-minimising N at each budget (parabola vertex).")
    tokens_opt: list[float] = Field(description="D_opt = C / (6 N_opt).")
    exponent_a: float = Field(description="Fitted a in N_opt = k * C^a (log-log OLS over budgets).")
    exponent_b: float = Field(description="Fitted b in D_opt = k * C^b.")


def isoflop_optimum(
    flops: Sequence[float], params: Sequence[float], loss: Sequence[float], *, rel_tol: float = 0.05
) -> IsoFlopResult:
    """Approach-2 helper: group runs into budgets (within rel_tol), fit loss = q(log N), take the vertex.

    Known bias (Open-Athena/scaling-law-analysis): off-centre or wide grids shift the vertex; read
    `exponent_a` as an approach-2 estimate, not the truth.
    """
    c = np.asarray(flops, dtype=float)
    n = np.asarray(params, dtype=float)
    y = np.asarray(loss, dtype=float)
    order = np.argsort(c)
    groups: list[list[int]] = []
    for i in order:
        if groups and abs(c[i] / c[groups[-1][0]] - 1.0) <= rel_tol:
            groups[-1].append(int(i))
        else:
            groups.append([int(i)])
    budgets, n_opt = [], []
    for g in groups:
        x = np.log(n[g])
        if len(np.unique(x)) < 3 or np.ptp(x) < 0.1:
            continue  # fewer than three sizes, or a sweep too narrow to locate a vertex
        q2, q1, _ = np.polyfit(x, y[g], 2)
        if q2 <= 0:
            continue  # no minimum inside this budget's sweep
        budgets.append(float(np.exp(np.mean(np.log(c[g])))))
        n_opt.append(float(np.exp(-q1 / (2 * q2))))
    if len(budgets) < 2:
        raise ValueError(
            "isoFLOP needs at least two budgets with >= 3 model sizes each and a convex sweep; "
            f"got {len(budgets)} usable budget(s)"
        )
    b_arr, n_arr = np.array(budgets), np.array(n_opt)
    d_arr = b_arr / (6 * n_arr)
    a_exp = float(np.polyfit(np.log(b_arr), np.log(n_arr), 1)[0])
    b_exp = float(np.polyfit(np.log(b_arr), np.log(d_arr), 1)[0])
    return IsoFlopResult(
        budgets=budgets,
        params_opt=n_opt,
        tokens_opt=d_arr.tolist(),
        exponent_a=a_exp,
        exponent_b=b_exp,
    )
