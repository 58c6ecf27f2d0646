"""`ladder watch EXP TARGET`: follow a live run in the terminal against its forecast.

A hero runs for weeks; the question every morning is "is it on track?". This view answers it from the
run directory alone (any fsspec store, so a laptop can watch a cluster's bucket): step of planned,
tokens, the last eval loss against the forecast band and how many sigma off it is, ETA from the
measured throughput, the newest forecast version and when it was made, and the newest alerts.

It reads metrics.jsonl incrementally (ladder.runs.read_metrics from the last byte offset), so each
refresh costs only the new lines, and keeps running summaries rather than the whole history.
`--once` prints one frame and exits (scripts, tests).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Optional

import typer

from ladder.alerts import band_sigma, read_alerts
from ladder.runs import read_metrics
from ladder.store import Store, resolve_root


@dataclass
class WatchState:
    """Running summary of one run directory, updated from the metric lines appended since the last poll."""

    run_dir: str  # local path or URL
    target: str
    forecast_store: Store | None
    offset: int = 0
    step: int | None = None
    tokens: float | None = None
    time_of_step: float | None = None
    train_loss: float | None = None
    eval_step: int | None = None
    eval_loss: float | None = None
    logged_band: tuple[float, float, float] | None = None  # forecast/loss, lo, hi written beside the last eval
    logged_version: int | None = None
    tokens_per_second: float | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)
    forecast: Any = None
    forecast_version: int | None = None
    forecast_meta: dict[str, Any] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    spike_window: int = 20

    def __post_init__(self) -> None:
        self._store = Store(self.run_dir)
        self._tail: list[dict[str, Any]] = []  # recent metric rows: context of the spike rules
        self._eval_rows: list[dict[str, Any]] = []  # (step, eval/loss, logged band) of every eval
        self._found: dict[tuple[str, int], dict[str, Any]] = {}  # alerts this view derived itself
        self._last_alert_step = -1

    def poll(self) -> None:
        store = self._store
        if not self.spec:
            self.spec = store.read_json(f"{store.root}/spec.json") or {}
        self.status = store.read_status(store.root) or {}
        rows, self.offset = read_metrics(store, store.root, offset=self.offset)
        for row in rows:
            self._take(row)
        self._refresh_forecast()
        self._derive_alerts(rows)
        stream = {(a.get("kind"), a.get("step")): a for a in read_alerts(self.run_dir)}
        merged = {**self._found, **stream}  # the run's own stream (written by the overlay) wins
        self.alerts = sorted(merged.values(), key=lambda a: (a.get("step", 0), a.get("kind", "")))[-5:]

    def _derive_alerts(self, rows: list[dict[str, Any]]) -> None:
        """The alert rules over the new lines, so runs without an overlay (rungs, imported runs) get alerts too."""
        from ladder.alerts import band_alerts, run_alerts

        if any(r.get("event") == "resume" for r in rows):
            back_to = min(int(r.get("step", 0)) for r in rows if r.get("event") == "resume")
            self._eval_rows = [r for r in self._eval_rows if r["step"] <= back_to]
            self._last_alert_step = min(self._last_alert_step, back_to)
        fresh = [r for r in rows if "event" not in r and "step" in r]
        self._eval_rows += [{k: r[k] for k in ("step", "eval/loss", "forecast/loss", "forecast/lo", "forecast/hi") if k in r}
                            for r in fresh if _finite(r.get("eval/loss"))]
        self._tail = (self._tail + fresh)
        found = [a for a in run_alerts(self._tail, None, band_consecutive=10**9, spike_window=self.spike_window) if a.step > self._last_alert_step]
        found += band_alerts(self._eval_rows, self.forecast)
        for alert in found:
            self._found.setdefault(alert.key, alert.to_dict())
        if self._tail:
            self._last_alert_step = max(self._last_alert_step, max(int(r["step"]) for r in self._tail))
        self._tail = self._tail[-(self.spike_window + 2):]

    def _take(self, row: dict[str, Any]) -> None:
        if row.get("event") == "resume":
            if self.eval_step is not None and self.eval_step > row.get("step", 0):
                self.eval_step = self.eval_loss = self.logged_band = None
            return
        if "step" not in row:
            return
        self.step = int(row["step"])
        self.tokens = row.get("tokens", self.tokens)
        self.time_of_step = row.get("time", self.time_of_step)
        if _finite(row.get("train/loss")):
            self.train_loss = float(row["train/loss"])
        if _finite(row.get("throughput/tokens_per_second")):
            self.tokens_per_second = float(row["throughput/tokens_per_second"])
        if _finite(row.get("eval/loss")):
            self.eval_step, self.eval_loss = self.step, float(row["eval/loss"])
            keys = ("forecast/loss", "forecast/lo", "forecast/hi")
            self.logged_band = tuple(float(row[k]) for k in keys) if all(_finite(row.get(k)) for k in keys) else None
            self.logged_version = row.get("forecast/version")

    def _refresh_forecast(self) -> None:
        if self.forecast_store is None:
            return
        try:
            versions = self.forecast_store.list_forecasts(self.target)
            if not versions or versions[-1] == self.forecast_version:
                return
            from forecasting.forecast import Forecast

            payload = self.forecast_store.read_forecast(self.target, versions[-1]) or {}
            self.forecast_meta = payload.pop("ladder", None) or {}
            self.forecast = Forecast.model_validate(payload)
            self.forecast_version = versions[-1]
        except Exception:  # noqa: BLE001 - a half-written or foreign forecast must not stop the view
            pass

    # ------------------------------------------------------------------ numbers shown

    @property
    def num_steps(self) -> int | None:
        return (self.spec.get("derived") or {}).get("num_steps")

    @property
    def planned_tokens(self) -> float | None:
        return (self.spec.get("derived") or {}).get("tokens")

    def band(self) -> tuple[float, float, float] | None:
        """Forecast (loss, lo, hi) at the last eval: the newest stored version, else the one logged beside the eval."""
        if self.eval_step is None:
            return None
        if self.forecast is not None:
            from ladder.alerts import band_at_step

            return band_at_step(self.forecast, self.eval_step) or self.logged_band
        return self.logged_band

    def sigma(self) -> float | None:
        band = self.band()
        if band is None or self.eval_loss is None:
            return None
        return band_sigma(self.eval_loss, *band)

    def eta_seconds(self) -> float | None:
        derived = self.spec.get("derived") or {}
        per_step = derived.get("tokens_per_step")
        if self.step is None or not self.num_steps or not per_step or not self.tokens_per_second:
            return None
        return max(0, self.num_steps - self.step) * per_step / self.tokens_per_second


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _tokens(value: float | None) -> str:
    if value is None:
        return "-"
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.0f}"


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{days}d " if days else "") + f"{hours:d}:{minutes:02d}:{secs:02d}"


def _age(iso: str | None) -> str:
    if not iso:
        return "-"
    try:
        made = datetime.fromisoformat(iso)
        return f"{iso[:19].replace('T', ' ')} UTC ({_duration((datetime.now(UTC) - made).total_seconds())} ago)"
    except ValueError:
        return iso


_SEVERITY_STYLE = {"info": "cyan", "warning": "yellow", "critical": "bold red"}


def render(state: WatchState):
    """One frame of the view as a rich renderable."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    planned = state.num_steps
    progress = f" ({state.step / planned:.1%})" if state.step is not None and planned else ""
    grid.add_row("state", str(state.status.get("state", "-")))
    grid.add_row("step", f"{state.step if state.step is not None else '-'} / {planned or '-'}{progress}")
    grid.add_row("tokens", f"{_tokens(state.tokens)} / {_tokens(state.planned_tokens)}")
    grid.add_row("train loss", f"{state.train_loss:.4f}" if state.train_loss is not None else "-")
    band, sigma = state.band(), state.sigma()
    if state.eval_loss is not None:
        line = f"{state.eval_loss:.4f} at step {state.eval_step}"
        if band is not None:
            inside = band[1] <= state.eval_loss <= band[2]
            style = "green" if inside else "red"
            line += f"   predicted {band[0]:.4f} [{band[1]:.4f}, {band[2]:.4f}]   [{style}]{_sigma_text(sigma, band)}[/]"
        grid.add_row("eval loss", line)
    else:
        grid.add_row("eval loss", "- (no eval yet)")
    speed = f"{state.tokens_per_second:,.0f} tokens/s" if state.tokens_per_second else "-"
    grid.add_row("throughput", speed)
    grid.add_row("ETA", _duration(state.eta_seconds()))
    if state.forecast is not None:
        f = state.forecast
        made_by = "refit" if f.method == "refit" else f.method
        live = state.forecast_meta.get("live_step")
        grid.add_row(
            "forecast",
            f"version {state.forecast_version} ({made_by}{f', live prefix to step {live}' if live else ''}), "
            f"made {_age(f.created_at)}",
        )
        grid.add_row("final loss", f"{f.final_loss:.4f} [{f.final_loss_lo:.4f}, {f.final_loss_hi:.4f}] ({f.level:.0%})")
    elif state.logged_version is not None:
        grid.add_row("forecast", f"version {state.logged_version} (as logged beside the last eval)")
    else:
        grid.add_row("forecast", "none stored for this target")
    parts: list[Any] = [grid]
    if state.alerts:
        alerts = Table(title="recent alerts", show_header=True, header_style="bold", expand=False)
        alerts.add_column("step", justify="right")
        alerts.add_column("kind")
        alerts.add_column("message", overflow="fold")
        for a in state.alerts:
            style = _SEVERITY_STYLE.get(a.get("severity", ""), "white")
            alerts.add_row(str(a.get("step", "")), f"[{style}]{a.get('kind', '')}[/]", str(a.get("message", "")))
        parts.append(alerts)
    else:
        parts.append("no alerts")
    return Panel(Group(*parts), title=f"ladder watch: {state.target}", subtitle=state.run_dir, expand=False)


