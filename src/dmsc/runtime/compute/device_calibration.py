"""Measure one accelerator (or this CPU) into a device spec with measured efficiency curves.

``dmsc calibrate --device cuda`` times, on the device, the kernels the cost model costs:

- matrix products of transformer shapes (tokens x width x width, from 0.03 to 1,000 GFLOP on a
  GPU) in each 16-bit type the device runs (fp32 on a CPU),
- PyTorch's fused causal attention (scaled_dot_product_attention) over sequence lengths,
- a device-memory copy and, on a GPU, host-to-device copies from pinned memory,
- on a GPU, the host's time to issue one kernel (:func:`measure_host_op`): a small model's step
  is bound by it, not by the device,
- on a GPU, the host side of a data-parallel exchange (:func:`measure_host_side`): a gradient's
  copy to pageable host memory and back, and one thread's host memory bandwidth, at which the
  runtime's codecs and the leader's rules run.

A curve point is ``[gflop, share of the peak]``: the peak is the device preset's (NVIDIA's data
sheet) when the device's name matches one, else the fastest rate measured, so that the cost model
(:meth:`dmsc.netmodel.constants.DeviceCalibration.gemm_fraction`) reproduces the measured rate
at every measured size. Attention FLOPs are counted as the cost model counts them (the full
``s x s`` products, causal or not), so its fraction is what the model must divide by.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dmsc.netmodel import DEFAULT_CALIBRATION
from dmsc.spec import TransformerSpec
from dmsc.spec.devices import DEVICE_PRESETS

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (tokens, k, n): a 16-bit GPU's curve from small to the largest transformer GEMMs
GPU_SHAPES = (
    (512, 1024, 1024),
    (2048, 1024, 1024),
    (2048, 2048, 2048),
    (4096, 4096, 4096),
    (8192, 4096, 16384),
    (8192, 8192, 8192),
    (16384, 12288, 12288),
)
CPU_SHAPES = ((64, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024))
# (batch x heads, sequence, head dim) of the attention curve
GPU_ATTENTION = ((32, 512, 128), (32, 2048, 128), (16, 8192, 128))
CPU_ATTENTION = ((4, 64, 32), (4, 256, 32))
_NAMES = (("h200", "h200-sxm"), ("h100", "h100-sxm"), ("a100", "a100-sxm-80gb"), ("b200", "b200"))


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Median seconds of ``fn`` over ``repeats`` runs after warm-up (device synchronised)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run(fn: Callable[[], object], repeats: int) -> float:
        for _ in range(2):
            fn()
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def preset_of(name: str) -> str | None:
    """The device preset a device's name (``torch.cuda.get_device_name``) matches."""
    low = name.lower()
    return next((preset for key, preset in _NAMES if key in low), None)


def _busy_rate(gflop: float, rate: float, overhead_s: float) -> float:
    """FLOP/s of a kernel measured at ``rate`` once its fixed ``overhead_s`` is taken out (at
    most half its time is taken for the overhead)."""
    seconds = gflop * 1e9 / rate
    return gflop * 1e9 / max(seconds - overhead_s, seconds / 2)


def measured_peaks(
    gemm: dict[str, list[tuple[float, float]]],
    attention: list[tuple[float, float]],
    attention_dtype: str,
    overhead_s: float = DEFAULT_CALIBRATION.generation("generic").kernel_overhead_s,
) -> dict[str, float]:
    """TFLOP/s peaks of a device without a data sheet, from its measured ``(gflop, FLOP/s)``
    points: the fastest rate (a product or attention) without the kernel overhead that the
    cost model adds back. With the overhead left in, the fastest kernel's share came out above
    1, was capped, and the kernel was predicted a whole overhead slower than measured."""
    peaks = {d: max(_busy_rate(g, r, overhead_s) for g, r in pts) / 1e12 for d, pts in gemm.items()}
    fastest = max(_busy_rate(g, r, overhead_s) for g, r in attention) / 1e12
    peaks[attention_dtype] = max(peaks.get(attention_dtype, 0.0), fastest)
    return peaks


