"""`ladder report EXP --out DIR`: one static HTML page that tells a ladder's whole story, for publishing.

Why one self-contained file: a lab publishes run pages (Marin's are the model) that must open anywhere,
years later, without the store, a server or a network. So everything is inline: CSS, the charts (the
same offline SVG plotter and tables as `ladder plot`, ladder.views.html), and the numbers themselves.

Why sections that never fail: a report is wanted most when a ladder is half done (rungs finished, the
hero blocked or running, an imported run that crashed). Each section is built on its own; what it cannot
show yet it says, in words, in the section and in the summary at the top, instead of crashing the page.

Sections: the ladder table (every step from `ladder.executor.plan`, read only), the data mixture (tokens
per source and per phase: weights x the run's tokens between phase boundaries), the configs (collapsible
JSON), the curves with their fits and bands (`ladder.views.plots.experiment_plot_data`), the target's forecast
versions against its actual curve, backtest errors (`forecasting.api.backtest` on the ladder's table),
and alerts (each run's alerts.jsonl plus `ladder.alerts.run_alerts` over its metrics).
"""

from __future__ import annotations

import html
import json
import math
import traceback
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Callable, Optional

import typer

REPORT_FILE = "index.html"
HELD_OUT_SHOWN = 8  # held-out runs per backtest in the backtest section, worst first


@dataclass
class Section:
    """One part of the page: its anchor, heading, HTML body and what it could not show (sentences)."""

    id: str
    title: str
    body: str = ""
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # caveats that are not gaps (a partial curve used, an assumption)


@dataclass
class ReportContext:
    """What every section reads: the experiment, its store and the chosen target."""

    experiment_ref: str
    exp: Any
    store: Any
    target: str | None
    plan_rows: list = field(default_factory=list)
    forecasts: list = field(default_factory=list)  # (version, Forecast, meta) oldest first
    plot: Any = None  # ladder.views.common.PlotData, or None when there is nothing to plot


# ---------------------------------------------------------------- small formatting helpers


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def si(value: float | None, digits: int = 3) -> str:
    """60.6M, 1.17B, 18T; '-' for nothing."""
    if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g}{suffix}"
    return f"{value:.{digits}g}"


def _num(value: float | None, fmt: str = ".4f") -> str:
    if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    return format(value, fmt)


def _pct(value: float | None) -> str:
    return _num(None if value is None else 100 * value, "+.2f") + ("%" if value is not None and math.isfinite(value) else "")


def _cell(text: str, *, col: str | None = None, value: Any = None, cls: str | None = None) -> str:
    attrs = ""
    if col:
        attrs += f' data-col="{_e(col)}"'
    if value is not None and not (isinstance(value, float) and not math.isfinite(value)):
        attrs += f' data-value="{_e(value)}"'
    if cls:
        attrs += f' class="{_e(cls)}"'
    return f"<td{attrs}>{text}</td>"


def _table(headers: list[str], rows: list[str], *, table_id: str | None = None) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    ident = f' id="{_e(table_id)}"' if table_id else ""
    return f'<table{ident}><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _missing(lines: list[str]) -> str:
    return "".join(f'<div class="missing">missing: {_e(line)}</div>' for line in lines)


def _notes(lines: list[str]) -> str:
    return "".join(f'<div class="note">note: {_e(line)}</div>' for line in lines)


def _json_block(obj: Any) -> str:
    return f"<pre>{_e(json.dumps(obj, indent=2, sort_keys=False, default=str))}</pre>"


# ---------------------------------------------------------------- reading the store


def _train_steps(exp) -> list:
    from ladder.dag import TrainStep

    return [s for s in exp.dag if isinstance(s, TrainStep)]


def default_target(exp) -> str | None:
    """The experiment's single fit target, else its largest training step (by planned FLOPs)."""
    from ladder.dag import FitStep

    fit_targets = sorted({s.target for s in exp.dag if isinstance(s, FitStep)})
    if len(fit_targets) == 1:
        return fit_targets[0]
    trains = _train_steps(exp)
    return max(trains, key=lambda s: s.flops or 0).name if trains else None


