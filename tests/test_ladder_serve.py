"""`ladder serve`: the live page's data (incremental reads, fits, bands, alerts, hosts), the server's rules
(read-only, the token off loopback, no path out of the root) and the page itself in headless chromium.

The browser tests drive Debian's /usr/bin/chromium over the DevTools protocol (websocket-client), with every
non-loopback request sent to a closed loopback proxy port; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import fsspec
import httpx
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from forecasting.forecast import CurvePoint, Forecast, TargetSpec
from ladder.alerts import Alert, append_alerts, band_sigma
from ladder.fitting import store_forecast
from ladder.loader import load_experiment
from ladder.store import Store
from ladder.views.serve import LivePage, Server, bind, serve_command, token_required

CHROMIUM = "/usr/bin/chromium"
REPO = Path(__file__).resolve().parents[1]

EXPERIMENT = textwrap.dedent(
    """
    from ladder import TrainStep, build_ladder
    from trainer.config import ModelConfig, MoEConfig
    from tests.ladder_helpers import tiny_spec


    def rung(name, width, layers, batches):
        model = ModelConfig(hidden_dim=width, num_layers=layers, num_heads=2, seq_len=32,
                            moe=MoEConfig(num_experts=4, top_k=2, expert_dim=width))
        train = tiny_spec().train.model_copy(update={"tokens": 32 * 8 * batches})
        return TrainStep(name=name, spec=tiny_spec(model=model, train=train))


    steps = build_ladder([rung("r32", 32, 2, 20), rung("r48", 48, 2, 30), rung("r64", 64, 3, 40)],
                         hero=rung("hero", 96, 4, 400))
    """
)


def _loss(g: float, flops_full: float, name: str) -> float:
    wobble = 1 + 0.004 * np.sin(7 * g + len(name))
    return float((1.5 + 40.0 * (g * flops_full) ** -0.12 * (1 + 0.1 * (1 - g))) * wobble)


def _eval_line(derived, name: str, step: int, **extra) -> dict:
    tokens = step * derived.tokens_per_step
    flops = 3.0 * tokens * derived.flops_per_token
    return {"step": step, "tokens": tokens, "flops": flops, "eval/loss": _loss(step / derived.num_steps, float(derived.total_flops), name), **extra}


def _append(store: Store, path: str, lines: list[dict] | str) -> None:
    text = lines if isinstance(lines, str) else "".join(json.dumps(line) + "\n" for line in lines)
    store.append_text(path, text)


class Ladder:
    """A store as a live ladder leaves it: three finished rungs, a hero a quarter of the way with two hosts, two
    forecast versions (the ladder's and a refit), one alert in the hero's alerts.jsonl."""

    def __init__(self, root: str, exp_file: Path, rungs: tuple[str, ...] = ("r32", "r48", "r64"), hero: bool = True):
        self.experiment = str(exp_file)
        self.dag = load_experiment(self.experiment).dag
        self.store = Store(root)
        self.root = root
        for name in rungs:
            derived = self.dag[name].derived
            run_dir = self._run_dir(name)
            self.store.write_json(f"{run_dir}/spec.json", {"name": name, "derived": derived.model_dump()})
            steps = sorted({max(1, round(g * derived.num_steps)) for g in np.linspace(0.1, 1.0, 10)})
            _append(self.store, f"{run_dir}/metrics.jsonl", [_eval_line(derived, name, s) for s in steps])
            self.store.acquire_lease(run_dir, "writer")
            self.store.finish(run_dir, "writer", "done")
        run_hero, hero = hero, self.dag["hero"].derived
        self.hero = hero
        self.hero_dir = self._run_dir("hero")
        self.evals = 0
        self.last_step = 0
        if run_hero:
            self.store.write_json(f"{self.hero_dir}/spec.json", {"name": "hero", "derived": hero.model_dump()})
            self.store.acquire_lease(self.hero_dir, "writer")
            self.grow(100)
        target = TargetSpec(name="hero", params_active=float(hero.params_active), tokens=float(hero.tokens),
                            num_steps=hero.num_steps, tokens_per_step=float(hero.tokens_per_step))
        steps = np.unique(np.geomspace(1, hero.num_steps, 40).round().astype(int))
        for method, shift, meta in (("matched_progress", 0.0, {}), ("refit", 0.02, {"live_step": 100})):
            curve = [CurvePoint(step=int(s), loss=_loss(s / hero.num_steps, float(hero.total_flops), "hero") + shift,
                                lo=_loss(s / hero.num_steps, float(hero.total_flops), "hero") + shift - 0.1,
                                hi=_loss(s / hero.num_steps, float(hero.total_flops), "hero") + shift + 0.1) for s in steps]
            store_forecast(self.store, Forecast(
                target=target, method=method, inputs_fingerprint=method, curve=curve, final_loss=curve[-1].loss,
                final_loss_lo=curve[-1].lo, final_loss_hi=curve[-1].hi, law=f"test {method}",
                band_terms={"live_points": 2.0} if method == "refit" else {}), meta=meta)
        if not run_hero:
            return
        append_alerts(self.store.url_of(self.hero_dir),
                      [Alert("param_norm_jump", 60, "warning", "params/norm/total rose 12% between steps 50 and 60; 80% of the rise is the router bias.")])

    def _run_dir(self, name: str) -> str:
        return self.store.run_dir(name, self.dag.fingerprints[name])

    def grow(self, to_step: int, *, eval_every: int = 50) -> int:
        """The hero trains on to `to_step`: a train line every 10 steps (two hosts' throughput), an eval every `eval_every`."""
        lines = []
        for step in range(self.last_step + 10, to_step + 1, 10):
            lines.append({"step": step, "tokens": step * self.hero.tokens_per_step, "train/loss": 5.0 - step / 1000,
                          "throughput/tokens_per_second": 2000.0, "throughput/host0/tokens_per_second": 1000.0,
                          "throughput/host1/tokens_per_second": 700.0 + step / 10})
            if step % eval_every == 0:
                lines.append(_eval_line(self.hero, "hero", step))
                self.evals += 1
        self.last_step = to_step
        _append(self.store, f"{self.hero_dir}/metrics.jsonl", lines)
        return self.evals


def _make(tmp_path: Path, root: str | None = None, **kw) -> Ladder:
    exp_file = tmp_path / "tiny_ladder.py"
    exp_file.write_text(EXPERIMENT)
    return Ladder(root or str(tmp_path / "store"), exp_file, **kw)


def _tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(path)).encode() + b"\0" + file.read_bytes())
    return h.hexdigest()


