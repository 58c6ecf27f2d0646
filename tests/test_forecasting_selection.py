"""selection: a candidate's expected error is its backtest rate at the target's distance, discounted by how little
evidence the backtest had (one held-out size is not ten)."""

import math

import numpy as np
import pandas as pd
import pytest

from forecasting import final_laws as fl
from forecasting import selection
from forecasting.forecast import BacktestResult, TargetSpec


def _result(method: str, rate: float, sizes: int) -> BacktestResult:
    return BacktestResult(method=method, kind="compute", held_out=[f"run{i}" for i in range(sizes)], held_out_sizes=sizes,
                          mean_rel_error=0.0, rms_rel_error=rate * 0.5, max_abs_rel_error=rate, distance=0.5, rate=rate,
                          n_points=sizes)


def _ladder_points() -> dict[str, np.ndarray]:
    n = np.array([1e7, 3e7, 1e8])
    return {"params_active": n, "tokens": 20 * n, "params_total": n, "flops": 6 * n * 20 * n}


def test_a_law_scored_on_one_held_out_size_does_not_win_over_one_scored_on_ten_by_a_small_margin():
    target = TargetSpec(name="t", params_active=1e9, tokens=20e9)
    tp, ref = fl.target_point(target), _ladder_points()
    d = float(fl.distance(tp, ref)[0])
    assert d == pytest.approx(2.0)  # 2 decades of compute beyond the largest fitted run
    lucky = selection._evidence("chinchilla", lambda: _result("chinchilla", 0.030, sizes=1), tp, ref)
    steady = selection._evidence("farseer", lambda: _result("farseer", 0.034, sizes=10), tp, ref)
    assert lucky["independent_errors"] == 1 and steady["independent_errors"] == 10
    assert lucky["small_sample_factor"] == pytest.approx(1.62, abs=0.01)  # t_0.975(3) / 1.96
    assert steady["small_sample_factor"] == pytest.approx(1.11, abs=0.01)  # t_0.975(12) / 1.96
    assert lucky["expected_error"] == pytest.approx(0.030 * d * lucky["small_sample_factor"])
    assert steady["expected_error"] < lucky["expected_error"]  # raw rates would have ranked them the other way
    # with the same evidence on both sides the raw rates decide, unchanged
    even = selection._evidence("chinchilla", lambda: _result("chinchilla", 0.030, sizes=10), tp, ref)
    assert even["expected_error"] < steady["expected_error"]
    assert math.isclose(even["expected_error"] / steady["expected_error"], 0.030 / 0.034)


def test_matched_progress_counts_its_held_out_sizes_as_the_final_laws_do():
    """Runs of one size make one independent error: matched progress's backtest must not count each as its own
    (on Muennighoff et al.'s runs, eight epochs of one 4.2B model would otherwise pass for eight sizes)."""
    from forecasting.public_data import data_dir, marin_ladder

    table, _, _ = marin_ladder(data_dir() / "marin_535b_ladder")
    res = selection.backtest_matched_progress(table)
    assert res.held_out == ["d2048"] and res.held_out_sizes == 1  # four rungs: fit three, predict the largest
    epochs = pd.concat([table.assign(run=table["run"] + f"/{k}ep") for k in (1, 2)])  # two runs per size, same curves
    res2 = selection.backtest_matched_progress(epochs)
    # d1536 and d2048, two runs each (the two late splits hold out d2048 alone, too few sizes: every split counts)
    assert len(res2.held_out) == 4 and res2.held_out_sizes == 2 and res2.rate_points is None


def test_a_backtest_split_is_fitted_once_and_its_failure_remembered(monkeypatch):
    """The final-point and curve backtests of one law share their splits: each fit part is fitted once, a failed
    fit is not retried (a failing Chinchilla fit runs BFGS to its iteration limit), and each caller gets its own
    FitError with the fit's message."""
    calls: list[str] = []

    def fit_final(law, part, **kw):
        calls.append(law)
        if law == "chinchilla":
            raise fl.FitError("the Chinchilla fit did not converge")
        return f"{law} on {len(part)} runs"

    monkeypatch.setattr(fl, "fit_final", fit_final)
    fl._CACHE.clear()
    part = pd.DataFrame({"run": ["a", "b", "c"], "loss": [3.0, 2.8, 2.6], "run_flops": [1e15, 3e15, 1e16]})
    assert fl._split_fit("compute", part) == fl._split_fit("compute", part) == "compute on 3 runs"
    errors = []
    for _ in range(2):
        with pytest.raises(fl.FitError, match="did not converge") as error:
            fl._split_fit("chinchilla", part)
        errors.append(error.value)
    assert errors[0] is not errors[1]
    assert fl._split_fit("compute", part.iloc[:2]) == "compute on 2 runs"  # another part is another fit
    assert calls == ["compute", "chinchilla", "compute"]
    fl._CACHE.clear()