def _run_dir(ctx: ReportContext, name: str) -> str:
    return ctx.store.run_dir(name, ctx.exp.dag.fingerprints[name])


def _metrics(ctx: ReportContext, name: str) -> list[dict]:
    from ladder.runs import read_metrics
    from trainer.metrics import apply_resume_markers

    run_dir = _run_dir(ctx, name)
    if not ctx.store.exists(f"{run_dir}/metrics.jsonl"):
        return []
    rows, _ = read_metrics(ctx.store, run_dir)
    return apply_resume_markers(rows)


def _load_forecasts(ctx: ReportContext) -> list:
    from ladder.fitting import load_forecast

    if ctx.target is None:
        return []
    out = []
    for version in ctx.store.list_forecasts(ctx.target):
        raw = ctx.store.read_forecast(ctx.target, version) or {}
        forecast = load_forecast(ctx.store, ctx.target, version)
        if forecast is not None:
            forecast.version = version
            out.append((version, forecast, raw.get("ladder") or {}))
    return out


# ---------------------------------------------------------------- sections


def ladder_section(ctx: ReportContext) -> Section:
    from ladder.runs import summarize

    section = Section("ladder", "Ladder")
    rows = []
    counts: dict[str, int] = {}
    for row in ctx.plan_rows:
        step = ctx.exp.dag[row.name]
        counts[row.state] = counts.get(row.state, 0) + 1
        derived = step.derived if row.kind == "train" else None
        detail = row.detail
        provenance = (row.status or {}).get("provenance") or {}
        if provenance and row.state == "done":  # "0 attempt(s)" says nothing about a run trained elsewhere
            detail = f"imported ({provenance.get('note') or provenance.get('source', 'external run')})"
        status = _e(detail) if detail else ""
        if row.kind == "train":
            try:
                summary = summarize(ctx.store, _run_dir(ctx, row.name))
            except Exception:  # noqa: BLE001 - an unreadable run shows as no progress
                summary = None
            for line in summary.warnings if summary is not None else ():
                section.notes.append(f"{row.name}: {line}")
            if summary is not None and summary.step is not None:
                planned = summary.num_steps or (derived.num_steps if derived else None)
                progress = f"step {summary.step:,}" + (f" of {planned:,} ({summary.step / planned:.1%})" if planned else "")
                if summary.eval_loss is not None:
                    progress += f"; eval loss {summary.eval_loss:.4f} at step {summary.eval_step:,}"
                status = f"{status}<br>{_e(progress)}" if status else _e(progress)
            elif row.state in ("pending", "blocked"):
                status = f"{status}<br>not started" if status else "not started"
        waits = ", ".join(row.waits_for)
        rows.append(
            f'<tr data-step="{_e(row.name)}">'
            + _cell(_e(row.name), col="name")
            + _cell(_e(row.kind), col="kind")
            + _cell(f'<span class="state {_e(row.state)}">{_e(row.state)}</span>', col="state", value=row.state)
            + _cell(si(derived.params_active) if derived else "", col="params_active", value=derived.params_active if derived else None)
            + _cell(si(derived.params_total) if derived else "", col="params_total", value=derived.params_total if derived else None)
            + _cell(si(derived.tokens) if derived else "", col="tokens", value=derived.tokens if derived else None)
            + _cell(_num(row.flops, ".3g") if row.flops else "", col="flops", value=row.flops)
            + _cell(status, col="status")
            + _cell(_e(waits), col="waits_for")
            + _cell(f"<code>{_e(row.path)}</code>", col="path")
            + "</tr>"
        )
    summary_line = ", ".join(f"{n} {state}" for state, n in counts.items())
    section.body = (
        f"<p>{len(ctx.plan_rows)} steps: {_e(summary_line)}. Parameters, tokens and FLOPs are planned numbers from "
        "each spec (trainer.accounting); FLOPs are training FLOPs (3 x forward).</p>"
        + _table(["step", "kind", "state", "active params", "total params", "tokens", "FLOPs", "status", "waits for", "path"],
                 rows, table_id="ladder-table")
    )
    not_done = [r.name for r in ctx.plan_rows if r.state != "done"]
    if not_done:
        section.missing.append(f"not finished: {', '.join(not_done)}")
    return section


