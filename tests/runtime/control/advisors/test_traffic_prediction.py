"""Traffic prediction: Holt's smoothing against hand-computed values and a brute-force fit, its
held-out error against the naive forecaster's, and the series read from step traces."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import pytest
from modules_helpers import DP_BYTES, fill_run, make_plan, two_sites

from dmsc.data.db import Database
from dmsc.data.forecast import GRID
from dmsc.data.traces import StepTrace
from dmsc.runtime.control.advisors import read_measurements
from dmsc.runtime.control.advisors.traffic import (
    TrafficPrediction,
    boundary_bytes,
    exchange_bytes,
    fit_holt,
    forecast_series,
    holt_forecasts,
    mape_pct,
)


def test_holt_forecasts_match_hand_computed_values() -> None:
    # l0 = 1, b0 = 2. t=2: f = 3 + 2 = 5 after l1 = .5*3 + .5*3 = 3, b1 = .5*2 + .5*2 = 2;
    # l2 = .5*4 + .5*5 = 4.5, b2 = .5*1.5 + .5*2 = 1.75 -> f3 = 6.25;
    # l3 = .5*8 + .5*6.25 = 7.125, b3 = .5*2.625 + .5*1.75 = 2.1875 -> next = 9.3125.
    f = holt_forecasts(np.array([1.0, 3.0, 4.0, 8.0]), 0.5, 0.5)[0]
    assert np.isnan(f[:2]).all()
    assert f[2:].tolist() == [5.0, 6.25, 9.3125]


def test_holt_on_a_grid_is_each_pair_run_alone() -> None:
    y = np.array([2.0, 2.5, 2.2, 3.1, 3.0, 3.8, 4.1])
    alphas, betas = np.array([0.2, 0.7, 1.0]), np.array([0.0, 0.3, 0.9])
    grid = holt_forecasts(y, alphas, betas)
    for k, (a, b) in enumerate(zip(alphas, betas, strict=True)):
        np.testing.assert_array_equal(grid[k], holt_forecasts(y, float(a), float(b))[0])


def test_fit_is_the_least_squares_pair_of_the_grid() -> None:
    rng = np.random.default_rng(3)
    y = 1.0 + 0.05 * np.arange(40) + rng.normal(0, 0.1, 40)
    best = min(
        itertools.product(GRID[1:], GRID),
        key=lambda ab: float(((holt_forecasts(y, *ab)[0, 2:40] - y[2:]) ** 2).sum()),
    )
    assert fit_holt(y) == pytest.approx(best)


def test_a_linear_trend_is_forecast_exactly_and_beats_the_last_value() -> None:
    f = forecast_series([0.4 + 0.01 * i for i in range(20)])
    assert f.forecaster == "holt" and f.held_out == 4  # the last 20%
    assert f.next_value == pytest.approx(0.6)
    assert f.mae == pytest.approx(0.0, abs=1e-12)
    assert f.naive_mae == pytest.approx(0.01)


def test_holt_beats_the_last_value_on_a_noisy_trend() -> None:
    """A step time that drifts up 2 ms a step under 10 ms of noise: the held-out MAE of Holt
    against the naive forecaster's (printed: the README quotes them)."""
    rng = np.random.default_rng(0)
    y = 0.4 + 0.002 * np.arange(100) + rng.normal(0, 0.01, 100)
    f = forecast_series(y)
    assert f.held_out == 20
    assert f.mae is not None and f.naive_mae is not None
    assert f.mae <= f.naive_mae
    print(f"holt MAE {f.mae * 1e3:.2f} ms ({f.mape_pct:.2f}%), naive {f.naive_mae * 1e3:.2f} ms")


def test_a_constant_series_is_forecast_exactly_by_both() -> None:
    f = forecast_series([2_097_152.0] * 30)
    assert f.next_value == 2_097_152.0
    assert f.mae == 0.0 and f.naive_mae == 0.0 and f.mape_pct == 0.0


def test_too_few_points_give_the_last_value_and_no_error() -> None:
    f = forecast_series([1.0, 2.0, 3.0])
    assert (f.forecaster, f.next_value, f.held_out, f.mae) == ("last value", 3.0, 0, None)
    with pytest.raises(ValueError):
        forecast_series([])


def test_mape_leaves_out_zero_actuals() -> None:
    assert mape_pct(np.array([0.0, 2.0]), np.array([1.0, 1.0])) == pytest.approx(50.0)
    assert mape_pct(np.array([0.0]), np.array([1.0])) is None


def _trace(step: int, stage: int, replica: int, sent: dict[tuple[int, int], int]) -> StepTrace:
    return StepTrace(step, stage, replica, 0.0, [], sent)


def test_bytes_per_boundary_and_exchange_by_step() -> None:
    traces = [
        _trace(0, 0, 0, {(1, 0): 100, (0, 1): 7}),
        _trace(0, 0, 1, {(1, 1): 100, (0, 0): 7}),
        _trace(0, 1, 0, {(0, 0): 50}),
        _trace(0, 1, 1, {(0, 1): 50}),
        _trace(1, 0, 0, {(1, 0): 120}),
        _trace(1, 1, 0, {(0, 0): 60}),
    ]
    assert boundary_bytes(traces) == {0: [300.0, 180.0]}
    assert exchange_bytes(traces) == {0: [14.0, 0.0]}


def test_the_module_forecasts_each_boundary_exchange_and_the_step_time(tmp_path: Path) -> None:
    cluster = two_sites()
    plan = make_plan(cluster)
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run, _ = fill_run(db, cluster, plan, steps=25, step_s=lambda s: 0.5 + 0.004 * s)
    proposals = TrafficPrediction().propose(read_measurements(db, run, time.time()))
    by_target = {p.target: p for p in proposals}
    assert set(by_target) == {"boundary 0->1", "exchange stage 0", "exchange stage 1", "step time"}
    assert all(p.kind == "forecast" and p.predicted_gain_s_per_step == 0 for p in proposals)
    assert "site-a -> site-b via site-a-site-b" in by_target["boundary 0->1"].reason
    assert by_target["exchange stage 0"].details["next_value"] == pytest.approx(2 * DP_BYTES)
    step = by_target["step time"].details
    assert step["held_out"] == 5 and step["mae"] < step["naive_mae"]
    assert step["next_value"] == pytest.approx(0.5 + 0.004 * 25)
    assert "held-out MAE" in by_target["step time"].reason
