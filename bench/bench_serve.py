"""What `ladder serve` costs on a long run: time to first paint and server CPU per update, on a hero with
10,000 evals and 1,000,000 train-loss lines, each against a baseline measured in the same run.

    .venv/bin/python bench/bench_serve.py [--train-lines 1000000] [--evals 10000] [--updates 20] [--markdown bench/RESULTS_serve.md]

It builds a store in a temporary folder (three finished rungs, a hero whose metrics.jsonl holds one train line
per step with four hosts' throughput every 10 steps and an eval every train-lines/evals steps, three forecast
versions of 200 points), then measures:

- startup: the first poll, which reads every line once (wall and CPU of that thread, and the growth of the
  process's peak RSS);
- a browser's first load: the snapshot's size and the server's time to build and serialize it, then in headless
  chromium (Debian's, over the DevTools protocol) the first contentful paint and the time until the data is drawn
  (both from navigation start), against the same page over a small run (1,000 lines, 10 evals);
- each update (the hero appends 100 train lines and one eval): the server's CPU for the poll and for serializing
  its delta, against re-reading the whole metrics.jsonl with ladder.runs.read_metrics (what a view without byte
  offsets would pay per update); and in the browser, the render time and the delay from the append to the new
  eval on screen (the poll interval, 0.5 s here, included).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.* (the DevTools client and the spec builder the tests use)

import numpy as np  # noqa: E402

from forecasting.forecast import CurvePoint, Forecast, TargetSpec  # noqa: E402
from ladder.fitting import store_forecast  # noqa: E402
from ladder.loader import load_experiment  # noqa: E402
from ladder.runs import read_metrics  # noqa: E402
from ladder.store import Store  # noqa: E402
from ladder.views.serve import LivePage, Server, bind  # noqa: E402

EXPERIMENT = textwrap.dedent(
    """
    from ladder import TrainStep, build_ladder
    from trainer.config import ModelConfig, MoEConfig
    from tests.ladder_helpers import tiny_spec


    def rung(name, width, layers, steps):
        model = ModelConfig(hidden_dim=width, num_layers=layers, num_heads=2, seq_len=32,
                            moe=MoEConfig(num_experts=4, top_k=2, expert_dim=width))
        train = tiny_spec().train.model_copy(update={"tokens": 32 * 8 * steps})
        return TrainStep(name=name, spec=tiny_spec(model=model, train=train))


    steps = build_ladder([rung("r32", 32, 2, 200), rung("r48", 48, 2, 300), rung("r64", 64, 3, 400)],
                         hero=rung("hero", 96, 4, HERO_STEPS))
    """
)


def _loss(g: float) -> float:
    return 2.0 + 3.0 * max(g, 1e-6) ** -0.08 - 3.0


def build_store(folder: Path, train_lines: int, evals: int) -> tuple[str, str, Store, str, object]:
    folder.mkdir(parents=True, exist_ok=True)
    exp_file = folder / "bench_ladder.py"
    exp_file.write_text(EXPERIMENT.replace("HERO_STEPS", str(train_lines)))
    dag = load_experiment(str(exp_file)).dag
    store = Store(str(folder / "store"))
    for name in ("r32", "r48", "r64"):
        d = dag[name].derived
        run_dir = store.run_dir(name, dag.fingerprints[name])
        store.write_json(f"{run_dir}/spec.json", {"name": name, "derived": d.model_dump()})
        lines = []
        for g in np.linspace(0.1, 1.0, 10):
            step = int(round(g * d.num_steps))
            tokens = step * d.tokens_per_step
            loss = 1.5 + 40.0 * (g * float(d.total_flops)) ** -0.12
            lines.append(json.dumps({"step": step, "tokens": tokens, "flops": 3 * tokens * d.flops_per_token, "eval/loss": loss}))
        store.append_text(f"{run_dir}/metrics.jsonl", "\n".join(lines) + "\n")
        store.acquire_lease(run_dir, "bench")
        store.finish(run_dir, "bench", "done")
    hero = dag["hero"].derived
    hero_dir = store.run_dir("hero", dag.fingerprints["hero"])
    store.write_json(f"{hero_dir}/spec.json", {"name": "hero", "derived": hero.model_dump()})
    store.acquire_lease(hero_dir, "bench")
    every = max(1, train_lines // evals)
    with open(f"{hero_dir}/metrics.jsonl", "w") as handle:
        handle.writelines(hero_lines(hero, 1, train_lines, every))
    target = TargetSpec(name="hero", params_active=float(hero.params_active), tokens=float(hero.tokens),
                        num_steps=hero.num_steps, tokens_per_step=float(hero.tokens_per_step))
    steps = np.unique(np.geomspace(1, hero.num_steps, 260).round().astype(int))[-200:]
    for version, shift in enumerate((0.0, 0.01, -0.005), start=1):
        curve = [CurvePoint(step=int(s), loss=_loss(s / hero.num_steps) + shift, lo=_loss(s / hero.num_steps) + shift - 0.05,
                            hi=_loss(s / hero.num_steps) + shift + 0.05) for s in steps]
        store_forecast(store, Forecast(target=target, method="matched_progress" if version == 1 else "refit", inputs_fingerprint=str(version),
                                       curve=curve, final_loss=curve[-1].loss, final_loss_lo=curve[-1].lo, final_loss_hi=curve[-1].hi,
                                       law="bench"), meta={"live_step": train_lines // 2} if version > 1 else {})
    return str(exp_file), str(folder / "store"), store, hero_dir, hero


def hero_lines(hero, first: int, last: int, eval_every: int):
    """Train lines as the trainer writes them (a dozen keys), four hosts' throughput every 10 steps, an eval every `eval_every`."""
    per_step = hero.tokens_per_step
    per_token = 3 * hero.flops_per_token
    t0 = 1.7e9
    for step in range(first, last + 1):
        tokens = step * per_step
        g = step / hero.num_steps
        line = (f'{{"step": {step}, "tokens": {tokens}, "flops": {tokens * per_token:.6g}, "time": {t0 + step * 0.25:.3f}, '
                f'"train/loss": {_loss(g) + 0.05 * np.sin(step):.6f}, "optim/learning_rate": {3e-3 * (1 - g):.6g}, '
                f'"grad/norm/total": {0.5 + 0.1 * np.cos(step):.5f}, "params/norm/total": {100 + g:.5f}, '
                f'"throughput/tokens_per_second": 1024.0, "throughput/mfu": 0.41')
        if step % 10 == 0:
            line += "".join(f', "throughput/host{h}/tokens_per_second": {1024.0 - 40 * h:.1f}' for h in range(4))
        yield line + "}\n"
        if step % eval_every == 0:
            yield f'{{"step": {step}, "tokens": {tokens}, "flops": {tokens * per_token:.6g}, "eval/loss": {_loss(g):.6f}}}\n'


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def first_load(page: LivePage, tmp: Path) -> dict[str, float]:
    """Serve `page` and open it in headless chromium: paint and data-drawn times, snapshot size, render time."""
    from tests.test_ladder_serve import Browser

    server = Server(page, bind("127.0.0.1", 0), interval=0.5).start()
    browser = Browser(tmp)
    try:
        browser.open(server.url)
        browser.wait_for("document.body && document.body.dataset.ready === '1'", timeout=300)
        time.sleep(0.3)
        out = {
            "fcp_ms": browser.eval("(performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime || null"),
            "drawn_ms": float(browser.eval("document.body.dataset.readyAt")),
            "render_ms": float(browser.eval("document.body.dataset.renderMs")),
            "state_bytes": browser.eval("performance.getEntriesByType('resource').filter(e => e.name.includes('api/state'))[0].decodedBodySize"),
        }
        return out | {"errors": list(browser.errors), "browser": browser, "server": server}
    except BaseException:
        browser.close()
        server.stop()
        raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-lines", type=int, default=1_000_000)
    ap.add_argument("--evals", type=int, default=10_000)
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--markdown", help="also write the results as markdown to this file")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    t = time.perf_counter()
    experiment, root, store, hero_dir, hero = build_store(tmp / "big", args.train_lines, args.evals)
    size_mb = Path(f"{hero_dir}/metrics.jsonl").stat().st_size / 1e6
    print(f"store built in {time.perf_counter() - t:.1f} s: hero metrics.jsonl {size_mb:.0f} MB", flush=True)
    small = build_store(tmp / "small", 1_000, 10)

    # startup: the first poll reads every line once
    rss0 = maxrss_mb()
    page = LivePage(experiment, root)
    page.poll()
    startup = dict(page.last_poll)
    rss_growth = maxrss_mb() - rss0
    feed = page.feeds["hero"]
    print(f"startup: {startup['wall_s']:.1f} s wall, {startup['cpu_s']:.1f} s CPU; {len(feed.evals)} evals, "
          f"{len(feed.train_steps)} train points held; peak RSS +{rss_growth:.0f} MB", flush=True)
    t, c = time.perf_counter(), time.thread_time()
    snapshot = json.dumps(page.snapshot(), separators=(",", ":"), allow_nan=False)
    snap_wall, snap_cpu = time.perf_counter() - t, time.thread_time() - c

    # per update, server side (no server running, so the thread's CPU is the poll's alone)
    every = max(1, args.train_lines // args.evals)
    step = args.train_lines
    poll_cpu, delta_cpu, full_cpu = [], [], []
    for _ in range(args.updates):
        first = step + 1
        step += 100
        with open(f"{hero_dir}/metrics.jsonl", "a") as handle:
            handle.writelines(hero_lines(hero, first, step, 100))
        c = time.thread_time()
        delta = page.poll()
        poll_cpu.append(time.thread_time() - c)
        c = time.thread_time()
        json.dumps(delta, separators=(",", ":"), allow_nan=False)
        delta_cpu.append(time.thread_time() - c)
    for _ in range(3):
        c = time.thread_time()
        rows, _ = read_metrics(store, hero_dir)
        full_cpu.append(time.thread_time() - c)
        del rows
    poll_ms, delta_ms, full_ms = (1e3 * statistics.median(x) for x in (poll_cpu, delta_cpu, full_cpu))
    print(f"per update: poll {poll_ms:.1f} ms CPU + delta JSON {delta_ms:.2f} ms; a full re-read {full_ms:.0f} ms "
          f"({full_ms / poll_ms:.0f}x the poll)", flush=True)

    # first paint: the big run against a small one, then live updates in the browser
    small_page = LivePage(small[0], small[1])
    small_page.poll()
    small_load = first_load(small_page, tmp / "chrome-small")
    small_load["browser"].close()
    small_load["server"].stop()
    big = first_load(page, tmp / "chrome-big")
    browser, server = big["browser"], big["server"]
    renders, delays = [], []
    try:
        evals = len(page.feeds["hero"].evals)
        for _ in range(min(args.updates, 10)):
            first = step + 1
            step += 100
            with open(f"{hero_dir}/metrics.jsonl", "a") as handle:
                handle.writelines(hero_lines(hero, first, step, 100))
            evals += 1
            t = time.perf_counter()
            browser.wait_for(f"document.getElementById('chart-target').dataset.evals === '{evals}'", timeout=60)
            delays.append(time.perf_counter() - t)
            time.sleep(0.05)
            renders.append(float(browser.eval("document.body.dataset.renderMs")))
        errors = big["errors"] + browser.errors
    finally:
        browser.close()
        server.stop()
    rows = [
        ("hero metrics.jsonl", f"{args.train_lines:,} train lines + {args.evals:,} evals ({size_mb:.0f} MB)", "1,000 lines + 10 evals"),
        ("startup: first read of every line", f"{startup['wall_s']:.1f} s wall, {startup['cpu_s']:.1f} s CPU, peak RSS +{rss_growth:.0f} MB", ""),
        ("snapshot /api/state (server)", f"{len(snapshot) / 1e6:.2f} MB, {1e3 * snap_cpu:.0f} ms CPU ({1e3 * snap_wall:.0f} ms wall)", ""),
        ("first contentful paint (browser)", f"{big['fcp_ms']:.0f} ms", f"{small_load['fcp_ms']:.0f} ms"),
        ("data drawn (browser, from navigation)", f"{big['drawn_ms']:.0f} ms", f"{small_load['drawn_ms']:.0f} ms"),
        ("first render of the page (JS)", f"{big['render_ms']:.0f} ms", f"{small_load['render_ms']:.0f} ms"),
        ("per update: server poll CPU (median)", f"{poll_ms:.1f} ms (+{delta_ms:.2f} ms delta JSON)", ""),
        ("per update: full re-read with read_metrics", f"{full_ms:.0f} ms ({full_ms / poll_ms:.0f}x the poll)", ""),
        ("per update: browser render (median)", f"{statistics.median(renders):.0f} ms", ""),
        ("per update: append -> point on screen (median, 0.5 s poll)", f"{statistics.median(delays):.2f} s", ""),
        ("console errors", str(len(errors)), str(len(small_load["errors"]))),
    ]
    table = ["| measure | big run | small run |", "|---|---|---|", *[f"| {a} | {b} | {c} |" for a, b, c in rows]]
    print("\n".join(table))
    if args.markdown:
        Path(args.markdown).write_text(
            "# ladder serve on a long run\n\n"
            f"`.venv/bin/python bench/bench_serve.py --train-lines {args.train_lines} --evals {args.evals} --updates {args.updates}` "
            f"on {time.strftime('%Y-%m-%d')} (2 shared CPU cores; other agents were running).\n\n"
            + "\n".join(table) + "\n\n" + (__doc__.split("\n\n", 2)[2]) + "\n")


if __name__ == "__main__":
    main()