def resolve_watch_target(experiment: str, target: str | None, root: str | None) -> tuple[str, str, Store | None]:
    """(run_dir URL, target name, forecast store) for `EXP TARGET`, or for a run directory given directly."""
    run_store = Store(experiment)
    if run_store.exists(f"{run_store.root}/spec.json") or run_store.exists(f"{run_store.root}/metrics.jsonl"):
        spec = run_store.read_json(f"{run_store.root}/spec.json") or {}
        name = target or spec.get("name") or run_store.root.rstrip("/").rsplit("/", 1)[-1].rsplit("-", 1)[0]
        if root is not None:
            forecast_root = root
        else:  # {root}/runs/{name}-{fp}: the forecasts live two levels up
            parent = run_store.root.rstrip("/").rsplit("/", 2)
            forecast_root = run_store.url_of(parent[0]) if len(parent) == 3 and parent[1] == "runs" else None
        return run_store.url_of(run_store.root), name, Store(forecast_root) if forecast_root else None
    from ladder.dag import TrainStep
    from ladder.loader import load_experiment

    exp = load_experiment(experiment)
    if target is None:
        raise ValueError("give the training step to watch: `ladder watch EXPERIMENT TARGET` (or a run directory).")
    step = exp.dag[target]
    if not isinstance(step, TrainStep):
        raise ValueError(f"{target!r} is a {step.kind} step; only training steps can be watched.")
    store = Store(resolve_root(root))
    return store.url_of(store.run_dir(target, exp.dag.fingerprints[target])), target, store