def _curve(points: list[tuple[float, float]], peak: float, overhead_s: float) -> list[list[float]]:
    """``[gflop, share of peak]`` points in increasing gflop. The cost model adds a kernel's
    fixed ``overhead_s`` to ``flops / (peak x share)``, so the share is of the time without it;
    each share at most 1 (a peak measured here is the fastest rate without the overhead)."""
    by_size: dict[float, list[float]] = {}
    for g, rate in points:  # two shapes of equal FLOPs are one point of the curve
        by_size.setdefault(round(g, 6), []).append(_busy_rate(g, rate, overhead_s))
    return [
        [g, round(min(1.0, statistics.mean(rates) / peak), 4)]
        for g, rates in sorted(by_size.items())
    ]


HOST_OP_MODELS = ("llama-mini", "gpt-mini")  # the first one's figure goes into the spec


def measure_host_op(
    device: str,
    model: str | TransformerSpec,
    repeats: int = 20,
    blocks: tuple[int, int] = (2, 16),
) -> float:
    """Host seconds to issue one kernel as the cost model counts them, on ``device`` as a stage
    worker runs a ``model`` block (bf16 autocast over float32 weights on CUDA), on 8 tokens so
    that the device's own work is negligible: the slope of the time of a forward and backward
    over chains of ``blocks`` blocks, per counted kernel (x 3 for the backward). The slope
    leaves out what each backward call and sync costs once (about 1.3 ms on an H100's host),
    which a step pays once per micro-batch: timed one block at a time, that fixed cost made the
    figure 1.37x the slope, and a 345M model's step was predicted 42% slow."""
    from dmsc.netmodel import build_layer_costs
    from dmsc.netmodel.compute import issued_kernels
    from dmsc.runtime.compute.models.chain import build_layer
    from dmsc.spec import JobSpec, resolve_model

    dev = torch.device(device)
    spec = resolve_model(model) if isinstance(model, str) else model
    assert isinstance(spec, TransformerSpec)

    def chain_step(n: int) -> Callable[[], float]:
        chain = torch.nn.Sequential(*(build_layer(spec, 1) for _ in range(n))).to(dev)
        x = torch.randn(1, 8, spec.hidden, device=dev, requires_grad=True)
        grad = torch.randn(1, 8, spec.hidden, device=dev)

        def step() -> float:
            t0 = time.perf_counter()
            with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
                y = chain(x)
            y.backward(grad)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            return time.perf_counter() - t0

        return step

    kernels = 3 * issued_kernels(build_layer_costs(spec, JobSpec(global_batch=1))[1])
    short, long = blocks
    diff, t_long = paired_difference(chain_step(short), chain_step(long), repeats)
    # a noisy set of pairs can give no slope: then the long chain's mean, fixed costs and all
    return diff / ((long - short) * kernels) if diff > 0 else t_long / (long * kernels)


def paired_difference(
    short: Callable[[], float], long: Callable[[], float], repeats: int
) -> tuple[float, float]:
    """The median over ``repeats`` adjacent pairs of ``long() - short()`` (each returns the
    seconds its run took), after two unmeasured pairs; and the median of ``long()``.

    Timed one after the other (every short run, then every long one), a host that slowed down
    or sped up between the two halves moved the difference by all of its drift; pairs side by
    side see the same host. On an H200 the sequential figure was unsteady: the same
    ``calibrate --device cuda`` measured 54, 73 and 113 us a kernel on three lent machines
    whose measurement of the trained model's own block gave 62, 89 and 63, and its prediction
    of the step came out -1%, +16% and +103% (benchmarks/results/gpu_check_h200.json)."""
    for _ in range(2):
        short(), long()
    diffs, longs = [], []
    for _ in range(repeats):
        a = short()
        b = long()
        diffs.append(b - a)
        longs.append(b)
    return statistics.median(diffs), statistics.median(longs)


