"""`ladder serve EXP`: one experiment's live page in a browser, read from the store alone.

Why: a run draws its audience when anyone can watch the loss move against the prediction, and a lab that
cannot (or will not) use W&B's hosted dashboards had only a terminal (`ladder watch`) and static files. This
page shows the ladder table (state and progress of every step), each rung's eval curve with the law fitted
through the rungs, the target's actual curve against its forecast band drawn ahead to the run's last step
(every stored forecast version selectable), the refit history, alerts with their explanation as they arrive,
and per-host throughput of a multi-host step. Runs imported or attached from elsewhere are run directories
like our own, so they are shown the same way.

How it stays cheap: one `LivePage` per server reads the store every `interval` seconds, whoever is
watching: each metrics.jsonl and alerts.jsonl from the byte offset where the last read stopped (a torn
last line is left for the next read), each forecast version once, the ladder's status files (small).
What a poll found becomes one numbered delta; a browser fetches the snapshot once (`/api/state`, the
train-loss curve thinned to at most `MAX_TRAIN_POINTS`) and then receives the deltas as server-sent
events (`/api/events?since=SEQ`), so an update costs the new lines, never a re-read. The rung fits are
recomputed from the evals already held, only when a rung logged a new eval, at most every `FIT_EVERY` s.

Server: Starlette on uvicorn. Starlette gives routing with typed path parameters, a streaming response
for server-sent events, safe static files (no path can leave the package's folder) and plain ASGI
middleware for the token, and ships its own test client; uvicorn is the reference ASGI server and binds
the socket we hand it. The stdlib's ThreadingHTTPServer could serve this too, but SSE there is one
blocked thread per browser, and path and header handling would be ours to get right. Both libraries are
small, pure Python (uvicorn's optional speedups are not required) and widely kept.

Read-only: every route is GET; no route writes the store, and no path parameter names a file (a target
must be one of the experiment's steps, a version an integer it has stored). Without a token, only requests
whose Host header names loopback are answered (a DNS-rebinding guard). Off loopback a token is
required (`token_required`): `--host` other than loopback needs `--token` or one is generated and printed,
and every request without it (Authorization: Bearer, ?token=, or the cookie that opening the printed URL sets)
gets 401. The page's script, styles and
charts (inline SVG) ship in `serve_static/`; nothing is fetched from anywhere else (the Content-Security-
Policy says so to the browser too).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import ipaddress
import json
import math
import secrets
import socket
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer

from ladder.alerts import band_alerts, run_alerts
from ladder.store import Store
from ladder.views.common import BAND_COLOR, FIRST_BAND_COLOR, RUNG_COLORS

STATIC_DIR = Path(__file__).with_name("serve_static")
DEFAULT_PORT = 8765
MAX_TRAIN_POINTS = 2000  # train-loss (and per-host) points per run in a snapshot; the browser thins what arrives later alike
MAX_DELTA_POINTS = 5000  # new points of one run beyond which a delta carries the run's thinned snapshot instead
KEEP_DELTAS = 256  # deltas a reconnecting browser can catch up from; older ones get a fresh snapshot
FIT_EVERY = 10.0  # seconds between refits of the rung laws while rungs are still logging
READ_CHUNK = 4 << 20  # bytes of metrics.jsonl parsed at once (a million-line log is read in pieces)
DERIVE_TAIL_BYTES = 8 << 20  # a long catch-up derives alerts over its last 8 MB only (alerts.jsonl is the run's record)
SPIKE_WINDOW = 20
BAND_CONSECUTIVE = 3
CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


class ServeInputError(ValueError):
    """An experiment, root, host or port that cannot be served; the message says what to change."""


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def read_lines(store: Store, path: str, offset: int, limit: int | None = None) -> tuple[list[dict[str, Any]], int, bool]:
    """Complete JSON-object lines of an append-only file from byte `offset`, at most about `limit` bytes of them:
    (rows, next offset, more to read). As ladder.runs.read_jsonl: a last line without its newline is a writer
    mid-append and waits for the next read; a malformed complete line is skipped; a missing file is no rows."""
    limit = limit or READ_CHUNK
    try:
        with store.fs.open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(limit + 1)
    except FileNotFoundError:
        return [], offset, False
    more = len(data) > limit
    if more:
        data = data[:limit]
    end = data.rfind(b"\n")
    if end < 0:
        if more:  # one line longer than the chunk: read it whole
            rows, new_offset = _read_rest(store, path, offset)
            return rows, new_offset, False
        return [], offset, False
    rows = []
    for line in data[:end].split(b"\n"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows, offset + end + 1, more


def _read_rest(store: Store, path: str, offset: int) -> tuple[list[dict[str, Any]], int]:
    from ladder.runs import read_jsonl

    return read_jsonl(store, path, offset=offset)


# ---------------------------------------------------------------------------------------- one run


@dataclass
class RunFeed:
    """What the page knows of one training step's run directory, grown from the lines appended since the last read."""

    name: str
    run_dir: str  # a path of the store
    role: str  # "target" (forecast against its band), "rung" (a fit's input) or "run"
    keep_train: bool = False
    started: bool = False
    offset: int = 0
    alerts_offset: int = 0
    num_steps: int | None = None
    tokens_per_step: float | None = None
    flops_per_token: float | None = None
    params_active: float | None = None
    params_total: float | None = None
    planned_tokens: float | None = None
    step: int | None = None
    tokens: float | None = None
    train_loss: float | None = None
    eval_loss: float | None = None
    eval_step: int | None = None
    tokens_per_second: float | None = None
    evals: list[list[float | None]] = field(default_factory=list)  # [step, tokens, flops, loss, f_loss, f_lo, f_hi]
    train_steps: array = field(default_factory=lambda: array("d"))
    train_loss_values: array = field(default_factory=lambda: array("d"))
    hosts: dict[str, tuple[array, array]] = field(default_factory=dict)  # host rank -> (steps, tokens/s)
    alerts: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    has_overlay: bool = False

    def __post_init__(self) -> None:
        self._tail: list[dict[str, Any]] = []  # last logged rows: the context of the spike and norm rules
        self._streak: list[dict[str, Any]] = []  # evals since the last one inside its band
        self._last_alert_step = -1

    def read(self, store: Store, forecast) -> dict[str, Any] | None:
        """Read what was appended; the part of it the page must show (None when nothing changed)."""
        if not self.started:
            spec = store.read_json(f"{self.run_dir}/spec.json") if store.exists(f"{self.run_dir}/spec.json") else None
            if spec is None and not store.exists(f"{self.run_dir}/metrics.jsonl"):
                return None
            self.started = True
            derived = (spec or {}).get("derived") or {}
            self.num_steps = derived.get("num_steps")
            self.tokens_per_step = _num(derived.get("tokens_per_step"))
            self.flops_per_token = _num(derived.get("flops_per_token"))
            self.params_active = _num(derived.get("params_active"))
            self.params_total = _num(derived.get("params_total"))
            self.planned_tokens = _num(derived.get("tokens"))
        delta: dict[str, Any] = {"evals": [], "train": [], "hosts": {}, "alerts": []}
        path = f"{self.run_dir}/metrics.jsonl"
        derive_from = self.offset
        if self.offset == 0:
            with contextlib.suppress(Exception):  # not every filesystem knows a size: then everything is derived
                derive_from = max(0, int(store.fs.size(path)) - DERIVE_TAIL_BYTES)
        derived, grew, more = [], False, True
        while more:  # chunk by chunk, so a million-line catch-up never holds all its rows at once
            rows, self.offset, more = read_lines(store, path, self.offset)
            fresh: list[dict[str, Any]] = []
            for row in rows:
                self._take(row, delta, fresh)
            if self.offset > derive_from:
                derived += self._derive_alerts(fresh, forecast)
            elif fresh:  # history before the tail: the rules' context moves on without running them
                self._tail = (self._tail + fresh)[-(SPIKE_WINDOW + 2):]
                self._last_alert_step = max(self._last_alert_step, max(int(r["step"]) for r in fresh))
            grew = grew or bool(fresh)
            if not delta.get("replace") and len(delta["train"]) + len(delta["evals"]) > MAX_DELTA_POINTS:
                delta.update(replace=True, evals=[], train=[], hosts={})  # a catch-up: the run is sent whole, thinned
        alert_rows, self.alerts_offset, _ = read_lines(store, f"{self.run_dir}/alerts.jsonl", self.alerts_offset)
        found = [{**a, "source": "alerts.jsonl"} for a in alert_rows if isinstance(a.get("kind"), str)]
        found += [{**a.to_dict(), "source": "derived by this page"} for a in derived]
        for alert in found:
            key = (alert["kind"], int(alert.get("step") or 0))
            if key in self.alerts and self.alerts[key]["source"] == "alerts.jsonl":
                continue  # the run's own stream (written by the overlay) wins over what this page derived
            alert = {k: alert.get(k) for k in ("kind", "step", "severity", "message", "source", "time")} | {"run": self.name}
            self.alerts[key] = alert
            delta["alerts"].append(alert)
        if not (grew or delta["alerts"] or "truncate" in delta):
            return None
        if delta.pop("replace", False):
            return {"replace": self.snapshot(), "alerts": delta["alerts"], "summary": self.summary()}
        delta["summary"] = self.summary()
        return delta

    def _take(self, row: dict[str, Any], delta: dict[str, Any], fresh: list[dict[str, Any]]) -> None:
        step = _num(row.get("step"))
        if step is None:
            return
        step = int(step)
        if row.get("event") == "resume":  # an attempt rolled back: what it logged after `step` is rewritten
            self._truncate(step, delta)
            self.step = step
            return
        if "event" in row:
            return
        fresh.append(row)
        collect = not delta.get("replace")
        self.step = step
        self.tokens = _num(row.get("tokens")) or self.tokens
        train = _num(row.get("train/loss"))
        if train is not None and not row.get("train/nonfinite") and not row.get("train/skipped"):
            self.train_loss = train
            if self.keep_train:
                self.train_steps.append(step)
                self.train_loss_values.append(train)
                if collect:
                    delta["train"].append([step, train])
        tps = _num(row.get("throughput/tokens_per_second"))
        if tps is not None:
            self.tokens_per_second = tps
        for key, value in row.items() if "throughput/host0/tokens_per_second" in row else ():
            if key.startswith("throughput/host") and key.endswith("/tokens_per_second") and _num(value) is not None:
                host = key[len("throughput/host"):-len("/tokens_per_second")]
                steps, values = self.hosts.setdefault(host, (array("d"), array("d")))
                steps.append(step)
                values.append(float(value))
                if collect:
                    delta["hosts"].setdefault(host, []).append([step, float(value)])
        loss = _num(row.get("eval/loss"))
        if loss is not None:
            tokens = _num(row.get("tokens"))
            if tokens is None and self.tokens_per_step:
                tokens = step * self.tokens_per_step
            flops = _num(row.get("flops"))
            if flops is None and tokens is not None and self.flops_per_token:
                flops = 3.0 * tokens * self.flops_per_token
            point = [step, tokens, flops, loss, _num(row.get("forecast/loss")), _num(row.get("forecast/lo")),
                     _num(row.get("forecast/hi"))]
            if point[4] is not None:
                self.has_overlay = True  # the overlay logs the band beside each eval and writes every alert to alerts.jsonl
            self.evals.append(point)
            if collect:
                delta["evals"].append(point)
            self.eval_step, self.eval_loss = step, loss

    def _truncate(self, step: int, delta: dict[str, Any]) -> None:
        delta["truncate"] = min(step, delta.get("truncate", step))
        for name in ("evals", "train"):
            delta[name] = [p for p in delta[name] if p[0] <= step]
        delta["hosts"] = {h: [p for p in pts if p[0] <= step] for h, pts in delta["hosts"].items()}
        self.evals = [p for p in self.evals if p[0] <= step]
        cut = bisect.bisect_right(self.train_steps, step)
        del self.train_steps[cut:], self.train_loss_values[cut:]
        for steps, values in self.hosts.values():
            cut = bisect.bisect_right(steps, step)
            del steps[cut:], values[cut:]
        last = self.evals[-1] if self.evals else None
        self.eval_step, self.eval_loss = (int(last[0]), last[3]) if last else (None, None)
        self._tail = [r for r in self._tail if int(r["step"]) <= step]
        self._streak = [r for r in self._streak if int(r["step"]) <= step]
        self._last_alert_step = min(self._last_alert_step, step)

    def _derive_alerts(self, fresh: list[dict[str, Any]], forecast) -> list:
        """The alert rules (ladder.alerts) over the new lines, so runs without an overlay (rungs, imported runs)
        get alerts too; a run with one has them all in its alerts.jsonl already. Each rule sees a bounded context
        (the last SPIKE_WINDOW rows, the evals since the last one inside its band), so a long run costs no more
        per update than a short one."""
        if not fresh or self.has_overlay:
            return []
        context = self._tail + fresh
        found = [a for a in run_alerts(context, None, band_consecutive=10**9, spike_window=SPIKE_WINDOW)
                 if a.step > self._last_alert_step]
        self._last_alert_step = max(self._last_alert_step, max(int(r["step"]) for r in fresh))
        self._tail = context[-(SPIKE_WINDOW + 2):]
        evals = _with_bands([r for r in fresh if _num(r.get("eval/loss")) is not None], forecast)
        if evals:
            streak = self._streak + evals
            found += [a for a in band_alerts(streak, forecast, consecutive=BAND_CONSECUTIVE)]
            inside = [i for i, r in enumerate(streak) if _inside_band(r)]
            self._streak = streak[inside[-1] + 1:] if inside else streak
            if len(self._streak) > BAND_CONSECUTIVE:  # the streak's alert is out; its length no longer matters
                self._streak = self._streak[:BAND_CONSECUTIVE] + self._streak[-1:]
        return found

    def summary(self) -> dict[str, Any]:
        progress = min(1.0, self.step / self.num_steps) if self.step is not None and self.num_steps else None
        return {"step": self.step, "num_steps": self.num_steps, "progress": progress, "tokens": self.tokens,
                "planned_tokens": self.planned_tokens, "train_loss": self.train_loss, "eval_loss": self.eval_loss,
                "eval_step": self.eval_step, "tokens_per_second": self.tokens_per_second}

    def snapshot(self) -> dict[str, Any]:
        return {
            "role": self.role, "started": self.started, "summary": self.summary(), "evals": list(self.evals),
            "train": _thinned(self.train_steps, self.train_loss_values),
            "hosts": {h: _thinned(steps, values) for h, (steps, values) in self.hosts.items()},
        }