def _phase_bounds(data, num_steps: int) -> list[tuple[int, int]]:
    starts = [int(round(p.start_fraction * num_steps)) for p in data.phases]
    return [(start, starts[i + 1] if i + 1 < len(starts) else num_steps) for i, start in enumerate(starts)]


def mixture_tokens(step) -> dict[str, Any]:
    """Tokens per source and per phase of a training step: each phase's weights x the tokens trained in it."""
    derived = step.derived
    data = step.spec.data
    bounds = _phase_bounds(data, derived.num_steps)
    phases = []
    for phase, (start, end) in zip(data.phases, bounds, strict=True):
        tokens = (end - start) * derived.tokens_per_step
        phases.append({"start_step": start, "end_step": end, "start_fraction": phase.start_fraction, "tokens": tokens,
                       "weights": dict(phase.weights), "source_tokens": {s: w * tokens for s, w in phase.weights.items()}})
    totals = {s.name: sum(p["source_tokens"].get(s.name, 0.0) for p in phases) for s in data.sources}
    return {"phases": phases, "totals": totals, "tokens": derived.tokens}


def mixture_section(ctx: ReportContext) -> Section:
    section = Section("mixture", "Data mixture")
    summary_rows, details = [], []
    for step in _train_steps(ctx.exp):
        mix = mixture_tokens(step)
        data = step.spec.data
        phases = mix["phases"]
        top = sorted(mix["totals"].items(), key=lambda kv: -kv[1])[:3]
        summary_rows.append(
            f'<tr data-step="{_e(step.name)}">' + _cell(_e(step.name), col="name")
            + _cell(str(len(data.sources)), col="sources", value=len(data.sources))
            + _cell(_e("; ".join(f"phase {i}: steps {p['start_step']:,}-{p['end_step']:,} ({si(p['tokens'])} tokens)"
                                for i, p in enumerate(phases))), col="phases")
            + _cell(si(mix["tokens"]), col="tokens", value=mix["tokens"])
            + _cell(_e(", ".join(f"{name} {si(t)}" for name, t in top)), col="top_sources")
            + _cell(_e(data.tokenizer or "bytes"), col="tokenizer") + "</tr>"
        )
        headers = ["source", "kind", "paths"]
        for i, p in enumerate(phases):
            headers += [f"phase {i} weight", f"phase {i} tokens"]
        headers.append("total tokens")
        rows = []
        for source in sorted(data.sources, key=lambda s: -mix["totals"][s.name]):
            cells = _cell(_e(source.name), col="source") + _cell(_e(source.kind)) + _cell(_e(", ".join(source.paths) or "(built in)"))
            for i, p in enumerate(phases):
                cells += _cell(_num(p["weights"].get(source.name, 0.0), ".4g"), col=f"weight{i}", value=p["weights"].get(source.name, 0.0))
                cells += _cell(si(p["source_tokens"].get(source.name, 0.0)), col=f"tokens{i}", value=p["source_tokens"].get(source.name, 0.0))
            cells += _cell(si(mix["totals"][source.name]), col="total", value=mix["totals"][source.name])
            rows.append(f'<tr data-source="{_e(source.name)}">{cells}</tr>')
        details.append(
            f'<details data-step="{_e(step.name)}"><summary>{_e(step.name)}: {len(data.sources)} sources, '
            f"{len(phases)} phase(s), {si(mix['tokens'])} tokens</summary>{_table(headers, rows)}</details>"
        )
    if not summary_rows:
        section.missing.append("the experiment has no training steps")
    section.body = (
        "<p>Tokens per source are planned: each phase's weights x the tokens trained between its boundaries "
        "(phase starts at round(start fraction x steps)).</p>"
        + _table(["step", "sources", "phases", "tokens", "largest sources", "tokenizer"], summary_rows, table_id="mixture-table")
        + "".join(details)
    )
    return section