def measure_host_side(
    device: torch.device, repeats: int = 10, nbytes: int = 64 * 1024 * 1024
) -> dict[str, float]:
    """The host side of ``device`` as the runtime uses it for a data-parallel exchange's codecs
    and the leader's rules (:func:`dmsc.netmodel.sync.host_side`): ``copy_gbyte_s``, a
    gradient's copy to the host as ``.cpu()`` makes it (into fresh pageable memory) and the
    answer's back into place, GB/s one way (the mean of the two); ``memory_gbyte_s``, a tensor
    copy in host memory (read + write) on one thread, as a worker runs; ``gaussian_ns``, one
    thread's draw of an fp32 Gaussian (central privacy's noise at the leader); ``mask_ns``, one
    thread's expansion of an element of a pair's secure-aggregation mask; ``lowrank_ns``, one
    thread's PowerSGD products, an element of a gradient matrix
    (:func:`.host_rates.measure_lowrank_seconds`)."""
    from dmsc.runtime.compute.host_rates import measure_lowrank_seconds, measure_mask_seconds

    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    timed = _timer(device)
    down = timed(lambda: on_device.cpu() if device.type != "cpu" else on_device.clone(), repeats)
    up = timed(lambda: on_device.copy_(pageable), repeats)
    src, dst = torch.empty_like(pageable), torch.empty_like(pageable)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker's (WorkerConfig.threads)
    gen = torch.Generator().manual_seed(0)
    try:
        copy_s = _timer(torch.device("cpu"))(lambda: dst.copy_(src), repeats)
        draw_s = _timer(torch.device("cpu"))(lambda: torch.randn(1 << 20, generator=gen), repeats)
        mask_s = measure_mask_seconds(n_threads=1)
        lowrank_s = measure_lowrank_seconds(n_threads=1)
    finally:
        torch.set_num_threads(threads)
    return {
        "copy_gbyte_s": 2 * nbytes / (down + up) / 1e9,
        "memory_gbyte_s": 2 * nbytes / copy_s / 1e9,
        "gaussian_ns": draw_s / (1 << 20) * 1e9,
        "mask_ns": mask_s * 1e9,
        "lowrank_ns": lowrank_s * 1e9,
    }