def _thinned(steps: array, values: array, limit: int = MAX_TRAIN_POINTS) -> list[list[float]]:
    """At most about `limit` evenly spaced points of a long series, its last point always included."""
    n = len(steps)
    stride = max(1, math.ceil(n / limit))
    picks = list(range(0, n, stride)) + ([n - 1] if n and (n - 1) % stride else [])
    return [[steps[i], values[i]] for i in picks]


BAND_KEYS = ("forecast/loss", "forecast/lo", "forecast/hi")


def _with_bands(rows: list[dict[str, Any]], forecast) -> list[dict[str, Any]]:
    """Eval rows with the band each is judged against: the one logged beside it, else the forecast's at its step
    (`band_at_step`, computed for all rows at once: one interpolation in log(step) per chunk, not one per row)."""
    need = [i for i, r in enumerate(rows) if any(_num(r.get(k)) is None for k in BAND_KEYS)]
    if forecast is None or not need or not forecast.curve:
        return rows
    import numpy as np

    steps = np.array([float(rows[i]["step"]) for i in need])
    knots = np.log(np.array([max(p.step, 1) for p in forecast.curve], dtype=float))
    x = np.log(np.maximum(steps, 1.0))
    bands = [np.interp(x, knots, np.array([getattr(p, k) for p in forecast.curve], dtype=float)) for k in ("loss", "lo", "hi")]
    out = list(rows)
    for j, i in enumerate(need):
        if len(forecast.curve) <= 1 and steps[j] < forecast.target.steps():
            continue  # a final-loss law speaks only about the last step (band_at_step)
        out[i] = {**rows[i], **{k: float(b[j]) for k, b in zip(BAND_KEYS, bands)}}
    return out


