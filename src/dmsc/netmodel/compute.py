"""Time of the compute kernels of a layer on one device: a roofline with wave quantization.

A GEMM runs at ``peak x efficiency x quantization`` unless its bytes make it memory-bound; the
efficiency is the device generation's (fp8 GEMMs have their own), or the device's measured curve
at the GEMM's size when its spec has one (a measured curve already holds the quantization); the
quantization is the fraction of a device's SMs that its output tiles keep busy (NVIDIA, "Matrix
Multiplication Background" guide: tile and wave quantization). A fused (flash) attention kernel
runs at the generation's attention efficiency. Element-wise kernels stream their bytes at
``memory bandwidth x memory_efficiency``. Backward costs twice the forward (a GEMM for the input
gradient and one for the weight gradient, each as large as the forward one), plus what a flash
kernel computes again. A layer takes at least the time its host needs to issue its kernels (the
device's measured ``host_op_us``), which bounds small layers on a fast accelerator.

A mixture of experts also routes: the runtime's routing, dispatch and combine index every
routed element (a token's hidden vector, once per expert it chose) each way
(:mod:`dmsc.runtime.compute.mixture_rate`), at the device's measured ``dispatch_ns``, else as
:data:`DISPATCH_PASSES` passes over memory (:func:`dispatch_s`). Unpriced until 2026-12-05,
moe-mini's block measured 12.4 ms a micro-batch of four sequences on this project's CPU against
a predicted 10.1 (the index operations cost 5-7 ns per routed element each way there, where
their passes over memory come to about 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dmsc.netmodel.constants import DTYPE_BYTES, Calibration, DeviceCalibration
from dmsc.netmodel.layers import Gemm, LayerCost
from dmsc.spec.cluster import DeviceTypeSpec


class DtypeUnsupported(ValueError):
    """The device type has no peak rate for the model's data type."""


def peak_flops(device: DeviceTypeSpec, dtype: str) -> float:
    """Peak FLOP/s of ``device`` in ``dtype`` (fp32 math on tf32 units where only tf32 is given)."""
    if dtype in device.peak_tflops:
        return device.peak_tflops[dtype] * 1e12
    if dtype == "fp32" and "tf32" in device.peak_tflops:
        return device.peak_tflops["tf32"] * 1e12
    raise DtypeUnsupported(
        f"device has no peak_tflops for {dtype} (has {', '.join(device.peak_tflops)})"
    )


def _overhead(device: DeviceTypeSpec, dc: DeviceCalibration) -> float:
    """Fixed cost of one kernel: the device's measured figure, else the generation's."""
    if device.op_overhead_us is not None:
        return device.op_overhead_us * 1e-6
    return dc.kernel_overhead_s


def host_op_seconds(device: DeviceTypeSpec, dc: DeviceCalibration) -> float:
    """Host time to issue one kernel: the device's measured figure, else the generation's (0:
    none known)."""
    if device.host_op_us is not None:
        return device.host_op_us * 1e-6
    return dc.host_op_s


# Element passes over memory per routed element, each way, of the runtime's mixture
# (compute/expert_parallel.py): the tokens gathered in expert order (read, write), each
# expert's rows gathered (read, write), the answers' buffer zeroed and written in place, the
# answers weighted (read, write) and added up per token in place (read, read and write).
DISPATCH_PASSES = 10.0


def dispatch_s(device: DeviceTypeSpec, dtype: str, dc: DeviceCalibration) -> float:
    """Seconds per routed element, each way, of a mixture's routing, dispatch and combine on
    ``device``: its measured figure, else :data:`DISPATCH_PASSES` passes over memory of
    ``dtype`` elements (module docstring)."""
    if dc.dispatch_s is not None:
        return dc.dispatch_s
    return (
        DISPATCH_PASSES
        * DTYPE_BYTES[dtype]
        / (device.memory_bw_gbyte_s * 1e9 * dc.memory_efficiency)
    )


