"""The Forecast: what a user (or the overlay, or a script) reads about a run that has not finished.

Why one typed object: every forecast and refit is stored as a new version by the caller's store, shown
by the CLI as a table, emitted as JSON, and compared later with what the run did. So it carries its
own provenance (method, law, parameters with intervals, fingerprint of the inputs, creation time),
the whole predicted curve with bands (not one number), and how wrong its method was on this very
ladder (the backtest) when that is known. `to_json()` / `from_json()` round-trip exactly.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from forecasting.bootstrap import Interval


class CurvePoint(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    step: int = Field(description="Optimizer step of the target run.")
    tokens: float | None = Field(None, description="Tokens seen at this step (None when unknown).")
    flops: float | None = Field(None, description="Cumulative FLOPs at this step (None when unknown).")
    loss: float = Field(description="Predicted loss.")
    lo: float = Field(description="Lower edge of the band.")
    hi: float = Field(description="Upper edge of the band.")


class TargetSpec(BaseModel):
    """The run to forecast (it may not have happened yet)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(description="Target name.")
    params_active: float = Field(gt=0, description="Active parameters N.")
    tokens: float = Field(gt=0, description="Planned training tokens D.")
    params_total: float | None = Field(None, gt=0, description="Total parameters (MoE).")
    num_steps: int | None = Field(None, gt=0, description="Planned optimizer steps.")
    tokens_per_step: float | None = Field(None, gt=0, description="Tokens per step.")
    flops_per_token: float | None = Field(None, gt=0, description="Training FLOPs per token (one convention with the ladder).")
    total_flops: float | None = Field(None, gt=0, description="Planned total FLOPs; default flops_per_token*tokens, else 6*N*D.")
    lr: list[float] | None = Field(None, description="LR at every step 1..num_steps (the schedule), when known.")
    unique_tokens: float | None = Field(None, gt=0, description="Unique tokens of the data (repeated-epoch runs), when known.")

    def __repr_args__(self):
        # a schedule is one float per step (thousands): show its length and ends, not every value
        for name, value in super().__repr_args__():
            if name == "lr" and value is not None and len(value) > 6:
                yield name, f"<{len(value)} steps: {value[0]:.3g} .. max {max(value):.3g} .. {value[-1]:.3g}>"
            else:
                yield name, value

    def planned_flops(self) -> float:
        if self.total_flops is not None:
            return float(self.total_flops)
        if self.flops_per_token is not None:
            return float(self.flops_per_token * self.tokens)
        return 6.0 * self.params_active * self.tokens

    def steps(self) -> int:
        if self.num_steps is not None:
            return int(self.num_steps)
        if self.tokens_per_step is not None:
            return int(round(self.tokens / self.tokens_per_step))
        return 1


class HeldOutRun(BaseModel):
    """One held-out run of one backtest split: what the method, fitted without it, predicted for its last point.

    Why per run: a backtest's RMS says how wrong a method is on a ladder, not where. One run missed by 13% among
    runs predicted within 0.3% (a 44-epoch run among 1-7-epoch ones; a rung whose recipe changed) is a different
    thing to trust than the same RMS spread evenly, and only the runs show which.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    run: str = Field(description="The held-out run.")
    fitted_on: str = Field(description="What the split fitted: 'k runs' (the k smallest, or those on one side of a "
                           "tokens-per-parameter cut), or 'its first k of n evals' (a prefix backtest).")
    distance: float = Field(description="Extrapolation distance from what was fitted to this run (the backtest's units).")
    predicted: float = Field(description="Predicted loss at the run's last scored point.")
    actual: float = Field(description="Observed loss there.")
    error: float = Field(description="predicted / actual - 1 at that point.")
    rms_error: float = Field(description="RMS of predicted / actual - 1 over every point of this run the split scored.")
    n_points: int = Field(description="Points of this run the split scored (1 for a final point, its evals for a curve).")


class BacktestResult(BaseModel):
    """How wrong a method was on this ladder when it predicted what it had not seen."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    method: str = Field(description="Method backtested.")
    kind: str = Field(description="'compute' (fit small runs, predict the largest) or 'prefix' (fit a curve prefix, predict its end).")
    held_out: list[str] = Field(description="Runs predicted.")
    held_out_sizes: int | None = Field(
        None, description="Distinct model sizes among the held-out runs: errors of runs of one size are correlated, so "
        "this, not the number of runs, is how many independent errors the backtest measured (None = one per run).")
    mean_rel_error: float = Field(description="Mean signed relative error (prediction/actual - 1).")
    rms_rel_error: float = Field(description="RMS relative error.")
    max_abs_rel_error: float = Field(description="Worst absolute relative error.")
    distance: float = Field(description="Extrapolation distance of the backtest (decades of compute, or ln of step ratio).")
    rate: float = Field(
        description="RMS error / mean distance of the points it is measured on (rate_points, rate_distance): error "
        "per unit of extrapolation (error assumed to grow linearly with distance), used to choose a method and widen bands."
    )
    n_points: int = Field(description="Points scored.")
    rate_points: int | None = Field(
        None, description="Of n_points, how many `rate` was measured on: the expanding splits that fit the most runs, "
        "and every split along tokens per parameter (forecasting.final_laws); None = all of them.")
    rate_distance: float | None = Field(
        None, description="Mean distance of the points `rate` was measured on (None = `distance`): a band is never "
        "narrower than rate x this distance.")

    @property
    def distance_of_rate(self) -> float:
        """The mean distance of the points the rate was measured on."""
        return self.distance if self.rate_distance is None else self.rate_distance
    tokens_per_param_points: int = Field(
        0, description="Of n_points, how many came from splits along tokens per parameter (fit the runs on one side "
        "of a D/N cut, predict the other): the evidence for a target whose D/N lies outside the runs' range.")
    repetition_epochs: list[float] | None = Field(
        None, description="Epochs of the unique data (tokens / unique tokens) of the held-out runs this backtest was "
        "scored on, when restricted to those at about a target's repetition (forecasting.final_laws.at_repetition); "
        "None = every held-out run.")
    final_run: str | None = Field(None, description="The largest held-out run (its last point is reported below).")
    final_predicted: float | None = Field(None, description="Predicted loss at final_run's last point.")
    final_actual: float | None = Field(None, description="Observed loss at final_run's last point.")
    runs: list[HeldOutRun] = Field(
        default_factory=list, description="Every held-out run of every split with a finite error, in split order "
        "(`worst_runs` ranks them): where the errors above came from.")

    def worst_runs(self, n: int | None = None) -> list[HeldOutRun]:
        """The held-out runs by |error| at their last point, largest first (the n largest, or all)."""
        ranked = sorted(self.runs, key=lambda r: -abs(r.error))
        return ranked if n is None else ranked[:n]