def _inside_band(row: dict[str, Any]) -> bool:
    if any(_num(row.get(k)) is None for k in BAND_KEYS):
        return True  # no band to be outside of
    return float(row["forecast/lo"]) <= float(row["eval/loss"]) <= float(row["forecast/hi"])


# ---------------------------------------------------------------------------------------- the page


@dataclass
class _TargetForecasts:
    name: str
    versions: dict[int, tuple[Any, dict[str, Any]]] = field(default_factory=dict)  # version -> (Forecast, ladder meta)

    @property
    def newest(self):
        return self.versions[max(self.versions)][0] if self.versions else None


def _history_entry(forecast, meta: dict[str, Any]) -> dict[str, Any]:
    return {"version": int(forecast.version), "method": forecast.method, "created_at": forecast.created_at,
            "final_loss": _num(forecast.final_loss), "final_loss_lo": _num(forecast.final_loss_lo),
            "final_loss_hi": _num(forecast.final_loss_hi), "level": forecast.level,
            "live_points": _num(forecast.band_terms.get("live_points")) or 0, "live_step": meta.get("live_step"),
            "law": forecast.law, "warnings": list(forecast.warnings)}


class LivePage:
    """The live state of one experiment's page: `poll()` reads what is new in the store and returns it as a
    numbered delta; `snapshot()` is everything at once; `deltas_since(seq)` is what a browser missed."""

    def __init__(self, experiment: str, root: str | None = None):
        from ladder.dag import FitStep, TrainStep
        from ladder.fitting import ladder_runs_for
        from ladder.loader import ExperimentError, load_experiment

        try:
            self.exp = load_experiment(experiment)
        except ExperimentError as error:
            raise ServeInputError(str(error)) from None
        try:
            self.store = Store(root)
        except (ValueError, ImportError) as error:  # an unknown fsspec protocol, or its package is not installed
            raise ServeInputError(f"--root {root}: not a store this machine can read ({error}).") from None
        dag = self.exp.dag
        self.dag = dag
        train = [s.name for s in dag if isinstance(s, TrainStep)]
        if not train:
            raise ServeInputError(f"{experiment} has no training step to show.")
        fit_targets = [s.target for s in dag if isinstance(s, FitStep)]
        stored = [n for n in train if n not in fit_targets and self.store.list_forecasts(n)]
        self.targets = list(dict.fromkeys(fit_targets + stored))
        rungs = {r for t in self.targets for r in ladder_runs_for(dag, t)}
        # rungs by size, as `ladder plot` orders them (smallest compute first), not by name
        self.rung_names = sorted((n for n in train if n in rungs and n not in self.targets), key=lambda n: dag[n].flops or 0.0)
        self.feeds = {
            n: RunFeed(n, self.store.run_dir(n, dag.fingerprints[n]),
                       "target" if n in self.targets else "rung" if n in rungs else "run", keep_train=n in self.targets)
            for n in train
        }
        self.forecasts = {t: _TargetForecasts(t) for t in self.targets}
        self.lock = threading.Lock()
        self.seq = 0
        self.deltas: deque[dict[str, Any]] = deque(maxlen=KEEP_DELTAS)
        self.steps: list[dict[str, Any]] = []
        self.fits: dict[str, Any] = {"curves": {}, "law": None}
        self._fit_counts: dict[str, int] = {}
        self._fit_at = -math.inf
        self.last_poll: dict[str, float] = {}
        self.polls = 0

    @property
    def title(self) -> str:
        return self.exp.name

    # ------------------------------------------------------------------ reading

    def poll(self) -> dict[str, Any] | None:
        """One read of the store; the delta it produced (also kept for `deltas_since`), or None if nothing changed."""
        wall, cpu = time.perf_counter(), time.thread_time()  # a poll runs in one thread: its CPU, not the server's
        with self.lock:
            delta: dict[str, Any] = {}
            versions = self._read_forecasts()
            if versions:
                delta["forecasts"] = versions
            runs = {}
            for name, feed in self.feeds.items():
                target = self.forecasts.get(name)
                changed = feed.read(self.store, target.newest if target else None)
                if changed:
                    runs[name] = changed
            if runs:
                delta["runs"] = runs
            steps = self._steps_table()
            if _without_detail(steps) != _without_detail(self.steps):  # a heartbeat's age alone is no news
                delta["steps"] = steps
            self.steps = steps
            fits = self._refit_rungs(force=False)
            if fits is not None:
                delta["fits"] = fits
            self.polls += 1
            if delta:
                self.seq += 1
                delta["seq"] = self.seq
                self.deltas.append(delta)
            self.last_poll = {"wall_s": time.perf_counter() - wall, "cpu_s": time.thread_time() - cpu, "at": time.time()}
            return delta or None

    def _read_forecasts(self) -> dict[str, list[dict[str, Any]]]:
        from forecasting.forecast import Forecast

        out: dict[str, list[dict[str, Any]]] = {}
        for target, held in self.forecasts.items():
            for version in self.store.list_forecasts(target):
                if version in held.versions:
                    continue
                try:
                    payload = self.store.read_forecast(target, version) or {}
                    meta = payload.pop("ladder", None) or {}
                    forecast = Forecast.model_validate(payload)
                except Exception:  # noqa: BLE001 - a half-written or foreign forecast must not stop the page; read again next poll
                    continue
                forecast.version = version
                held.versions[version] = (forecast, meta)
                out.setdefault(target, []).append(self._version_entry(target, version, with_curve=True))
        return out

    def _version_entry(self, target: str, version: int, *, with_curve: bool) -> dict[str, Any]:
        forecast, meta = self.forecasts[target].versions[version]
        entry = _history_entry(forecast, meta)
        if with_curve:
            entry["curve"] = self._curve(target, forecast)
        return entry

    def _curve(self, target: str, forecast) -> list[list[float | None]]:
        """The band as drawn: all of it, ahead to the target's last step; a refit's curve before the target's first
        eval (its live law extrapolated backwards, not evidence) is left out, as `ladder plot` draws it."""
        points = [[p.step, _num(p.tokens), _num(p.flops), _num(p.loss), _num(p.lo), _num(p.hi)] for p in forecast.curve]
        feed = self.feeds.get(target)
        if forecast.method.startswith("refit") and feed is not None and feed.evals:
            first = feed.evals[0][0]
            points = [p for p in points if p[0] >= first] or points[-1:]
        if len(points) == 1 and forecast.target.num_steps:
            points[0][0] = forecast.target.num_steps
        return points

    def _steps_table(self) -> list[dict[str, Any]]:
        from ladder.executor import plan

        out = []
        for row in plan(self.dag, self.store):
            feed = self.feeds.get(row.name)
            out.append({"name": row.name, "kind": row.kind, "state": row.state, "detail": row.detail,
                        "role": feed.role if feed else row.kind, "flops": _num(row.flops),
                        "source": _source_of(row.status), **(feed.summary() if feed else {})})
        return out

    def _refit_rungs(self, *, force: bool) -> dict[str, Any] | None:
        """The law through the rungs' evals (`ladder plot`'s rung_fits), when they changed and FIT_EVERY s have passed."""
        counts = {n: len(self.feeds[n].evals) for n in self.rung_names}
        now = time.monotonic()
        if counts == self._fit_counts or (not force and now - self._fit_at < FIT_EVERY):
            return None
        self._fit_counts, self._fit_at = counts, now
        curves, law = {}, None
        table = self._rung_table()
        if table is not None:
            from ladder.views.plots import rung_fits

            try:
                fits, law = rung_fits(table)
            except Exception:  # noqa: BLE001 - a fit that cannot be made yet is drawn as no line, never an error page
                fits, law = None, None
            if fits is not None:
                for run, rows in fits.groupby("run", sort=True):
                    curves[str(run)] = [[_num(f), _num(l)] for f, l in zip(rows["flops"], rows["loss"])]
        self.fits = {"curves": curves, "law": law}
        return self.fits

    def _rung_table(self):
        import pandas as pd

        records = []
        for name in self.rung_names:
            feed = self.feeds[name]
            for step, tokens, flops, loss, *_ in feed.evals:
                if step <= 0 or flops is None or tokens is None:
                    continue
                record = {"run": name, "step": int(step), "loss": loss, "tokens": tokens, "flops": flops}
                if feed.num_steps:
                    record["fraction"] = step / feed.num_steps
                for key in ("params_active", "params_total"):
                    if getattr(feed, key):
                        record[key] = getattr(feed, key)
                records.append(record)
        if not records:
            return None
        return pd.DataFrame(records).drop_duplicates(["run", "step"], keep="last")

    # ------------------------------------------------------------------ what a browser asks for

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "seq": self.seq, "experiment": self.title, "root": self.store.url, "targets": self.targets,
                "colors": {"rungs": RUNG_COLORS, "band": BAND_COLOR, "first": FIRST_BAND_COLOR},
                "rungs": self.rung_names, "steps": self.steps, "fits": self.fits,
                "runs": {n: f.snapshot() for n, f in self.feeds.items()},
                "forecasts": {t: [self._version_entry(t, v, with_curve=v == max(h.versions))
                                  for v in sorted(h.versions)] for t, h in self.forecasts.items()},
                "alerts": sorted((a for f in self.feeds.values() for a in f.alerts.values()),
                                 key=lambda a: (a.get("time") or 0, a.get("step") or 0)),
                "last_poll": self.last_poll,
            }

    def deltas_since(self, seq: int) -> list[dict[str, Any]] | None:
        """The deltas after `seq`, oldest first; None when some of them are no longer kept (the browser must reload)."""
        with self.lock:
            if seq >= self.seq:
                return []
            if not self.deltas or self.deltas[0]["seq"] > seq + 1:
                return None
            return [d for d in self.deltas if d["seq"] > seq]

    def forecast_version(self, target: str, version: int) -> dict[str, Any] | None:
        with self.lock:
            held = self.forecasts.get(target)
            if held is None or version not in held.versions:
                return None
            return self._version_entry(target, version, with_curve=True)


