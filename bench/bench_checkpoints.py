"""How well a run's mid-run eval, converted by `forecasting.checkpoints`, gives the final loss of a run that really
stopped there; the baseline is the raw eval, measured on the same pairs in the same run.

Pairs: the public Multi-Power Law curves (per size, the 72k-step cosine run's eval nearest the 24k-step cosine run's
final tokens) and six runs of our local ladder's recipe (tests/data/local_checkpoint_pairs.csv: r32 and r48 at 8
tokens per parameter against the same widths trained to half and a third of that). Then the synthetic ladder at one
tokens-per-parameter ratio of tests/test_forecasting_checkpoints.py: Chinchilla fitted on its checkpoints against the
laws that final points allow, on targets at 20, 80 and 200 tokens per parameter.

    .venv/bin/python bench/bench_checkpoints.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forecasting import suite  # noqa: E402
from forecasting.api import TargetSpec, forecast_target  # noqa: E402
from forecasting.checkpoints import annealing_fit, equivalent_final  # noqa: E402
from forecasting.multipower import curve_from_table  # noqa: E402
from tests.test_forecasting_checkpoints import LOCAL_PAIRS, TPS, _annealed_run  # noqa: E402


def markdown(frame: pd.DataFrame) -> str:
    def cell(v) -> str:
        return f"{v:+.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def pair(table: pd.DataFrame, long_run: str, short: pd.DataFrame) -> dict:
    rows = table[table["run"] == long_run].sort_values("step")
    curve = curve_from_table(rows, long_run)
    law, rms = annealing_fit(curve)
    short = short.sort_values("step")
    actual, tokens = float(short["loss"].iloc[-1]), float(short["tokens"].iloc[-1])
    i = int(np.argmin(np.abs(rows["tokens"].to_numpy(float) - tokens)))
    return {"long run": long_run, "short run": str(short["run"].iloc[0]), "tokens off %": 100 * (rows["tokens"].iloc[i] / tokens - 1),
            "raw eval err %": 100 * (curve.loss[i] / actual - 1), "converted err %": 100 * (equivalent_final(law, curve, i) / actual - 1),
            "annealing fit rms %": 100 * rms}


def main() -> None:
    rows = []
    mpl = suite.load_multipower()
    for size in ("csv_25", "csv_100", "csv_400"):
        t = mpl[mpl["size"] == size]
        rows.append(pair(t, t.loc[t["schedule"] == "cosine_72000", "run"].iloc[0], t[t["schedule"] == "cosine_24000"]))
    local = pd.read_csv(LOCAL_PAIRS)
    for width in (32, 48):
        for part in ("half", "third"):
            rows.append(pair(local, f"r{width}", local[local["run"] == f"r{width}_{part}"]))
    frame = pd.DataFrame(rows)
    print(markdown(frame))
    print(f"\nmean abs error: raw eval {frame['raw eval err %'].abs().mean():.2f}%, converted {frame['converted err %'].abs().mean():.2f}%"
          f" ({frame['raw eval err %'].abs().mean() / frame['converted err %'].abs().mean():.1f}x smaller)\n")

    ladder = pd.concat([_annealed_run(n, 20.0, seed=i) for i, n in enumerate([1e7, 2e7, 4e7, 8e7, 1.6e8])], ignore_index=True)
    out = []
    for n, m in ((6.4e8, 20.0), (6.4e8, 80.0), (3.2e8, 200.0)):
        truth = float(_annealed_run(n, m, noise=0.0)["loss"].iloc[-1])
        target = TargetSpec(name=f"{n:.2g}@{m:g}", params_active=n, tokens=n * m, num_steps=int(round(n * m / TPS)), tokens_per_step=TPS)
        for method in ("chinchilla", "compute", "auto"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                f = forecast_target(ladder, target, method=method, n_bootstrap=20)
            out.append({"target": target.name, "method": f"{method} ({f.method})", "err %": 100 * (f.final_loss / truth - 1),
                        "half-width %": 100 * (f.final_loss_hi - f.final_loss_lo) / 2 / f.final_loss,
                        "covers": f.final_loss_lo <= truth <= f.final_loss_hi,
                        "checkpoints": any("converted checkpoints" in w for w in f.warnings)})
    print(markdown(pd.DataFrame(out)))


if __name__ == "__main__":
    main()
