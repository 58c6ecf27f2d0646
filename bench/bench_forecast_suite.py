"""The public backtest suite: every forecasting method on every public data set the package ships, one table.

Data sets, splits, scoring and caps: forecasting/suite.py's docstrings. Methods: forecasting.api.METHODS, read
at run time, plus auto (and live_only on refit splits). A method that cannot fit a split is reported n/a with
its reason; the suite never stops for it.

Run:  .venv/bin/python bench/bench_forecast_suite.py [--quick] [--methods a,b] [--datasets x,y]
          [--n-bootstrap 20] [--timeout 120] [--budget 600] [--json PATH] [--markdown PATH] [--points CSV]
The whole suite (no --quick, --methods or --datasets) writes its report to bench/RESULTS_forecast_suite.md unless
--markdown says otherwise; a partial run only prints it, so it cannot overwrite the committed table with a subset.
Same as `ladder backtest --suite`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from forecasting import suite

RESULTS = Path(__file__).parent / "RESULTS_forecast_suite.md"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small subset (one split per data set, few targets)")
    ap.add_argument("--methods", default=None, help="comma-separated methods (default: forecasting.api.METHODS + auto)")
    ap.add_argument("--datasets", default=None, help=f"comma-separated data sets (default: all of {','.join(suite.DATASETS)})")
    ap.add_argument("--n-bootstrap", type=int, default=20, help="bootstrap refits per forecast (default 20)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per forecast call before it counts as a timeout (default 120; 10 with --quick)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds one method may spend on one data set, the rest skipped (default 600; 10 with --quick)")
    ap.add_argument("--points", default=None, help="write every scored point (CSV) here")
    ap.add_argument("--json", default=None, help="write the full result (per split and per configuration) here")
    ap.add_argument("--markdown", default=None, help="write the report here (default for the whole suite: bench/RESULTS_forecast_suite.md)")
    ap.add_argument("--quiet", action="store_true", help="no per-target progress lines on stderr")
    return ap.parse_args(argv)


def whole_suite(args: argparse.Namespace) -> bool:
    """Whether this run is the whole suite, the only run whose report may replace bench/RESULTS_forecast_suite.md."""
    return not (args.quick or args.methods or args.datasets)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    timeout = args.timeout if args.timeout is not None else (10.0 if args.quick else 120.0)
    budget = args.budget if args.budget is not None else (10.0 if args.quick else 600.0)
    try:
        datasets = args.datasets.split(",") if args.datasets else list(suite.DATASETS)
        methods = args.methods.split(",") if args.methods else None
        suite.suite_methods(methods)
        splits = suite.all_splits(datasets, quick=args.quick)
    except ValueError as e:
        print(f"bench_forecast_suite: {e}", file=sys.stderr)
        return 2
    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    res = suite.run_suite(splits, methods, n_bootstrap=args.n_bootstrap, timeout_s=timeout, budget_s=budget,
                          progress=progress,
                          quick=args.quick)
    command = "python bench/bench_forecast_suite.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    text = suite.render_markdown(res, command.strip())
    print(text)
    md = args.markdown or (str(RESULTS) if whole_suite(args) else None)
    if md:
        Path(md).write_text("# Public backtest suite\n\n" + text)
    if args.points:
        res.points.to_csv(args.points, index=False)
    if args.json:
        Path(args.json).write_text(json.dumps(suite.to_json(res), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
