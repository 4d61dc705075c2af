from __future__ import annotations

import pytest

from dmsc.netmodel import DEFAULT_CALIBRATION, Gemm
from dmsc.netmodel.compute import DtypeUnsupported, gemm_time, peak_flops, wave_efficiency
from dmsc.spec import DeviceTypeSpec

A100 = DeviceTypeSpec(
    peak_tflops={"fp16": 312, "tf32": 156},
    memory_gib=80,
    memory_bw_gbyte_s=2039,
    sm_count=108,
    generation="a100",
)
C = DEFAULT_CALIBRATION.for_device(A100)


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
    epilogue = 2 * 8192 * 27648 / (2039e9 * C.memory_efficiency)  # the output tiles' stores
    expected = g.flops / (312e12 * C.gemm_efficiency) + epilogue + C.kernel_overhead_s
    assert gemm_time(g, A100, "fp16", C) == pytest.approx(expected)


def test_gemm_efficiency_grows_with_the_inner_dimension() -> None:
    """The output tiles' stores weigh less as k grows: the H200's measured cuBLAS times
    (benchmarks/results/gpu_h200.json) rise from 0.63 of peak at k=1024 to 0.75 at k=12288."""
    h200 = DeviceTypeSpec(preset="h200-sxm")
    dc = DEFAULT_CALIBRATION.for_device(h200)

    def eff(k: int) -> float:
        g = Gemm(8192, 8192, k)
        return g.flops / gemm_time(g, h200, "bf16", dc) / 989e12

    assert eff(1024) < eff(4096) < eff(12288)
    assert eff(12288) / eff(1024) == pytest.approx(0.75 / 0.63, rel=0.1)


def test_measured_curve_replaces_the_generation_constants() -> None:
    """A device spec's measured efficiency (issue 13, item 4) is what a GEMM of that size gets,
    interpolated in log(GFLOP), in place of the generation's efficiency and quantization."""
    measured = {
        "source": "test",
        "gemm": {"bf16": [[1.0, 0.4], [100.0, 0.8]]},
        "attention": {"bf16": [[10.0, 0.5]]},
        "memory": 0.9,
        "framework_gib": 0.5,
    }
    dev = DeviceTypeSpec(preset="h100-sxm", measured=measured)
    dc = DEFAULT_CALIBRATION.for_device(dev)
    assert dc.memory_efficiency == 0.9 and dc.framework_bytes == 0.5 * 2**30
    g = Gemm(2000, 2500, 1000)  # 10 GFLOP: halfway in log between 1 and 100 -> 0.6
    assert g.flops == 10e9
    t = gemm_time(g, dev, "bf16", dc)
    assert t == pytest.approx(10e9 / (989e12 * 0.6) + dc.kernel_overhead_s)
    assert dc.gemm_fraction("bf16", 0.01) == 0.4 and dc.gemm_fraction("bf16", 1e4) == 0.8
    assert dc.gemm_fraction("fp8", 10) is None  # not measured: the generation's fp8 figure
    assert dc.attention_fraction("bf16", 1e3) == 0.5


def test_a_measured_rate_is_not_capped_by_the_streaming_memory_bandwidth() -> None:
    """A small product measured at some rate runs at that rate, even where the device's measured
    (streaming copy) memory bandwidth would make it memory-bound: its operands were in cache
    when it was measured. (The calibration test failed on a loaded machine, where the copy ran
    slowly and the roofline made the model slower than the measurement.)"""
    measured = {"source": "test", "gemm": {"fp32": [[0.002, 0.1], [2.0, 0.5]]}}
    dev = DeviceTypeSpec(peak_tflops={"fp32": 0.2}, memory_gib=8, memory_bw_gbyte_s=0.5,
                         measured=measured)  # fmt: skip
    dc = DEFAULT_CALIBRATION.for_device(dev)
    g = Gemm(64, 128, 128)  # 2.1 MFLOP, 131 kB of operands: 0.26 ms at the copy's 0.5 GB/s
    t = gemm_time(g, dev, "fp32", dc)
    share = dc.gemm_fraction("fp32", g.flops / 1e9)
    assert share is not None
    assert t == pytest.approx(g.flops / (0.2e12 * share) + dc.kernel_overhead_s)


def test_thin_gemm_is_memory_bound() -> None:
    g = Gemm(8192, 8192, 8)  # 8 FLOPs per element written
    t = gemm_time(g, A100, "fp16", C)
    nbytes = 2 * (8192 * 8 * 2 + 8192 * 8192)
    t_memory = nbytes / (2039e9 * C.memory_efficiency) + C.kernel_overhead_s
    assert t_memory <= t <= 1.1 * t_memory  # the stores of C are the time; k adds little


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