def watch_command(
    experiment: str = typer.Argument(..., help="Experiment file/module, or a run directory (local path or fsspec URL)."),
    target: Optional[str] = typer.Argument(None, help="The training step to watch (e.g. hero); optional with a run directory."),
    root: Optional[str] = typer.Option(None, "--root", help="Artifact root (default $LADDER_ROOT or ./ladder-runs).", envvar="LADDER_ROOT"),
    interval: float = typer.Option(2.0, "--interval", min=0.1, help="Seconds between refreshes."),
    once: bool = typer.Option(False, "--once", help="Print one frame and exit."),
) -> None:
    """Follow a live run: step, tokens, eval loss against the forecast band (sigma), ETA, forecast version, alerts."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    try:
        run_dir, name, forecast_store = resolve_watch_target(experiment, target, root)
    except Exception as error:  # noqa: BLE001 - one clear line, exit code 2 (bad input)
        Console(stderr=True).print(f"[red]error:[/red] {error}")
        raise typer.Exit(2)
    state = WatchState(run_dir=run_dir, target=name, forecast_store=forecast_store)
    state.poll()
    if once:
        console.print(render(state))
        return
    try:
        with Live(render(state), console=console, refresh_per_second=4, transient=False) as live:
            while True:
                time.sleep(interval)
                state.poll()
                live.update(render(state))
                if _finished(state):
                    break
    except KeyboardInterrupt:
        raise typer.Exit(130)


def _finished(state: WatchState) -> bool:
    """A done or failed run writes nothing more: stop following it."""
    return state.status.get("state") in ("done", "failed")


def _sigma_text(sigma: float | None, band: tuple[float, float, float]) -> str:
    """How far off the band, in words a reader can trust: never an infinite or absurd sigma."""
    loss, lo, hi = band
    if sigma is None or not math.isfinite(sigma) or (hi - lo) <= 1e-9 * max(abs(loss), 1.0):
        return "band has zero width (no sigma)"
    if abs(sigma) > 1000:
        return f"{'+' if sigma > 0 else '-'}>1000 sigma"
    return f"{sigma:+.2f} sigma"