def configs_section(ctx: ReportContext) -> Section:
    from ladder.dag import FitStep, FunctionStep, TrainStep

    section = Section("configs", "Configs")
    blocks = []
    for step in ctx.exp.dag:
        fp = ctx.exp.dag.fingerprints[step.name]
        if isinstance(step, TrainStep):
            spec = step.spec.model_dump(mode="json")
            optimizer = dict(spec["optimizer"])
            schedule = optimizer.pop("schedule", None)
            data = dict(spec["data"])
            data["sources"] = f"{len(data['sources'])} sources (see Data mixture)"
            data["phases"] = [{"start_fraction": p["start_fraction"], "weights": f"{len(p['weights'])} weights"} for p in data["phases"]]
            parts = {"model": spec["model"], "optimizer": optimizer, "schedule": schedule, "train": spec["train"], "data": data,
                     "resources": spec.get("resources"), "tags": spec.get("tags"), "accounting": spec.get("accounting"),
                     "derived": step.derived.model_dump()}
        elif isinstance(step, FitStep):
            parts = {"target": step.target, "deps": list(step.deps), "config": step.config.model_dump(mode="json")}
        elif isinstance(step, FunctionStep):
            parts = {"function": step.content(), "deps": list(step.deps)}
        else:
            parts = {"content": step.content()}
        inner = "".join(f"<details><summary>{_e(name)}</summary>{_json_block(value)}</details>" for name, value in parts.items())
        blocks.append(f'<details class="config" data-step="{_e(step.name)}"><summary>{_e(step.name)} ({_e(step.kind)}, '
                      f"fingerprint {_e(fp[:10])})</summary>{inner}</details>")
    section.body = "".join(blocks)
    return section


def curves_section(ctx: ReportContext) -> tuple[Section, str]:
    """The section and the CSS its charts need ('' when there are none)."""
    section = Section("curves", "Curves, fits and forecast bands")
    if ctx.plot is None:
        section.missing.append(ctx.__dict__.get("plot_error") or "nothing to plot yet: no run has logged metrics and no forecast is stored")
        section.body = "<p>No charts yet.</p>"
        return section, ""
    from ladder.views.html import chart_fragment

    css, body = chart_fragment(ctx.plot)
    data = ctx.plot
    section.notes.extend(w for w in data.warnings if not w.startswith("no "))
    # "no stored forecast" is said once, in the forecast section
    section.missing.extend(w for w in data.warnings if w.startswith("no ") and not w.startswith("no stored forecast"))
    section.body = (
        f"<p>{_e(ctx.target)} and the runs its forecast reads; forecast: {_e(data.method or 'none stored')}. "
        f"y: {_e(data.loss_label)}; x: training compute (FLOPs). "
        "Drag across a chart or use the wheel to zoom; double-click resets.</p>"
        + body
    )
    return section, css


