"""The calibration of the cost model: the constants that are not in a spec, with sources.

Compute constants come per device generation (:class:`DeviceCalibration`: A100, H100, H200, B200
and a generic one for anything else), communication constants once. A device type picks its
generation (``generation`` or ``preset`` in the cluster spec, else its name), and measured curves
in its spec (``measured``, written by ``dmsc calibrate``) take precedence over the generation's.
Every validation set of a generation is predicted with that generation's constants unchanged
(benchmarks/validate_costmodel.py; the figures below are kept equal to it by a test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dmsc.spec.cluster import DeviceTypeSpec

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
GIB = 1024**3


@dataclass(frozen=True)
class Validated:
    """Where a calibration was checked against measurement: the published set, the device it ran
    on, and the error of the predicted throughput there (kept equal to what
    :mod:`dmsc.netmodel.validation` computes by a test)."""

    set_name: str
    source: str
    device: str
    rows: int
    mean_abs_error_pct: float
    max_abs_error_pct: float


Curve = tuple[tuple[float, float], ...]


def interpolate(curve: Curve, gflop: float) -> float:
    """The curve's fraction at ``gflop``: linear in log(gflop), flat beyond the end points."""
    if gflop <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in pairwise(curve):
        if gflop <= x1:
            w = (math.log(gflop) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return curve[-1][1]


LOWRANK_RANK = 4  # the rank a device spec's ``lowrank_ns`` (PowerSGD's products) is measured at


@dataclass(frozen=True)
class DeviceCalibration:
    """Achievable fractions of peak and fixed costs of real kernels on one device generation."""

    generation: str
    # Sustained fraction of the 16-bit tensor-core peak that cuBLAS GEMMs of transformer shapes
    # reach under training load (clocks settle below boost), before wave quantization.
    gemm_efficiency: float
    # The same for fp8 GEMMs (Transformer Engine / cuBLASLt), of the fp8 peak.
    fp8_gemm_efficiency: float
    # A fused (flash) attention kernel's share of the 16-bit peak, forward; its backward is
    # costed as 2.5 forwards (FlashAttention-2, Dao 2023, sec. 4: backward is 2.5x the forward
    # FLOPs with the Q K^T recomputation, at about the same rate).
    attention_efficiency: float
    # Memory-bound element-wise kernels (norms, activations, residual adds, optimizer) stream at
    # this share of the HBM peak.
    memory_efficiency: float
    # Fixed cost of one kernel launch (CUDA launch plus tail).
    kernel_overhead_s: float
    # Host time to issue one kernel (eager PyTorch's dispatch and launch), a floor under a
    # layer's time: 0 where not known (a device spec's measured ``host_op_us`` replaces it).
    host_op_s: float = 0.0
    # The host side of a device the runtime computes on off the CPU (cuda): the runtime's
    # data-parallel codecs and the leader's rules run on the host (the gradient copied down,
    # the answer copied back), so their passes go at the host's memory bandwidth and the
    # copies at the host link's rate. ``host_memory_bytes_s``: one worker thread's tensor copy
    # (read + write; the workers run one thread, WorkerConfig.threads): 19-22 GB/s measured on
    # this project's x86 server core (dmsc.runtime.compute.calibrate.measure_memory_bandwidth at
    # one thread, 2026-12-03). ``host_copy_bytes_s``: a device-host copy one way; an H100's PCIe
    # Gen5 x16 moved 53.6 GB/s down and 54.6 up (pinned; gpu_check_h100.json), and a PCIe Gen4
    # x16 part half of it. A device spec's measured ``host_memory_bw_gbyte_s`` and
    # ``host_copy_gbyte_s`` (dmsc calibrate --device cuda) replace both.
    host_memory_bytes_s: float = 20e9
    host_copy_bytes_s: float = 27e9
    # One host thread's time to draw an fp32 Gaussian (torch.randn with a generator: central
    # DP's noise at the leader), compute-bound: 5.2-7.6 ns on this project's x86 core
    # (2026-12-03); a device spec's measured ``gaussian_ns`` replaces it.
    gaussian_s: float = 6e-9
    # One host thread's time to expand one element of a pair's secure-aggregation mask (a
    # ChaCha20 keystream through `cryptography`'s OpenSSL, 4 bytes, widened to int64):
    # 1.4 ns on this project's x86 core (2026-12-04); a device spec's ``mask_ns`` replaces it.
    mask_s: float = 1.4e-9
    # One host thread's time, per element of a gradient matrix, for PowerSGD's four rank-4
    # products with it (and the QR between) as the runtime's codec runs them
    # (dmsc.runtime.compute.host_rates): 2.97-3.37 ns on this project's x86 core, a 4M-element
    # matrix (2026-12-04); a device spec's measured ``lowrank_ns`` replaces it.
    lowrank_s: float = 3e-9
    # The device's time per routed element (a token's hidden vector to one of its experts) of
    # the runtime's mixture routing, dispatch and combine, each way (dmsc.netmodel.compute:
    # ``dispatch_s``); None: priced as passes over memory. A device spec's measured
    # ``dispatch_ns`` sets it.
    dispatch_s: float | None = None
    # Output tile of a tensor-core GEMM for the wave quantization (NVIDIA GEMM guide: 256 x 128
    # is cuBLAS's most efficient tile on A100); None where the library's persistent kernels
    # balance tiles over the SMs (Hopper, Blackwell: cuBLAS times on an H200 follow no
    # quantization, gpu_h200.json: 1.5x spread of measured/predicted over its GEMMs without it,
    # 2.0x with 256 x 128 waves).
    gemm_tile_m: int | None = 256
    gemm_tile_n: int = 128
    # Device memory in use outside tensors: the CUDA context, cuBLAS/cuDNN workspaces and NCCL
    # buffers; 0 for devices that are not GPUs.
    framework_bytes: float = 0.0
    # Memory the caching allocator holds beyond the live tensors at the peak (fragmentation of
    # blocks of different sizes), as a share of the live tensors.
    allocator_overhead: float = 0.0
    sources: str = ""
    validated: tuple[Validated, ...] = ()
    # Measured curves (from a device spec's ``measured``): they replace the efficiencies above.
    gemm_curves: tuple[tuple[str, Curve], ...] = ()
    attention_curves: tuple[tuple[str, Curve], ...] = ()
    measured_source: str | None = None

    def gemm_fraction(self, dtype: str, gflop: float) -> float | None:
        """The measured share of peak of a GEMM of ``gflop`` in ``dtype``, if one was measured."""
        for name, curve in self.gemm_curves:
            if name == dtype:
                return interpolate(curve, gflop)
        return None

    def attention_fraction(self, dtype: str, gflop: float) -> float:
        for name, curve in self.attention_curves:
            if name == dtype:
                return interpolate(curve, gflop)
        return self.attention_efficiency


# Framework memory of a GPU process: CUDA context about 0.5 GiB with lazy module loading (PyTorch
# "CUDA semantics" notes; nvidia-smi of an idle torch process on A100/H100 shows 0.5-0.6 GiB), the
# cuBLAS workspace (32 MiB per stream on Hopper, torch's CUBLAS_WORKSPACE_CONFIG default) and NCCL
# communicator buffers (NCCL_BUFFSIZE 4 MiB per channel and peer): 1 GiB together. The caching
# allocator's fragmentation at the peak: 5% of live tensors (PyTorch memory snapshots of
# transformer training show reserved/allocated of 1.03-1.10).
_GPU_FRAMEWORK = 1.0 * GIB
_GPU_FRAGMENTATION = 0.05

A100 = DeviceCalibration(
    generation="a100",
    # Fitted to the two A100 sets together (Megatron-LM SC'21 Table 1, Korthikanti et al. 2023):
    # 0.72 of peak in the main loop, within the 220-250 of 312 TFLOP/s cuBLAS sustains on
    # transformer shapes; MAMF (Bekman, "Machine Learning Engineering") measures at most 271
    # (0.87) on the best square shapes.
    gemm_efficiency=0.72,
    fp8_gemm_efficiency=0.75,  # no fp8 on A100; unused
    # FlashAttention-2 on A100: 187-225 TFLOP/s forward+backward at head dim 128 (Dao 2023,
    # fig. 4-6): 0.6-0.72 of peak. No A100 set here runs flash: not fitted.
    attention_efficiency=0.62,
    # STREAM-like copies on A100 80GB reach ~1.7 of 2.0 TB/s.
    memory_efficiency=0.85,
    kernel_overhead_s=5e-6,
    framework_bytes=_GPU_FRAMEWORK,
    allocator_overhead=_GPU_FRAGMENTATION,
    sources="SC'21 and MLSys'23 fit; FlashAttention-2 paper; MAMF; NVIDIA A100 datasheet",
    validated=(
        Validated("megatron-sc21", "Megatron-LM SC'21 Table 1", "A100 80GB", 10, 2.5, 6.6),
        Validated("korthikanti-mlsys23", "Korthikanti et al. MLSys'23", "A100 80GB", 8, 5.4, 9.2),
    ),
)

H100 = DeviceCalibration(
    gemm_tile_m=None,
    generation="h100",
    # The three constants below are fitted together to the three H100 sets (Megatron-Core bf16,
    # NeMo 24.07 fp8, Llama 3 405B bf16: 18 rows), one set for the generation.
    # bf16: 0.55 of peak in the main loop (544 of 989 TFLOP/s), with the output stores on top.
    # In isolation on an H200, cuBLAS main loops run at about 0.77 of peak (gpu_h200.json): a
    # GEMM alone on one GPU boosts its clock; eight in a node under the 700 W cap sustain less.
    # MAMF bf16 on H100 SXM: 794 of 989 TFLOP/s at best.
    gemm_efficiency=0.55,
    # fp8: the same share of the fp8 peak (1088 of 1979 TFLOP/s); MAMF measures 1403 (0.71) at
    # best.
    fp8_gemm_efficiency=0.55,
    # The fused attention kernel, counted on the full s x s products of forward and backward
    # (the model FLOPs the published tables count). FlashAttention-2 runs at 335-350 TFLOP/s
    # (0.35) and FlashAttention-3, the Hopper kernel cuDNN's fused attention in Transformer
    # Engine resembles, at 0.55-0.75 forward (Shah et al. 2024, fig. 5); a causal kernel skips
    # about half of the products, which this effective share absorbs.
    attention_efficiency=0.45,
    # HBM3 copies on H100 SXM reach ~2.9-3.0 of 3.35 TB/s (an H200 copies at 0.85 of 4.8 TB/s,
    # gpu_h200.json).
    memory_efficiency=0.88,
    kernel_overhead_s=4e-6,
    host_copy_bytes_s=54e9,  # PCIe Gen5 x16 (gpu_check_h100.json)
    framework_bytes=_GPU_FRAMEWORK,
    allocator_overhead=_GPU_FRAGMENTATION,
    sources="Megatron-Core, NeMo 24.07 and Llama 3 H100 fit; MAMF; FlashAttention-3 paper; "
    "NVIDIA H100 datasheet",
    # Restated when the data-parallel all-reduce became a timeline of buckets behind the
    # backward (netmodel/dp_buckets.py); before it: 4.1/7.2, 4.8/7.7 and 4.1/4.9 (mean/max %).
    # Megatron-Core's and NeMo's rows then priced in Megatron-Core's own buckets
    # (validation.megatron_core_bucket_bytes), not dmsc's 4 MiB: megatron-core-h100 4.5/9.3 ->
    # 4.5/9.4 (its last bucket, the embedding's, larger), nemo-h100-fp8 unchanged at 3.9/7.9.
    # Sequence parallelism then priced call for call (an all-gather and a reduce-scatter for
    # each all-reduce, netmodel/tp_calls.py): megatron-core-h100 4.5/9.4 -> 4.5/9.5,
    # nemo-h100-fp8 3.9/7.9 -> 3.9/8.0, llama3-405b 3.2/3.5 -> 3.1/3.5.
    validated=(
        Validated(
            "megatron-core-h100", "Megatron-LM README H100 weak scaling", "H100 80GB", 9, 4.5, 9.5
        ),
        Validated("nemo-h100-fp8", "NeMo 24.07 DGX-H100 FP8", "H100 80GB", 7, 3.9, 8.0),
        Validated("llama3-405b", "Llama 3 Herd of Models Table 4", "H100 80GB", 2, 3.1, 3.5),
    ),
)

# H200: the H100's chip and clocks with HBM3e (4.8 TB/s): the same kernel efficiencies, more
# bandwidth in the spec. No published set of its own here.
H200 = replace(
    H100, generation="h200", validated=(), sources="H100 constants; NVIDIA H200 datasheet"
)

B200 = DeviceCalibration(
    gemm_tile_m=None,
    generation="b200",
    # MAMF on B200: 1745 of 2250 TFLOP/s bf16 (0.78); the H100's ratio of training level to
    # MAMF (0.60 / 0.80) carried over. Not checked on a bf16 set.
    gemm_efficiency=0.58,
    # fp8 and attention: fitted to the two NeMo 25.02 DGX-B200 FP8 rows, the only public B200
    # figures this model can express (MAMF fp8: 3433 of 4500, 0.76, at best). Two constants on
    # two rows: a calibration, not a held-out validation.
    fp8_gemm_efficiency=0.55,
    attention_efficiency=0.45,
    memory_efficiency=0.88,
    kernel_overhead_s=4e-6,
    host_copy_bytes_s=54e9,  # PCIe Gen5 x16, as the H100's
    framework_bytes=_GPU_FRAMEWORK,
    allocator_overhead=_GPU_FRAGMENTATION,
    sources="MAMF (Bekman); NeMo 25.02 DGX-B200 FP8 fit; NVIDIA HGX B200 datasheet",
    # restated with the bucketed data-parallel all-reduce (netmodel/dp_buckets.py; 1.2/1.9 before)
    # (sequence parallelism priced call for call: 0.8/1.1 -> 0.6/0.7)
    validated=(Validated("nemo-b200-fp8", "NeMo 25.02 DGX-B200 FP8", "B200", 2, 0.6, 0.7),),
)

# Anything else (CPUs, other accelerators): the A100's kernel efficiencies, no GPU framework
# memory. ``dmsc calibrate`` divides what it measures by these, so predictions on the calibrated
# spec hold whatever they are. The A100's validation does not carry over (no published set ran
# on these devices).
GENERIC = replace(
    A100,
    generation="generic",
    framework_bytes=0.0,
    allocator_overhead=0.0,
    sources="A100 kernel efficiencies; no validation",
    validated=(),
)


@dataclass(frozen=True)
class Calibration:
    """Per-generation compute constants and the communication constants of the cost model."""

    name: str = "default"
    generations: tuple[DeviceCalibration, ...] = (A100, H100, H200, B200, GENERIC)
    # Bus bandwidth NCCL reaches as a fraction of the link rate: ~230 of 300 GB/s on NVLink3
    # (nccl-tests all_reduce_perf on DGX A100), ~23.5 of 25 GB/s on HDR InfiniBand.
    intra_node_link_efficiency: float = 0.77
    network_link_efficiency: float = 0.92
    inter_dc_link_efficiency: float = 0.95
    # Fixed cost of one collective call (launch and synchronisation), NCCL's base latency ~10 us.
    collective_overhead_s: float = 10e-6

    def generation(self, name: str) -> DeviceCalibration:
        for g in self.generations:
            if g.generation == name:
                return g
        return next(g for g in self.generations if g.generation == "generic")

    def for_device(self, device: DeviceTypeSpec) -> DeviceCalibration:
        """The constants of ``device``: its generation's, with what its spec measured on top."""
        base = self.generation(device.generation or "generic")
        host = {
            key: getattr(device, field) * 1e9
            for key, field in (
                ("host_memory_bytes_s", "host_memory_bw_gbyte_s"),
                ("host_copy_bytes_s", "host_copy_gbyte_s"),
            )
            if getattr(device, field) is not None
        }
        if device.gaussian_ns is not None:
            host["gaussian_s"] = device.gaussian_ns * 1e-9
        if device.mask_ns is not None:
            host["mask_s"] = device.mask_ns * 1e-9
        if device.lowrank_ns is not None:
            host["lowrank_s"] = device.lowrank_ns * 1e-9
        if device.dispatch_ns is not None:
            host["dispatch_s"] = device.dispatch_ns * 1e-9
        if host:
            base = replace(base, **host)
        m = device.measured
        if m is None:
            return base
        return replace(
            base,
            memory_efficiency=m.memory if m.memory is not None else base.memory_efficiency,
            framework_bytes=(
                m.framework_gib * GIB if m.framework_gib is not None else base.framework_bytes
            ),
            gemm_curves=tuple((k, tuple(v)) for k, v in m.gemm.items()),
            attention_curves=tuple((k, tuple(v)) for k, v in m.attention.items()),
            measured_source=m.source,
        )

    def with_generation(self, name: str, **changes: Any) -> Calibration:
        """This calibration with some constants of one generation changed (sensitivity runs)."""
        gens = tuple(replace(g, **changes) if g.generation == name else g for g in self.generations)
        return replace(self, generations=gens)


DEFAULT_CALIBRATION = Calibration()