def measure_device(device: str = "cuda", quick: bool = False) -> dict[str, Any]:
    """The device type spec of ``device`` (``cuda``, ``cuda:N`` or ``cpu``) with its measured
    curves, and what was measured (``report``: rates, copies, the device's name)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here (torch.cuda.is_available() is False)")
    timed = _timer(dev)
    gpu = dev.type == "cuda"
    name = torch.cuda.get_device_name(dev) if gpu else (platform.processor() or "cpu")
    dtypes = ["bf16", "fp16"] if gpu else ["fp32"]
    shapes: tuple[tuple[int, int, int], ...] = GPU_SHAPES if gpu else CPU_SHAPES
    if quick:
        shapes = shapes[:2]
    repeats = 5 if quick else 20
    gemm: dict[str, list[tuple[float, float]]] = {}
    for d in dtypes:
        gemm[d] = []
        for m, k, n in shapes:
            a = torch.randn(m, k, device=dev, dtype=_TORCH_DTYPES[d])
            b = torch.randn(k, n, device=dev, dtype=_TORCH_DTYPES[d])
            flops = 2.0 * m * k * n

            def product(a: torch.Tensor = a, b: torch.Tensor = b) -> torch.Tensor:
                return a @ b

            gemm[d].append((flops / 1e9, flops / timed(product, repeats)))
            del a, b
    attention: list[tuple[float, float]] = []
    d_att = dtypes[0]
    for bh, s, hd in (GPU_ATTENTION if gpu else CPU_ATTENTION)[: 2 if quick else None]:
        qkv = [torch.randn(1, bh, s, hd, device=dev, dtype=_TORCH_DTYPES[d_att]) for _ in "qkv"]
        flops = 4.0 * bh * s * s * hd  # Q K^T and P V, as the cost model counts them

        def attend(t: list[torch.Tensor] = qkv) -> torch.Tensor:
            return F.scaled_dot_product_attention(t[0], t[1], t[2], is_causal=True)

        seconds = timed(attend, repeats)
        attention.append((flops / 1e9, flops / seconds))
    nbytes = (256 if gpu else 64) * 1024 * 1024
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_bytes_s = 2.0 * nbytes / timed(lambda: dst.copy_(src), repeats)
    report: dict[str, Any] = {"device": name, "memory_copy_gbyte_s": copy_bytes_s / 1e9}
    if gpu:
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        h2d = nbytes / timed(lambda: src.copy_(host, non_blocking=True), repeats)
        d2h = nbytes / timed(lambda: host.copy_(src, non_blocking=True), repeats)
        report |= {"host_to_device_gbyte_s": h2d / 1e9, "device_to_host_gbyte_s": d2h / 1e9}
        side = measure_host_side(dev, repeats)
        report |= {f"host_{k}": v for k, v in side.items()}
    preset = preset_of(name) if gpu else None
    if preset is not None:
        base: dict[str, Any] = {"preset": preset}
        peaks = DEVICE_PRESETS[preset]["peak_tflops"]
        memory_bw = float(DEVICE_PRESETS[preset]["memory_bw_gbyte_s"])
    else:  # no data sheet: the fastest rate measured is the peak
        peaks = measured_peaks(gemm, attention, d_att)
        memory_bw = copy_bytes_s / 1e9
        total = (
            torch.cuda.get_device_properties(dev).total_memory
            if gpu
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        )
        base = {
            "peak_tflops": {d: round(p, 6) for d, p in peaks.items()},
            "memory_gib": round(total / 1024**3, 2),
            "memory_bw_gbyte_s": round(memory_bw, 3),
        }
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    generation = DEVICE_PRESETS[preset]["generation"] if preset is not None else "generic"
    ovh = DEFAULT_CALIBRATION.generation(generation).kernel_overhead_s
    measured = {
        "source": f"dmsc calibrate --device {device} on {name}, {when}",
        "gemm": {d: _curve(pts, peaks[d] * 1e12, ovh) for d, pts in gemm.items()},
        "attention": {d_att: _curve(attention, peaks[d_att] * 1e12, ovh)},
        "memory": round(min(1.0, copy_bytes_s / 1e9 / memory_bw), 4),
    }
    if gpu:  # a CPU issues its own work: its kernel overhead is calibrate's op_overhead_us
        issue_s = {m: measure_host_op(device, m) for m in HOST_OP_MODELS}
        report["host_op_us"] = {m: s * 1e6 for m, s in issue_s.items()}
        base["host_op_us"] = round(issue_s[HOST_OP_MODELS[0]] * 1e6, 3)
        base["host_memory_bw_gbyte_s"] = round(side["memory_gbyte_s"], 3)
        base["host_copy_gbyte_s"] = round(side["copy_gbyte_s"], 3)
        base["gaussian_ns"] = round(side["gaussian_ns"], 3)
        base["mask_ns"] = round(side["mask_ns"], 3)
        base["lowrank_ns"] = round(side["lowrank_ns"], 3)
    report["gemm_tflops"] = {d: [[g, r / 1e12] for g, r in pts] for d, pts in gemm.items()}
    report["attention_tflops"] = [[g, r / 1e12] for g, r in attention]
    return {"spec": {**base, "measured": measured}, "report": report}


def report_lines(report: dict[str, Any]) -> list[str]:
    """What ``dmsc calibrate --device`` prints of what it measured."""
    lines = [
        f"matmul {dtype} TFLOP/s: " + ", ".join(f"{g:g} GFLOP {r:.1f}" for g, r in points)
        for dtype, points in report["gemm_tflops"].items()
    ]
    att = ", ".join(f"{g:g} GFLOP {r:.1f}" for g, r in report["attention_tflops"])
    lines.append(f"attention TFLOP/s: {att}")
    copies = ", ".join(f"{k} {v:.1f}" for k, v in report.items() if k.endswith("gbyte_s"))
    lines.append(f"copies GB/s: {copies}")
    if "host_op_us" in report:
        host = ", ".join(f"{m} block {v:.1f}" for m, v in report["host_op_us"].items())
        lines.append(f"host time to issue one kernel (us, as the cost model counts them): {host}")
    return lines


def one_device_cluster(name: str, device_spec: dict[str, Any]) -> dict[str, Any]:
    """A cluster of one node holding this one device: what ``dmsc estimate`` checks a
    single-device run against."""
    return {
        "name": f"one-{name}",
        "device_types": {name: device_spec},
        "node_types": {
            "host": {"device": name, "devices": 1, "link": {"bandwidth_gbit_s": 100}}
        },
        "datacenters": [
            {"name": "here", "nodes": [{"type": "host", "count": 1}],
             "network": {"gbit_s_per_node": 100}}
        ],
    }  # fmt: skip