def forecast_section(ctx: ReportContext) -> Section:
    section = Section("forecast", f"Forecast of {ctx.target or '(no target)'} against actual")
    if ctx.target is None:
        section.missing.append("the experiment has no training step to forecast")
        return section
    actual = ctx.plot.actual if ctx.plot is not None else None
    target_row = next((r for r in ctx.plan_rows if r.name == ctx.target), None)
    done = target_row is not None and target_row.state == "done"
    last = actual.sort_values("step").iloc[-1] if actual is not None and not actual.empty else None
    planned = ctx.exp.dag[ctx.target].derived.num_steps
    if last is None:
        status = f"{ctx.target} has not logged an eval yet"
        section.missing.append(f"{ctx.target} has no actual curve yet")
    else:
        status = (f"{ctx.target}: {len(actual)} evals, latest at step {int(last['step']):,} of {planned:,} "
                  f"({last['step'] / planned:.1%}), loss {last['loss']:.4f}")
        if not done:
            status += "; its final loss is not known yet"
    residuals = ctx.plot.residuals if ctx.plot is not None else None
    rows = []
    for version, forecast, meta in ctx.forecasts:
        res = residuals[residuals["version"] == version] if residuals is not None and not residuals.empty else None
        inside = (((res["loss"] >= res["lo"]) & (res["loss"] <= res["hi"])).mean() if res is not None and len(res) else None)
        latest = res.sort_values("step").iloc[-1]["residual"] if res is not None and len(res) else None
        final_err = (float(last["loss"]) / forecast.final_loss - 1) if done and last is not None else None
        why = "refit" if meta.get("refit") else (meta.get("fit_step") or meta.get("why") or meta.get("experiment") or "")
        rows.append(
            f'<tr data-version="{version}">' + _cell(f"v{version}", col="version", value=version)
            + _cell(_e(forecast.method), col="method") + _cell(_e(forecast.created_at[:19]), col="created_at")
            + _cell(_num(forecast.final_loss), col="final_loss", value=forecast.final_loss)
            + _cell(_num(forecast.final_loss_lo), col="final_loss_lo", value=forecast.final_loss_lo)
            + _cell(_num(forecast.final_loss_hi), col="final_loss_hi", value=forecast.final_loss_hi)
            + _cell(str(int(forecast.band_terms.get("live_points", 0))), col="live_points")
            + _cell(_pct(latest), col="latest_residual", value=latest)
            + _cell(_num(None if inside is None else 100 * inside, ".0f") + ("%" if inside is not None else ""), col="inside_band", value=inside)
            + _cell(_pct(final_err), col="final_error", value=final_err)
            + _cell(_e(why), col="made_by") + "</tr>"
        )
    if not ctx.forecasts:
        section.missing.append(f"no stored forecast of {ctx.target}; run `ladder forecast {ctx.experiment_ref} {ctx.target}`")
    newest = ctx.forecasts[-1][1] if ctx.forecasts else None
    headline = ""
    if newest is not None:
        headline = (f'<p class="headline" id="forecast-headline">{_e(ctx.target)}: predicted final loss '
                    f"<b>{newest.final_loss:.4f}</b> [{newest.final_loss_lo:.4f}, {newest.final_loss_hi:.4f}] "
                    f"({newest.level:.0%} interval), forecast v{ctx.forecasts[-1][0]} by {_e(newest.method)}; "
                    f"law: <code>{_e(newest.law)}</code></p>")
    section.body = (
        headline + f"<p>{_e(status)}.</p>"
        + _table(["version", "method", "made at (UTC)", "final loss", "95% lo", "95% hi", "live evals used",
                  "latest residual", "actual evals inside band", "final error", "made by"], rows, table_id="forecast-table")
        + "<p>Residual: actual / predicted - 1 at the same step. Final error is shown once the target is done.</p>"
    )
    return section