# ---------------------------------------------------------------- the page's data


def test_snapshot_holds_the_table_fits_band_history_alerts_and_hosts(tmp_path):
    ladder = _make(tmp_path)
    page = LivePage(ladder.experiment, ladder.root)
    page.poll()
    snap = json.loads(json.dumps(page.snapshot(), allow_nan=False))  # what the browser receives: strict JSON
    states = {s["name"]: (s["state"], s["role"]) for s in snap["steps"]}
    assert states == {"r32": ("done", "rung"), "r48": ("done", "rung"), "r64": ("done", "rung"),
                      "fit": ("pending", "fit"), "hero": ("running", "target")}
    hero_row = next(s for s in snap["steps"] if s["name"] == "hero")
    assert hero_row["step"] == 100 and hero_row["num_steps"] == ladder.hero.num_steps
    assert hero_row["progress"] == pytest.approx(100 / ladder.hero.num_steps)
    assert snap["targets"] == ["hero"] and snap["rungs"] == ["r32", "r48", "r64"]
    assert sorted(snap["fits"]["curves"]) == ["r32", "r48", "r64"] and snap["fits"]["law"]
    hero = snap["runs"]["hero"]
    assert [p[0] for p in hero["evals"]] == [50, 100]
    assert len(hero["train"]) == 10 and sorted(hero["hosts"]) == ["0", "1"] and hero["hosts"]["1"][-1] == [100, 710.0]
    versions = snap["forecasts"]["hero"]
    assert [(v["version"], v["method"]) for v in versions] == [(1, "matched_progress"), (2, "refit")]
    assert "curve" not in versions[0] and versions[1]["live_step"] == 100
    # the newest band runs ahead of the run to its last step; a refit's band starts at the hero's first eval
    assert versions[1]["curve"][-1][0] == ladder.hero.num_steps and versions[1]["curve"][0][0] >= 50
    assert page.forecast_version("hero", 1)["curve"][0][0] == 1
    assert [(a["kind"], a["step"], a["source"]) for a in snap["alerts"]] == [("param_norm_jump", 60, "alerts.jsonl")]
    assert "router bias" in snap["alerts"][0]["message"]