def _without_detail(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k != "detail"} for row in steps]


def _source_of(status: dict[str, Any] | None) -> str | None:
    """Where a step's run came from when it was not trained here: imported or attached (status.json's history)."""
    for event in reversed((status or {}).get("history") or []):
        if event.get("event") in ("imported", "attached"):
            return f"{event['event']} from {event.get('source', 'elsewhere')}"
    return None


# ---------------------------------------------------------------------------------------- the server


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def token_required(host: str, require_token: bool = False) -> bool:
    """A token guards every request when the server listens beyond loopback, or when asked to (`--require-token`)."""
    return require_token or not is_loopback(host)


class _TokenGate:
    """ASGI middleware: 401 for any request that does not carry the token (Authorization: Bearer, ?token=, or the
    cookie set when the page was opened with ?token=, which is how its script, styles and event stream carry it)."""

    def __init__(self, app, token: str):
        self.app, self.token = app, token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from http.cookies import SimpleCookie
        from urllib.parse import parse_qs

        cookie_name = f"ladder_token_{(scope.get('server') or ('', 0))[1]}"  # cookies ignore ports: one per server
        header, cookie = b"", b""
        for name, value in scope.get("headers") or []:
            if name == b"authorization" and value.lower().startswith(b"bearer "):
                header = value[7:].strip()
            elif name == b"cookie":
                jar = SimpleCookie()
                with contextlib.suppress(Exception):
                    jar.load(value.decode("latin-1"))
                if cookie_name in jar:
                    cookie = jar[cookie_name].value.encode()
        query = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token") or [""])[0].encode()
        if not any(given and secrets.compare_digest(given, self.token) for given in (header, query, cookie)):
            from starlette.responses import PlainTextResponse

            response = PlainTextResponse("401: this page needs its token (open the URL `ladder serve` printed).\n",
                                         status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        if not (query and secrets.compare_digest(query, self.token)):
            return await self.app(scope, receive, send)
        set_cookie = f"{cookie_name}={self.token.decode()}; Path=/; HttpOnly; SameSite=Strict".encode()

        async def with_cookie(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*(message.get("headers") or []), (b"set-cookie", set_cookie)]}
            await send(message)

        await self.app(scope, receive, with_cookie)


