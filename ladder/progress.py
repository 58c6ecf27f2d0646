"""Live progress of `ladder submit`, read from the run directories while Ray workers train.

A training step runs in a Ray worker, which has no terminal: the trainer's rich bar never shows there,
and Ray forwards only the worker's log lines. So the submitter follows each running step's
metrics.jsonl itself, from the byte offset where it stopped (a hero's long log is never read twice),
and shows step, loss, tokens/s and ETA: a rich progress display on a terminal, and otherwise (CI, nohup,
`| tee`) one plain line per advancing step every `interval` seconds, with no terminal codes.

`quiet_ray_warnings()` keeps two things out of such logs: Ray's colour codes around forwarded worker
lines (RAY_COLOR_PREFIX=0) and its token-authentication notice on every embedded start (a logging
warning of `ray._private.authentication.authentication_token_setup`; the embedded Ray listens on
loopback only, see README "Network").
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ladder.runs import read_metrics
from ladder.store import Store

DEFAULT_INTERVAL = 5.0
RAY_TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


@dataclass
class _Tracked:
    name: str
    run_dir: str
    num_steps: int | None
    offset: int = 0
    step: int | None = None
    loss: float | None = None
    eval_loss: float | None = None
    tokens_per_second: float | None = None
    tokens_per_step: float | None = None
    first: tuple[float, int] | None = None  # (time, step) of the first line seen in this submit
    last: tuple[float, int] | None = None
    printed_step: int | None = None
    task: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def eta_seconds(self) -> float | None:
        """Remaining steps at the wall-clock pace seen in this submit (evals and checkpoints included),
        else at the logged tokens/s."""
        if self.step is None or not self.num_steps:
            return None
        left = max(0, self.num_steps - self.step)
        if self.first and self.last and self.last[1] > self.first[1] and self.last[0] > self.first[0]:
            return left * (self.last[0] - self.first[0]) / (self.last[1] - self.first[1])
        if self.tokens_per_second and self.tokens_per_step:
            return left * self.tokens_per_step / self.tokens_per_second
        return None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return str(datetime.timedelta(seconds=int(round(seconds))))


def _si(value: float | None) -> str:
    if value is None:
        return "?"
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


class SubmitProgress:
    """Follows the metrics.jsonl of every running training step; `poll()` shows what is new.

    `live=None` picks the rich display when `console` is a terminal, plain lines otherwise. `interval`:
    seconds between plain lines of one step. `read_every`: seconds between reads of the run directories.
    """

    def __init__(self, store: Store, console=None, *, live: bool | None = None, interval: float = DEFAULT_INTERVAL,
                 read_every: float = 1.0, clock: Callable[[], float] = time.monotonic):
        from rich.console import Console

        self.store = store
        self.console = console or Console(highlight=False)
        self.live = self.console.is_terminal if live is None else live
        self.interval = interval
        self.read_every = read_every
        self.clock = clock
        self.steps: dict[str, _Tracked] = {}
        self.bytes_read = 0
        self._last_read = -math.inf
        self._last_print = -math.inf
        self._progress = None

    # ------------------------------------------------------------------ what the executor calls

    def start(self, name: str, run_dir: str, num_steps: int | None, tokens_per_step: float | None = None) -> None:
        """Follow `name`'s run directory (a path of this store) from the end of what it holds now."""
        tracked = _Tracked(name=name, run_dir=run_dir, num_steps=num_steps, tokens_per_step=tokens_per_step)
        self._read(tracked, catch_up=True)
        self.steps[name] = tracked
        if self.live:
            progress = self._rich()
            tracked.task = progress.add_task(name, total=num_steps or None, completed=tracked.step or 0,
                                             loss="", speed="")

    def poll(self, *, force: bool = False) -> list[str]:
        """Read what the running steps wrote since the last read; return (and print) the plain lines shown."""
        now = self.clock()
        if not self.steps or (not force and now - self._last_read < self.read_every):
            return []
        self._last_read = now
        for tracked in self.steps.values():
            self._read(tracked)
        if self.live:
            for tracked in self.steps.values():
                self._update_rich(tracked)
            return []
        if not force and now - self._last_print < self.interval:
            return []
        self._last_print = now
        lines = []
        for tracked in self.steps.values():
            if tracked.step is not None and tracked.step != tracked.printed_step:
                tracked.printed_step = tracked.step
                lines.append(self.line(tracked))
        for line in lines:
            self.console.print(line, markup=False, highlight=False)
        return lines

    def finish(self, name: str) -> None:
        """Stop following `name` (it finished, failed or was interrupted); its last state is shown once more."""
        tracked = self.steps.pop(name, None)
        if tracked is None:
            return
        self._read(tracked)
        if self.live and tracked.task is not None and self._progress is not None:
            self._update_rich(tracked)  # the finished step's bar stays, at its last state
            self._progress.refresh()
        elif not self.live and tracked.step is not None and tracked.step != tracked.printed_step:
            self.console.print(self.line(tracked), markup=False, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # ------------------------------------------------------------------ reading and showing

    def line(self, t: _Tracked) -> str:
        of = f"/{t.num_steps:,}" if t.num_steps else ""
        pct = f" ({t.step / t.num_steps:.1%})" if t.num_steps and t.step is not None else ""
        parts = [f"[progress] {t.name} step {t.step:,}{of}{pct}"]
        if t.loss is not None:
            parts.append(f"loss {t.loss:.4f}")
        if t.eval_loss is not None:
            parts.append(f"eval {t.eval_loss:.4f}")
        if t.tokens_per_second is not None:
            parts.append(f"{_si(t.tokens_per_second)} tokens/s")
        parts.append(f"ETA {_eta(t.eta_seconds())}")
        return "  ".join(parts)

    def _read(self, t: _Tracked, *, catch_up: bool = False) -> None:
        rows, offset = read_metrics(self.store, t.run_dir, offset=t.offset)
        self.bytes_read += offset - t.offset
        t.offset = offset
        for row in rows:
            if not _finite(row.get("step")):
                continue
            t.step = int(row["step"])
            if row.get("event") == "resume":
                t.first = None  # a restart: the pace before it says nothing about the pace after it
                continue
            if _finite(row.get("train/loss")):
                t.loss = float(row["train/loss"])
            if _finite(row.get("eval/loss")):
                t.eval_loss = float(row["eval/loss"])
            if _finite(row.get("throughput/tokens_per_second")):
                t.tokens_per_second = float(row["throughput/tokens_per_second"])
            if not catch_up and _finite(row.get("time")):
                point = (float(row["time"]), t.step)
                t.first = t.first or point
                t.last = point

    def _rich(self):
        if self._progress is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[loss]}"),
                TextColumn("{task.fields[speed]}"), TimeRemainingColumn(), console=self.console, transient=False,
            )
            self._progress.start()
        return self._progress

    def _update_rich(self, t: _Tracked) -> None:
        if t.task is None or self._progress is None:
            return
        loss = f"loss {t.loss:.4f}" if t.loss is not None else ""
        if t.eval_loss is not None:
            loss += f" eval {t.eval_loss:.4f}"
        speed = f"{_si(t.tokens_per_second)} tokens/s" if t.tokens_per_second is not None else ""
        self._progress.update(t.task, completed=t.step or 0, loss=loss, speed=speed)


class _DropTokenAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("Token authentication is")


def quiet_ray_warnings(*, tty: bool) -> None:
    """No colour codes around Ray's forwarded worker lines when the log is not a terminal, and no
    token-authentication notice at each embedded start (an explicit RAY_COLOR_PREFIX is kept)."""
    if not tty:
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    logger = logging.getLogger(RAY_TOKEN_AUTH_LOGGER)
    if not any(isinstance(f, _DropTokenAuthNotice) for f in logger.filters):
        logger.addFilter(_DropTokenAuthNotice())


__all__ = ["DEFAULT_INTERVAL", "SubmitProgress", "quiet_ray_warnings"]