def test_each_poll_reads_only_what_was_appended(tmp_path):
    ladder = _make(tmp_path)
    page = LivePage(ladder.experiment, ladder.root)
    page.poll()
    hero = page.feeds["hero"]
    size = os.path.getsize(f"{ladder.hero_dir}/metrics.jsonl")
    assert hero.offset == size
    assert page.poll() is None  # nothing new (a heartbeat's age aside): no delta, and the browser is not woken
    ladder.grow(200)
    # a writer caught mid-line: the torn line waits for its newline
    _append(ladder.store, f"{ladder.hero_dir}/metrics.jsonl", '{"step": 210, "eval/lo')
    delta = page.poll()
    assert [p[0] for p in delta["runs"]["hero"]["evals"]] == [150, 200]
    assert [p[0] for p in delta["runs"]["hero"]["train"]] == list(range(110, 201, 10))
    assert hero.offset == size + (os.path.getsize(f"{ladder.hero_dir}/metrics.jsonl") - size - len('{"step": 210, "eval/lo'))
    _append(ladder.store, f"{ladder.hero_dir}/metrics.jsonl", 'ss": 3.0}\n')
    assert [p[0] for p in page.poll()["runs"]["hero"]["evals"]] == [210]
    # a resume marker: the attempt after step 150 was rolled back; the page forgets it, the delta says so
    _append(ladder.store, f"{ladder.hero_dir}/metrics.jsonl", [{"event": "resume", "step": 150}, _eval_line(ladder.hero, "hero", 200)])
    delta = page.poll()["runs"]["hero"]
    assert delta["truncate"] == 150 and [p[0] for p in delta["evals"]] == [200]
    assert [p[0] for p in hero.evals] == [50, 100, 150, 200] and max(hero.train_steps) == 150
    # what a reconnecting browser missed, in order; too old a cursor asks for a reload
    assert [d["seq"] for d in page.deltas_since(page.seq - 2)] == [page.seq - 1, page.seq]
    assert page.deltas_since(page.seq) == []


def test_a_long_catch_up_sends_the_run_whole_and_thinned(tmp_path):
    ladder = _make(tmp_path)
    page = LivePage(ladder.experiment, ladder.root)
    page.poll()
    evals = ladder.grow(60_100, eval_every=1000)  # 6,000 train lines at once: the server was paused, or a browser slept
    delta = page.poll()["runs"]["hero"]
    assert set(delta) == {"replace", "alerts", "summary"}
    run = delta["replace"]
    assert len(run["evals"]) == evals and len(page.feeds["hero"].train_steps) == 6010
    assert len(run["train"]) <= 2001 and run["train"][-1] == [60_100, 5.0 - 60_100 / 1000]
    assert len(run["hosts"]["1"]) <= 2001 and run["summary"]["step"] == 60_100