def test_hopper_gemms_have_no_wave_quantization() -> None:
    """A100's cuBLAS tiles leave a ragged last wave idle; Hopper's persistent kernels balance
    the tiles over the SMs (the H200's measured times follow no quantization), so there a GEMM
    one tile column wider costs in proportion to its FLOPs."""
    h100 = DeviceTypeSpec(preset="h100-sxm")
    dh = DEFAULT_CALIBRATION.for_device(h100)
    full, ragged = Gemm(2048, 3456, 8192), Gemm(2048, 3584, 8192)
    assert wave_efficiency(ragged, 132, dh) == 1.0
    assert wave_efficiency(ragged, 108, C) < 0.8  # the A100 constants keep the waves
    per_flop = [gemm_time(g, h100, "bf16", dh) / g.flops for g in (full, ragged)]
    assert per_flop[1] == pytest.approx(per_flop[0], rel=0.01)


def test_a_small_layer_takes_the_hosts_time_to_issue_its_kernels() -> None:
    """On a fast GPU a small model's layers are bound by the host issuing their kernels (gpu_check
    on an H100: a 345M Llama's step kept the GPU busy 99 of 332 ms). With a measured host time
    per kernel the layer takes at least kernels x that time; a large layer is unchanged."""
    from dmsc.netmodel import build_layer_costs
    from dmsc.netmodel.compute import issued_kernels, layer_time
    from dmsc.spec import JobSpec, resolve_model

    h100 = DeviceTypeSpec(preset="h100-sxm")
    host = h100.model_copy(update={"host_op_us": 50.0})
    job = JobSpec(global_batch=1, micro_batch=1, precision="autocast")
    small = build_layer_costs(resolve_model("gpt-mini"), job)[1]
    fast = layer_time(small, h100, "bf16", "none", DEFAULT_CALIBRATION)
    bound = layer_time(small, host, "bf16", "none", DEFAULT_CALIBRATION)
    n = issued_kernels(small)
    assert fast.forward < n * 50e-6  # the device alone would be faster than the host
    assert bound.forward == pytest.approx(n * 50e-6)
    assert bound.backward == pytest.approx(2 * n * 50e-6)
    big = build_layer_costs(resolve_model("gpt3-175b"), job)[1]
    assert layer_time(big, host, "bf16", "none", DEFAULT_CALIBRATION) == layer_time(
        big, h100, "bf16", "none", DEFAULT_CALIBRATION
    )


def test_a_mixtures_routing_is_priced_per_routed_element_each_way() -> None:
    """moe-mini's block measured 12.4 ms a micro-batch of four on this project's CPU against a
    predicted 10.1 while its routing, dispatch and combine went unpriced (2026-12-05). Each
    routed element (a token's hidden vector, once per expert it chose) now costs the device's
    measured ``dispatch_ns`` forward and backward, else DISPATCH_PASSES passes over memory; a
    dense block routes nothing."""
    from dmsc.netmodel import build_layer_costs
    from dmsc.netmodel.compute import DISPATCH_PASSES, layer_time
    from dmsc.spec import JobSpec, resolve_model

    cpu = DeviceTypeSpec(peak_tflops={"fp32": 0.05}, memory_gib=4, memory_bw_gbyte_s=20)
    measured = cpu.model_copy(update={"dispatch_ns": 6.0})
    job = JobSpec(global_batch=4, micro_batch=4)
    moe = build_layer_costs(resolve_model("moe-mini"), job)[1]
    dense = build_layer_costs(resolve_model("gpt-mini"), job)[1]
    assert moe.routed_elements == 4 * 128 * 2 * 128 and dense.routed_elements == 0
    bare = moe.__class__(**{**moe.__dict__, "routed_elements": 0.0})

    def fwd_bwd(layer: object, device: DeviceTypeSpec) -> tuple[float, float]:
        t = layer_time(layer, device, "fp32", "none", DEFAULT_CALIBRATION)  # type: ignore[arg-type]
        return t.forward, t.backward

    each_way = moe.routed_elements * 6e-9
    got, without = fwd_bwd(moe, measured), fwd_bwd(bare, measured)
    assert got[0] - without[0] == pytest.approx(each_way)
    assert got[1] - without[1] == pytest.approx(each_way)
    mem = 20e9 * DEFAULT_CALIBRATION.for_device(cpu).memory_efficiency
    passes = moe.routed_elements * DISPATCH_PASSES * 4 / mem
    assert fwd_bwd(moe, cpu)[0] - fwd_bwd(bare, cpu)[0] == pytest.approx(passes)