class Forecast(BaseModel):
    model_config = ConfigDict(frozen=False, extra="forbid")
    target: TargetSpec
    method: str = Field(description="Method that produced it (matched_progress, chinchilla, compute, refit, ...).")
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(), description="UTC ISO time.")
    version: int = Field(0, description="Set by the caller's store; a refit is a new version.")
    inputs_fingerprint: str = Field(description="sha256 of the input table (and live prefix) content.")
    curve: list[CurvePoint] = Field(default_factory=list, description="Predicted curve with bands.")
    final_loss: float
    final_loss_lo: float
    final_loss_hi: float
    level: float = Field(0.95, description="Coverage level of every band.")
    law: str = Field(description="Formula string of the fitted law.")
    params: dict[str, Interval] = Field(default_factory=dict, description="Law parameters with intervals.")
    backtest: list[BacktestResult] = Field(default_factory=list, description="This method's errors on this ladder.")
    band_terms: dict[str, float] = Field(default_factory=dict, description="Relative sigma of each band term at the final step.")
    allocation: dict | None = Field(
        None, description="The compute-optimal N and D for the target's budget and where the target sits "
        "(forecasting.api.optimal_allocation), when a caller attached it (`ladder forecast --json` does).",
    )
    selection: list[dict] = Field(
        default_factory=list,
        description="method='auto': every candidate method with its backtest error on this table (or why it was "
        "not applicable); the chosen one is marked `chosen`.",
    )
    warnings: list[str] = Field(default_factory=list)

    def to_json(self, **kw) -> str:
        return self.model_dump_json(**kw)

    @classmethod
    def from_json(cls, text: str) -> Forecast:
        return cls.model_validate_json(text)

    def band_at(self, step: int | float) -> tuple[float, float, float]:
        """(loss, lo, hi) at `step`: interpolation in log(step) between curve points (clamped at the ends)."""
        if not self.curve:
            return self.final_loss, self.final_loss_lo, self.final_loss_hi
        s = np.log(np.array([max(p.step, 1) for p in self.curve], dtype=float))
        cols = [np.array([getattr(p, k) for p in self.curve]) for k in ("loss", "lo", "hi")]
        x = np.log(max(float(step), 1.0))
        return tuple(float(np.interp(x, s, c)) for c in cols)  # type: ignore[return-value]

    def curve_frame(self) -> pd.DataFrame:
        return pd.DataFrame([p.model_dump() for p in self.curve], columns=list(CurvePoint.model_fields))

    # ------------------------------------------------------------------ notebook views

    def __repr__(self) -> str:
        band = f"{self.final_loss:.4f} [{self.final_loss_lo:.4f}, {self.final_loss_hi:.4f}] ({self.level:.0%})"
        extra = f", {len(self.warnings)} warning(s)" if self.warnings else ""
        return (f"Forecast({_clip(self.target.name, 60)!r}: final loss {band}, method={self.method}, "
                f"version={self.version}, {len(self.curve)} curve points{extra})")

    __str__ = __repr__

    def _repr_html_(self) -> str:
        rows = [
            ("target", self.target.name),
            ("final loss", f"{self.final_loss:.4f} [{self.final_loss_lo:.4f}, {self.final_loss_hi:.4f}] ({self.level:.0%})"),
            ("method", self.method),
            ("version", str(self.version)),
            ("law", _clip(self.law, 160)),
            ("curve", f"{len(self.curve)} points to step {self.curve[-1].step:,}" if self.curve else "final point only"),
            ("created", self.created_at),
        ]
        rows += [(f"backtest ({b.kind})", f"rms error {b.rms_rel_error:.2%} over {b.distance:.2f} units") for b in self.backtest]
        rows += [("warning", _clip(w, 200)) for w in self.warnings]
        return html_table("Forecast", rows)

    def to_frame(self) -> pd.DataFrame:
        """The predicted curve: one row per point (step, tokens, flops, loss, lo, hi)."""
        return self.curve_frame()

    def plot(self, ax=None, *, actual: pd.DataFrame | None = None, x: str = "step"):
        """The predicted curve and its band against `x` (step, tokens or flops) on matplotlib Axes (new ones if
        `ax` is None); `actual`, a table with `x` and `loss` columns (the run's own evals), is drawn on top."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(6, 4))
        frame = self.to_frame()
        if x not in ("step", "tokens", "flops"):
            raise ValueError(f"x={x!r}: choose step, tokens or flops")
        if frame.empty or frame[x].isna().any():
            raise ValueError(f"this forecast's curve has no {x} values; plot against x='step'")
        label = f"forecast v{self.version} ({self.method})"
        if len(frame) == 1:  # final-loss laws predict one point
            row = frame.iloc[0]
            ax.errorbar([row[x]], [row["loss"]], yerr=[[row["loss"] - row["lo"]], [row["hi"] - row["loss"]]],
                        fmt="o", capsize=4, label=label)
        else:
            ax.fill_between(frame[x], frame["lo"], frame["hi"], alpha=0.25, label=f"{self.level:.0%} band")
            ax.plot(frame[x], frame["loss"], label=label)
            ax.set_xscale("log")
        if actual is not None and len(actual):
            ax.plot(actual[x], actual["loss"], ".", color="black", label="actual")
        ax.set_xlabel(x)
        ax.set_ylabel("loss")
        ax.set_title(_clip(self.target.name, 60))
        ax.legend()
        return ax

    def summary(self) -> dict:
        """Flat dict for a CLI table or --json: the final-loss estimate and interval under explicit keys."""
        return {
            "target": self.target.name,
            "method": self.method,
            "version": self.version,
            "final_loss": self.final_loss,
            "final_loss_lo": self.final_loss_lo,
            "final_loss_hi": self.final_loss_hi,
            "level": self.level,
            "law": self.law,
            "created_at": self.created_at,
            "warnings": list(self.warnings),
        }


Z95 = 1.959963984540054  # every band here is +-Z95 sigma around its prediction, in log space


def log_sigma(lo, hi, z: float = Z95):
    """The log-normal sigma of a band [lo, hi] read as +-z sigma in log space (a lower end at or below zero is read
    as 1e-300). Scalars or arrays."""
    return (np.log(np.asarray(hi, dtype=float)) - np.log(np.maximum(np.asarray(lo, dtype=float), 1e-300))) / (2 * z)


def log_band_z(actual, pred, lo, hi, z: float = Z95):
    """How many sigmas `actual` lies from `pred`, reading the band [lo, hi] as +-z sigma of a log-normal and taking
    the half on the actual's side: log(actual / pred) / (log(hi / pred) / z) above the prediction, log(actual /
    pred) / (log(pred / lo) / z) below. |result| <= z exactly when the band holds `actual` (a reading in loss units
    would call a point on the edge of a wide log band 2.2 sigma off); a band of zero width gives +-inf (0 when the
    prediction is exact). Scalars or arrays; a non-positive loss gives nan."""
    y, p, lo, hi = (np.asarray(v, dtype=float) for v in (actual, pred, lo, hi))
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.log(y / p)
        half = np.where(err >= 0, np.log(np.maximum(hi, p) / p), np.log(p / np.clip(lo, 1e-300, p))) / z
        return np.where(err == 0, 0.0, err / half)


def fingerprint_table(*tables: pd.DataFrame | None) -> str:
    h = hashlib.sha256()
    for t in tables:
        if t is None:
            h.update(b"none")
            continue
        cols = sorted(map(str, t.columns))
        h.update(json.dumps(cols).encode())
        h.update(pd.util.hash_pandas_object(t[cols].sort_values(cols[: min(2, len(cols))]), index=False).values.tobytes())
    return h.hexdigest()[:16]


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def html_table(title: str, rows: list[tuple[str, str]]) -> str:
    """A small two-column HTML table for a notebook's rich display (values escaped)."""
    from html import escape

    body = "".join(f"<tr><th style='text-align:left'>{escape(k)}</th><td style='text-align:left'>{escape(v)}</td></tr>" for k, v in rows)
    return f"<table><caption style='text-align:left'><b>{escape(title)}</b></caption>{body}</table>"
