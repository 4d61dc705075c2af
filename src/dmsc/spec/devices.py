"""Device presets: the spec-sheet figures of the accelerators people train on, by name.

A device type may name a ``preset`` and give only what differs (``{preset: h100-sxm}``); the
preset also sets its ``generation``, which picks the cost model's calibration for that generation
(dmsc.netmodel.constants). Peaks are dense (no 2:4 sparsity) tensor-core rates; ``memory_gib`` is
what the driver reports as the device's total memory (nvidia-smi), not the marketing GB.

Sources:
- A100 SXM4 80GB: NVIDIA A100 datasheet (312 TFLOP/s bf16/fp16, 156 tf32, 19.5 fp32, 624 int8;
  2039 GB/s HBM2e; 108 SMs); nvidia-smi reports 81920 MiB.
- H100 SXM5 80GB: NVIDIA H100 datasheet (989 TFLOP/s bf16/fp16, 1979 fp8/int8, 494 tf32, 67 fp32;
  3350 GB/s HBM3; 132 SMs); nvidia-smi reports 81559 MiB.
- H200 SXM 141GB: NVIDIA H200 datasheet (the H100's compute; 4800 GB/s HBM3e; 132 SMs);
  nvidia-smi reports 143771 MiB.
- B200 (HGX B200, 1000 W): NVIDIA HGX/DGX B200 datasheet, dense = half of the sparse figures
  (2250 TFLOP/s bf16/fp16, 4500 fp8, 1100 tf32, 75 fp32; 8000 GB/s HBM3e; 148 SMs, 2 x 74);
  nvidia-smi reports 183359 MiB.
"""

from __future__ import annotations

from typing import Any, Literal

Generation = Literal["a100", "h100", "h200", "b200", "generic"]

# Hopper's tensor-core rates: the H200 is the H100's chip with more and faster memory.
_HOPPER = {"bf16": 989, "fp16": 989, "fp8": 1979, "int8": 1979, "tf32": 494, "fp32": 67}

DEVICE_PRESETS: dict[str, dict[str, Any]] = {
    "a100-sxm-80gb": {
        "generation": "a100",
        "peak_tflops": {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5, "int8": 624},
        "memory_gib": 80.0,
        "memory_bw_gbyte_s": 2039,
        "sm_count": 108,
    },
    "h100-sxm": {
        "generation": "h100",
        "peak_tflops": _HOPPER,
        "memory_gib": 79.6,
        "memory_bw_gbyte_s": 3350,
        "sm_count": 132,
    },
    "h200-sxm": {
        "generation": "h200",
        "peak_tflops": _HOPPER,
        "memory_gib": 140.4,
        "memory_bw_gbyte_s": 4800,
        "sm_count": 132,
    },
    "b200": {
        "generation": "b200",
        "peak_tflops": {
            "bf16": 2250,
            "fp16": 2250,
            "fp8": 4500,
            "int8": 4500,
            "tf32": 1100,
            "fp32": 75,
        },
        "memory_gib": 179.1,
        "memory_bw_gbyte_s": 8000,
        "sm_count": 148,
    },
}

# A device type named like a generation ("h100-80gb", "dgx-a100") is of that generation unless it
# names one.
_NAMED: tuple[tuple[str, Generation], ...] = (
    ("b200", "b200"),
    ("h200", "h200"),
    ("h100", "h100"),
    ("a100", "a100"),
)


def generation_from_name(name: str) -> Generation:
    """The generation a device type's name says it is, else ``generic``."""
    low = name.lower()
    for key, gen in _NAMED:
        if key in low:
            return gen
    return "generic"
