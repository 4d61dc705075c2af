"""The calibration of the cost model: the few constants that are not in a spec, with sources.

One instance, :data:`DEFAULT_CALIBRATION`, serves every prediction; the validation against the
published Megatron-LM table (benchmarks/validate_costmodel.py) uses it unchanged for all rows.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class Validated:
    """Where a calibration was checked against measurement: the published set, the device it ran
    on, and the error of the predicted throughput there (kept equal to what
    :func:`dmsc.netmodel.validation.validate_megatron` computes by a test)."""

    source: str
    device: str
    generation: str  # matched against a cluster's device type names ("a100-80gb" is an A100)
    rows: int
    mean_abs_error_pct: float
    max_abs_error_pct: float


@dataclass(frozen=True)
class Calibration:
    """Achievable fractions of peak and fixed overheads of real kernels and collectives."""

    name: str = "default"
    validated: tuple[Validated, ...] = (
        Validated(
            "Megatron-LM SC'21 Table 1 (Narayanan et al.)", "A100 80GB", "a100", 10, 2.3, 6.4
        ),
    )

    # Sustained fraction of the tensor-core peak that cuBLAS fp16/bf16 GEMMs of transformer shapes
    # reach once the clock settles under load: about 220-250 of 312 TFLOP/s on an A100 SXM
    # (70-80%); very large square GEMMs reach more, but training kernels are not those. 0.72 is the
    # value in this range that fits the whole Megatron-LM SC'21 table (one value for all rows;
    # benchmarks/validate_costmodel.py shows 0.75 still meets the 5% / 10% target).
    gemm_efficiency: float = 0.72
    # Output tile of a tensor-core GEMM kernel (NVIDIA GEMM guide: 256x128 is the most efficient
    # cuBLAS tile on A100) for the wave quantization of GEMMs on devices that give sm_count.
    gemm_tile_m: int = 256
    gemm_tile_n: int = 128
    # Memory-bound element-wise kernels (layer norm, softmax, dropout, bias+GeLU) stream at about
    # 80-90% of HBM peak (STREAM-like copies on A100 reach ~1.7 of 2.0 TB/s).
    memory_efficiency: float = 0.85
    # Fixed cost of one kernel launch (CUDA launch plus tail), about 5 us.
    kernel_overhead_s: float = 5e-6
    # Bus bandwidth NCCL reaches as a fraction of the link rate: ~230 of 300 GB/s on NVLink3
    # (nccl-tests all_reduce_perf on DGX A100), ~23.5 of 25 GB/s on HDR InfiniBand.
    intra_node_link_efficiency: float = 0.77
    network_link_efficiency: float = 0.92
    inter_dc_link_efficiency: float = 0.95
    # Fixed cost of one collective call (launch and synchronisation), NCCL's base latency ~10 us.
    collective_overhead_s: float = 10e-6
    # Optimizer step (mixed-precision Adam): bytes moved per parameter of the shard it owns
    # (read fp16 grad, read/write fp32 master, m and v, write fp16 weight: 2+8+8+8+2 = 28).
    optimizer_bytes_per_param: float = 28.0


DEFAULT_CALIBRATION = Calibration()