def test_new_forecast_versions_and_alerts_arrive_as_deltas(tmp_path):
    ladder = _make(tmp_path)
    page = LivePage(ladder.experiment, ladder.root)
    page.poll()
    newest = page.forecasts["hero"].newest
    store_forecast(ladder.store, newest.model_copy(update={"final_loss": newest.final_loss - 0.01, "inputs_fingerprint": "v3"}),
                   meta={"live_step": 100})
    append_alerts(ladder.store.url_of(ladder.hero_dir), [Alert("band", 100, "critical", "eval/loss has been above the band for 3 evals in a row")])
    delta = page.poll()
    assert [v["version"] for v in delta["forecasts"]["hero"]] == [3] and delta["forecasts"]["hero"][0]["curve"]
    assert [(a["kind"], a["step"]) for a in delta["runs"]["hero"]["alerts"]] == [("band", 100)]


def test_a_run_without_an_overlay_gets_derived_alerts(tmp_path):
    ladder = _make(tmp_path)
    page = LivePage(ladder.experiment, ladder.root)
    page.poll()
    lines = [{"step": s, "train/loss": 4.0 - s / 1e4 + (2.0 if s == 400 else 0.0)} for s in range(110, 500, 10)]
    _append(ladder.store, f"{ladder.hero_dir}/metrics.jsonl", lines)
    delta = page.poll()
    found = [(a["kind"], a["step"], a["source"]) for a in delta["runs"]["hero"]["alerts"]]
    assert found == [("loss_spike", 400, "derived by this page")]
    assert page.poll() is None  # nothing new: the alert is not raised again


def test_a_long_history_derives_alerts_over_its_tail_only(tmp_path, monkeypatch):
    import ladder.views.serve as serve

    ladder = _make(tmp_path)
    lines = [{"step": s, "train/loss": 4.0 - s / 1e5 + (2.0 if s in (300, 2900) else 0.0)} for s in range(110, 3000, 10)]
    _append(ladder.store, f"{ladder.hero_dir}/metrics.jsonl", lines)
    monkeypatch.setattr(serve, "DERIVE_TAIL_BYTES", 2000)  # about the last 50 lines
    monkeypatch.setattr(serve, "READ_CHUNK", 1000)
    page = LivePage(ladder.experiment, ladder.root)
    page.poll()
    derived = [(a["kind"], a["step"]) for a in page.feeds["hero"].alerts.values() if a["source"] == "derived by this page"]
    assert derived == [("loss_spike", 2900)]  # the spike at step 300 lies before the tail; its rules were not run there
    assert len(page.feeds["hero"].train_steps) == 10 + len(lines)  # every line was still read


def test_band_alerts_are_derived_against_the_newest_forecast_unless_the_run_has_an_overlay(tmp_path):
    from ladder.alerts import band_alerts

    ladder = _make(tmp_path)
    page = LivePage(ladder.experiment, ladder.root)
    page.poll()
    low = [{**_eval_line(ladder.hero, "hero", s), "eval/loss": _eval_line(ladder.hero, "hero", s)["eval/loss"] - 0.5} for s in (150, 200, 250)]
    _append(ladder.store, f"{ladder.hero_dir}/metrics.jsonl", low)
    found = page.poll()["runs"]["hero"]["alerts"]
    # the same alert ladder.alerts raises from the forecast itself (band_at_step per row)
    expected = band_alerts(low, page.forecasts["hero"].newest)
    assert [(a["kind"], a["step"], a["message"]) for a in found] == [("band", 250, expected[0].message)]
    # an eval with the band logged beside it: an overlay writes this run's alerts, the page derives no more
    _append(ladder.store, f"{ladder.hero_dir}/metrics.jsonl",
            [{**low[-1], "step": s, "forecast/loss": 4.0, "forecast/lo": 3.9, "forecast/hi": 4.1} for s in (300, 350, 400)])
    assert not page.poll()["runs"]["hero"]["alerts"] and page.feeds["hero"].has_overlay


def test_an_fsspec_root_is_served_the_same_way(tmp_path):
    root = "memory://serve-test-root"
    try:
        ladder = _make(tmp_path, root)
        page = LivePage(ladder.experiment, root)
        page.poll()
        assert [p[0] for p in page.feeds["hero"].evals] == [50, 100]
        ladder.grow(150)
        assert [p[0] for p in page.poll()["runs"]["hero"]["evals"]] == [150]
        assert sorted(page.fits["curves"]) == ["r32", "r48", "r64"]
    finally:
        fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


