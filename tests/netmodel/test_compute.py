from __future__ import annotations

import pytest

from dmsc.netmodel import DEFAULT_CALIBRATION, Gemm
from dmsc.netmodel.compute import DtypeUnsupported, gemm_time, peak_flops, wave_efficiency
from dmsc.spec import DeviceTypeSpec

C = DEFAULT_CALIBRATION
A100 = DeviceTypeSpec(
    peak_tflops={"fp16": 312, "tf32": 156}, memory_gib=80, memory_bw_gbyte_s=2039, sm_count=108
)


def test_wave_quantization_by_hand() -> None:
    # 2048 x 3456 output in 256 x 128 tiles: 8 x 27 = 216 tiles = exactly 2 waves of 108 SMs.
    assert wave_efficiency(Gemm(2048, 3456, 1024), 108, C) == pytest.approx(1.0)
    # One more column of tiles: 224 tiles -> 3 waves, 224 useful tile slots of 324.
    g = Gemm(2048, 3584, 1024)
    assert wave_efficiency(g, 108, C) == pytest.approx(224 / 324)
    # A ragged edge wastes the unused part of the last tile row.
    assert wave_efficiency(Gemm(300, 128, 64), None, C) == 1.0
    assert wave_efficiency(Gemm(300, 128, 64), 2, C) == pytest.approx(300 / 512)


def test_large_gemm_runs_at_the_calibrated_rate() -> None:
    g = Gemm(8192, 27648, 8192)  # 64 x 216 tiles = 128 full waves
    expected = g.flops / (312e12 * C.gemm_efficiency) + C.kernel_overhead_s
    assert gemm_time(g, A100, "fp16", C) == pytest.approx(expected)


def test_thin_gemm_is_memory_bound() -> None:
    g = Gemm(8192, 8192, 8)  # 8 FLOPs per element written
    t = gemm_time(g, A100, "fp16", C)
    nbytes = 2 * (8192 * 8 * 2 + 8192 * 8192)
    assert t == pytest.approx(nbytes / (2039e9 * C.memory_efficiency) + C.kernel_overhead_s)


def test_efficiency_grows_with_size() -> None:
    rates = []
    for n in (256, 1024, 4096, 16384):
        g = Gemm(n, n, n)
        rates.append(g.flops / gemm_time(g, A100, "fp16", C))
    assert rates == sorted(rates)
    assert rates[-1] <= 312e12 * C.gemm_efficiency


def test_peak_by_dtype() -> None:
    assert peak_flops(A100, "fp32") == 156e12  # fp32 math on tf32 tensor cores
    with pytest.raises(DtypeUnsupported, match="bf16"):
        peak_flops(A100, "bf16")
