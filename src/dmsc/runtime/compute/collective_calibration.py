"""Measure this machine's collectives: the all-reduce of a small process group, as the runtime's
tensor- and data-parallel exchanges run it (gloo on the CPU; NCCL between GPUs where CUDA is).

Two processes (spawned: a forked copy of a process that already ran torch's thread pools or a
gRPC server may hang) join a group over a TCPStore on 127.0.0.1 and all-reduce float32 tensors of
a few sizes in rounds (the median of each size, waited for each way); the smallest and the
largest give
``t = a + s / b`` (the alpha-beta model the cost model prices collectives with,
:mod:`dmsc.netmodel.collectives`) where ``s`` is what one member of a ring all-reduce sends,
``2 (n - 1) / n`` of the tensor: ``a`` is the call's latency, ``b`` its bandwidth. NCCL needs
one GPU per rank: it is measured only where CUDA has two devices.

The rounds interleave: each round times every size both ways, so each median is drawn from the
whole measurement rather than from a few milliseconds of it. Timed size by size and way by way,
a spell of the shared machine as long as one size's rounds (30 calls of 1 KB took about 12 ms)
moved that size's whole median: a calibration gave an awake latency of 682 us where the runs
before and after it gave 335-368 us (:func:`timed_rounds`). And the pair is started
:data:`PASSES` times, each size's figure the median over the passes: from one pair to the
next, seconds apart, this machine's figures moved more than within one (15 passes in a row:
latency 371-618 us and bandwidth 7.9-16.0 Gbit/s, the medians of three 419-524 us and
10.5-12.7 Gbit/s; ``benchmarks/calibration_steadiness.py``).

The pair also times the replicas' quorum (:func:`time_quorum`): the store round trips the
runtime's replicas make before an exchange it runs whole (a codec's, the leader's, a round's),
which the cost model prices beside such an exchange (``collective.quorum_us``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmsc.runtime.compute.waiting import finish

SIZES = (1024, 256 * 1024, 4 * 1024 * 1024)  # bytes of the all-reduced tensor
ROUNDS = 30
PASSES = 3  # pairs started one after another; each size's figure the median over them
WORLD = 2
JOIN_TIMEOUT_S = 60.0


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(latency_s, bytes_per_s)`` of the line ``t = a + s / b`` through the smallest and the
    largest of the ``(bytes sent, seconds)`` points: the bandwidth from the difference of their
    times, the latency what is left of the smallest's (a ping-pong's two-point estimate; on a
    shared machine a least-squares line through every size was led astray by one slow size)."""
    if len(points) < 2:
        raise ValueError("fitting a latency and a bandwidth needs two sizes at least")
    (x0, t0), (x1, t1) = min(points), max(points)
    if x1 == x0:
        raise ValueError("the sizes must differ")
    if t1 <= t0:
        raise ValueError(f"the time does not grow with the size ({t0:.3g} s, then {t1:.3g} s)")
    rate = (x1 - x0) / (t1 - t0)
    return max(0.0, t0 - x0 / rate), rate


WAYS = ("blocked", "awake")
# A call waited for awake skips the wake-up a blocked wait pays, so on a machine at rest it is no
# slower: six calibrations in a row gave awake latencies 0.68-0.98 of the blocked ones
# (calibration_steadiness_cpu.json). One of 4.2 (2,014 against 480 us: parallel_modes_cpu.json,
# rerun_2026_12_04_eve, measured as another benchmark's processes were ending) says the pair
# spun on cores something else wanted; priced at it, the tensor- and expert-parallel calls of
# the run that followed came out 4-5 times their measured time. Past this ratio the awake
# figures are left out and the blocked ones price every call.
AWAKE_LATENCY_MAX = 2.0


def timed_rounds(
    call: Callable[[int, str], float], sizes: Sequence[int], rounds: int
) -> dict[str, dict[int, float]]:
    """The median of ``rounds`` timings of ``call(size, way)`` for each size and each of
    :data:`WAYS`, timed interleaved: round after round, every size both ways within each round.
    Returns ``{way: {size: median seconds}}``."""
    took: dict[tuple[str, int], list[float]] = {(w, s): [] for w in WAYS for s in sizes}
    for _ in range(rounds):
        for size in sizes:
            for way in WAYS:
                took[(way, size)].append(call(size, way))
    return {w: {s: statistics.median(took[(w, s)]) for s in sizes} for w in WAYS}