def test_the_rate_comes_from_the_splits_that_fit_the_most_runs_once_they_hold_out_four_sizes():
    """Five expanding splits: the first three miss by 8%, the last two by 1%. The errors are reported over every
    point; the rate, its distance and its held-out sizes come from the last two splits when they hold out four model
    sizes, and from more splits when they do not (three points' RMS is noise)."""
    def result(sizes_per_split: list[list[float]]) -> BacktestResult:
        held, rel, dist, sizes, point_split, held_split = [], [], [], [], [], []
        for k, split_sizes in enumerate(sizes_per_split):
            for n in split_sizes:
                held.append(f"N={n:g}")
                rel.append(0.08 if k < 3 else 0.01)
                dist.append(1.0 if k < 3 else 0.5)
                sizes.append(n)
                point_split.append(k)
                held_split.append(k)
        return fl.summarise("overtrain", held, rel, dist, None, sizes, point_split=point_split, held_split=held_split)

    wide = result([[1e8, 2e8, 4e8, 8e8, 16e8]] * 3 + [[4e8, 8e8, 16e8], [16e8, 32e8]])  # the last two: 4 sizes
    assert wide.rms_rel_error == pytest.approx(math.sqrt((15 * 0.08**2 + 5 * 0.01**2) / 20))
    assert wide.distance == pytest.approx((15 * 1.0 + 5 * 0.5) / 20)
    assert (wide.rate, wide.rate_points, wide.rate_distance, wide.held_out_sizes) == (pytest.approx(0.02), 5, 0.5, 4)
    narrow = result([[1e8, 2e8, 4e8, 8e8, 16e8]] * 3 + [[16e8], [16e8, 32e8]])  # the last two: 2 sizes, the last three: 6
    assert narrow.rate_points == 8 and narrow.held_out_sizes == 6
    assert narrow.rate == pytest.approx(math.sqrt((5 * 0.08**2 + 3 * 0.01**2) / (5 * 1.0 + 3 * 0.25)))
    everything = result([[1e8, 2e8], [2e8], [4e8]])  # three splits, three sizes in all: every split
    assert everything.rate_points is None and everything.rate_distance is None
    assert everything.distance_of_rate == everything.distance


def test_runs_of_one_compute_are_ordered_by_name_whatever_order_the_table_arrives_in():
    """A backtest split holds out the runs after the first k in compute order; Muennighoff et al.'s runs of one size
    share a compute (8 repetitions of one token budget), and a sort that left their order to the machine gave one
    table two backtests (another held-out set, another band). Shuffled rows give one order: compute, then name."""
    from forecasting import suite
    from forecasting.backtest import last_points, run_compute

    table = next(s for s in suite.splits_datablations() if s.name.startswith("oscar")).train
    orders = []
    for seed in range(3):
        shuffled = table.sample(frac=1.0, random_state=seed)
        runs = last_points(shuffled)["run"].tolist()
        assert run_compute(shuffled).index.tolist() == runs
        orders.append(runs)
    assert orders[0] == orders[1] == orders[2]
    assert orders[0][8:11] == ["4.2B/oscar/14ep", "4.2B/oscar/1ep", "4.2B/oscar/2ep"]


def test_a_run_cut_short_counts_at_its_planned_compute_in_the_final_laws_and_the_backtests_alike():
    """A table with fractions but no flops column (a user's CSV): the run stopped halfway is planned at 6*N*D over
    its fraction, so it sorts after a finished run of 1.5x its logged compute in both orders; counted at the
    compute it had logged, the backtests put it first while the final-loss laws put it last."""
    from forecasting.backtest import last_points, run_compute

    table = pd.DataFrame({
        "run": ["half", "half", "whole"], "step": [1, 2, 2], "fraction": [0.25, 0.5, 1.0],
        "params_active": [1e8, 1e8, 1e8], "tokens": [1e9, 2e9, 3e9], "loss": [3.0, 2.8, 2.7],
    })
    assert run_compute(table).index.tolist() == last_points(table)["run"].tolist() == ["whole", "half"]
    assert run_compute(table)["half"] == pytest.approx(6 * 1e8 * 4e9)
