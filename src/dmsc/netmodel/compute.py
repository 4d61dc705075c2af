"""Time of the compute kernels of a layer on one device: a roofline with wave quantization.

A GEMM runs at ``peak x gemm_efficiency x quantization`` unless its bytes make it memory-bound;
the quantization is the fraction of a device's SMs that its output tiles keep busy (NVIDIA, "Matrix
Multiplication Background" guide: tile and wave quantization). Element-wise kernels stream their
bytes at ``memory bandwidth x memory_efficiency``. Backward costs twice the forward (a GEMM for the
input gradient and one for the weight gradient, each as large as the forward one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dmsc.netmodel.constants import DTYPE_BYTES, Calibration
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


def _overhead(device: DeviceTypeSpec, calib: Calibration) -> float:
    """Fixed cost of one kernel: the device's measured figure, else the calibration's."""
    if device.op_overhead_us is not None:
        return device.op_overhead_us * 1e-6
    return calib.kernel_overhead_s


def wave_efficiency(gemm: Gemm, sm_count: int | None, calib: Calibration) -> float:
    """Useful fraction of the tile-waves a GEMM occupies (1.0 when the SM count is unknown)."""
    if sm_count is None:
        return 1.0
    tm, tn = calib.gemm_tile_m, calib.gemm_tile_n
    tiles_m, tiles_n = math.ceil(gemm.m / tm), math.ceil(gemm.n / tn)
    tiles = tiles_m * tiles_n * gemm.batch
    waves = math.ceil(tiles / sm_count)
    useful = gemm.m * gemm.n * gemm.batch
    return useful / (waves * sm_count * tm * tn)


def gemm_time(gemm: Gemm, device: DeviceTypeSpec, dtype: str, calib: Calibration) -> float:
    """Seconds for one GEMM (roofline of tensor-core compute and memory traffic)."""
    if gemm.flops == 0:
        return 0.0
    nbytes = DTYPE_BYTES[dtype] * gemm.batch * (gemm.m * gemm.k + gemm.k * gemm.n + gemm.m * gemm.n)
    rate = peak_flops(device, dtype) * calib.gemm_efficiency
    t_compute = gemm.flops / (rate * wave_efficiency(gemm, device.sm_count, calib))
    t_memory = nbytes / (device.memory_bw_gbyte_s * 1e9 * calib.memory_efficiency)
    return max(t_compute, t_memory) + _overhead(device, calib)


@dataclass(frozen=True)
class LayerTime:
    """Compute seconds of one layer for one micro-batch on one device."""

    forward: float
    backward: float
    recompute: float  # extra forward work before the backward, under the recompute policy


def layer_time(
    layer: LayerCost,
    device: DeviceTypeSpec,
    dtype: str,
    recompute: str,
    calib: Calibration,
) -> LayerTime:
    """Forward, backward and recomputation time of ``layer`` on ``device``."""
    gemm_s = sum(gemm_time(g, device, dtype, calib) for g in layer.gemms)
    mem_rate = device.memory_bw_gbyte_s * 1e9 * calib.memory_efficiency
    flop_rate = peak_flops(device, dtype) * calib.gemm_efficiency
    eltwise_s = layer.elementwise_bytes / mem_rate + layer.elementwise_kernels * _overhead(
        device, calib
    )
    other_s = layer.extra_flops / flop_rate
    forward = gemm_s + eltwise_s + other_s
    flash_again = sum(gemm_time(g, device, dtype, calib) for g in layer.backward_recompute)
    backward = 2 * forward + flash_again
    if recompute == "full":
        again = forward
    elif recompute == "selective" and not layer.backward_recompute:
        # The attention core only: scores, softmax, dropout, probabilities x V (gemms 1 and 2).
        again = layer.recompute_bytes / mem_rate if layer.recompute_flops else 0.0
        if layer.recompute_flops:
            again += sum(gemm_time(g, device, dtype, calib) for g in layer.gemms[1:3])
    else:
        again = 0.0
    return LayerTime(forward, backward, again)
