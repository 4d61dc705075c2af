"""The all-reduce of this machine: the alpha-beta fit and its refusals (a real two-process gloo
group runs in every ``dmsc calibrate``: tests/cli/test_runtime.py checks what it wrote)."""

from __future__ import annotations

from typing import Any

import pytest

from dmsc.runtime.compute.collective_calibration import (
    fit_alpha_beta,
    measure_allreduce,
    time_allreduce,
    timed_rounds,
)


def test_the_fit_recovers_latency_and_bandwidth_from_the_ends() -> None:
    a, b = 300e-6, 2e9
    points = [(x, a + x / b) for x in (1024.0, 262144.0, 4194304.0)]
    points[1] = (262144.0, 1.0)  # one slow size in the middle does not lead the fit
    latency, rate = fit_alpha_beta(points)
    assert latency == pytest.approx(a) and rate == pytest.approx(b)


def test_the_fit_refuses_what_it_cannot_fit() -> None:
    with pytest.raises(ValueError, match="two sizes at least"):
        fit_alpha_beta([(1.0, 1.0)])
    with pytest.raises(ValueError, match="does not grow with the size"):
        fit_alpha_beta([(1.0, 2.0), (100.0, 1.0)])
    with pytest.raises(ValueError, match="the sizes must differ"):
        fit_alpha_beta([(5.0, 1.0), (5.0, 2.0)])


def test_a_spell_as_long_as_one_sizes_rounds_moves_no_median() -> None:
    """The defect: timed size by size and way by way, a slow spell of the machine as long as one
    size's rounds made that size's whole median (an awake latency of 682 us against 335-368 us in
    the calibrations around it). Interleaved, the spell lands in a few rounds of every size and
    way, and no median moves."""
    sizes, rounds = (1024, 256 * 1024, 4 * 1024 * 1024), 30
    base = {1024: 400e-6, 256 * 1024: 1e-3, 4 * 1024 * 1024: 8e-3}
    calls = 0

    def call(size: int, way: str) -> float:
        nonlocal calls
        calls += 1
        slow = 30 < calls <= 60  # 30 calls in a row: one size's rounds, timed one after another
        return base[size] * (0.5 if way == "awake" else 1.0) + (5e-3 if slow else 0.0)

    got = timed_rounds(call, sizes, rounds)
    assert calls == rounds * len(sizes) * 2
    for size, t in base.items():
        assert got["blocked"][size] == pytest.approx(t)
        assert got["awake"][size] == pytest.approx(t / 2)


def test_each_sizes_figure_is_the_median_over_the_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three pairs started one after another, the first in a slow spell (every size twice as
    long): the fit is the one of the other two, not moved by the slow pass."""
    from dmsc.runtime.compute import collective_calibration as cc

    a, b = 400e-6, 1.5e9
    sizes = (1024, 4 * 1024 * 1024)
    passes = iter([2.0, 1.0, 1.0])

    def one_pass(backend: str, sizes: tuple[int, ...], rounds: int) -> tuple[dict, dict, float]:  # type: ignore[type-arg]
        k = next(passes)
        t = {s: k * (a + s / b) for s in sizes}  # (sent 2 (n - 1) / n of s: all of it at 2)
        return t, {s: v / 2 for s, v in t.items()}, k * 1e-3

    monkeypatch.setattr(cc, "time_allreduce", one_pass)
    got = cc.measure_allreduce("gloo", sizes)
    assert got["latency_s"] == pytest.approx(a) and got["bytes_s"] == pytest.approx(b)
    assert got["latency_awake_s"] == pytest.approx(a / 2)
    assert got["quorum_s"] == pytest.approx(1e-3)  # the slow pair's 2 ms left out too
    with pytest.raises(ValueError, match="passes must be >= 1"):
        cc.measure_allreduce("gloo", sizes, passes=0)


def test_nccl_needs_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="nccl: 2 CUDA devices needed, 1 here"):
        measure_allreduce("nccl")


def test_a_real_gloo_all_reduce_is_timed_blocked_and_awake() -> None:
    """Two spawned processes, a few rounds: each size's median waited for blocked and waited
    for awake (dmsc.runtime.compute.waiting), all positive, and their quorum's. (Their fit is
    the one above; on this machine a blocked small one can take longer than a larger, which
    the fit refuses, and ``dmsc calibrate`` then leaves the collective out.)"""
    times, awake, quorum = time_allreduce("gloo", (1024, 256 * 1024), rounds=5)
    assert set(times) == set(awake) == {1024, 256 * 1024}
    assert min(times.values()) > 0 and min(awake.values()) > 0
    assert 0 < quorum < 5.0  # the replicas' quorum on the pair's store, as the runtime's


def test_awake_figures_slower_than_twice_the_blocked_ones_are_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call waited for awake is no slower than a blocked one on a machine at rest; an awake
    latency 4.2 times the blocked one (parallel_modes_cpu.json, rerun_2026_12_04_eve) priced
    the tensor-parallel calls of the next run 4-5 times over. Past twice the blocked latency
    the awake fit is left out, with the reason; at twice or under it is kept."""
    from dmsc.runtime.compute import collective_calibration as cc

    a, b = 480e-6, 1.5e9
    sizes = (1024, 4 * 1024 * 1024)

    def passes(awake_latency: float) -> Any:
        def one_pass(backend: str, sizes: tuple[int, ...], rounds: int) -> Any:
            t = {s: a + s / b for s in sizes}
            return t, {s: awake_latency + s / b for s in sizes}, 1e-3

        return one_pass

    monkeypatch.setattr(cc, "time_allreduce", passes(2014e-6))
    got = cc.measure_allreduce("gloo", sizes)
    assert "latency_awake_s" not in got and "bytes_awake_s" not in got
    assert got["awake_left_out"] == "awake latency 2014 us against 480 us blocked (over 2x)"
    assert got["latency_s"] == pytest.approx(a)  # the blocked figures stay
    monkeypatch.setattr(cc, "time_allreduce", passes(2 * a))
    got = cc.measure_allreduce("gloo", sizes)
    assert got["latency_awake_s"] == pytest.approx(2 * a) and "awake_left_out" not in got