def test_an_imported_run_is_shown_like_our_own(tmp_path):
    from ladder.importer import import_source

    ladder = _make(tmp_path, rungs=("r48", "r64"))
    derived = ladder.dag["r32"].derived
    export = tmp_path / "wandb-export.csv"  # a W&B history export of a rung trained elsewhere
    steps = sorted({max(1, round(g * derived.num_steps)) for g in np.linspace(0.1, 1.0, 10)})
    export.write_text("_step,eval/loss\n" + "".join(f"{s},{_eval_line(derived, 'r32', s)['eval/loss']}\n" for s in steps))
    import_source(ladder.store, ladder.dag, "r32", str(export))
    page = LivePage(ladder.experiment, ladder.root)
    page.poll()
    row = next(s for s in page.steps if s["name"] == "r32")
    assert row["state"] == "done" and row["source"] == f"imported from {export}"
    assert [p[0] for p in page.feeds["r32"].evals] == steps and sorted(page.fits["curves"]) == ["r32", "r48", "r64"]


def test_an_attached_run_is_shown_like_our_own_while_it_is_followed(tmp_path):
    import threading

    from ladder.attach import attach_run

    ladder = _make(tmp_path, hero=False)
    source = tmp_path / "elsewhere" / "metrics.jsonl"  # a run training elsewhere, its log on shared storage
    source.parent.mkdir()

    def write(steps):
        with open(source, "a") as handle:
            handle.writelines(json.dumps({"step": s, "eval/loss": _eval_line(ladder.hero, "hero", s)["eval/loss"]}) + "\n" for s in steps)

    write([40, 80, 120])
    page = LivePage(ladder.experiment, ladder.root)
    page.poll()
    outcome = {}
    follower = threading.Thread(target=lambda: outcome.update(done=attach_run(
        ladder.store, ladder.dag, "hero", str(source), poll_seconds=0.05, idle_timeout=3.0, refit_every=10**6,
        n_bootstrap=5, console_alerts=False)))
    follower.start()
    try:
        deadline = time.monotonic() + 60
        while len(page.feeds["hero"].evals) < 2:  # the newest step is held back until a later one shows it is complete
            assert time.monotonic() < deadline
            page.poll()
            time.sleep(0.1)
        row = next(s for s in page.steps if s["name"] == "hero")
        assert row["state"] == "running" and row["source"] == f"attached from {source}"
        write([160, 200])
        while len(page.feeds["hero"].evals) < 4:
            assert time.monotonic() < deadline
            page.poll()
            time.sleep(0.1)
    finally:
        follower.join(timeout=60)
    page.poll()
    evals = page.feeds["hero"].evals
    assert [p[0] for p in evals] == [40, 80, 120, 160, 200]
    # the overlay our trainer calls logged the band beside each eval, so this run's alerts are its alerts.jsonl's
    assert all(p[4] is not None for p in evals) and page.feeds["hero"].has_overlay
    assert outcome["done"].evals == 5


# ---------------------------------------------------------------- the server's rules


def test_the_token_rule_is_a_function_of_the_bind_host_and_the_flag():
    assert not token_required("127.0.0.1") and not token_required("localhost") and not token_required("::1")
    assert not token_required("127.0.0.2")
    assert token_required("0.0.0.0") and token_required("::") and token_required("10.1.2.3") and token_required("myhost")
    assert token_required("127.0.0.1", require_token=True)


@pytest.fixture
def served(tmp_path):
    ladder = _make(tmp_path)
    page = LivePage(ladder.experiment, ladder.root)
    servers = []

    def start(token: str | None = None, interval: float = 0.2) -> Server:
        server = Server(page, bind("127.0.0.1", 0), token=token, interval=interval).start()
        servers.append(server)
        return server

    yield ladder, page, start
    for server in servers:
        server.stop()


