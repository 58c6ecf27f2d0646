// The live page of `ladder serve`: one snapshot (/api/state), then deltas as server-sent events (/api/events).
// Charts are inline SVG drawn here (no library, nothing fetched from elsewhere). ladder/views/serve.py says why.
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token");
const MAX_TRAIN = 4000; // train-loss (and per-host) points kept per run; beyond, every other one is dropped (the server thins alike)
// the views' colours (ladder/views/common.py) arrive with the snapshot; these are used until then
let COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#8c564b", "#e377c2", "#17becf", "#bcbd22"];
let BAND = "#6a3d9a", FIRST = "#999999";
const SVG = "http://www.w3.org/2000/svg";

const S = { seq: 0, experiment: "", root: "", targets: [], rungs: [], steps: [], runs: {}, forecasts: {}, curves: {},
            fits: { curves: {}, law: null }, alerts: new Map(), target: null, version: null, fresh: new Set() };
let source = null, renderPending = false;

function api(path) {
  if (!TOKEN) return path;
  return path + (path.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(TOKEN);
}

function fmt(v, digits = 4) {
  if (v === null || v === undefined || !isFinite(v)) return "-";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(2).replace("e+", "e");
  return Number(v.toFixed(digits)).toString();
}

function si(v) {
  if (v === null || v === undefined || !isFinite(v)) return "-";
  for (const [s, k] of [["T", 1e12], ["B", 1e9], ["M", 1e6], ["K", 1e3]]) if (Math.abs(v) >= k) return (v / k).toPrecision(3) + s;
  return v.toPrecision(3);
}

function el(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function sv(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// ------------------------------------------------------------------ state

function keyOf(a) { return `${a.run}|${a.kind}|${a.step}`; }

function loadSnapshot(snap) {
  Object.assign(S, { seq: snap.seq, experiment: snap.experiment, root: snap.root, targets: snap.targets, rungs: snap.rungs,
                     steps: snap.steps, runs: snap.runs, fits: snap.fits, forecasts: {}, curves: {} });
  if (snap.colors) ({ rungs: COLORS, band: BAND, first: FIRST } = snap.colors);
  S.alerts = new Map();
  for (const a of snap.alerts) S.alerts.set(keyOf(a), a);
  for (const [t, entries] of Object.entries(snap.forecasts)) addVersions(t, entries);
  if (!S.target || !S.targets.includes(S.target)) S.target = S.targets[0] || null;
}

function addVersions(target, entries) {
  const list = S.forecasts[target] || (S.forecasts[target] = []);
  const curves = S.curves[target] || (S.curves[target] = {});
  for (const e of entries) {
    if (e.curve) curves[e.version] = e.curve;
    const meta = Object.assign({}, e);
    delete meta.curve;
    const at = list.findIndex((x) => x.version === e.version);
    if (at >= 0) list[at] = meta; else list.push(meta);
  }
  list.sort((a, b) => a.version - b.version);
}

function thin(points) {
  while (points.length > MAX_TRAIN) {
    const last = points[points.length - 1];
    points = points.filter((_, i) => i % 2 === 0);
    if (points[points.length - 1] !== last) points.push(last);
  }
  return points;
}

function applyDelta(d) {
  if (d.seq <= S.seq) return;
  if (d.forecasts) for (const [t, entries] of Object.entries(d.forecasts)) addVersions(t, entries);
  if (d.runs) {
    for (const [name, r] of Object.entries(d.runs)) {
      if (r.replace) {  // a catch-up (a long pause, or the first read of a long run): the run whole, thinned
        S.runs[name] = r.replace;
        for (const a of r.alerts) { S.alerts.set(keyOf(a), a); S.fresh.add(keyOf(a)); }
        continue;
      }
      const run = S.runs[name] || (S.runs[name] = { evals: [], train: [], hosts: {}, summary: {} });
      run.started = true;
      if (r.truncate !== undefined) {
        const keep = (p) => p[0] <= r.truncate;
        run.evals = run.evals.filter(keep);
        run.train = run.train.filter(keep);
        for (const h of Object.keys(run.hosts)) run.hosts[h] = run.hosts[h].filter(keep);
      }
      run.evals.push(...r.evals);
      run.train = thin(run.train.concat(r.train));
      for (const [h, pts] of Object.entries(r.hosts)) run.hosts[h] = thin((run.hosts[h] || []).concat(pts));
      run.summary = r.summary;
      for (const a of r.alerts) { S.alerts.set(keyOf(a), a); S.fresh.add(keyOf(a)); }
    }
  }
  if (d.steps) S.steps = d.steps;
  if (d.fits) S.fits = d.fits;
  S.seq = d.seq;
}

async function refresh() {
  const response = await fetch(api("api/state"), { cache: "no-store" });
  if (!response.ok) throw new Error(`api/state: HTTP ${response.status}`);
  loadSnapshot(await response.json());
  scheduleRender();
}

function connect() {
  if (source) source.close();
  source = new EventSource(api(`api/events?since=${S.seq}`));
  source.addEventListener("open", () => setConn("live", "live"));
  source.addEventListener("delta", (event) => { applyDelta(JSON.parse(event.data)); scheduleRender(); });
  source.addEventListener("reset", () => { source.close(); source = null; refresh().then(connect, retry); });
  source.addEventListener("error", () => { if (source) source.close(); source = null; retry(); });
}

function retry() {
  setConn("lost", "reconnecting");
  setTimeout(() => refresh().then(connect, retry), 2000);
}

function setConn(cls, text) {
  const node = document.getElementById("conn");
  node.className = "conn " + cls;
  node.textContent = text;
}

async function versionCurve(target, version) {
  const curves = S.curves[target] || (S.curves[target] = {});
  if (curves[version]) return curves[version];
  const response = await fetch(api(`api/forecast/${encodeURIComponent(target)}/${version}`), { cache: "no-store" });
  if (!response.ok) return null;
  const entry = await response.json();
  curves[version] = entry.curve;
  return entry.curve;
}

// ------------------------------------------------------------------ charts

function niceTicks(lo, hi, count) {
  const span = hi - lo;
  if (!(span > 0)) return [lo];
  const raw = span / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => span / s <= count) || 10 * mag;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  return out;
}

function logTicks(lo, hi) {
  const a = Math.floor(Math.log10(lo)), b = Math.ceil(Math.log10(hi));
  if (b - a >= 2) {
    const every = Math.max(1, Math.ceil((b - a) / 7));
    const out = [];
    for (let e = a; e <= b; e += every) { const v = Math.pow(10, e); if (v >= lo && v <= hi) out.push(v); }
    if (out.length >= 2) return out;
  }
  return niceTicks(lo, hi, 5).filter((v) => v > 0);
}

// spec: {xlog, xlabel, ylabel, xrange?: [lo, hi], yfrom?: series names for the y range, series: [...]}
// series kinds: line {pts: [[x, y]]}, points {pts}, band {pts: [[x, lo, hi]]}, errorbar {pts: [[x, y, lo, hi]]}
function drawChart(container, spec) {
  container.textContent = "";
  const width = container.clientWidth || 900, height = container.clientHeight || 320;
  const m = { l: 64, r: 16, t: 10, b: 40 };
  const svg = sv("svg", { viewBox: `0 0 ${width} ${height}`, role: "img" });
  container.appendChild(svg);
  const ok = (x) => x !== null && x !== undefined && isFinite(x) && (!spec.xlog || x > 0);
  const xs = [];
  for (const s of spec.series) for (const p of s.pts) if (ok(p[0])) xs.push(p[0]);
  if (!xs.length) {
    svg.appendChild(sv("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, spec.empty || "nothing to draw yet"));
    container.dataset.drawn = "0";
    return 0;
  }
  let [x0, x1] = spec.xrange || [Math.min(...xs), Math.max(...xs)];
  if (x0 === x1) { x0 = spec.xlog ? x0 / 2 : x0 - 1; x1 = spec.xlog ? x1 * 2 : x1 + 1; }
  const ys = [];
  for (const s of spec.series) {
    if (spec.yfrom && !spec.yfrom.includes(s.name)) continue;
    for (const p of s.pts) {
      if (!ok(p[0]) || p[0] < x0 || p[0] > x1) continue;
      for (const v of s.kind === "line" || s.kind === "points" ? [p[1]] : p.slice(1)) if (v !== null && isFinite(v)) ys.push(v);
    }
  }
  if (!ys.length) for (const s of spec.series) for (const p of s.pts) for (const v of p.slice(1)) if (v !== null && isFinite(v)) ys.push(v);
  let [y0, y1] = spec.yrange || [Math.min(...ys), Math.max(...ys)];
  const pad = (y1 - y0) * 0.06 || Math.abs(y1) * 0.01 || 0.1;
  y0 -= pad; y1 += pad;
  const lx0 = spec.xlog ? Math.log10(x0) : x0, lx1 = spec.xlog ? Math.log10(x1) : x1;
  const X = (x) => m.l + ((spec.xlog ? Math.log10(x) : x) - lx0) / (lx1 - lx0 || 1) * (width - m.l - m.r);
  const Y = (y) => height - m.b - (y - y0) / (y1 - y0) * (height - m.t - m.b);
  const clipId = "clip-" + container.id;
  const defs = sv("defs");
  const clip = sv("clipPath", { id: clipId });
  clip.appendChild(sv("rect", { x: m.l, y: m.t, width: width - m.l - m.r, height: height - m.t - m.b }));
  defs.appendChild(clip);
  svg.appendChild(defs);
  const xt = spec.xlog ? logTicks(x0, x1) : niceTicks(x0, x1, Math.max(3, Math.floor((width - m.l - m.r) / 110)));
  const yt = niceTicks(y0, y1, Math.max(3, Math.floor((height - m.t - m.b) / 45)));
  for (const v of xt) {
    svg.appendChild(sv("line", { x1: X(v), x2: X(v), y1: m.t, y2: height - m.b, class: "grid" }));
    svg.appendChild(sv("text", { x: X(v), y: height - m.b + 14, "text-anchor": "middle" }, (spec.xfmt || fmt)(v)));
  }
  for (const v of yt) {
    svg.appendChild(sv("line", { x1: m.l, x2: width - m.r, y1: Y(v), y2: Y(v), class: "grid" }));
    svg.appendChild(sv("text", { x: m.l - 5, y: Y(v) + 4, "text-anchor": "end" }, fmt(v)));
  }
  svg.appendChild(sv("line", { x1: m.l, x2: width - m.r, y1: height - m.b, y2: height - m.b, class: "axis" }));
  svg.appendChild(sv("line", { x1: m.l, x2: m.l, y1: m.t, y2: height - m.b, class: "axis" }));
  svg.appendChild(sv("text", { x: (m.l + width - m.r) / 2, y: height - 6, "text-anchor": "middle" }, spec.xlabel || ""));
  svg.appendChild(sv("text", { x: 12, y: (m.t + height - m.b) / 2, "text-anchor": "middle",
                               transform: `rotate(-90 12 ${(m.t + height - m.b) / 2})` }, spec.ylabel || ""));
  const plot = sv("g", { "clip-path": `url(#${clipId})` });
  svg.appendChild(plot);
  let drawn = 0;
  for (const s of spec.series) {
    const pts = s.pts.filter((p) => ok(p[0]) && p[1] !== null && isFinite(p[1]));
    if (!pts.length) continue;
    const g = sv("g", { "data-series": s.name });
    if (s.kind === "band") {
      const upper = pts.filter((p) => p[2] !== null).map((p) => `${X(p[0]).toFixed(1)},${Y(p[2]).toFixed(1)}`);
      const lower = pts.filter((p) => p[1] !== null).reverse().map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`);
      g.appendChild(sv("polygon", { points: upper.concat(lower).join(" "), fill: s.color, "fill-opacity": s.opacity || 0.16, stroke: "none" }));
    } else if (s.kind === "line") {
      const d = pts.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
      const attrs = { d, fill: "none", stroke: s.color, "stroke-width": s.width || 1.5, "stroke-opacity": s.alpha || 1 };
      if (s.dash) attrs["stroke-dasharray"] = s.dash;
      g.appendChild(sv("path", attrs));
    } else if (s.kind === "points") {
      const d = pts.map((p) => `M${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}h0`).join("");
      g.appendChild(sv("path", { d, stroke: s.color, "stroke-width": 2 * (s.r || 3), "stroke-linecap": "round", fill: "none" }));
    } else if (s.kind === "errorbar") {
      for (const p of pts) {
        g.appendChild(sv("line", { x1: X(p[0]), x2: X(p[0]), y1: Y(p[2]), y2: Y(p[3]), stroke: s.color, "stroke-width": 1.5 }));
        g.appendChild(sv("circle", { cx: X(p[0]), cy: Y(p[1]), r: 4, fill: s.color }));
      }
    }
    g.dataset.count = String(pts.length);
    s.inFrame = pts.filter((p) => p[0] >= x0 && p[0] <= x1 && (s.kind === "band" || s.kind === "errorbar"
      ? p[p.length - 1] >= y0 && p[p.length - 2] <= y1 : p[1] >= y0 && p[1] <= y1)).length;
    drawn += pts.length;
    plot.appendChild(g);
  }
  container.dataset.drawn = String(drawn);
  return drawn;
}

function legend(container, series) {
  container.textContent = "";
  for (const s of series) {
    if (!s.pts.length || !s.label) continue;
    const item = el("span");
    const swatch = el("span", { class: "swatch" });
    swatch.style.background = s.color;
    if (s.kind === "band") swatch.style.opacity = "0.5";
    item.appendChild(swatch);
    item.appendChild(document.createTextNode(s.inFrame === 0 ? `${s.label} (outside the frame)` : s.label));
    container.appendChild(item);
  }
}

// ------------------------------------------------------------------ panels

function renderSteps() {
  const body = document.querySelector("#steps tbody");
  body.textContent = "";
  for (const s of S.steps) {
    const tr = el("tr", { "data-step": s.name, "data-state": s.state });
    tr.appendChild(el("td", {}, s.name));
    tr.appendChild(el("td", {}, s.role));
    tr.appendChild(el("td", { class: `state state-${s.state}`, title: s.detail || "" }, s.state));
    const progress = el("td");
    if (s.progress !== null && s.progress !== undefined) {
      const bar = el("span", { class: "bar" });
      const fill = el("span");
      fill.style.width = `${(100 * s.progress).toFixed(1)}%`;
      bar.appendChild(fill);
      progress.appendChild(bar);
      progress.appendChild(document.createTextNode(`${(100 * s.progress).toFixed(1)}% (${s.step}/${s.num_steps})`));
    } else if (s.step !== null && s.step !== undefined) {
      progress.textContent = `step ${s.step}`;
    }
    tr.appendChild(progress);
    tr.appendChild(el("td", { class: "num" }, fmt(s.train_loss)));
    tr.appendChild(el("td", { class: "num" }, s.eval_loss !== null && s.eval_loss !== undefined ? `${fmt(s.eval_loss)} @ ${s.eval_step}` : "-"));
    tr.appendChild(el("td", { class: "num" }, s.tokens ? `${si(s.tokens)} / ${si(s.planned_tokens)}` : "-"));
    tr.appendChild(el("td", { class: "num" }, si(s.tokens_per_second)));
    tr.appendChild(el("td", {}, s.source || ""));
    body.appendChild(tr);
  }
}

function bandSigma(actual, band) {
  // sigmas between `actual` and band = (loss, lo, hi), the band read as +-1.96 sigma in log space on the actual's side
  // (ladder.alerts.band_sigma); null for a band of zero width
  const err = Math.log(actual / band[0]);
  const half = (err >= 0 ? Math.log(Math.max(band[2], band[0]) / band[0])
                         : Math.log(band[0] / Math.min(Math.max(band[1], 1e-300), band[0]))) / 1.959963984540054;
  return err === 0 ? 0 : (half > 0 ? err / half : null);
}

function bandAt(curve, step) {
  // (loss, lo, hi) at `step`, interpolated in log(step) as Forecast.band_at does
  if (!curve || !curve.length) return null;
  const x = Math.log(Math.max(step, 1));
  const sx = curve.map((p) => Math.log(Math.max(p[0], 1)));
  if (x <= sx[0]) return [curve[0][3], curve[0][4], curve[0][5]];
  for (let i = 1; i < curve.length; i++) {
    if (x <= sx[i]) {
      const w = (x - sx[i - 1]) / (sx[i] - sx[i - 1] || 1);
      return [3, 4, 5].map((k) => curve[i - 1][k] + w * (curve[i][k] - curve[i - 1][k]));
    }
  }
  const last = curve[curve.length - 1];
  return [last[3], last[4], last[5]];
}

function renderTargetControls() {
  const tsel = document.getElementById("target-select");
  if (tsel.options.length !== S.targets.length) {
    tsel.textContent = "";
    for (const t of S.targets) tsel.appendChild(el("option", { value: t }, t));
  }
  tsel.value = S.target || "";
  const vsel = document.getElementById("version-select");
  const versions = S.forecasts[S.target] || [];
  const want = ["newest", ...versions.map((v) => String(v.version))];
  const have = Array.from(vsel.options).map((o) => o.value);
  if (want.join() !== have.join()) {
    vsel.textContent = "";
    vsel.appendChild(el("option", { value: "newest" }, versions.length ? `newest (v${versions[versions.length - 1].version})` : "none stored"));
    for (const v of versions) vsel.appendChild(el("option", { value: String(v.version) }, `v${v.version} ${v.method}`));
  }
  vsel.value = S.version === null ? "newest" : String(S.version);
}

async function renderTarget() {
  renderTargetControls();
  const chart = document.getElementById("chart-target");
  const target = S.target;
  const run = (target && S.runs[target]) || { evals: [], train: [], summary: {} };
  const versions = S.forecasts[target] || [];
  const version = S.version !== null ? S.version : versions.length ? versions[versions.length - 1].version : null;
  const curve = version !== null ? await versionCurve(target, version) : null;
  const first = versions.length > 1 && version !== versions[0].version && document.getElementById("show-first").checked
    ? await versionCurve(target, versions[0].version) : null;
  const entry = versions.find((v) => v.version === version);
  const logx = document.getElementById("logx").checked;
  const evals = run.evals.map((p) => [p[0], p[3]]);
  const series = [];
  if (first) series.push({ name: "first", kind: "line", color: FIRST, dash: "5,4", pts: first.map((p) => [p[0], p[3]]),
                           label: `forecast v${versions[0].version} (first)` });
  if (curve && curve.length > 1) {
    series.push({ name: "band", kind: "band", color: BAND, pts: curve.map((p) => [p[0], p[4], p[5]]), label: `${Math.round(100 * (entry ? entry.level : 0.95))}% band` });
    series.push({ name: "forecast", kind: "line", color: BAND, pts: curve.map((p) => [p[0], p[3]]), label: `forecast v${version} (${entry ? entry.method : ""})` });
  } else if (curve && curve.length === 1) {
    const p = curve[0];
    series.push({ name: "forecast", kind: "errorbar", color: BAND, pts: [[p[0], p[3], p[4], p[5]]], label: `final loss v${version}, interval` });
  }
  series.push({ name: "train", kind: "line", color: "#bbbbbb", width: 1, pts: run.train, label: "train loss" });
  series.push({ name: "evals", kind: "points", color: "#000000", r: 2.5, pts: evals, label: "eval loss (actual)" });
  const planned = run.summary && run.summary.num_steps;
  const lastBand = curve && curve.length ? curve[curve.length - 1][0] : null;
  const end = Math.max(planned || 0, lastBand || 0, ...evals.map((p) => p[0]));
  const start = logx ? Math.max(1, Math.min(...[...evals.map((p) => p[0]), ...(curve || []).map((p) => p[0]), end / 1000].filter((v) => v > 0))) : 0;
  // the y range follows the evals and the band where the evals are (before the first eval: the band's later part),
  // so an early extrapolation of the law does not squash the part that matters; the clip path cuts the rest
  const fromStep = evals.length ? evals[0][0] * 0.8 : end * 0.3;
  const ys = [];
  for (const s of series) {
    if (s.name === "train" || s.name === "first") continue;
    for (const p of s.pts) if (p[0] >= fromStep) for (const v of s.kind === "points" || s.kind === "line" ? [p[1]] : p.slice(1)) if (v !== null && isFinite(v)) ys.push(v);
  }
  const drawn = drawChart(chart, { xlog: logx, xlabel: "step (band drawn to the run's last step)", ylabel: "loss",
                                   xrange: end > 0 ? [start, end * 1.02] : undefined, yrange: ys.length ? [Math.min(...ys), Math.max(...ys)] : undefined,
                                   series, empty: "no eval and no forecast yet" });
  chart.dataset.evals = String(evals.length);
  chart.dataset.version = version === null ? "" : String(version);
  chart.dataset.bandEnd = lastBand === null ? "" : String(lastBand);
  legend(document.getElementById("legend-target"), series);
  const summary = document.getElementById("target-summary");
  const s = run.summary || {};
  const parts = [];
  if (s.step !== null && s.step !== undefined) parts.push(`step ${s.step}${planned ? ` of ${planned} (${(100 * s.step / planned).toFixed(1)}%)` : ""}`);
  if (evals.length) {
    const [step, loss] = evals[evals.length - 1];
    let line = `last eval ${fmt(loss)} at step ${step}`;
    const band = curve ? bandAt(curve, step) : null;
    if (band && curve.length > 1) {
      const z = bandSigma(loss, band);
      line += `, predicted ${fmt(band[0])} [${fmt(band[1])}, ${fmt(band[2])}]` + (z === null ? " (band has zero width)" : ` (${z >= 0 ? "+" : ""}${z.toFixed(2)} sigma)`);
    }
    parts.push(line);
  } else {
    parts.push("no eval yet");
  }
  if (entry) parts.push(`v${entry.version} ${entry.method} predicts final ${fmt(entry.final_loss)} [${fmt(entry.final_loss_lo)}, ${fmt(entry.final_loss_hi)}]` +
                        (entry.live_step ? `, refit on the live run to step ${entry.live_step}` : ""));
  else parts.push("no forecast stored for this target");
  summary.textContent = parts.join("; ");
  return drawn;
}

function renderHistory() {
  const versions = S.forecasts[S.target] || [];
  drawChart(document.getElementById("chart-history"), {
    xlog: false, xlabel: "forecast version (refits are new versions)", ylabel: "predicted final loss", xfmt: (v) => Number.isInteger(v) ? `v${v}` : "",
    xrange: versions.length ? [versions[0].version - 0.5, versions[versions.length - 1].version + 0.5] : undefined,
    series: [{ name: "history", kind: "errorbar", color: BAND, pts: versions.map((v) => [v.version, v.final_loss, v.final_loss_lo, v.final_loss_hi]) }],
    empty: "no stored forecast",
  });
  const body = document.querySelector("#history-table tbody");
  body.textContent = "";
  for (const v of versions.slice().reverse()) {
    const tr = el("tr", { "data-version": String(v.version) });
    tr.appendChild(el("td", {}, `v${v.version}`));
    tr.appendChild(el("td", {}, v.method));
    tr.appendChild(el("td", {}, (v.created_at || "").slice(0, 19).replace("T", " ")));
    tr.appendChild(el("td", { class: "num" }, fmt(v.final_loss)));
    tr.appendChild(el("td", { class: "num" }, `[${fmt(v.final_loss_lo)}, ${fmt(v.final_loss_hi)}]`));
    tr.appendChild(el("td", { class: "num" }, v.live_points ? `${v.live_points}${v.live_step ? ` (to step ${v.live_step})` : ""}` : "-"));
    body.appendChild(tr);
  }
}

function renderRungs() {
  const series = [];
  S.rungs.forEach((name, i) => {
    const run = S.runs[name];
    if (!run) return;
    const color = COLORS[i % COLORS.length];
    series.push({ name: `rung-${name}`, kind: "points", color, r: 3, pts: run.evals.map((p) => [p[2], p[3]]), label: `rung ${name}` });
    const fit = (S.fits.curves || {})[name];
    if (fit) series.push({ name: `fit-${name}`, kind: "line", color, width: 1.2, alpha: 0.8, pts: fit, label: `fitted law (${name})` });
  });
  const fitL = (S.fits.curves || {})["L(C)"];
  if (fitL) series.push({ name: "fit-L(C)", kind: "line", color: "#555555", pts: fitL, label: "fitted L(C)" });
  drawChart(document.getElementById("chart-rungs"), { xlog: true, xlabel: "training compute (FLOPs)", ylabel: "eval loss", series,
                                                      empty: "no rung has logged an eval yet" });
  legend(document.getElementById("legend-rungs"), series);
  document.getElementById("fit-law").textContent = S.fits.law ? `law: ${S.fits.law}` : "";
}

function renderAlerts() {
  const list = document.getElementById("alert-list");
  list.textContent = "";
  const alerts = Array.from(S.alerts.values()).sort((a, b) => (b.time || 0) - (a.time || 0) || (b.step || 0) - (a.step || 0));
  if (!alerts.length) list.appendChild(el("li", { class: "none" }, "no alerts"));
  for (const a of alerts.slice(0, 200)) {
    const key = keyOf(a);
    const li = el("li", { class: `alert sev-${a.severity || "info"}${S.fresh.has(key) ? " fresh" : ""}`, "data-key": key });
    li.appendChild(el("span", { class: "meta" }, `${a.severity || ""} · ${a.run} · ${a.kind} @ step ${a.step}`));
    li.appendChild(el("span", { class: "message" }, a.message || ""));
    li.appendChild(el("span", { class: "meta" }, ` (${a.source})`));
    list.appendChild(li);
  }
  S.fresh.clear();
}

function renderHosts() {
  const box = document.getElementById("host-charts");
  box.textContent = "";
  let any = false;
  for (const [name, run] of Object.entries(S.runs)) {
    const hosts = Object.keys(run.hosts || {}).sort((a, b) => Number(a) - Number(b));
    if (!hosts.length) continue;
    any = true;
    const block = el("div", { class: "host-block", "data-run": name });
    block.appendChild(el("h3", {}, name));
    const chart = el("div", { class: "chart small", id: `chart-hosts-${name.replace(/[^A-Za-z0-9_-]/g, "_")}` });
    block.appendChild(chart);
    const table = el("table");
    const head = el("tr");
    for (const h of ["host", "tokens/s (latest)", "vs median"]) head.appendChild(el("th", {}, h));
    table.appendChild(head);
    const latest = hosts.map((h) => run.hosts[h][run.hosts[h].length - 1][1]);
    const median = latest.slice().sort((a, b) => a - b)[Math.floor(latest.length / 2)];
    hosts.forEach((h, i) => {
      const tr = el("tr", { "data-host": h });
      tr.appendChild(el("td", {}, `host ${h}`));
      tr.appendChild(el("td", { class: "num" }, si(latest[i])));
      const rel = median ? latest[i] / median - 1 : 0;
      tr.appendChild(el("td", { class: `num${rel < -0.1 ? " slow" : ""}` }, `${rel >= 0 ? "+" : ""}${(100 * rel).toFixed(1)}%`));
      table.appendChild(tr);
    });
    block.appendChild(table);
    box.appendChild(block);
    drawChart(chart, { xlog: false, xlabel: "step", ylabel: "tokens/s", series: hosts.map((h, i) => ({
      name: `host${h}`, kind: "line", color: COLORS[i % COLORS.length], pts: run.hosts[h], label: `host ${h}` })) });
  }
  document.getElementById("hosts").hidden = !any;
}

async function render() {
  renderPending = false;
  const started = performance.now();
  document.getElementById("title").textContent = `ladder serve: ${S.experiment}`;
  document.getElementById("root").textContent = S.root;
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()} (seq ${S.seq})`;
  renderSteps();
  renderHistory();
  renderRungs();
  renderAlerts();
  renderHosts();
  await renderTarget();
  document.body.dataset.seq = String(S.seq);
  document.body.dataset.renderMs = (performance.now() - started).toFixed(1);  // read by bench/bench_serve.py
  if (!document.body.dataset.ready) document.body.dataset.readyAt = performance.now().toFixed(1);  // ms since navigation
  document.body.dataset.ready = "1";
}

function scheduleRender() {
  if (renderPending) return;
  renderPending = true;
  requestAnimationFrame(() => { render().catch(fail); });
}

function fail(error) {
  setConn("lost", `error: ${error.message || error}`);
  throw error;
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("target-select").addEventListener("change", (e) => { S.target = e.target.value; S.version = null; scheduleRender(); });
  document.getElementById("version-select").addEventListener("change", (e) => {
    S.version = e.target.value === "newest" ? null : Number(e.target.value);
    scheduleRender();
  });
  document.getElementById("logx").addEventListener("change", scheduleRender);
  document.getElementById("show-first").addEventListener("change", scheduleRender);
  window.addEventListener("resize", scheduleRender);
  refresh().then(connect, retry);
});