def backtest_section(ctx: ReportContext) -> Section:
    from forecasting import api
    from ladder.fitting import FitInputError, ladder_runs_for, table_from_steps
    from ladder.views.common import order_runs

    section = Section("backtest", "Backtest errors")
    if ctx.target is None:
        section.missing.append("no target, so no ladder to backtest")
        return section
    notes: list[str] = []
    names = ladder_runs_for(ctx.exp.dag, ctx.target)
    try:
        table = table_from_steps(ctx.exp.dag, ctx.store, names, allow_partial=True, warnings=notes)
    except FitInputError as error:
        section.missing.append(str(error))
        section.body = f"<p>The ladder of {_e(ctx.target)} ({_e(', '.join(names))}) cannot be backtested yet.</p>"
        return section
    report = api.backtest(table)
    rows = []
    for r in report.results:
        rows.append(
            f'<tr data-kind="{_e(r.kind)}">' + _cell(_e(r.kind), col="kind") + _cell(_e(r.method), col="method")
            + _cell(_e(", ".join(r.held_out)), col="held_out")
            + _cell(_pct(r.mean_rel_error), col="mean_rel_error", value=r.mean_rel_error)
            + _cell(_pct(r.rms_rel_error).lstrip("+"), col="rms_rel_error", value=r.rms_rel_error)
            + _cell(_pct(r.max_abs_rel_error).lstrip("+"), col="max_abs_rel_error", value=r.max_abs_rel_error)
            + _cell(_num(r.distance, ".2f"), col="distance", value=r.distance)
            + _cell(_pct(r.rate).lstrip("+"), col="rate", value=r.rate)
            + _cell(str(r.n_points), col="n_points", value=r.n_points)
            + _cell(_e(r.final_run or "-"), col="final_run")
            + _cell(_num(r.final_predicted), col="final_predicted", value=r.final_predicted)
            + _cell(_num(r.final_actual), col="final_actual", value=r.final_actual) + "</tr>"
        )
    runs = [
        f'<tr data-kind="{_e(r.kind)}">' + _cell(_e(r.kind), col="kind") + _cell(_e(h.run), col="run")
        + _cell(_e(h.fitted_on), col="fitted_on") + _cell(_num(h.distance, ".2f"), col="distance", value=h.distance)
        + _cell(_num(h.predicted), col="predicted", value=h.predicted) + _cell(_num(h.actual), col="actual", value=h.actual)
        + _cell(_pct(h.error), col="error", value=h.error)
        + _cell(_pct(h.rms_error).lstrip("+"), col="rms_error", value=h.rms_error)
        + _cell(str(h.n_points), col="n_points", value=h.n_points) + "</tr>"
        for r in report.results for h in r.worst_runs(HELD_OUT_SHOWN)
    ]
    section.notes.extend(notes)
    section.missing.extend(report.warnings)
    if not rows:
        section.missing.append("no backtest could be run on this ladder")
    section.body = (
        f"<p>{_e(report.method)} on {table['run'].nunique()} runs ({_e(', '.join(order_runs(table)))}): "
        "fit the smaller runs (compute) or a curve's prefix (prefix), predict what was held out. Distance: decades of "
        "compute, or ln of the step ratio.</p>"
        + _table(["kind", "method", "held out", "mean error", "rms error", "worst", "distance", "rms error per unit",
                  "points", "largest held out", "predicted", "actual"], rows, table_id="backtest-table")
        + (f"<p>Where those errors came from: each backtest's held-out runs, worst last point first (up to "
           f"{HELD_OUT_SHOWN} per backtest; a run held out by several splits appears once per split).</p>"
           + _table(["kind", "held-out run", "fitted on", "distance", "predicted", "actual", "error at its last point",
                     "rms over its points", "points"], runs, table_id="backtest-runs-table") if runs else "")
    )
    return section


def alerts_section(ctx: ReportContext) -> Section:
    from ladder.alerts import read_alerts, run_alerts

    section = Section("alerts", "Alerts")
    newest = ctx.forecasts[-1][1] if ctx.forecasts else None
    rows, read_from = [], []
    for step in _train_steps(ctx.exp):
        run_dir = _run_dir(ctx, step.name)
        if not ctx.store.exists(f"{run_dir}/spec.json") and not ctx.store.exists(f"{run_dir}/metrics.jsonl"):
            continue
        read_from.append(step.name)
        merged: dict[tuple[str, int], dict] = {}
        for alert in read_alerts(ctx.store.url_of(run_dir)):
            key = (str(alert.get("kind")), int(alert.get("step", -1)))
            merged[key] = {**alert, "source": "alerts.jsonl"}
        for alert in run_alerts(_metrics(ctx, step.name), newest if step.name == ctx.target else None):
            key = alert.key
            merged[key] = {**alert.to_dict(), "source": "alerts.jsonl + metrics" if key in merged else "metrics"}
        for (kind, at), alert in sorted(merged.items(), key=lambda kv: kv[0][1]):
            severity = str(alert.get("severity", "info"))
            rows.append(
                f'<tr data-run="{_e(step.name)}" data-kind="{_e(kind)}">' + _cell(_e(step.name), col="run")
                + _cell(f"{at:,}", col="step", value=at) + _cell(_e(kind), col="kind")
                + _cell(f'<span class="sev {_e(severity)}">{_e(severity)}</span>', col="severity", value=severity)
                + _cell(_e(alert.get("message", "")), col="message") + _cell(_e(alert["source"]), col="source") + "</tr>"
            )
    if not read_from:
        section.missing.append("no run has started, so there is nothing to check")
    intro = (f"<p>{len(rows)} alert(s) in {len(read_from)} run(s) ({_e(', '.join(read_from) or 'none')}): each run's "
             "alerts.jsonl, and the alerts its metrics raise when read again now (band against the newest forecast for "
             f"{_e(ctx.target or 'the target')}, loss and grad-norm spikes, parameter-norm jumps by group).</p>")
    section.body = intro + (_table(["run", "step", "kind", "severity", "message", "source"], rows, table_id="alerts-table")
                            if rows else "<p>No alerts.</p>")
    return section


