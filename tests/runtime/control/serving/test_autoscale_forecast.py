"""The autoscaler's forecast (pure): a stepped ramp of requests, scaled out ahead with a
look-ahead and only after the step without one; no forecast scale-out on a steady load."""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable

import numpy as np
import pytest

from dmsc.data.forecast import fit_holt, forecast_ahead, holt_forecasts
from dmsc.runtime.control.serving.autoscale import ScalePolicy, parse_autoscale
from dmsc.runtime.control.serving.elastic import autoscale_loop
from dmsc.runtime.transport.messages import AutoscaleSettings

SERVICE_S = 0.25  # a request alone takes 0.25 s of a replica
CAPACITY = 2 / 3 / SERVICE_S  # at target 2 in flight a replica runs at rho = 2/3: 2.67 req/s


def in_flight(rate: float) -> float:
    """The mean requests in flight on one replica, a processor-sharing queue at ``rate``."""
    rho = rate * SERVICE_S
    return rho / (1 - rho)


def stepped(t: float) -> float:
    """0.5 req/s more every 10 s, from 0.5 to 3 req/s; one replica's capacity (2.67 req/s at
    its target) is crossed by the step at 50 s."""
    return 0.5 * (1 + min(int(t // 10), 5))


def _run(lookahead_s: float, rate: Callable[[float], float], seconds: float) -> list[tuple]:
    """Sample ``rate`` every 0.5 s as the autoscale loop would (the requests in flight one
    replica would hold, as whole numbers whose mean is the queue's; the arrivals counter);
    every change (time, replicas, reason)."""
    policy = ScalePolicy(
        AutoscaleSettings(
            min=1, max=4, target=2, cooldown_s=10, window_s=5, lookahead_s=lookahead_s
        )
    )
    current, arrived, held, changes = 1, 0.0, 0.0, []
    for k in range(int(seconds / 0.5) + 1):
        t = k * 0.5
        if k:
            arrived += rate(t - 0.5) * 0.5
        before, held = held, held + in_flight(rate(t))
        n = math.floor(held) - math.floor(before)  # whole numbers, the right mean
        wanted = policy.observe(t, n, current, math.floor(arrived + 1e-9))
        if wanted != current:
            changes.append((t, wanted, policy.why))
            current = wanted
            policy.changed(t)
    return changes


def test_a_forecast_ramp_is_scaled_out_before_its_step_and_says_so() -> None:
    ahead = _run(20.0, stepped, 60.0)
    t, replicas, why = ahead[0]
    assert replicas == 2
    assert t < 50.0  # before the rate passes one replica's capacity
    assert stepped(t) < CAPACITY
    found = re.fullmatch(r"forecast: ([\d.]+) req/s in 20s > capacity ([\d.]+) req/s .*", why)
    assert found is not None, why
    rate, capacity = float(found[1]), float(found[2])
    assert capacity == pytest.approx(CAPACITY, rel=0.1)  # Little's law and the PS queue
    assert rate > capacity


def test_without_a_look_ahead_the_replica_comes_only_after_the_step() -> None:
    reactive = _run(0.0, stepped, 60.0)
    t, replicas, why = reactive[0]
    assert replicas == 2 and t >= 50.0 and stepped(t) > CAPACITY
    assert "forecast" not in why and "requests in flight" in why


def test_a_steady_load_below_capacity_is_not_forecast_into_a_scale_out() -> None:
    assert _run(20.0, lambda t: 2.0, 120.0) == []


def test_a_replica_the_forecast_needs_is_not_removed() -> None:
    """Two replicas; the load in flight has fitted one for a minute, the climbing rate 40 s
    ahead will not."""
    settings = {"min": 1, "max": 4, "target": 2, "cooldown_s": 0, "window_s": 5}
    policy = ScalePolicy(AutoscaleSettings(**settings, lookahead_s=40))
    reactive = ScalePolicy(AutoscaleSettings(**settings))
    held = 0.0
    for k in range(201):  # 100 s: the scale-in window (a minute) is full
        t = k * 0.5
        rate = 0.5 + 0.025 * t  # 0.5 to 3 req/s over two replicas, 4 req/s 40 s later
        before, held = held, held + 2 * in_flight(rate / 2)
        n = math.floor(held) - math.floor(before)
        arrived = math.floor(0.5 * t + 0.0125 * t * t)
        wanted = policy.observe(t, n, 2, arrived)
        without = reactive.observe(t, n, 2, arrived)
    assert without == 1, reactive.why  # the reference: the reactive rule removes it
    assert wanted == 2, policy.why


def test_the_look_ahead_is_the_longer_of_the_setting_and_the_last_measured_start() -> None:
    policy = ScalePolicy(AutoscaleSettings(lookahead_s=10))
    assert policy.lookahead_s == 10
    policy.changed(0.0, ready_s=25.0)
    assert policy.lookahead_s == 25
    assert ScalePolicy(AutoscaleSettings()).lookahead_s == 0  # off: no forecast
    assert parse_autoscale("infer:lookahead=20").lookahead_s == 20
    with pytest.raises(ValueError, match="lookahead_s: Input should be greater than or equal"):
        parse_autoscale("infer:lookahead=-1")


def test_forecast_ahead_extends_holts_last_level_and_trend() -> None:
    y = np.array([1.0, 2.5, 2.9, 4.2, 5.1, 5.8, 7.2])
    alpha, beta = fit_holt(y)
    one = holt_forecasts(y, alpha, beta)[0, -1]
    assert forecast_ahead(y, 1) == pytest.approx(one)
    step = forecast_ahead(y, 2) - forecast_ahead(y, 1)  # the trend
    assert forecast_ahead(y, 5) == pytest.approx(one + 4 * step)
    assert forecast_ahead([3.0, 4.0], 10) == 4.0  # too few points: the last value
    with pytest.raises(ValueError, match="no measurements"):
        forecast_ahead([], 1)


class RecordingPool:
    """What autoscale_loop drives, without processes: the reasons it was given."""

    def __init__(self) -> None:
        self.serving: list[str] = []
        self.reasons: list[str] = []
        self.log = logging.getLogger("test")

    def count(self) -> int:
        return 1 + len(self.serving)

    def scale_out(self, reason: str, in_flight: float = 0.0) -> str | None:
        self.reasons.append(reason)
        self.serving.append(f"serve-{len(self.serving) + 1}")
        return self.serving[-1]

    def newest(self) -> str | None:
        return self.serving[-1] if self.serving else None

    def scale_in(self, name: str, reason: str, in_flight: float = 0.0) -> None:
        self.serving.remove(name)


def test_the_loop_reads_the_arrivals_and_records_the_forecasts_reason() -> None:
    """The ramp of the first test through ``autoscale_loop``: the pool is told why (the
    reason of its ``scale_events`` row), and the start it took becomes the look-ahead."""
    pool, stop, t = RecordingPool(), threading.Event(), [0.0]
    arrived = [0.0]

    def clock() -> float:  # called once a sample, and once more after a scale-out
        t[0] += 0.5
        arrived[0] += stepped(t[0]) * 0.5
        if t[0] >= 48.0:
            stop.set()
        return t[0]

    settings = AutoscaleSettings(min=1, max=4, target=2, cooldown_s=10, window_s=5, lookahead_s=20)
    policy = ScalePolicy(settings)
    held = [0.0]

    def load() -> int:
        before = held[0]
        held[0] += in_flight(stepped(t[0]))
        return math.floor(held[0]) - math.floor(before)

    autoscale_loop(
        pool,  # type: ignore[arg-type]
        policy,
        load,
        stop,
        0.0,
        clock,
        arrivals=lambda: math.floor(arrived[0] + 1e-9),
    )
    assert pool.reasons and pool.reasons[0].startswith("forecast: ")
    assert policy.ready_s == pytest.approx(0.5)  # one tick of this clock