def issued_kernels(layer: LayerCost) -> int:
    """Kernels a layer's forward issues as the cost model counts them (each GEMM entry and each
    element-wise kernel); calibrate divides its measured host time by the same count."""
    return len(layer.gemms) + layer.elementwise_kernels


def wave_efficiency(gemm: Gemm, sm_count: int | None, dc: DeviceCalibration) -> float:
    """Useful fraction of the tile-waves a GEMM occupies (1.0 when the SM count is unknown)."""
    if sm_count is None or dc.gemm_tile_m is None:
        return 1.0
    tm, tn = dc.gemm_tile_m, dc.gemm_tile_n
    tiles_m, tiles_n = math.ceil(gemm.m / tm), math.ceil(gemm.n / tn)
    tiles = tiles_m * tiles_n * gemm.batch
    waves = math.ceil(tiles / sm_count)
    useful = gemm.m * gemm.n * gemm.batch
    return useful / (waves * sm_count * tm * tn)


def gemm_time(gemm: Gemm, device: DeviceTypeSpec, dtype: str, dc: DeviceCalibration) -> float:
    """Seconds for one GEMM (roofline of tensor-core compute and memory traffic, or the device's
    measured rate at that size); ``dtype`` is the model's, a GEMM that names its own (fp8) runs
    in that."""
    if gemm.flops == 0:
        return 0.0
    d = gemm.dtype or dtype
    measured = dc.gemm_fraction(d, gemm.flops / 1e9)
    if measured is not None:
        # A measured share is the whole rate reached at that size, memory traffic included (a
        # small product's operands sit in cache, faster than the streaming copy that measured
        # the memory bandwidth): no roofline over it.
        return gemm.flops / (peak_flops(device, d) * measured) + _overhead(device, dc)
    eff = dc.fp8_gemm_efficiency if d == "fp8" else dc.gemm_efficiency
    rate = peak_flops(device, d) * eff * wave_efficiency(gemm, device.sm_count, dc)
    nbytes = DTYPE_BYTES[d] * gemm.batch * (gemm.m * gemm.k + gemm.k * gemm.n + gemm.m * gemm.n)
    bw = device.memory_bw_gbyte_s * 1e9 * dc.memory_efficiency
    t_memory = nbytes / bw
    # After its main loop over k, each output tile is converted and stored (the epilogue), which
    # the main loop does not hide: a GEMM with a short k is slower per FLOP. On an H200 this
    # gives the measured cuBLAS times within a few percent from k = 1024 (0.63 of peak) to
    # k = 12288 (0.75) (benchmarks/results/gpu_h200.json).
    epilogue = DTYPE_BYTES[model_out(d)] * gemm.batch * gemm.m * gemm.n / bw
    return max(gemm.flops / rate + epilogue, t_memory) + _overhead(device, dc)


def model_out(dtype: str) -> str:
    """Type a GEMM writes its output in: fp8 GEMMs write 16-bit outputs."""
    return "bf16" if dtype == "fp8" else dtype


def flash_time(flops: float, device: DeviceTypeSpec, dtype: str, dc: DeviceCalibration) -> float:
    """Seconds of a fused attention kernel doing ``flops`` (one launch)."""
    if flops == 0:
        return 0.0
    rate = peak_flops(device, dtype) * dc.attention_fraction(dtype, flops / 1e9)
    return flops / rate + _overhead(device, dc)


@dataclass(frozen=True)
class LayerTime:
    """Compute seconds of one layer for one micro-batch on one device."""

    forward: float
    backward: float
    recompute: float  # extra forward work before the backward, under the recompute policy
    # Weight-gradient GEMMs of the column-parallel layers (QKV, first MLP matrix), which an
    # asynchronous tensor-parallel all-reduce of the input gradient runs under.
    wgrad_window: float = 0.0


# Layer times by (layer, device, dtype, recompute, calibration): a strategy search meets the same
# layer on the same device in every stage of many strategies (build_layer_costs hands out the
# same layer objects for them). Keyed by identity (a device spec holds dicts and is not
# hashable; hashing a layer's value costs more than the lookup saves); each entry keeps its
# objects, so that no id can be reused while the entry lives.
_CACHE_SIZE = 4096
_times: dict[tuple[object, ...], tuple[LayerCost, DeviceTypeSpec, Calibration, LayerTime]] = {}