# ---------------------------------------------------------------- the page


def _guard(build: Callable[[], Section], section_id: str, title: str) -> Section:
    """A section that raised becomes a section that says why; the rest of the page stands."""
    try:
        return build()
    except Exception as error:  # noqa: BLE001 - one broken section must not cost the whole report
        last = traceback.format_exception_only(type(error), error)[-1].strip()
        return Section(section_id, title, "<p>This section could not be built.</p>", [f"error: {last}"])


def build_report(experiment_ref: str, *, root: str | None = None, target: str | None = None) -> str:
    """The report page as one HTML string."""
    from ladder.dag import TrainStep
    from ladder.executor import code_version, plan
    from ladder.loader import load_experiment
    from ladder.views.common import NothingToPlot, PlotInputError
    from ladder.views.plots import experiment_plot_data
    from ladder.store import Store, resolve_root

    exp = load_experiment(experiment_ref)
    store = Store(resolve_root(root))
    if target is not None:
        step = exp.dag.steps.get(target)
        if not isinstance(step, TrainStep):
            names = ", ".join(s.name for s in _train_steps(exp))
            raise ValueError(f"{target!r} is not a training step of {experiment_ref}; choose one of {names}.")
    ctx = ReportContext(experiment_ref=experiment_ref, exp=exp, store=store, target=target or default_target(exp))
    ctx.plan_rows = plan(exp.dag, store)
    try:
        ctx.forecasts = _load_forecasts(ctx)
    except Exception as error:  # noqa: BLE001
        ctx.forecasts = []
        ctx.__dict__["forecast_error"] = str(error)
    if ctx.target is not None:
        try:
            ctx.plot = experiment_plot_data(experiment_ref, ctx.target, store.url)
        except (NothingToPlot, PlotInputError) as error:
            ctx.__dict__["plot_error"] = str(error)
        except Exception as error:  # noqa: BLE001
            ctx.__dict__["plot_error"] = f"the curves could not be read: {error}"

    sections = [
        _guard(lambda: ladder_section(ctx), "ladder", "Ladder"),
        _guard(lambda: mixture_section(ctx), "mixture", "Data mixture"),
        _guard(lambda: configs_section(ctx), "configs", "Configs"),
    ]
    chart_css = ""
    try:
        curves, chart_css = curves_section(ctx)
    except Exception as error:  # noqa: BLE001
        curves = Section("curves", "Curves, fits and forecast bands", "<p>The charts could not be built.</p>", [f"error: {error}"])
    sections += [
        curves,
        _guard(lambda: forecast_section(ctx), "forecast", "Forecast against actual"),
        _guard(lambda: backtest_section(ctx), "backtest", "Backtest errors"),
        _guard(lambda: alerts_section(ctx), "alerts", "Alerts"),
    ]
    if "forecast_error" in ctx.__dict__:
        sections[4].missing.append(f"stored forecasts unreadable: {ctx.__dict__['forecast_error']}")

    nav = "".join(f'<a href="#{s.id}">{_e(s.title)}</a>' for s in sections)
    missing = [(s, line) for s in sections for line in s.missing]
    summary = ("<ul>" + "".join(f'<li><a href="#{s.id}">{_e(s.title)}</a>: {_e(line)}</li>' for s, line in missing) + "</ul>"
               if missing else "<p>Every section is complete.</p>")
    body = "".join(
        f'<section id="{s.id}" data-missing="{len(s.missing)}"><h2>{_e(s.title)}</h2>{_missing(s.missing)}{_notes(s.notes)}{s.body}</section>'
        for s in sections
    )
    name = Path(experiment_ref).stem if experiment_ref.endswith(".py") else experiment_ref.rsplit(".", 1)[-1]
    title = f"{name}: scaling ladder report"
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    about = (exp.module.__doc__ or "").strip()
    about_html = (f'<details id="about"><summary>About this experiment (its docstring)</summary><pre>{_e(about)}</pre></details>'
                  if about else "")
    meta = (f"experiment <code>{_e(experiment_ref)}</code> · store <code>{_e(store.url)}</code> · target "
            f"<b>{_e(ctx.target or '-')}</b> · generated {generated} by ladder {_e(code_version())}")
    return (
        _PAGE.replace("{{TITLE}}", _e(title)).replace("{{CHART_CSS}}", chart_css).replace("{{META}}", meta)
        .replace("{{NAV}}", nav).replace("{{SUMMARY}}", about_html + summary).replace("{{BODY}}", body)
    )


