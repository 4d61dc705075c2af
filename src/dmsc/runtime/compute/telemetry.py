"""Hardware telemetry of a stage worker: what its process and its node use.

psutil reads the worker process's CPU time, resident memory (RSS) and storage I/O, and its node's
CPU, memory and network counters; ``torch.cuda`` reads the GPU memory the process holds and, where
``nvidia-ml-py`` is installed (``torch.cuda.utilization`` needs it; dmsc does not require it), each
GPU's utilisation, for the GPUs this process holds memory on. A process that has not initialised
CUDA is never made to: a CPU worker reports no GPU.

Three readers, each through :class:`Telemetry`:

- a training step's reply (:meth:`Telemetry.traced` wraps ``RunStep``) carries the process's CPU
  % over the call, its RSS at the end, on a GPU the peak memory torch allocated during the call,
  and its node's CPU % over the last window; the control plane keeps them with the step's trace
  (:mod:`dmsc.data.traces`; the control loop's busy node reads the node's);
- ``Health`` (:meth:`Telemetry.reported`) carries a snapshot of the process and its node, which
  ``dmsc status`` and the dashboard show;
- the worker's Prometheus registry holds a collector read at scrape time (``dmsc_worker_*`` for
  the process, ``dmsc_node_*`` for its machine).

A CPU percentage needs a window: a daemon thread reads the CPU and network counters every
:data:`WINDOW_S` seconds and the snapshot gives the rates over the last window it closed. A step
pays two readings of its own, at its start and end, and never waits for the thread: 71 us on the
2-core CI machine, 0.06% of a gpt-mini training step; the thread takes 0.01% of a core
(``benchmarks/telemetry_cost.py``, ``benchmarks/results/telemetry_cost_cpu.json``).
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import psutil
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dmsc.runtime.compute.cpuset import node_cores, node_cpu_times

WINDOW_S = 1.0  # the window of the CPU percentages and network rates a snapshot gives
Handler = Callable[[Any], dict[str, Any]]


@dataclass(frozen=True)
class Mark:
    """The counters a window is measured between."""

    at: float  # time.monotonic()
    process_cpu_s: float  # user + system seconds of this process
    node_busy_s: float  # CPU seconds of every core not idle (nor waiting for I/O)
    node_all_s: float  # CPU seconds of every core
    net_sent: int
    net_recv: int


def _process_cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def percent(busy_s: float, window_s: float) -> float:
    """CPU seconds over a window, as a percentage of one core's time (0 for an empty window)."""
    return 100.0 * busy_s / window_s if window_s > 0 else 0.0


