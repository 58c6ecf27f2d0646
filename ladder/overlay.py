"""The live forecast overlay: predicted loss and band beside every eval of a running job.

A forecast is only useful where people look while the run trains: metrics.jsonl and W&B's eval/loss
chart. `ForecastOverlay` is a trainer hook (`hook(step, metrics) -> dict`): after each eval it reads
the newest stored forecast version of its target and returns forecast/loss, forecast/lo, forecast/hi,
forecast/sigma (how many standard deviations eval/loss is from the prediction, the 95% band read as
+-1.96 sigma in log space: `ladder.alerts.band_sigma`) and forecast/version, which the trainer writes on
the same line and logs to W&B at the same step as eval/loss (so a W&B panel plotting eval/loss, forecast/lo
and forecast/hi shows the band at past evals). Each new forecast version is also logged once as a chart of
its whole curve, ahead of the run.

Every `refit_every` evals it refits the forecast with the run's own live prefix (forecasting's
`refit_forecast`: the ladder table plus the stored ladder forecast as the prior) and stores a new
version, which takes over at the next eval. A refit on a big ladder takes seconds and can fail; the
run must not notice either. So refits run off the training thread (one background thread, never two
refits at once, each in a spawned child process by default so scipy never holds the trainer's GIL; the
result is picked up at a later eval), and every failure is logged, written to the alerts stream, and
leaves the previous forecast in place. The overlay also runs the alert rules (ladder.alerts) over the new metric
lines after each eval.
"""

from __future__ import annotations

import logging
import math
import threading
import traceback
from typing import Any, Sequence

from ladder import alerts as alerts_lib
from ladder.runs import read_metrics
from ladder.store import Store

log = logging.getLogger(__name__)

DEFAULT_REFIT_EVERY = 10
REFIT_DRAIN_SECONDS = 120.0  # how long the end of a run waits for a refit in flight to store its version