def write_report(experiment_ref: str, out_dir: str, *, root: str | None = None, target: str | None = None) -> Path:
    """Write `out_dir/index.html` (one self-contained file) and return its path."""
    page = build_report(experiment_ref, root=root, target=target)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT_FILE
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path


def report_command(
    experiment: str = typer.Argument(..., help="Experiment file (experiments/foo.py) or module."),
    out: str = typer.Option(..., "--out", "-o", help="Output folder; the page is written as DIR/index.html."),
    root: Optional[str] = typer.Option(None, "--root", help="Artifact root (any fsspec URL); default $LADDER_ROOT or ./ladder-runs."),
    target: Optional[str] = typer.Option(None, "--target", help="Training step to report the forecast of; default: the fit target."),
) -> None:
    """Write a static, self-contained HTML report of an experiment (opens without network)."""
    from ladder.loader import ExperimentError

    try:
        path = write_report(experiment, out, root=root, target=target)
    except (ExperimentError, ValueError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    page = path.read_text(encoding="utf-8")
    missing = page.count('<div class="missing">')
    typer.echo(f"wrote {path} ({len(page.encode()) / 1024:.0f} KiB; {missing} missing piece(s) named in the page)")


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{TITLE}}</title>
<style>
{{CHART_CSS}}
body{font-family:system-ui,Arial,sans-serif;margin:0;color:#222;background:#fafafa;font-size:14px}
header{background:#2d2346;color:#fff;padding:14px 20px} header h1{font-size:22px;margin:0 0 4px 0}
header .meta{font-size:12px;color:#ddd} header code{color:#fff}
nav{position:sticky;top:0;background:#fff;border-bottom:1px solid #ddd;padding:6px 20px;z-index:5}
nav a{margin-right:14px;color:#4a2d8a;text-decoration:none;font-size:13px}
main{padding:8px 20px 40px 20px;max-width:1500px}
section{background:#fff;border:1px solid #e2e2e2;border-radius:6px;padding:8px 14px;margin:12px 0}
h2{font-size:18px;margin:6px 0 8px 0}
table{border-collapse:collapse;font-size:12px;margin:6px 0;width:100%}
th,td{border-bottom:1px solid #eee;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f0f8;position:sticky;top:30px}
td[data-value]{font-variant-numeric:tabular-nums}
td code{font-size:11px;word-break:break-all}
.state{padding:1px 6px;border-radius:8px;font-size:11px;color:#fff;background:#888}
.state.done{background:#2e7d32}.state.running{background:#0277bd}.state.failed{background:#c62828}
.state.pending{background:#b8860b}.state.blocked{background:#8e24aa}
.sev.critical{color:#c62828;font-weight:600}.sev.warning{color:#b8860b}.sev.info{color:#0277bd}
.missing{background:#fff6e0;border-left:3px solid #e0a800;padding:3px 8px;margin:4px 0;font-size:12px}
.note{background:#eef4fb;border-left:3px solid #6a8cc7;padding:3px 8px;margin:4px 0;font-size:12px}
.headline{font-size:15px} details{margin:4px 0} summary{cursor:pointer}
pre{background:#f6f6f6;padding:6px;font-size:11px;overflow:auto;max-height:420px;margin:2px 0}
#summary ul{margin:4px 0}
</style></head><body>
<header><h1>{{TITLE}}</h1><div class="meta">{{META}}</div></header>
<nav>{{NAV}}</nav>
<main>
<section id="summary"><h2>Overview and what is missing</h2>{{SUMMARY}}</section>
{{BODY}}
</main>
</body></html>
"""