class Telemetry:
    """The telemetry of the process it is made in; registers its collector in ``registry`` and
    starts the window thread (``window_s`` 0: no thread, the rates stay unknown). ``cuda`` is
    ``torch.cuda`` (a test gives a fake)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        window_s: float = WINDOW_S,
        cuda: Any = torch.cuda,
    ) -> None:
        self.proc = psutil.Process()
        self.cuda = cuda
        self.host = socket.gethostname()
        self._lock = threading.Lock()
        self._last = self.mark()
        self.rates: dict[str, float | None] = dict.fromkeys(
            ("cpu_percent", "node_cpu_percent", "net_sent_bytes_s", "net_recv_bytes_s")
        )
        self._stop = threading.Event()
        if registry is not None:
            registry.register(_Collector(self))
        if window_s > 0:
            threading.Thread(target=self._every, args=(window_s,), daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    def mark(self) -> Mark:
        busy, total = node_cpu_times()  # its node's cores: a cpuset's when pinned
        net = psutil.net_io_counters(nowrap=False)  # the kernel's sums as /proc/net/dev has them
        sent, recv = (net.bytes_sent, net.bytes_recv) if net is not None else (0, 0)
        return Mark(time.monotonic(), _process_cpu_s(self.proc), busy, total, sent, recv)

    def tick(self) -> None:
        """Close a window: the rates since the previous one."""
        new = self.mark()
        with self._lock:
            old, self._last = self._last, new
        dt = new.at - old.at
        if dt <= 0:
            return
        self.rates = {
            "cpu_percent": percent(new.process_cpu_s - old.process_cpu_s, dt),
            # within 0..100: busy is all less idle and iowait, summed floats of a million seconds
            # that round (-4e-9 over an idle window), and Linux's iowait may step back
            "node_cpu_percent": min(
                max(
                    100.0
                    * (new.node_busy_s - old.node_busy_s)
                    / max(new.node_all_s - old.node_all_s, 1e-9),
                    0.0,
                ),
                100.0,
            ),
            # an interface that went away takes its counts with it: never a negative rate
            "net_sent_bytes_s": max(new.net_sent - old.net_sent, 0) / dt,
            "net_recv_bytes_s": max(new.net_recv - old.net_recv, 0) / dt,
        }

    def _every(self, window_s: float) -> None:
        while not self._stop.wait(window_s):
            try:
                self.tick()
            except (psutil.Error, OSError):  # a counter unreadable for a moment: next window
                continue

    # -- what a reader asks for ------------------------------------------------------------
    def process(self) -> dict[str, Any]:
        """This process now: CPU % over the last window, CPU seconds, RSS, storage I/O, threads."""
        with self.proc.oneshot():
            mem = self.proc.memory_info()
            cpu_s = _process_cpu_s(self.proc)
            threads = self.proc.num_threads()
        read: int | None = None
        written: int | None = None
        try:
            io = self.proc.io_counters()
            read, written = int(io.read_bytes), int(io.write_bytes)
        except (psutil.Error, OSError, AttributeError):  # /proc/PID/io closed to this user
            pass
        return {
            "cpu_percent": self.rates["cpu_percent"],
            "cpu_seconds": cpu_s,
            "rss_bytes": int(mem.rss),
            "io_read_bytes": read,
            "io_write_bytes": written,
            "threads": threads,
        }

    def node(self) -> dict[str, Any]:
        """The machine now: CPU % over the last window, cores, memory, network totals and rates."""
        vm = psutil.virtual_memory()
        net = psutil.net_io_counters(nowrap=False)  # the kernel's sums as /proc/net/dev has them
        return {
            "host": self.host,
            "cpus": node_cores(),  # its cpuset's when pinned
            "cpu_percent": self.rates["node_cpu_percent"],
            "memory_total_bytes": int(vm.total),
            "memory_used_bytes": int(vm.total - vm.available),
            "memory_available_bytes": int(vm.available),
            "net_sent_bytes": int(net.bytes_sent) if net is not None else None,
            "net_recv_bytes": int(net.bytes_recv) if net is not None else None,
            "net_sent_bytes_s": self.rates["net_sent_bytes_s"],
            "net_recv_bytes_s": self.rates["net_recv_bytes_s"],
        }

    def _cuda_devices(self) -> list[int]:
        """The CUDA devices this process uses: those its allocator holds memory on (none until
        it initialised CUDA itself; a GPU of the node that another worker uses is not ours)."""
        c = self.cuda
        if not (c.is_available() and c.is_initialized()):
            return []
        return [i for i in range(c.device_count()) if c.memory_reserved(i) > 0]

    def gpus(self) -> list[dict[str, Any]]:
        """Each CUDA device: the memory this process's allocator holds, the device's memory and
        utilisation (None where ``nvidia-ml-py`` is missing or the driver will not say)."""
        out = []
        for i in self._cuda_devices():
            try:
                util: float | None = float(self.cuda.utilization(i))
            except Exception:  # ModuleNotFoundError without nvidia-ml-py, an NVMLError...
                util = None
            out.append(
                {
                    "device": i,
                    "memory_allocated_bytes": int(self.cuda.memory_allocated(i)),
                    "memory_reserved_bytes": int(self.cuda.memory_reserved(i)),
                    "memory_total_bytes": int(self.cuda.get_device_properties(i).total_memory),
                    "utilization_percent": util,
                }
            )
        return out

    def snapshot(self) -> dict[str, Any]:
        """What ``Health`` carries: ``process``, ``node`` and ``gpus``."""
        return {"process": self.process(), "node": self.node(), "gpus": self.gpus()}

    # -- per step ----------------------------------------------------------------------------
    def step_start(self) -> tuple[float, float]:
        for i in self._cuda_devices():
            self.cuda.reset_peak_memory_stats(i)
        return time.monotonic(), _process_cpu_s(self.proc)

    def step_end(self, start: tuple[float, float]) -> dict[str, Any]:
        """CPU % of this process since ``start``, its RSS now, the GPU memory torch
        allocated at the peak since then (summed over devices; None without CUDA), and its
        node's CPU % (all cores) over the last window the thread closed (None before one)."""
        with self.proc.oneshot():
            cpu_s = _process_cpu_s(self.proc)
            rss = int(self.proc.memory_info().rss)
        devices = self._cuda_devices()
        peak = sum(int(self.cuda.max_memory_allocated(i)) for i in devices) if devices else None
        return {
            "cpu_percent": percent(cpu_s - start[1], time.monotonic() - start[0]),
            "rss_bytes": rss,
            "gpu_peak_bytes": peak,
            "node_cpu_percent": self.rates["node_cpu_percent"],
        }

    def traced(self, run_step: Handler) -> Handler:
        """``RunStep`` whose training replies carry ``telemetry`` (:meth:`step_end`); a reading
        that fails leaves it out and never fails the step."""

        @functools.wraps(run_step)
        def run(m: Any) -> dict[str, Any]:
            if not getattr(m, "train", False):
                return run_step(m)
            start = _quietly(self.step_start)
            out = run_step(m)
            if start is not None and (use := _quietly(lambda: self.step_end(start))) is not None:
                out["telemetry"] = use
            return out

        return run

    def reported(self, health: Handler) -> Handler:
        """``Health`` whose reply carries ``telemetry`` (:meth:`snapshot`); a reading that fails
        leaves it out: a worker that answers is never taken for a stuck one because of it."""

        @functools.wraps(health)
        def answer(m: Any) -> dict[str, Any]:
            out = health(m)
            if (seen := _quietly(self.snapshot)) is not None:
                out["telemetry"] = seen
            return out

        return answer


