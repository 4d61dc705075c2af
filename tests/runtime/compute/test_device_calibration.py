"""``dmsc calibrate --device``: a device measured into a spec whose curves give the cost model
back the measured times (on this machine's CPU; the same code times a GPU)."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest
import yaml
from conftest import run_dmsc

from dmsc.netmodel import DEFAULT_CALIBRATION
from dmsc.netmodel.compute import flash_time, gemm_time
from dmsc.netmodel.layers import Gemm
from dmsc.runtime.compute.device_calibration import (
    CPU_ATTENTION,
    CPU_SHAPES,
    measure_device,
    one_device_cluster,
    preset_of,
)
from dmsc.spec import ClusterSpec


def test_the_cost_model_gives_back_the_measured_times() -> None:
    got = measure_device("cpu", quick=True)
    cluster = ClusterSpec.model_validate(one_device_cluster("cpu", got["spec"]))
    device = cluster.device_types["cpu"]
    dc = DEFAULT_CALIBRATION.for_device(device)
    for (m, k, n), (gflop, tflops) in zip(
        CPU_SHAPES, got["report"]["gemm_tflops"]["fp32"], strict=False
    ):
        measured = gflop / tflops / 1e3
        predicted = gemm_time(Gemm(m, n, k), device, "fp32", dc)
        assert predicted == pytest.approx(measured, rel=0.05), (m, k, n)
    for (bh, s, hd), (gflop, tflops) in zip(
        CPU_ATTENTION, got["report"]["attention_tflops"], strict=False
    ):
        assert 4.0 * bh * s * s * hd / 1e9 == pytest.approx(gflop)
        predicted = flash_time(gflop * 1e9, device, "fp32", dc)
        assert predicted == pytest.approx(gflop / tflops / 1e3, rel=0.05)


def test_device_names_find_their_presets() -> None:
    assert preset_of("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert preset_of("NVIDIA H200") == "h200-sxm"
    assert preset_of("NVIDIA A100-SXM4-80GB") == "a100-sxm-80gb"
    assert preset_of("NVIDIA GeForce RTX 4090") is None


def test_calibrate_device_writes_a_cluster_and_refuses_what_it_cannot_measure(
    tmp_path: Path,
) -> None:
    from dmsc.cli.runtime import calibrate_device
    from dmsc.spec import SpecError

    out = tmp_path / "one.yaml"
    calibrate_device("cpu", str(out), quick=True)
    cluster = ClusterSpec.model_validate(yaml.safe_load(out.read_text()))
    assert cluster.device_types["cpu"].measured is not None
    with pytest.raises(SpecError, match="no CUDA device here"):
        calibrate_device("cuda", str(out), quick=True)
    res = run_dmsc("calibrate", "--device", "tpu", home=tmp_path)
    assert res.returncode == 2 and "--device: 'tpu': expected cpu, cuda or cuda:N" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_fast_small_kernel_is_given_back_its_measured_time() -> None:
    """The fastest kernel measured is a small one (49 us, 10x the 5 us kernel overhead): the
    curve and the peak must give its time back, not its time plus the overhead (the peak was
    the fastest rate with the overhead in; that kernel's share was capped at 1)."""
    from dmsc.runtime.compute.device_calibration import _curve, measured_peaks

    overhead = DEFAULT_CALIBRATION.generation("generic").kernel_overhead_s
    points = [(0.002, 0.002e9 / 49e-6), (0.0335, 0.0335e9 / 1.1e-3)]
    peaks = measured_peaks({"fp32": points}, [(0.001, 0.001e9 / 60e-6)], "fp32", overhead)
    curve = _curve(points, peaks["fp32"] * 1e12, overhead)
    for (g, rate), (_, share) in zip(points, curve, strict=True):
        predicted = g * 1e9 / (peaks["fp32"] * 1e12 * share) + overhead
        assert predicted == pytest.approx(g * 1e9 / rate, rel=1e-3)


def test_the_host_time_to_issue_a_kernel_is_measured_and_printed() -> None:
    """calibrate --device cuda writes the host's time per kernel (as the cost model counts them)
    into the spec; here the same measurement runs on the CPU, which issues its own work (so the
    CPU's spec gets none: its kernel overhead is op_overhead_us)."""
    from dmsc.runtime.compute.device_calibration import measure_host_op, report_lines

    for model in ("llama-mini", "gpt-mini"):
        seconds = measure_host_op("cpu", model, repeats=3)
        assert 0 < seconds < 0.1  # a CPU computes its 8 tokens too: a loose, noisy figure here
    got = measure_device("cpu", quick=True)
    assert "host_op_us" not in got["spec"] and "host_op_us" not in got["report"]
    lines = report_lines({**got["report"], "host_op_us": {"llama-mini": 61.5}})
    assert lines[-1].endswith("llama-mini block 61.5")
    assert report_lines(got["report"])[-1].startswith("copies GB/s: ")


def test_shapes_of_equal_flops_make_one_point_of_a_valid_curve() -> None:
    """On an H100 `dmsc calibrate --device cuda` (no --quick) failed: 8192x4096x16384 and
    8192^3 are both 1099.5 GFLOP, and a curve's sizes must increase. Equal sizes are one point
    (their mean rate)."""
    from dmsc.runtime.compute.device_calibration import GPU_SHAPES, _curve

    sizes = [2.0 * m * k * n / 1e9 for m, k, n in GPU_SHAPES]
    assert len(set(sizes)) < len(sizes)  # the shapes calibrate times do repeat a size
    points = [(g, 500e12 + 10e12 * i) for i, g in enumerate(sizes)]
    curve = _curve(points, 1000e12, 0.0)
    assert len(curve) == len(set(sizes))
    assert all(b[0] > a[0] for a, b in itertools.pairwise(curve))
    equal = [r for g, r in points if round(g, 6) == round(sizes[4], 6)]
    assert [c[1] for c in curve if c[0] == round(sizes[4], 6)] == [sum(equal) / 2 / 1e15]
    spec = {"peak_tflops": {"bf16": 1000}, "memory_gib": 80, "memory_bw_gbyte_s": 3000}
    ClusterSpec.model_validate(
        one_device_cluster("gpu", {**spec, "measured": {"source": "test", "gemm": {"bf16": curve}}})
    )


def test_the_host_side_of_an_exchange_is_measured_into_the_spec() -> None:
    """calibrate --device cuda measures what the runtime's host-side exchange work runs at: a
    gradient's copy to the host and back, and one thread's host memory bandwidth; the spec
    carries both and the cost model prices a GPU's codec passes with them
    (tests/netmodel/test_sync.py). Here the same measurement on the CPU (a copy in memory
    stands for the device's), checked against a copy timed here at one thread: the same
    figure within this machine's noise."""
    import time

    import torch

    from dmsc.runtime.compute.device_calibration import measure_host_side

    side = measure_host_side(torch.device("cpu"), repeats=5, nbytes=16 * 1024 * 1024)
    assert set(side) == {"copy_gbyte_s", "memory_gbyte_s", "gaussian_ns", "mask_ns", "lowrank_ns"}
    assert all(v > 0.1 for v in side.values())
    src, dst = (
        torch.empty(16 * 1024 * 1024, dtype=torch.uint8),
        torch.empty(16 * 1024 * 1024, dtype=torch.uint8),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    reference = 2 * src.numel() / sorted(times)[3] / 1e9
    assert 0.2 < side["memory_gbyte_s"] / reference < 5  # a shared 2-core machine: loose
    got = measure_device("cpu", quick=True)  # a CPU is its own host: no such figures
    assert "host_memory_bw_gbyte_s" not in got["spec"]


def test_the_host_op_slope_pairs_its_runs_so_a_drifting_host_cancels_out() -> None:
    """A host that slows down steadily while it is timed (here by a clock: each run takes its
    own length plus 1 ms more than the run before) moved the sequential figure (every short
    run, then every long one) by all the drift between the two halves; adjacent pairs keep
    only one run's worth."""
    from dmsc.runtime.compute.device_calibration import paired_difference

    calls = [0]

    def timed(length: float) -> float:
        calls[0] += 1
        return length + 1e-3 * calls[0]

    diff, t_long = paired_difference(lambda: timed(0.010), lambda: timed(0.030), repeats=20)
    assert diff == pytest.approx(0.020 + 1e-3)  # the true difference, and one run of drift
    assert 0.030 < t_long < 0.030 + 1e-3 * calls[0]
    calls[0] = 0  # the same clock timed the old way: the drift of 22 runs in the difference
    shorts = [timed(0.010) for _ in range(22)][2:]
    longs = [timed(0.030) for _ in range(22)][2:]
    assert statistics.median(longs) - statistics.median(shorts) == pytest.approx(0.020 + 0.022)