def layer_time(
    layer: LayerCost,
    device: DeviceTypeSpec,
    dtype: str,
    recompute: str,
    calib: Calibration,
) -> LayerTime:
    """Forward, backward and recomputation time of ``layer`` on ``device``."""
    key = (id(layer), id(device), dtype, recompute, id(calib))
    hit = _times.get(key)
    if hit is not None and hit[0] is layer and hit[1] is device and hit[2] is calib:
        return hit[3]
    got = _layer_time(layer, device, dtype, recompute, calib)
    if len(_times) >= _CACHE_SIZE:
        _times.clear()
    _times[key] = (layer, device, calib, got)
    return got


def _layer_time(
    layer: LayerCost,
    device: DeviceTypeSpec,
    dtype: str,
    recompute: str,
    calib: Calibration,
) -> LayerTime:
    dc = calib.for_device(device)
    plain = [g for g in layer.gemms if g.kind != "flash"]
    flash_flops = sum(g.flops for g in layer.gemms if g.kind == "flash")
    gemm_s = sum(gemm_time(g, device, dtype, dc) for g in plain)
    gemm_s += flash_time(flash_flops, device, dtype, dc)
    mem_rate = device.memory_bw_gbyte_s * 1e9 * dc.memory_efficiency
    flop_rate = peak_flops(device, dtype) * dc.gemm_efficiency
    eltwise_s = layer.elementwise_bytes / mem_rate + layer.elementwise_kernels * _overhead(
        device, dc
    )
    if layer.routed_elements:  # a mixture's routing, each way (module docstring)
        eltwise_s += layer.routed_elements * dispatch_s(device, dtype, dc)
    other_s = layer.extra_flops / flop_rate
    forward = gemm_s + eltwise_s + other_s
    # A flash kernel's backward computes Q K^T again (2.5x its forward FLOPs in all).
    again_flops = sum(g.flops for g in layer.backward_recompute)
    flash_again = flash_time(again_flops, device, dtype, dc) - (
        _overhead(device, dc) if again_flops else 0.0
    )
    # Backward: two GEMMs per forward GEMM (input and weight gradients); the element-wise
    # kernels' backward streams about what their forward does (read the saved input and the
    # incoming gradient, write one gradient), which Korthikanti et al.'s per-layer times show
    # (Table 4, 22B: backward 11.9 ms for a 7.7 ms forward, not 2x).
    backward = 2 * (gemm_s + other_s) + eltwise_s + flash_again
    # An accelerator computes while its host issues the next kernels, so a layer takes at least
    # the host's time to issue its kernels: small layers are host-bound (a 345M Llama's step on
    # an H100 kept the GPU busy 99 of 332 ms; benchmarks/results/gpu_check_h100.json). Backward
    # issues two kernels per forward one, as calibrate counts them.
    host = host_op_seconds(device, dc)
    if host:
        kernels = issued_kernels(layer)
        forward = max(forward, kernels * host)
        backward = max(backward, 2 * kernels * host)
    window = 0.0
    if layer.kind in ("block", "moe_block") and len(plain) >= 3:
        column = (plain[0], layer.gemms[4] if len(layer.gemms) > 4 else plain[-1])
        window = sum(gemm_time(g, device, dtype, dc) for g in column)
    if recompute == "full":
        again = forward
    elif recompute == "selective" and not layer.backward_recompute:
        # The attention core only: scores, softmax, dropout, probabilities x V (gemms 1 and 2).
        again = layer.recompute_bytes / mem_rate if layer.recompute_flops else 0.0
        if layer.recompute_flops:
            again += sum(gemm_time(g, device, dtype, dc) for g in layer.gemms[1:3])
    else:
        again = 0.0
    return LayerTime(forward, backward, again, window)