T = TypeVar("T")


def _quietly(read: Callable[[], T]) -> T | None:
    """``read()``, or None when the counters cannot be read (psutil, the OS or the GPU's
    driver refused): telemetry is never the reason a step or a Health call fails."""
    try:
        return read()
    except Exception:  # psutil.Error, OSError, a CUDA or NVML error: all the same here
        return None


# (metric, the reading's key, kind, help): the process's, then its node's, then each GPU's
_PROCESS = (
    (
        "dmsc_worker_cpu_percent",
        "cpu_percent",
        "gauge",
        "CPU used by this worker process over the"
        f" last {WINDOW_S:g} s, percent of one core (above 100 with several cores busy)",
    ),
    (
        "dmsc_worker_cpu_seconds",
        "cpu_seconds",
        "counter",
        "CPU seconds (user and system) of this worker process",
    ),
    (
        "dmsc_worker_memory_rss_bytes",
        "rss_bytes",
        "gauge",
        "Resident memory of this worker process",
    ),
    (
        "dmsc_worker_io_read_bytes",
        "io_read_bytes",
        "counter",
        "Bytes this worker process read from storage",
    ),
    (
        "dmsc_worker_io_write_bytes",
        "io_write_bytes",
        "counter",
        "Bytes this worker process wrote to storage",
    ),
    ("dmsc_worker_threads", "threads", "gauge", "Threads of this worker process"),
)
_NODE = (
    (
        "dmsc_node_cpu_percent",
        "cpu_percent",
        "gauge",
        f"CPU busy on this worker's node over the last {WINDOW_S:g} s, percent of all its cores",
    ),
    ("dmsc_node_cpus", "cpus", "gauge", "Logical CPUs of this worker's node"),
    ("dmsc_node_memory_total_bytes", "memory_total_bytes", "gauge", "Memory of this worker's node"),
    (
        "dmsc_node_memory_used_bytes",
        "memory_used_bytes",
        "gauge",
        "Memory in use on this worker's node (total less available)",
    ),
    (
        "dmsc_node_network_sent_bytes",
        "net_sent_bytes",
        "counter",
        "Bytes this worker's node sent, all interfaces",
    ),
    (
        "dmsc_node_network_received_bytes",
        "net_recv_bytes",
        "counter",
        "Bytes this worker's node received, all interfaces",
    ),
)
_GPU = (
    (
        "dmsc_worker_gpu_memory_allocated_bytes",
        "memory_allocated_bytes",
        "gauge",
        "GPU memory in tensors of this worker process",
    ),
    (
        "dmsc_worker_gpu_memory_reserved_bytes",
        "memory_reserved_bytes",
        "gauge",
        "GPU memory this worker process's allocator holds",
    ),
    ("dmsc_node_gpu_memory_total_bytes", "memory_total_bytes", "gauge", "Memory of the GPU"),
    (
        "dmsc_node_gpu_utilization_percent",
        "utilization_percent",
        "gauge",
        "Time the GPU ran a kernel over its last sample period (NVML)",
    ),
)


class _Collector(Collector):
    """The telemetry as Prometheus metrics, read when the registry is scraped (a reading that
    is unknown, such as a rate before the first window closed, is left out)."""

    def __init__(self, t: Telemetry) -> None:
        self.t = t

    def collect(self) -> Iterator[Metric]:
        for table, reading in (
            (_PROCESS, _quietly(self.t.process)),
            (_NODE, _quietly(self.t.node)),
        ):
            for name, key, kind, doc in table:
                family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                m = family(name, doc)
                if reading is not None and reading[key] is not None:
                    m.add_metric([], reading[key])
                yield m
        gpus = _quietly(self.t.gpus) or []
        for name, key, _, doc in _GPU if gpus else ():
            g = GaugeMetricFamily(name, doc, labels=["device"])
            for d in gpus:
                if d[key] is not None:
                    g.add_metric([str(d["device"])], d[key])
            yield g
