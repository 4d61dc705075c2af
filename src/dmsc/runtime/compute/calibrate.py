"""Measure this machine and write a cluster spec the cost model can predict it with.

What is measured, each as the median of repeated rounds with its spread (a shared machine's
load comes and goes: one round can be twice as slow as the next):

- the forward and backward of one transformer block of the model the cluster will run, at its
  micro-batch, on one thread as a stage worker runs it. The cost model's block time is made to
  equal it (:func:`block_rate`): the matrix products at the model's own shapes, and what a CPU
  spends around them that a GPU's constants do not know of (its attention and GeLU kernels run
  at a fraction of its matrix-product rate);
- matrix-multiply FLOP/s at the model's sizes (reported beside the block's rate), memory copy
  bandwidth, the per-kernel overhead, and the data plane's own loopback throughput and round
  trip (the pipeline's sends: the node's link);
- a mixture of experts' routing, dispatch and combine per routed element
  (:mod:`.mixture_rate`: the device's ``dispatch_ns``);
- the all-reduce of a two-process gloo group, as the tensor- and data-parallel exchanges run it
  (the node's ``collective``, which the cost model prices collectives with), and of NCCL where
  CUDA has two devices (:mod:`.collective_calibration`; reported, and the node's collective only
  where gloo's was not measured).

The cost model multiplies peaks by its calibrated efficiencies, so the spec gets
``measured / efficiency``. Rounds go on until the median holds (the interquartile spread of the
rounds under :data:`STABLE_SPREAD`) or :data:`MAX_ROUNDS` are done; when the block's or the
products' rounds spread more than :data:`NOISY_SPREAD` the calibration is flagged (``noisy``):
the machine was too busy to calibrate.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from dmsc.netmodel import DEFAULT_CALIBRATION
from dmsc.runtime.compute.collective_calibration import PASSES, measure_allreduce
from dmsc.runtime.compute.host_rates import best_rate as _best_rate
from dmsc.runtime.compute.host_rates import (
    measure_gaussian_seconds,
    measure_lowrank_seconds,
    measure_mask_seconds,
)
from dmsc.runtime.compute.host_rates import median_seconds as _median_seconds
from dmsc.runtime.compute.mixture_rate import measure_dispatch_seconds
from dmsc.runtime.transport.rpc import Client, bytes_handler, serve
from dmsc.spec import ClusterSpec, SpecError, load_spec

log = logging.getLogger(__name__)
MIN_ROUNDS, MAX_ROUNDS = 10, 30  # at least 3 s of block rounds, up to about 10 s
STABLE_SPREAD = 0.05  # interquartile range / median of the rounds at which measuring stops
NOISY_SPREAD = 0.15  # above this the figure is not trusted (said so, and in the spec)
CALIBRATION_MODEL, CALIBRATION_MICRO_BATCH = "gpt-mini", 4


@dataclass(frozen=True)
class Repeated:
    """A figure measured in rounds: the median of the rounds and their relative spread."""

    value: float
    spread: float  # interquartile range / median
    rounds: tuple[float, ...]


def relative_spread(values: list[float] | tuple[float, ...]) -> float:
    """Interquartile range over the median (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(values)


def repeated(
    measure: Callable[[], float],
    min_rounds: int = MIN_ROUNDS,
    max_rounds: int = MAX_ROUNDS,
    stable: float = STABLE_SPREAD,
) -> Repeated:
    """Rounds of ``measure`` until their spread is at most ``stable`` (after ``min_rounds``) or
    ``max_rounds`` are done."""
    values: list[float] = []
    while len(values) < max_rounds:
        values.append(measure())
        if len(values) >= min_rounds and relative_spread(values) <= stable:
            break
    return Repeated(statistics.median(values), relative_spread(values), tuple(values))


def _model_gemm_shapes(model: str, micro_batch: int) -> tuple[tuple[int, int, int], ...]:
    """(m, k, n) of the block's weight products at ``micro_batch`` (forward shapes)."""
    from dmsc.netmodel import build_layer_costs
    from dmsc.spec import JobSpec, resolve_model

    spec = resolve_model(model)
    block = build_layer_costs(spec, JobSpec(global_batch=micro_batch, micro_batch=micro_batch))[1]
    return tuple((g.m, g.k, g.n) for g in block.gemms if g.kind == "linear")


def measure_matmul_flops(
    threads: int = 1, shapes: tuple[tuple[int, int, int], ...] | None = None
) -> float:
    """FLOP/s of float32 matrix products of the given (m, k, n) shapes (default: the weight
    products of a gpt-mini block at micro-batch 4), their total FLOPs over their total time."""
    shapes = shapes or _model_gemm_shapes(CALIBRATION_MODEL, CALIBRATION_MICRO_BATCH)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = seconds = 0.0
        for m, k, n in shapes:
            a, b = torch.randn(m, k), torch.randn(k, n)
            seconds += _median_seconds(functools.partial(torch.mm, a, b), 10)
            flops += 2.0 * m * k * n
        return flops / seconds
    finally:
        torch.set_num_threads(old)


def measure_memory_bandwidth(nbytes: int = 64 * 1024 * 1024, threads: int = 1) -> float:
    """Bytes/s of a tensor copy (read + write) on ``threads`` threads: one, as a stage worker
    copies (it measured at the process's default, all the cores, until 2026-12-03, when the
    written bandwidth stopped being shared among all the cluster's devices:
    :mod:`dmsc.netmodel.core_share`)."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _best_rate(lambda: dst.copy_(src), 2.0 * nbytes, repeats=10)
    finally:
        torch.set_num_threads(old)


def _block_step(model: str, tokens: tuple[int, int]) -> Callable[[], None]:
    from dmsc.runtime.compute.models.chain import build_layer
    from dmsc.spec import TransformerSpec, resolve_model

    spec = resolve_model(model)
    assert isinstance(spec, TransformerSpec)
    block = build_layer(spec, 1)
    x = torch.randn(*tokens, spec.hidden, requires_grad=True)
    grad = torch.randn(*tokens, spec.hidden)

    def step() -> None:
        block(x).backward(grad)

    return step


def measure_block_seconds(
    model: str = CALIBRATION_MODEL, micro_batch: int = CALIBRATION_MICRO_BATCH, threads: int = 1
) -> float:
    """Seconds of one block's forward and backward at ``micro_batch`` sequences (one thread)."""
    from dmsc.spec import resolve_model

    step = _block_step(model, (micro_batch, resolve_model(model).seq))  # type: ignore[union-attr]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _median_seconds(step, repeats=10)
    finally:
        torch.set_num_threads(old)


def measure_op_overhead(threads: int = 1) -> float:
    """Seconds per kernel as the cost model counts kernels: forward and backward of a gpt-mini
    block on 8 tokens (compute negligible), divided by the block's kernel count x 3."""
    from dmsc.netmodel import build_layer_costs
    from dmsc.netmodel.compute import issued_kernels
    from dmsc.spec import JobSpec, resolve_model

    step = _block_step(CALIBRATION_MODEL, (1, 8))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        per_call = _median_seconds(step, repeats=30)
    finally:
        torch.set_num_threads(old)
    cost = build_layer_costs(resolve_model(CALIBRATION_MODEL), JobSpec(global_batch=1))[1]
    return per_call / (3 * issued_kernels(cost))  # forward + backward (2x)


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


def _device(measured: dict[str, float], rate: float, dc: Any) -> dict[str, Any]:
    out = {
        "peak_tflops": {"fp32": rate / dc.gemm_efficiency / 1e12},
        "memory_bw_gbyte_s": measured["memory_bytes_s"] / dc.memory_efficiency / 1e9,
        "op_overhead_us": measured["op_overhead_s"] * 1e6,
    }
    if "gaussian_s" in measured:
        out["gaussian_ns"] = measured["gaussian_s"] * 1e9
    if "mask_s" in measured:
        out["mask_ns"] = measured["mask_s"] * 1e9
    if "lowrank_s" in measured:
        out["lowrank_ns"] = measured["lowrank_s"] * 1e9
    if measured.get("dispatch_s"):
        out["dispatch_ns"] = measured["dispatch_s"] * 1e9
    return out


def block_rate(
    measured: dict[str, float],
    model: str = CALIBRATION_MODEL,
    micro_batch: int = CALIBRATION_MICRO_BATCH,
) -> float:
    """The matrix-product rate at which the cost model's block forward and backward takes the
    measured ``block_s`` (on one device, the measured memory bandwidth and kernel overhead).
    The cost model's block time is ``A / rate + C`` (the compute scales with the rate, the
    element-wise streams and kernel overheads do not): two evaluations give A and C."""
    from dmsc.netmodel import build_layer_costs
    from dmsc.netmodel.compute import layer_time
    from dmsc.spec import DeviceTypeSpec, JobSpec, resolve_model

    spec = resolve_model(model)
    block = build_layer_costs(spec, JobSpec(global_batch=micro_batch, micro_batch=micro_batch))[1]
    dc = DEFAULT_CALIBRATION.generation("generic")

    def predicted(rate: float) -> float:
        dev = DeviceTypeSpec.model_validate({"memory_gib": 1, **_device(measured, rate, dc)})
        lt = layer_time(block, dev, spec.dtype, "none", DEFAULT_CALIBRATION)
        return lt.forward + lt.backward

    r = measured["matmul_flops"]
    t1, t2 = predicted(r), predicted(2 * r)
    a = 2 * (t1 - t2) * r  # FLOP-equivalents of the compute part
    c = t1 - a / r
    left = measured["block_s"] - c
    if left <= 0:  # the fixed parts alone exceed the measurement: keep the products' rate
        return r
    return a / left


def calibrated_cluster(template: ClusterSpec, measured: dict[str, float]) -> dict[str, Any]:
    """The template cluster with this machine's figures (as the cost model will divide them).
    With a measured ``block_s`` the devices' rate is the block's (:func:`block_rate`), else the
    matrix products'."""
    c = DEFAULT_CALIBRATION
    data = template.model_dump(mode="json", exclude_none=True)
    # The constants the cost model will apply to these devices (their generation's).
    dcs = {k: c.for_device(d) for k, d in template.device_types.items()}
    # The cluster's devices are processes on this machine's cores: a job on more of them than
    # there are cores shares the cores among its processes. The devices carry one process's
    # rates on a core of its own, the cluster its cores; the cost model gives a job on k
    # devices min(1, cores / k) of them (dmsc.netmodel.core_share).
    data["shared_cores"] = max(1, int(measured.get("cores", 1.0)))
    rate = block_rate(measured) if "block_s" in measured else measured["matmul_flops"]
    for key, dev in data["device_types"].items():
        dev.update(_device(measured, rate, dcs[key]))
        if "source" in measured:
            dev["measured"] = {"source": measured_source(measured)}
    link_gbit = measured["loopback_bytes_s"] * 8 / 1e9
    latency_us = measured["loopback_rtt_s"] / 2 * 1e6
    for node in data["node_types"].values():
        node["link"] = {
            "bandwidth_gbit_s": link_gbit / c.intra_node_link_efficiency,
            "latency_us": latency_us / 4,
        }
    collective = _collective(measured, c.intra_node_link_efficiency)
    for node in data["node_types"].values():
        if collective is not None:
            node["collective"] = collective
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


def _collective(measured: dict[str, float], efficiency: float) -> dict[str, Any] | None:
    """The node's measured collective for the spec: gloo's, the one the runtime's collectives
    run (the data-parallel average is a gloo all-reduce on the host, from GPUs too, and
    ``dmsc up`` refuses tensor parallelism on GPUs), else NCCL's where only that was measured
    (None when neither was); its bandwidth over the efficiency the cost model will apply.
    NCCL's came first, and a two-GPU node's data-parallel exchange was priced at NCCL's speed
    while the runtime ran it through the host."""
    for backend in ("gloo", "nccl"):
        if f"{backend}_allreduce_bytes_s" in measured:
            when = dt.datetime.fromtimestamp(measured.get("source", time.time()), dt.UTC)
            return {
                "backend": backend,
                "bandwidth_gbit_s": measured[f"{backend}_allreduce_bytes_s"] * 8 / 1e9 / efficiency,
                "latency_us": measured[f"{backend}_allreduce_latency_s"] * 1e6,
                **(
                    {
                        "bandwidth_awake_gbit_s": measured[f"{backend}_allreduce_bytes_awake_s"]
                        * 8
                        / 1e9
                        / efficiency,
                        "latency_awake_us": measured[f"{backend}_allreduce_latency_awake_s"] * 1e6,
                    }
                    if f"{backend}_allreduce_bytes_awake_s" in measured
                    else {}
                ),
                **(
                    {"quorum_us": measured[f"{backend}_quorum_s"] * 1e6}
                    if f"{backend}_quorum_s" in measured
                    else {}
                ),
                "source": f"dmsc calibrate: a 2-process {backend} all-reduce on this machine, "
                f"{when:%Y-%m-%d %H:%M} UTC (each size's median over {PASSES} pairs of interleaved "
                "rounds; the smallest and largest size fitted)",
            }
    return None


def collective_words(node: dict[str, Any]) -> str:
    """What ``dmsc calibrate`` says of a written node's collective ("" when it has none)."""
    c = node.get("collective")
    if not c:
        return ""
    return (
        f"; collectives ({c['backend']} all-reduce, measured): {c['bandwidth_gbit_s']:.2f} "
        f"Gbit/s, {c['latency_us']:.0f} us"
        + (
            f" ({c['bandwidth_awake_gbit_s']:.2f} Gbit/s, {c['latency_awake_us']:.0f} us "
            "waited for awake)"
            if c.get("latency_awake_us") is not None
            else ""
        )
        + (f"; quorum {c['quorum_us']:.0f} us" if c.get("quorum_us") is not None else "")
    )


def measure_collectives() -> dict[str, float]:
    """The all-reduce of gloo, and of NCCL where CUDA has two devices, as figures
    (``BACKEND_allreduce_bytes_s`` and ``_latency_s``); a backend that could not be measured is
    left out, its reason logged."""
    out: dict[str, float] = {}
    backends = ["gloo"] + (["nccl"] if torch.cuda.device_count() >= 2 else [])
    for backend in backends:
        try:
            got = measure_allreduce(backend)
        except (RuntimeError, ValueError) as exc:
            log.warning("%s all-reduce not measured: %s", backend, exc)
            continue
        out[f"{backend}_allreduce_bytes_s"] = got["bytes_s"]
        out[f"{backend}_allreduce_latency_s"] = got["latency_s"]
        out[f"{backend}_quorum_s"] = got["quorum_s"]
        if "bytes_awake_s" in got:
            out[f"{backend}_allreduce_latency_awake_s"] = got["latency_awake_s"]
            out[f"{backend}_allreduce_bytes_awake_s"] = got["bytes_awake_s"]
        elif "awake_left_out" in got:
            why = got["awake_left_out"]
            log.warning("%s all-reduce waited for awake left out: %s", backend, why)
    return out


SPREAD_KEYS = ("block_s", "matmul_flops", "op_overhead_s")
NOISY_KEYS = ("block_s", "matmul_flops")


def measured_source(measured: dict[str, float]) -> str:
    """What the spec's ``measured.source`` says: when, and how steady the figures were."""
    when = dt.datetime.fromtimestamp(measured["source"], dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    spreads = ", ".join(
        f"{k.removesuffix('_s').removesuffix('_flops')} ±{measured[k + '_spread'] * 50:.0f}%"
        for k in SPREAD_KEYS
        if k + "_spread" in measured
    )
    noisy = "; TOO NOISY to trust" if measured.get("noisy") else ""
    return f"dmsc calibrate on this machine, {when} (median of rounds, {spreads}){noisy}"


def spread_lines(measured: dict[str, float]) -> list[str]:
    """The block's rate (what the cost model is fitted to) and how steady each repeated figure
    was; a warning when the machine was too busy to calibrate."""
    if "block_s" not in measured:
        return []
    lines = [
        f"gpt-mini block forward+backward at micro-batch {CALIBRATION_MICRO_BATCH}: "
        f"{measured['block_s'] * 1e3:.1f} ms ({measured['block_flops'] / 1e9:.1f} GFLOP/s as the "
        f"cost model counts it: the devices' rate); medians of rounds, interquartile spread "
        + ", ".join(
            f"{k} {measured[f'{k}_spread'] * 100:.0f}% ({measured[f'{k}_rounds']:.0f} rounds)"
            for k in ("block_s", "matmul_flops", "op_overhead_s")
        )
    ]
    if measured.get("noisy"):
        lines.append(
            f"warning: this machine is too busy to calibrate (a spread above "
            f"{NOISY_SPREAD:.0%}): predictions on this spec will not repeat; calibrate again "
            "when it is quieter"
        )
    return lines


def calibrate(
    template_path: str | Path,
    out_path: str | Path,
    rounds: tuple[int, int] = (MIN_ROUNDS, MAX_ROUNDS),
) -> dict[str, float]:
    """Measure, write the calibrated cluster spec to ``out_path``, return the figures: each
    repeated figure with its ``_spread`` and ``_rounds``, and ``noisy`` (1.0 when a spread is
    above :data:`NOISY_SPREAD`).

    ``out_path``'s directory must exist (checked before measuring; none is created). The
    figures are a worker's where the calling process keeps freed memory as a worker does
    (:func:`dmsc.runtime.compute.host_memory.keep_freed_memory`, which ``dmsc calibrate``
    calls; a library call leaves the caller's allocator alone)."""
    template = load_spec(ClusterSpec, template_path)
    if not Path(out_path).parent.is_dir():
        raise SpecError(str(out_path), "", f"directory {Path(out_path).parent} does not exist")
    # A first pass warms up what a fresh process pays once (allocator, kernels, thread pools,
    # the CPU's clock); the figures come from the rounds after it.
    measure_matmul_flops()
    measure_block_seconds()
    measure_op_overhead()
    measure_loopback(rounds=5)
    rate, rtt = measure_loopback()
    lo, hi = rounds
    figures = {
        "block_s": repeated(measure_block_seconds, lo, hi),
        "matmul_flops": repeated(measure_matmul_flops, lo, hi),
        "op_overhead_s": repeated(measure_op_overhead, lo, hi),
    }
    measured: dict[str, float] = {
        "memory_bytes_s": measure_memory_bandwidth(),
        "gaussian_s": measure_gaussian_seconds(),
        "mask_s": measure_mask_seconds(),
        "lowrank_s": measure_lowrank_seconds(),
        "dispatch_s": measure_dispatch_seconds(CALIBRATION_MICRO_BATCH),
        "loopback_bytes_s": rate,
        "loopback_rtt_s": rtt,
        "cores": float(
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)
        ),
        "source": time.time(),
        **measure_collectives(),
    }
    for key, fig in figures.items():
        measured |= {key: fig.value, f"{key}_spread": fig.spread, f"{key}_rounds": len(fig.rounds)}
    # The figures the prediction rests on (the kernel overhead of an 8-token block is a fraction
    # of a millisecond: its spread is reported, not judged).
    measured["noisy"] = float(any(figures[k].spread > NOISY_SPREAD for k in NOISY_KEYS))
    measured["block_flops"] = block_rate(measured)
    spec = calibrated_cluster(template, measured)
    ClusterSpec.model_validate(spec)
    Path(out_path).write_text(
        "# Written by `dmsc calibrate` from measurements of this machine.\n"
        + yaml.safe_dump(spec, sort_keys=False)
    )
    return measured