class _LoopbackHostGate:
    """ASGI middleware for a loopback server without a token: 400 unless the Host header names loopback, so a web page
    elsewhere cannot read this one through a name that it re-points at 127.0.0.1 (DNS rebinding)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
        name = host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        if is_loopback(name):
            return await self.app(scope, receive, send)
        from starlette.responses import PlainTextResponse

        response = PlainTextResponse(f"400: Host {host!r} is not loopback; open the page at 127.0.0.1 or localhost.\n", status_code=400)
        await response(scope, receive, send)


class _Headers:
    """ASGI middleware: the Content-Security-Policy (nothing from outside this server) and no caching of API answers."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                headers.append((b"content-security-policy", CSP.encode()))
                headers.append((b"x-content-type-options", b"nosniff"))
                if scope["path"].startswith("/api/"):
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


def build_app(page: LivePage, *, token: str | None = None, interval: float = 1.0, keepalive: float = 15.0):
    """The Starlette app of one page: GET routes only, the poll loop started and stopped with it."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    changed: dict[str, asyncio.Event] = {}

    def dumps(obj: Any) -> str:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        import anyio

        changed["event"] = asyncio.Event()
        if page.polls == 0:
            await anyio.to_thread.run_sync(page.poll)

        async def loop():
            while True:
                await asyncio.sleep(interval)
                try:
                    delta = await anyio.to_thread.run_sync(page.poll)
                except Exception:  # noqa: BLE001 - a flaky store read is retried at the next interval
                    continue
                if delta:
                    event, changed["event"] = changed["event"], asyncio.Event()
                    event.set()

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            changed["event"].set()

    async def index(request):
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    async def state(request):
        import anyio

        body = await anyio.to_thread.run_sync(lambda: dumps(page.snapshot()))  # a long run's snapshot must not stall the streams
        return Response(body, media_type="application/json")

    async def forecast(request):
        found = page.forecast_version(request.path_params["target"], request.path_params["version"])
        if found is None:
            return JSONResponse({"error": "no such target or forecast version"}, status_code=404)
        return Response(dumps(found), media_type="application/json")

    async def events(request):
        try:
            since = int(request.query_params.get("since", "0"))
        except ValueError:
            return JSONResponse({"error": "since must be an integer"}, status_code=400)

        async def stream():
            last = since
            yield "retry: 1000\n\n"
            while True:
                event = changed["event"]
                batch = page.deltas_since(last)
                if batch is None:
                    yield f"event: reset\ndata: {page.seq}\n\n"
                    return  # the browser reloads the snapshot and reconnects from its seq
                for delta in batch:
                    yield f"event: delta\ndata: {dumps(delta)}\n\n"
                    last = delta["seq"]
                if await request.is_disconnected():
                    return
                try:
                    await asyncio.wait_for(event.wait(), timeout=keepalive)
                except asyncio.TimeoutError:
                    yield ": keepalive\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    middleware = [Middleware(_Headers), Middleware(_TokenGate, token=token) if token else Middleware(_LoopbackHostGate)]
    routes = [
        Route("/", index, methods=["GET"]),
        Route("/api/state", state, methods=["GET"]),
        Route("/api/events", events, methods=["GET"]),
        Route("/api/forecast/{target}/{version:int}", forecast, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free one. ServeInputError when it cannot be had."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise ServeInputError(f"--host {host}: not an address or name this machine can listen on.") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise ServeInputError(f"--host {host} --port {port}: cannot listen there ({error.strerror}); choose another --port.") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class Server:
    """uvicorn serving one page on a socket we bound; `start()` runs it in a thread (tests, benchmarks)."""

    def __init__(self, page: LivePage, sock: socket.socket, *, token: str | None = None, interval: float = 1.0):
        import uvicorn

        self.page, self.sock, self.token = page, sock, token
        config = uvicorn.Config(build_app(page, token=token, interval=interval), log_level="warning",
                                timeout_graceful_shutdown=1, access_log=False)
        self.uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/" + (f"?token={self.token}" if self.token else "")

    def run(self) -> None:
        self.uvicorn.run(sockets=[self.sock])

    def start(self) -> "Server":
        self._thread = threading.Thread(target=self.run, name="ladder-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.uvicorn.started:
            raise RuntimeError("the server did not start")
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sock.close()


def serve_command(
    experiment: str = typer.Argument(..., help="Experiment file or module whose ladder to show."),
    root: Optional[str] = typer.Option(None, "--root", help="Artifact root, any fsspec URL (default $LADDER_ROOT or ./ladder-runs).", envvar="LADDER_ROOT"),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; anything but loopback needs a token."),
    port: int = typer.Option(DEFAULT_PORT, "--port", min=0, max=65535, help="Port (0: any free one)."),
    token: Optional[str] = typer.Option(None, "--token", envvar="LADDER_SERVE_TOKEN", help="Token every request must carry (default off loopback: one is generated and printed)."),
    require_token: bool = typer.Option(False, "--require-token", help="Require a token on loopback too."),
    interval: float = typer.Option(1.0, "--interval", min=0.1, help="Seconds between reads of the store."),
) -> None:
    """Serve the experiment's live page (ladder table, rung fits, the target against its forecast band, refit history,
    alerts, per-host throughput); read-only, updates by itself as the runs and forecasts grow."""
    if token is not None and len(token) < 8:
        typer.echo("error: --token must be at least 8 characters (or leave it out to have one generated).", err=True)
        raise typer.Exit(2)
    if token is None and token_required(host, require_token):
        token = secrets.token_urlsafe(18)
    try:
        page = LivePage(experiment, root)
        sock = bind(host, port)
    except ServeInputError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    server = Server(page, sock, token=token, interval=interval)
    typer.echo(f"serving {page.title} from {page.store.url} at {server.url}")
    if not is_loopback(host):
        typer.echo(f"listening beyond loopback ({host}): every request needs the token; the page is read-only.")
    typer.echo("Ctrl-C stops it.")
    server.run()
