"""Alerts that explain what went wrong in a run, not just that something did.

A number crossing a threshold is easy to detect and useless to read; what people asked about Marin's
hero was *which part* of the model moved. So every alert here is a pure function over a run's metric
rows (as metrics.jsonl holds them) and says, in one sentence, what happened, where, and by how much:

- `band_alerts`: the eval loss stayed outside the forecast band for N consecutive evals;
- `spike_alerts`: train/loss (or grad/norm/total) jumped far above a robust rolling baseline (median
  and MAD of the previous logged values, so one spike does not hide the next);
- `param_norm_alerts`: the parameter norm jumped between two logged steps, attributed to its groups:
  the change of the squared norm is the sum of the changes of the groups' squared norms
  (params/norm/{group}), so each group's share of the rise is exact, not a guess.

Being pure, the same functions serve the live overlay (after each eval), `ladder watch` and reports.
Sinks (terminal, alerts.jsonl in the run directory, W&B) live at the bottom and never raise.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from forecasting.forecast import Z95, log_band_z

log = logging.getLogger(__name__)

SEVERITIES = ("info", "warning", "critical")
ALERTS_FILE = "alerts.jsonl"


@dataclass(frozen=True)
class Alert:
    kind: str  # band | loss_spike | grad_spike | param_norm_jump | overlay_error
    step: int
    severity: str  # info | warning | critical
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def key(self) -> tuple[str, int]:
        """Identity for de-duplication: one alert of a kind per step."""
        return (self.kind, self.step)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _series(rows: Iterable[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if "step" in r and _finite(r.get(key))]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


# ---------------------------------------------------------------------------------------- band


def band_sigma(actual: float, loss: float, lo: float, hi: float, z: float = Z95) -> float:
    """Standard deviations between `actual` and the prediction, the band read as +-z sigma in log space on the
    actual's side (`forecasting.forecast.log_band_z`), so that |sigma| > z exactly when the eval is outside it."""
    return float(log_band_z(actual, loss, lo, hi, z))


def band_at_step(forecast, step: float) -> tuple[float, float, float] | None:
    """(loss, lo, hi) the forecast predicts at `step`, or None where it predicts nothing: a final-loss law
    (chinchilla, compute) has no curve, so it speaks only about the run's last step."""
    if len(forecast.curve) <= 1 and step < forecast.target.steps():
        return None
    return forecast.band_at(step)


def band_alerts(rows: Sequence[dict[str, Any]], forecast=None, *, consecutive: int = 3) -> list[Alert]:
    """One alert each time eval/loss has been outside the band for `consecutive` evals in a row.

    The band of an eval line is the one the overlay logged beside it (forecast/lo, forecast/hi: the
    forecast that was live then); lines without one use `forecast.band_at(step)`.
    """
    alerts: list[Alert] = []
    streak: list[tuple[int, float, float]] = []  # (step, sigma, predicted)
    for row in rows:
        if not _finite(row.get("eval/loss")) or "step" not in row:
            continue
        step, actual = int(row["step"]), float(row["eval/loss"])
        if all(_finite(row.get(k)) for k in ("forecast/loss", "forecast/lo", "forecast/hi")):
            loss, lo, hi = row["forecast/loss"], row["forecast/lo"], row["forecast/hi"]
        elif forecast is not None and band_at_step(forecast, step) is not None:
            loss, lo, hi = band_at_step(forecast, step)
        else:
            continue
        if lo <= actual <= hi:
            streak = []
            continue
        streak.append((step, band_sigma(actual, loss, lo, hi), loss))
        if len(streak) == consecutive:
            first, last = streak[0][0], streak[-1][0]
            side = "above" if streak[-1][1] > 0 else "below"
            sigma = streak[-1][1]
            how_far = f"{sigma:+.1f} sigma" if math.isfinite(sigma) else "the band has zero width"
            alerts.append(Alert(
                kind="band", step=step, severity="critical" if abs(sigma) >= 4 else "warning",
                message=(f"eval/loss has been {side} the forecast band for {consecutive} evals in a row "
                         f"(steps {first}-{last}); now {actual:.4f} vs predicted {streak[-1][2]:.4f} ({how_far})."),
            ))
    return alerts


# ---------------------------------------------------------------------------------------- spikes