def time_quorum(store: Any, rank: int, rounds: int) -> float:
    """The median seconds of ``rounds`` quorums of the group's ``WORLD`` members on ``store``,
    as the runtime's replicas agree before an exchange it runs whole
    (:class:`dmsc.runtime.compute.quorum.Quorum`), each begun together after a barrier."""
    from dmsc.runtime.compute.quorum import Quorum

    took = []
    for i in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        Quorum(store, rank, WORLD).join(
            f"calibrate/q{i}",
            held="calibrate|" + ".".join(str(r) for r in range(WORLD)),
            abandoned=lambda: False,
            policy="wait",
            bound_s=JOIN_TIMEOUT_S,
            timeout_s=JOIN_TIMEOUT_S,
        )
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _member(
    rank: int, port: int, backend: str, sizes: Sequence[int], rounds: int, out: Any
) -> None:
    """One rank: join, warm up, time each size's all-reduces (rank 0 reports)."""
    torch.set_num_threads(1)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, WORLD, rank == 0, dt.timedelta(seconds=60)
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=WORLD, timeout=dt.timedelta(seconds=60)
    )
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    try:
        tensors = {size: torch.ones(size // 4, device=device) for size in sizes}
        for x in tensors.values():
            for _ in range(3):  # warm-up: connections, buffers
                dist.all_reduce(x)

        def call(size: int, way: str) -> float:
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            work = dist.all_reduce(tensors[size], async_op=True)
            # awake: as the tp and ep collectives are waited for (.waiting)
            finish(work, cpu=device.type == "cpu" and way == "awake")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - t0

        medians = timed_rounds(call, sizes, rounds)
        quorum = time_quorum(store, rank, rounds)
        if rank == 0:
            out.put((medians["blocked"], medians["awake"], quorum))
    finally:
        dist.destroy_process_group()


def measure_allreduce(
    backend: str = "gloo",
    sizes: Sequence[int] = SIZES,
    rounds: int = ROUNDS,
    passes: int = PASSES,
) -> dict[str, Any]:
    """Time all-reduces of ``sizes`` bytes in a two-process ``backend`` group, ``passes``
    groups one after another; returns the fit (``latency_s``, ``bytes_s``: bandwidth as the
    bytes one member sends per second) of each size's median over the passes, the same fit of
    the calls waited for awake (``latency_awake_s``, ``bytes_awake_s``; left out where it does
    not fit), those seconds per size each way, the quorum's median over the passes
    (``quorum_s``: the replicas' agreement before an exchange the runtime runs whole), and the
    backend."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    runs = [time_allreduce(backend, sizes, rounds) for _ in range(passes)]
    times = {s: statistics.median(r[0][s] for r in runs) for s in sizes}
    awake = {s: statistics.median(r[1][s] for r in runs) for s in sizes}
    quorum = statistics.median(r[2] for r in runs)
    sent = 2 * (WORLD - 1) / WORLD
    latency, rate = fit_alpha_beta([(s * sent, t) for s, t in times.items()])
    got: dict[str, Any] = {"backend": backend, "latency_s": latency, "bytes_s": rate}
    got["quorum_s"] = quorum
    with contextlib.suppress(ValueError):  # left out: the blocked figures price every call
        latency_awake, rate_awake = fit_alpha_beta([(s * sent, t) for s, t in awake.items()])
        if latency_awake <= AWAKE_LATENCY_MAX * latency:
            got["latency_awake_s"], got["bytes_awake_s"] = latency_awake, rate_awake
        else:  # the machine was busy while the pair spun: left out, said why
            got["awake_left_out"] = (
                f"awake latency {latency_awake * 1e6:.0f} us against {latency * 1e6:.0f} us "
                f"blocked (over {AWAKE_LATENCY_MAX:g}x)"
            )
    return {**got, "seconds": times, "seconds_awake": awake}


def time_allreduce(
    backend: str, sizes: Sequence[int], rounds: int
) -> tuple[dict[int, float], dict[int, float], float]:
    """The median seconds of all-reduces of each of ``sizes`` bytes in a two-process
    ``backend`` group, waited for blocked and waited for awake (a CUDA work is waited for
    at once either way), and of the group's quorum (:func:`time_quorum`)."""
    if backend == "nccl" and torch.cuda.device_count() < WORLD:
        raise ValueError(f"nccl: {WORLD} CUDA devices needed, {torch.cuda.device_count()} here")
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_member, args=(r, port, backend, tuple(sizes), rounds, out))
        for r in range(WORLD)
    ]
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the children's torch: one thread, as a worker runs
    try:
        for p in procs:
            p.start()
    finally:
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    if alive or any(p.exitcode for p in procs) or out.empty():
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"{backend} all-reduce calibration failed (exit codes {codes})")
    times, awake, quorum = out.get()
    return times, awake, quorum
