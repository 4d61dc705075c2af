"""Measure this machine and write a cluster spec the cost model can predict it with.

Matrix-multiply FLOP/s at the sizes gpt-mini runs (one thread, as a stage worker uses), memory
copy bandwidth, and the data plane's own loopback throughput and round trip. The cost model
multiplies peaks by its calibrated efficiencies, so the spec gets ``measured / efficiency``.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from dmsc.netmodel import DEFAULT_CALIBRATION
from dmsc.runtime.transport.rpc import Client, bytes_handler, serve
from dmsc.spec import ClusterSpec, SpecError, load_spec


def _best_rate(fn: Any, work: float, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return work / statistics.median(times)


def measure_matmul_flops(
    threads: int = 1,
    shapes: tuple[tuple[int, int, int], ...] = ((512, 128, 512), (512, 512, 128), (512, 128, 384)),
) -> float:
    """FLOP/s of float32 matrix products of the given (m, k, n) shapes (median of shapes)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rates = []
        for m, k, n in shapes:
            a, b = torch.randn(m, k), torch.randn(k, n)
            rates.append(_best_rate(lambda a=a, b=b: a @ b, 2.0 * m * k * n))
        return statistics.median(rates)
    finally:
        torch.set_num_threads(old)


def measure_memory_bandwidth(nbytes: int = 64 * 1024 * 1024) -> float:
    """Bytes/s of a tensor copy (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return _best_rate(lambda: dst.copy_(src), 2.0 * nbytes, repeats=10)


def measure_op_overhead(threads: int = 1) -> float:
    """Seconds per kernel as the cost model counts kernels: forward and backward of a gpt-mini
    block on 8 tokens (compute negligible), divided by the block's kernel count x 3."""
    from dmsc.netmodel import build_layer_costs
    from dmsc.runtime.compute.models.gpt import Block
    from dmsc.spec import JobSpec, TransformerSpec, resolve_model

    spec = resolve_model("gpt-mini")
    assert isinstance(spec, TransformerSpec)
    block = Block(spec)
    x = torch.randn(1, 8, spec.hidden, requires_grad=True)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        per_call = 1.0 / _best_rate(lambda: block(x).sum().backward(), 1.0, repeats=50)
    finally:
        torch.set_num_threads(old)
    cost = build_layer_costs(spec, JobSpec(global_batch=1))[1]
    kernels = 3 * (len(cost.gemms) + cost.elementwise_kernels)  # forward + backward (2x)
    return per_call / kernels


def measure_loopback(nbytes: int = 4 * 1024 * 1024, rounds: int = 20) -> tuple[float, float]:
    """(bytes/s one way, round-trip seconds of an empty message) over gRPC on 127.0.0.1."""
    server, port = serve("dmsc.Echo", {"Sink": bytes_handler(lambda b: b"")})
    client = Client(f"127.0.0.1:{port}", "dmsc.Echo")
    try:
        payload = bytes(nbytes)
        rate = _best_rate(lambda: client.raw("Sink", payload), float(nbytes), repeats=rounds)
        rtt = 1.0 / _best_rate(lambda: client.raw("Sink", b""), 1.0, repeats=200)
    finally:
        client.close()
        server.stop(grace=0)
    return rate, rtt


def calibrated_cluster(template: ClusterSpec, measured: dict[str, float]) -> dict[str, Any]:
    """The template cluster with this machine's figures (as the cost model will divide them)."""
    c = DEFAULT_CALIBRATION
    data = template.model_dump(mode="json", exclude_none=True)
    # The constants the cost model will apply to these devices (their generation's).
    dcs = {k: c.for_device(d) for k, d in template.device_types.items()}
    # The cluster's devices are processes on this machine's cores: when there are more devices
    # than cores, running all at once (a pipeline's steady state) shares the cores among them.
    share = min(1.0, measured.get("cores", 1.0) / template.device_count)
    for key, dev in data["device_types"].items():
        dc = dcs[key]
        dev["peak_tflops"] = {"fp32": share * measured["matmul_flops"] / dc.gemm_efficiency / 1e12}
        dev["memory_bw_gbyte_s"] = share * measured["memory_bytes_s"] / dc.memory_efficiency / 1e9
        dev["op_overhead_us"] = measured["op_overhead_s"] * 1e6
    link_gbit = measured["loopback_bytes_s"] * 8 / 1e9
    latency_us = measured["loopback_rtt_s"] / 2 * 1e6
    for node in data["node_types"].values():
        node["link"] = {
            "bandwidth_gbit_s": link_gbit / c.intra_node_link_efficiency,
            "latency_us": latency_us / 4,
        }
    for dc in data["datacenters"]:
        dc["network"] = {
            "gbit_s_per_node": link_gbit / c.network_link_efficiency,
            "latency_us": latency_us / 4,
        }
    for link in data.get("links", []):
        link.pop("slots", None)
        link["bandwidth_gbit_s"] = link_gbit / c.inter_dc_link_efficiency
        link["km"] = 0.001  # loopback: no fibre
    data["name"] = f"{template.name}-calibrated"
    return data


def calibrate(template_path: str | Path, out_path: str | Path) -> dict[str, float]:
    """Measure, write the calibrated cluster spec to ``out_path``, return the figures.

    ``out_path``'s directory must exist (checked before measuring; none is created)."""
    template = load_spec(ClusterSpec, template_path)
    if not Path(out_path).parent.is_dir():
        raise SpecError(str(out_path), "", f"directory {Path(out_path).parent} does not exist")
    # A first pass warms up what a fresh process pays once (allocator, kernels, thread pools,
    # the CPU's clock); the figures come from the second.
    measure_matmul_flops()
    measure_op_overhead()
    measure_loopback(rounds=5)
    rate, rtt = measure_loopback()
    measured = {
        "matmul_flops": measure_matmul_flops(),
        "memory_bytes_s": measure_memory_bandwidth(),
        "loopback_bytes_s": rate,
        "loopback_rtt_s": rtt,
        "op_overhead_s": measure_op_overhead(),
        "cores": float(
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)
        ),
    }
    spec = calibrated_cluster(template, measured)
    ClusterSpec.model_validate(spec)
    Path(out_path).write_text(
        "# Written by `dmsc calibrate` from measurements of this machine.\n"
        + yaml.safe_dump(spec, sort_keys=False)
    )
    return measured