def spike_alerts(
    rows: Sequence[dict[str, Any]],
    key: str = "train/loss",
    *,
    window: int = 20,
    min_history: int = 5,
    z: float = 6.0,
    min_rise: float = 0.05,
) -> list[Alert]:
    """Logged values of `key` far above the median of the previous `window` values.

    A spike needs both a robust z-score >= `z` (MAD scaled to a standard deviation, floored at 0.1% of
    the median so a flat series does not flag noise) and a relative rise >= `min_rise`.
    """
    kind = {"train/loss": "loss_spike", "grad/norm/total": "grad_spike"}.get(key, f"{key}_spike")
    series = _series(rows, key)
    alerts: list[Alert] = []
    for index in range(min_history, len(series)):
        history = [v for _, v in series[max(0, index - window):index]]
        step, value = series[index]
        median = _median(history)
        scale = max(1.4826 * _median([abs(v - median) for v in history]), 1e-3 * abs(median), 1e-12)
        score = (value - median) / scale
        rise = (value - median) / abs(median) if median else math.inf
        if score >= z and rise >= min_rise:
            severity = "critical" if rise >= 1.0 or score >= 4 * z else "warning"
            alerts.append(Alert(
                kind=kind, step=step, severity=severity,
                message=(f"{key} jumped to {value:.4g} at step {step}, {rise:.0%} above its median {median:.4g} "
                         f"over the previous {len(history)} logged steps ({score:.0f} robust sigma)."),
            ))
    return alerts


# ---------------------------------------------------------------------------------------- param norms


def _group_names(row: dict[str, Any]) -> list[str]:
    return sorted(k.removeprefix("params/norm/") for k in row if k.startswith("params/norm/") and k != "params/norm/total")