class ForecastOverlay:
    """Trainer hook that logs the forecast band beside each eval, refits every K evals and raises alerts.

    store_url: root of the store that holds `{root}/forecasts/{target_name}/{n}.json`.
    target_spec: forecasting.forecast.TargetSpec of this run (ladder.fitting.target_spec(step)).
    ladder_run_dirs: the finished rungs the forecast was fitted to (URLs); empty disables refits.
    run_dir: this run's directory (local path or URL): metrics.jsonl is read from it, alerts.jsonl written to it.
    refit_every: refit after every K-th eval (0 or None: never).
    alerts: True for the default alert rules, False for none, or a dict of `ladder.alerts.run_alerts` options.
    refit_in: "process" (default) runs each refit in a spawned child process, so its seconds of scipy never
        hold the trainer's GIL; "thread" runs it in the background thread itself (cheaper to start).
    """

    def __init__(
        self,
        store_url: str,
        target_name: str,
        target_spec: Any,
        ladder_run_dirs: Sequence[str],
        *,
        run_dir: str | None = None,
        refit_every: int | None = DEFAULT_REFIT_EVERY,
        alerts: bool | dict[str, Any] = True,
        n_bootstrap: int = 50,
        seed: int = 0,
        console_alerts: bool = True,
        refit_in: str = "process",
    ):
        self.store = Store(store_url)
        self.target_name = target_name
        self.target_spec = target_spec
        self.ladder_run_dirs = list(ladder_run_dirs or [])
        self.run_dir = run_dir
        self.refit_every = int(refit_every or 0)
        self.alert_options = alerts if isinstance(alerts, dict) else {}
        self.alerts_enabled = alerts is not False
        self.n_bootstrap = n_bootstrap
        self.seed = seed
        self.console_alerts = console_alerts
        if refit_in not in ("process", "thread"):
            raise ValueError(f"refit_in must be 'process' or 'thread', got {refit_in!r}")
        self.refit_in = refit_in

        self.forecast = None  # newest forecast loaded so far (stays when a later load fails)
        self.version: int | None = None
        self.evals = 0
        self.refits_started = 0
        self.refits_failed = 0
        self.last_refit_error: str | None = None
        self.alerts: list[alerts_lib.Alert] = []
        # a restarted run re-reads its whole metrics.jsonl: alerts already in its stream are not raised again
        self._seen: set[tuple[str, int]] = {(a.get("kind"), a.get("step")) for a in alerts_lib.read_alerts(run_dir)} if run_dir else set()
        self._eval_points: dict[int, dict[str, Any]] = {}  # step -> eval row (for the live prefix)
        self._rows_tail: list[dict[str, Any]] = []  # recent metric rows (context of the spike rules)
        self._eval_rows: list[dict[str, Any]] = []  # eval rows with the band they were shown against
        self._offset = 0
        self._last_alert_step = -1
        self._thread: threading.Thread | None = None
        self._outcome: dict[str, Any] | None = None  # set by the refit thread, consumed at the next eval
        self._lock = threading.Lock()
        self._charted_version: int | None = None  # the forecast version whose whole curve W&B has

    # ------------------------------------------------------------------ the hook

    def __call__(self, step: int, metrics: dict[str, Any]) -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        try:
            self.evals += 1
            self._collect_refit()
            self._refresh_forecast()
            actual = metrics.get("eval/loss")
            band = alerts_lib.band_at_step(self.forecast, step) if self.forecast is not None else None
            if band is not None:
                loss, lo, hi = band
                out.update({"forecast/loss": loss, "forecast/lo": lo, "forecast/hi": hi, "forecast/version": self.version})
                sigma = alerts_lib.band_sigma(float(actual), loss, lo, hi) if _finite(actual) else math.nan
                if math.isfinite(sigma):  # a zero-width band has no sigma; never write Infinity into JSON lines
                    out["forecast/sigma"] = sigma
            if self.forecast is not None and self.version != self._charted_version:
                self._log_wandb_chart(int(step), actual)
            new_rows = self._read_new_rows(step, {**metrics, **out, "step": step})
            if _finite(actual):
                self._eval_points[int(step)] = {k: metrics[k] for k in ("step", "tokens", "flops", "eval/loss") if k in metrics}
                self._eval_points[int(step)]["step"] = int(step)
            if self.alerts_enabled:
                out.update(self._run_alerts(new_rows))
            context = self.alert_options.get("spike_window", 20) + 2
            self._rows_tail = [r for r in self._rows_tail if "event" not in r][-context:]
            if self.refit_every and self.evals % self.refit_every == 0:
                self.start_refit(step)
        except Exception:  # noqa: BLE001 - the overlay must never hurt the run
            log.warning("forecast overlay failed at step %d; continuing:\n%s", step, traceback.format_exc())
        return out or None

    def _log_wandb_chart(self, step: int, actual: Any) -> None:
        """W&B draws every key on its own chart, and only at steps already logged; this custom line chart puts
        the whole forecast curve (loss and band to the last planned step, ahead of the run) and eval/loss so
        far on one axis. Logged once per forecast version, with commit=False so it lands on this eval's
        step; skipped when no W&B run is active."""
        try:
            import wandb

            if wandb.run is None:
                return
            evals = {s: float(r["eval/loss"]) for s, r in self._eval_points.items() if _finite(r.get("eval/loss"))}
            if _finite(actual):
                evals[step] = float(actual)
            chart = forecast_chart(self.forecast, sorted(evals.items()),
                                   title=f"{self.target_name}: forecast v{self.version} and eval/loss")
            wandb.log({"forecast/chart": chart}, commit=False)
            self._charted_version = self.version
        except Exception as error:  # noqa: BLE001 - W&B must never hurt the run
            log.debug("W&B forecast chart not logged: %s", error)

    # ------------------------------------------------------------------ forecast versions

    def _refresh_forecast(self) -> None:
        """Load the newest stored version if it changed; keep the current one if loading fails."""
        from ladder.fitting import load_forecast

        try:
            versions = self.store.list_forecasts(self.target_name)
            if not versions or versions[-1] == self.version:
                return
            forecast = load_forecast(self.store, self.target_name, versions[-1])
            if forecast is not None:
                self.forecast, self.version = forecast, versions[-1]
        except Exception as error:  # noqa: BLE001
            log.warning("could not load forecast %s (keeping version %s): %s", self.target_name, self.version, error)

    # ------------------------------------------------------------------ refits

    def start_refit(self, step: int) -> bool:
        """Start a background refit with the live prefix so far; False if one is running or none is possible."""
        if not self.ladder_run_dirs:
            return False
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return False
            live = sorted(self._eval_points.values(), key=lambda r: r["step"])
            self.refits_started += 1
            self._thread = threading.Thread(target=self._refit_worker, args=(step, live), name=f"ladder-refit-{self.target_name}", daemon=True)
            self._thread.start()
        return True

    def _refit_worker(self, step: int, live_rows: list[dict[str, Any]]) -> None:
        args = (self.store.url, self.target_name, self.target_spec, self.ladder_run_dirs, live_rows, step, self.n_bootstrap, self.seed)
        try:
            if self.refit_in == "process":
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    version = pool.submit(refit_and_store, *args).result()
            else:
                version = refit_and_store(*args)
            outcome = {"ok": True, "step": step, "version": version}
        except BaseException as error:  # noqa: BLE001 - a refit failure is reported, never raised
            outcome = {"ok": False, "step": step, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
        with self._lock:
            self._outcome = outcome

    def _collect_refit(self) -> None:
        with self._lock:
            outcome, self._outcome = self._outcome, None
        if outcome is None:
            return
        if outcome["ok"]:
            log.info("refit of %s with the live prefix to step %d stored as version %s", self.target_name, outcome["step"], outcome["version"])
            return
        self.refits_failed += 1
        self.last_refit_error = outcome["error"]
        log.warning("refit of %s at step %d failed; keeping forecast version %s: %s\n%s",
                    self.target_name, outcome["step"], self.version, outcome["error"], outcome.get("trace", ""))
        alert = alerts_lib.Alert(
            kind="overlay_error", step=int(outcome["step"]), severity="info",
            message=f"refit of the {self.target_name} forecast at step {outcome['step']} failed ({outcome['error'][:200]}); "
                    f"forecast version {self.version} stays.",
        )
        self._emit([alert])

    def drain(self, timeout: float | None = REFIT_DRAIN_SECONDS) -> None:
        """At the end of a run: let a refit in flight store its version (a refit started a process and may not have
        landed before the last eval on a loaded machine; the worker's exit would lose it), then report its outcome."""
        self.wait(timeout)
        self._collect_refit()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a running refit (tests, end of training); its result is picked up at the next call."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # ------------------------------------------------------------------ alerts

    def _read_new_rows(self, step: int, eval_row: dict[str, Any]) -> list[dict[str, Any]]:
        """Metric lines written since the last eval (resume markers applied); earlier evals join the live prefix."""
        rows: list[dict[str, Any]] = []
        if self.run_dir:
            store = Store(self.run_dir)
            rows, self._offset = read_metrics(store, store.root, offset=self._offset)
        resumes = [int(r.get("step", 0)) for r in rows if r.get("event") == "resume"]
        if resumes:  # a rollback or restart: lines past the resume step are rewritten by the run that continued
            from trainer.metrics import apply_resume_markers

            back_to = min(resumes)
            self._rows_tail = apply_resume_markers(self._rows_tail + rows)
            self._eval_rows = [r for r in self._eval_rows if r["step"] <= back_to]
            self._eval_points = {s: r for s, r in self._eval_points.items() if s <= back_to}
            self._last_alert_step = min(self._last_alert_step, back_to)
            rows = apply_resume_markers(rows)
        else:
            self._rows_tail = self._rows_tail + rows
        new_rows = [r for r in rows if "event" not in r and "step" in r]
        known = {r["step"] for r in self._eval_rows}
        for r in new_rows:  # eval lines written before this process started (a resumed run) join the live prefix
            if _finite(r.get("eval/loss")) and r["step"] not in known:
                self._eval_points.setdefault(int(r["step"]), {k: r[k] for k in ("step", "tokens", "flops", "eval/loss") if k in r})
                self._eval_rows.append(r)
                known.add(r["step"])
        if int(step) not in known and _finite(eval_row.get("eval/loss")):
            self._eval_rows.append(eval_row)
        self._eval_rows.sort(key=lambda r: r["step"])
        return new_rows

    def _run_alerts(self, new_rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Run the alert rules over the metric lines written since the last eval, plus this eval."""
        options = dict(self.alert_options)
        consecutive = options.pop("band_consecutive", 3)
        found = [a for a in alerts_lib.run_alerts(self._rows_tail, None, band_consecutive=10**9, **options) if a.step > self._last_alert_step]
        found += alerts_lib.band_alerts(self._eval_rows, self.forecast, consecutive=consecutive)
        new = [a for a in found if a.key not in self._seen]
        self._last_alert_step = max([self._last_alert_step, *(int(r["step"]) for r in self._rows_tail if "step" in r)])
        self._emit(new)
        return {"alerts/count": len(self.alerts), "alerts/new": len(new)}

    def _emit(self, new: list[alerts_lib.Alert]) -> None:
        new = [a for a in new if a.key not in self._seen]
        if not new:
            return
        self._seen.update(a.key for a in new)
        self.alerts.extend(new)
        if self.console_alerts:
            alerts_lib.print_alerts(new)
        if self.run_dir:
            alerts_lib.append_alerts(self.run_dir, new)
        alerts_lib.wandb_alert(new)


def prior_forecast(store: Store, target: str):
    """The newest forecast of `target` made from the ladder alone (not a refit): refitting a refit would count
    the live prefix twice. Falls back to the newest version of any kind."""
    from forecasting.forecast import Forecast

    versions = store.list_forecasts(target)
    for version in reversed(versions):
        payload = store.read_forecast(target, version)
        if payload and payload.get("method") != "refit":
            payload.pop("ladder", None)
            return Forecast.model_validate(payload)
    if versions:
        from ladder.fitting import load_forecast

        return load_forecast(store, target)
    return None


def refit_and_store(store_url: str, target_name: str, target_spec, ladder_run_dirs: Sequence[str],
                    live_rows: Sequence[dict[str, Any]], step: int, n_bootstrap: int = 50, seed: int = 0) -> int:
    """Refit `target_name` with its live prefix (eval rows) against the ladder, store it as the next version."""
    from forecasting import api
    from forecasting.table import from_run_dirs

    from ladder.fitting import store_forecast

    store = Store(store_url)
    ladder_table = from_run_dirs(list(ladder_run_dirs))
    live = live_table(live_rows, target_spec)
    prior = prior_forecast(store, target_name)
    if prior is None:
        raise RuntimeError(f"no stored forecast of {target_name} to refit from")
    forecast = api.refit_forecast(ladder_table, target_spec, live, prior=prior, n_bootstrap=n_bootstrap, seed=seed)
    return store_forecast(
        store, forecast,
        meta={"refit": True, "by": "overlay", "live_step": int(step), "live_points": len(live), "prior_version": prior.version},
    )


def live_table(rows: Sequence[dict[str, Any]], target) -> Any:
    """The live prefix as forecasting's table (one row per eval), as forecasting.table.from_run_dirs reads a run dir."""
    import numpy as np
    import pandas as pd

    from forecasting.table import validate_table

    points = [r for r in rows if _finite(r.get("eval/loss")) and int(r.get("step", 0)) > 0]
    if not points:
        raise ValueError("no eval points in the live prefix yet")
    frame = pd.DataFrame({
        "run": target.name,
        "step": [int(r["step"]) for r in points],
        "loss": [float(r["eval/loss"]) for r in points],
        "split": "eval",
    })
    steps = frame["step"].to_numpy()
    if target.tokens_per_step:
        frame["tokens"] = steps * float(target.tokens_per_step)
    if all("flops" in r for r in points):
        frame["flops"] = [float(r["flops"]) for r in points]
    if target.lr:
        schedule = np.asarray(target.lr, dtype=float)
        frame["lr"] = schedule[np.clip(steps - 1, 0, len(schedule) - 1)]
    frame["params_active"] = float(target.params_active)
    if target.params_total:
        frame["params_total"] = float(target.params_total)
    if target.num_steps:
        frame["num_steps"] = float(target.num_steps)
        frame["fraction"] = steps / float(target.num_steps)
    if target.tokens_per_step:
        frame["tokens_per_step"] = float(target.tokens_per_step)
    return validate_table(frame.drop_duplicates("step", keep="last").sort_values("step").reset_index(drop=True))


def forecast_chart(forecast, evals: Sequence[tuple[int, float]] = (), *, title: str):
    """A W&B line chart of a forecast's whole curve (forecast/loss, forecast/lo, forecast/hi at every curve
    step, to the end of the planned run) and the observed eval/loss points (step, loss)."""
    import wandb

    steps = [int(p.step) for p in forecast.curve]
    xs = [steps, steps, steps]
    ys = [[float(p.loss) for p in forecast.curve], [float(p.lo) for p in forecast.curve], [float(p.hi) for p in forecast.curve]]
    keys = ["forecast/loss", "forecast/lo", "forecast/hi"]
    if evals:
        xs.append([int(s) for s, _ in evals])
        ys.append([float(v) for _, v in evals])
        keys.append("eval/loss")
    return wandb.plot.line_series(xs=xs, ys=ys, keys=keys, title=title, xname="step")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def overlay_for_step(step, store_url: str, run_dir: str, ladder_run_dirs: Sequence[str] | None, refit_every: int | None,
                     *, has_fit_step: bool = False) -> ForecastOverlay | None:
    """The overlay for a TrainStep, or None when no forecast of it exists or is planned."""
    from ladder.fitting import target_spec

    store = Store(store_url)
    if not has_fit_step and not store.list_forecasts(step.name):
        return None
    return ForecastOverlay(
        store_url, step.name, target_spec(step), ladder_run_dirs or [], run_dir=run_dir,
        refit_every=DEFAULT_REFIT_EVERY if refit_every is None else refit_every,
    )


__all__ = ["DEFAULT_REFIT_EVERY", "ForecastOverlay", "forecast_chart", "live_table", "overlay_for_step", "prior_forecast", "refit_and_store"]