def test_without_the_token_every_request_is_refused_and_nothing_writes(served, tmp_path):
    ladder, page, start = served
    token = "s3cret-token-for-tests"
    server = start(token=token)
    base = server.url.split("?")[0]
    before = _tree_digest(tmp_path / "store")
    with httpx.Client(base_url=base, timeout=10, trust_env=False) as client:
        for path in ("/", "/api/state", "/static/app.js", "/api/forecast/hero/1", "/api/events", "/nothing"):
            response = client.get(path)
            assert response.status_code == 401, path
        assert client.get("/api/state", headers={"Authorization": "Bearer wrong-token-xx"}).status_code == 401
        auth = {"Authorization": f"Bearer {token}"}
        state = client.get("/api/state", headers=auth)
        assert state.status_code == 200 and state.json()["targets"] == ["hero"]
        assert "default-src 'self'" in state.headers["content-security-policy"]
        assert client.get("/", params={"token": token}).status_code == 200
        assert client.get("/static/app.js", params={"token": token}).status_code == 200
        # read-only: no method but GET; path parameters name no file
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            assert client.request(method, "/api/state", headers=auth).status_code == 405
        assert client.post("/", headers=auth).status_code == 405
        for path in ("/api/forecast/..%2F..%2Fruns/1", "/api/forecast/r32/1", "/api/forecast/hero/99", "/api/forecast/hero/x",
                     "/static/..%2Fserve.py", "/static/../serve.py", "/static/%2e%2e/serve.py"):
            response = client.get(path, headers=auth)
            assert response.status_code == 404, path
            assert b"def serve_command" not in response.content
        assert client.get("/api/forecast/hero/1", headers=auth).json()["method"] == "matched_progress"
    assert _tree_digest(tmp_path / "store") == before


def test_without_a_token_only_loopback_host_names_are_answered(served):
    ladder, page, start = served
    server = start()
    port = server.sock.getsockname()[1]
    with httpx.Client(base_url=server.url, timeout=10, trust_env=False) as client:  # every request goes to 127.0.0.1
        assert client.get("/api/state").status_code == 200
        for host in (f"localhost:{port}", f"[::1]:{port}", f"127.0.0.1:{port}"):
            assert client.get("/api/state", headers={"Host": host}).status_code == 200, host
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}"):
            response = client.get("/api/state", headers={"Host": host})
            assert response.status_code == 400 and "is not loopback" in response.text, host


def test_server_sent_events_carry_the_new_points(served):
    ladder, page, start = served
    server = start()
    base = server.url
    with httpx.Client(base_url=base, timeout=10, trust_env=False) as client:
        seq = client.get("/api/state").json()["seq"]
        ladder.grow(150)
        deadline = time.monotonic() + 15
        with client.stream("GET", f"/api/events?since={seq}") as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            event, found = None, None
            for line in stream.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "delta":
                    delta = json.loads(line[6:])
                    if "hero" in delta.get("runs", {}) and delta["runs"]["hero"]["evals"]:
                        found = delta
                        break
                assert time.monotonic() < deadline
    assert [p[0] for p in found["runs"]["hero"]["evals"]] == [150]


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command("serve")(serve_command)
    app.command("noop")(lambda: None)
    return app