def norm_rise_attribution(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Each group's share of the rise of the squared parameter norm between two metric rows.

    ||theta||^2 = sum over groups of ||theta_g||^2, so d||theta||^2 = sum_g d||theta_g||^2 exactly and
    share_g = d||theta_g||^2 / sum_h d||theta_h||^2 (shares sum to 1; a shrinking group has a negative share).
    """
    groups = [g for g in _group_names(after) if _finite(before.get(f"params/norm/{g}")) and _finite(after.get(f"params/norm/{g}"))]
    deltas = {g: after[f"params/norm/{g}"] ** 2 - before[f"params/norm/{g}"] ** 2 for g in groups}
    total = sum(deltas.values())
    if not deltas or total == 0:
        return {}
    return dict(sorted(((g, d / total) for g, d in deltas.items()), key=lambda item: -item[1]))


def _pretty(group: str) -> str:
    return group.replace("_", " ")


def param_norm_alerts(rows: Sequence[dict[str, Any]], *, min_rise: float = 0.1) -> list[Alert]:
    """A jump of the parameter norm between consecutive logged steps, attributed to its groups.

    The norm watched is params/norm/total; when the groups hold more than the total (the trainer logs the
    router bias beside the weights), the norm over all groups is watched too, so a bias that runs away
    is caught even though the weights' total does not move.
    """
    logged = [r for r in rows if "step" in r and (_finite(r.get("params/norm/total")) or _group_names(r))]
    alerts: list[Alert] = []
    for before, after in zip(logged, logged[1:]):
        candidates = []
        if _finite(before.get("params/norm/total")) and _finite(after.get("params/norm/total")) and before["params/norm/total"] > 0:
            candidates.append(("params/norm/total", before["params/norm/total"], after["params/norm/total"]))
        shared = [g for g in _group_names(after) if _finite(before.get(f"params/norm/{g}")) and _finite(after.get(f"params/norm/{g}"))]
        if shared:
            all_before = math.sqrt(sum(before[f"params/norm/{g}"] ** 2 for g in shared))
            all_after = math.sqrt(sum(after[f"params/norm/{g}"] ** 2 for g in shared))
            total_after = after.get("params/norm/total")
            covers_more = not _finite(total_after) or all_after > 1.001 * total_after
            if covers_more and all_before > 0:
                candidates.append(("the parameter norm over all groups", all_before, all_after))
        for name, old, new in candidates:
            rise = new / old - 1.0
            if rise < min_rise:
                continue
            step0, step1 = int(before["step"]), int(after["step"])
            shares = norm_rise_attribution(before, after)
            if shares:
                top, share = next(iter(shares.items()))
                why = f"; {share:.0%} of the rise is the {_pretty(top)}"
                rest = [(g, s) for g, s in shares.items() if g != top and s >= 0.05]
                if rest:
                    why += " (then " + ", ".join(f"{_pretty(g)} {s:.0%}" for g, s in rest[:2]) + ")"
            else:
                why = " (no per-group norms logged to attribute it)"
            alerts.append(Alert(
                kind="param_norm_jump", step=step1, severity="critical" if rise >= 3 * min_rise else "warning",
                message=f"{name} rose {rise:.0%} between steps {step0} and {step1}{why}.",
            ))
            break  # one alert per interval: the weights' total if it moved, else the all-groups norm
    return alerts


# ---------------------------------------------------------------------------------------- all together


def run_alerts(
    rows: Sequence[dict[str, Any]],
    forecast=None,
    *,
    band_consecutive: int = 3,
    spike_window: int = 20,
    spike_z: float = 6.0,
    loss_spike_rise: float = 0.05,
    grad_spike_rise: float = 1.0,
    param_norm_rise: float = 0.1,
) -> list[Alert]:
    """Every alert of a run, in step order (rows with resume markers already applied)."""
    rows = [r for r in rows if "event" not in r and not r.get("train/nonfinite") and not r.get("train/skipped")]
    alerts = [
        *band_alerts(rows, forecast, consecutive=band_consecutive),
        *spike_alerts(rows, "train/loss", window=spike_window, z=spike_z, min_rise=loss_spike_rise),
        *spike_alerts(rows, "grad/norm/total", window=spike_window, z=spike_z, min_rise=grad_spike_rise),
        *param_norm_alerts(rows, min_rise=param_norm_rise),
    ]
    return sorted(alerts, key=lambda a: (a.step, a.kind))


# ---------------------------------------------------------------------------------------- sinks


def append_alerts(run_dir: str, alerts: Sequence[Alert]) -> None:
    """Append to run_dir/alerts.jsonl (local path or fsspec URL). Never raises."""
    if not alerts:
        return
    import time

    import fsspec

    text = "".join(json.dumps({**a.to_dict(), "time": time.time()}) + "\n" for a in alerts)
    try:
        fs, path = fsspec.core.url_to_fs(f"{run_dir.rstrip('/')}/{ALERTS_FILE}")
        if fs.protocol in ("file", "local") or "file" in tuple(fs.protocol):
            with open(path, "a") as handle:
                handle.write(text)
        else:  # object stores cannot append: rewrite (alerts are few)
            old = fs.cat_file(path).decode() if fs.exists(path) else ""
            fs.pipe_file(path, (old + text).encode())
    except Exception as error:  # noqa: BLE001 - an alert sink must never hurt the run
        log.warning("could not write %s to %s: %s", ALERTS_FILE, run_dir, error)


def read_alerts(run_dir: str) -> list[dict[str, Any]]:
    """Rows of run_dir/alerts.jsonl (torn or malformed lines skipped); [] when there is none or it cannot be read."""
    from ladder.runs import read_jsonl
    from ladder.store import Store

    try:
        store = Store(run_dir)
        return read_jsonl(store, f"{store.root}/{ALERTS_FILE}")[0]
    except Exception:  # noqa: BLE001 - a view of alerts must never fail its caller
        return []


_STYLE = {"info": "cyan", "warning": "yellow", "critical": "bold red"}


def print_alerts(alerts: Sequence[Alert], console=None) -> None:
    """Show alerts on the terminal (rich). Never raises."""
    try:
        from rich.console import Console

        console = console or Console(stderr=True)
        for a in alerts:
            console.print(f"[{_STYLE.get(a.severity, 'white')}][alert {a.kind} @ {a.step}][/] {a.message}", highlight=False)
    except Exception:  # noqa: BLE001
        pass


def wandb_alert(alerts: Sequence[Alert]) -> None:
    """Raise a W&B alert for each warning/critical alert if a W&B run is active. Never raises."""
    try:
        import wandb

        run = wandb.run
        if run is None:
            return
        for a in alerts:
            if a.severity == "info":
                continue
            level = wandb.AlertLevel.ERROR if a.severity == "critical" else wandb.AlertLevel.WARN
            run.alert(title=f"ladder: {a.kind} at step {a.step}", text=a.message, level=level, wait_duration=0)
    except Exception as error:  # noqa: BLE001 - never fail on W&B
        log.debug("wandb alert not sent: %s", error)