def test_bad_input_exits_2_with_one_sentence(tmp_path):
    runner = CliRunner()
    result = runner.invoke(_cli(), ["serve", str(tmp_path / "missing.py")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    ladder = _make(tmp_path)
    result = runner.invoke(_cli(), ["serve", ladder.experiment, "--root", "nosuchproto://bucket/runs"])
    assert result.exit_code == 2 and "--root nosuchproto://bucket/runs: not a store" in result.output
    result = runner.invoke(_cli(), ["serve", ladder.experiment, "--root", ladder.root, "--token", "short"])
    assert result.exit_code == 2 and "--token must be at least 8 characters" in result.output
    taken = bind("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        result = runner.invoke(_cli(), ["serve", ladder.experiment, "--root", ladder.root, "--port", str(port)])
        assert result.exit_code == 2 and f"--port {port}: cannot listen there" in result.output
    finally:
        taken.close()


def test_the_command_bound_off_loopback_prints_a_token_and_refuses_requests_without_it(tmp_path):
    """`ladder serve --host 0.0.0.0` as a user runs it; every request goes to 127.0.0.1 (no traffic leaves the machine)."""
    ladder = _make(tmp_path)
    exe = Path(sys.executable).with_name("ladder")
    proc = subprocess.Popen([str(exe), "serve", ladder.experiment, "--root", ladder.root, "--host", "0.0.0.0", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        first = proc.stdout.readline()
        match = re.search(r"at http://0\.0\.0\.0:(\d+)/\?token=(\S+)", first)
        assert match, first + proc.stdout.read(2000) if proc.poll() is not None else first
        port, token = match.groups()
        assert "every request needs the token" in proc.stdout.readline()
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=30, trust_env=False) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    refused = client.get("/api/state")
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and proc.poll() is None
                    time.sleep(0.2)
            assert refused.status_code == 401
            assert client.get("/", params={"token": "not-" + token}).status_code == 401
            state = client.get("/api/state", params={"token": token})
            assert state.status_code == 200 and state.json()["experiment"] == "tiny_ladder"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


# ---------------------------------------------------------------- the page in a real browser


class Browser:
    """Headless chromium driven over the DevTools protocol: navigate, evaluate, and collect console errors."""

    def __init__(self, tmp: Path):
        import websocket

        profile = tmp / "chromium-profile"
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0", f"--user-data-dir={profile}",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
             "--disable-default-apps", "--disable-extensions", "--disable-quic", "--proxy-server=http://127.0.0.1:9",
             "--window-size=1280,2400", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.monotonic() < deadline and self.proc.poll() is None, "chromium did not start"
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        pages = json.loads(opener.open(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
        self.ws = websocket.create_connection(url, timeout=10, suppress_origin=True)
        self.next_id = 0
        self.errors: list[str] = []
        for method in ("Runtime.enable", "Log.enable", "Page.enable"):
            self.call(method)

    def _event(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append(details.get("exception", {}).get("description") or details.get("text", "exception"))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.errors.append(f"{params['entry'].get('text', '')} [{params['entry'].get('url', '')}]")

    def call(self, method: str, **params):
        self.next_id += 1
        ident = self.next_id
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._event(message)

    def eval(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.eval(expression)
            except RuntimeError:  # the document is still being replaced by the navigation
                value = None
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.1)

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists() and not os.environ.get("CI"),
                                    reason="Debian's chromium is not installed (.ci/run installs it; in CI its absence fails)")


@pytest.fixture
def browser(tmp_path):
    b = Browser(tmp_path)
    yield b
    b.close()


@needs_chromium
def test_the_page_shows_the_ladder_and_follows_the_live_run(served, browser, tmp_path):
    ladder, page, start = served
    server = start()
    browser.open(server.url)
    browser.wait_for("document.body.dataset.ready === '1'")
    assert browser.eval("document.querySelectorAll('#steps tbody tr').length") == 5
    assert browser.eval("document.querySelector('#steps tr[data-step=hero]').dataset.state") == "running"
    chart = "document.getElementById('chart-target')"
    assert browser.eval(f"{chart}.dataset.evals") == "2" and browser.eval(f"{chart}.dataset.version") == "2"
    assert browser.eval(f"{chart}.dataset.bandEnd") == str(ladder.hero.num_steps)  # the band is drawn to the last step
    assert browser.eval(f"{chart}.querySelector('[data-series=evals]').dataset.count") == "2"
    assert browser.eval("document.querySelectorAll('#chart-rungs [data-series^=fit-]').length") == 3
    # the y range follows the evals and the band; the train loss (about 4.9 here) is drawn but clipped, and says so
    legend = browser.eval("document.getElementById('legend-target').textContent")
    assert "train loss (outside the frame)" in legend and "eval loss (actual)" in legend and "eval loss (actual) (" not in legend
    # the summary's sigma reads the band as `ladder watch` and the alerts do (log space, on the eval's side)
    summary = browser.eval("document.getElementById('target-summary').textContent")
    shown = re.search(r"last eval ([\d.]+) at step \d+, predicted ([\d.]+) \[([\d.]+), ([\d.]+)\] \(([+-][\d.]+) sigma\)", summary)
    assert shown, summary
    actual, loss, lo, hi, sigma = (float(v) for v in shown.groups())
    assert sigma == pytest.approx(band_sigma(actual, loss, lo, hi), abs=0.01), summary
    for actual, band in ((2.0 * np.exp(0.6), (2.0, 2.0 * np.exp(-0.588), 2.0 * np.exp(0.588))), (1.5, (2.0, 1.6, 2.3)), (2.0, (2.0, 2.0, 2.0))):
        assert browser.eval(f"bandSigma({float(actual)}, {[float(v) for v in band]})") == pytest.approx(band_sigma(actual, *band), rel=1e-9)
    assert browser.eval("bandSigma(2.1, [2.0, 2.0, 2.0])") is None  # a band of zero width: no sigma
    assert browser.eval("document.querySelectorAll('#history-table tbody tr').length") == 2
    assert browser.eval("document.getElementById('hosts').hidden") is False
    assert browser.eval("document.querySelectorAll('#host-charts tr[data-host]').length") == 2
    assert "router bias" in browser.eval("document.getElementById('alert-list').textContent")
    # a test process appends evals to the live run: the page shows them within seconds
    ladder.grow(250)
    browser.wait_for(f"{chart}.dataset.evals === '5'", timeout=10)
    assert browser.eval(f"{chart}.querySelector('[data-series=evals]').dataset.count") == "5"
    # an alert written to alerts.jsonl appears, with its explanation
    append_alerts(ladder.store.url_of(ladder.hero_dir),
                  [Alert("band", 250, "critical", "eval/loss has been above the forecast band for 3 evals in a row (steps 150-250).")])
    browser.wait_for("document.querySelector('#alert-list li[data-key=\"hero|band|250\"]') !== null", timeout=10)
    assert "steps 150-250" in browser.eval("document.querySelector('#alert-list li[data-key=\"hero|band|250\"]').textContent")
    # every forecast version is selectable: v1 is fetched and drawn
    browser.eval("(() => { const s = document.getElementById('version-select'); s.value = '1'; s.dispatchEvent(new Event('change')); })()")
    browser.wait_for(f"{chart}.dataset.version === '1'")
    v1_points = len(page.forecast_version("hero", 1)["curve"])
    assert v1_points > 20 and browser.eval(f"{chart}.querySelector('[data-series=band]').dataset.count") == str(v1_points)
    shot = browser.call("Page.captureScreenshot", format="png")["data"]
    assert len(shot) > 10_000
    assert browser.errors == []


@needs_chromium
def test_off_loopback_the_page_needs_its_token(served, browser):
    ladder, page, start = served
    # the rule that makes --host 0.0.0.0 require a token, exercised on loopback (no traffic may leave the machine)
    assert token_required("0.0.0.0")
    server = start(token="browser-test-token")
    bare = server.url.split("?")[0]
    browser.open(bare)
    browser.wait_for("document.readyState === 'complete' && document.body !== null")
    assert "401" in browser.eval("document.body.innerText")
    browser.open(server.url)
    browser.wait_for("document.body.dataset && document.body.dataset.ready === '1'")
    ladder.grow(150)
    browser.wait_for("document.getElementById('chart-target').dataset.evals === '3'")  # the event stream carries the token too
    # the errors logged are the refused bare load itself (and the browser's favicon request after it): the page,
    # its script and its event stream were let in
    refused = (f"(Unauthorized) [{bare}]", f"(Unauthorized) [{bare}favicon.ico]")
    assert [e for e in browser.errors if not e.endswith(refused)] == []
