"""A worker's hardware telemetry against the kernel's own counters, read here from ``/proc``.

Each reading of :class:`~dmsc.runtime.compute.telemetry.Telemetry` is compared with the same
quantity read independently for the same process or machine: a busy loop raises the CPU % and an
allocation raises the RSS by what ``/proc`` says. The GPU path runs against a fake ``torch.cuda``
(this machine has no CUDA): which calls are made, and that nothing touches CUDA in a process that
has not initialised it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dmsc.runtime.compute.telemetry import Mark, Telemetry

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_cpu_s() -> float:
    """utime + stime of this process (fields 14 and 15 of /proc/self/stat), in seconds."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def proc_rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def proc_node_cpu() -> tuple[int, int]:
    """(busy, all) jiffies of every core, from the first line of /proc/stat."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    return total - ticks[3] - ticks[4], total


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


def test_a_busy_step_and_an_idle_one_measure_what_proc_says() -> None:
    t = Telemetry(window_s=0)
    shown = {}
    for name, work in (("busy", busy), ("idle", time.sleep)):
        start, a0, c0 = t.step_start(), time.monotonic(), proc_cpu_s()
        work(0.5)
        got = t.step_end(start)
        a1, c1 = time.monotonic(), proc_cpu_s()  # the window closed right after the reading's
        want = 100 * (c1 - c0) / (a1 - a0)
        assert abs(got["cpu_percent"] - want) < 8, (name, got, want)  # 10 ms ticks over 0.5 s
        assert got["gpu_peak_bytes"] is None  # no CUDA here
        shown[name] = got["cpu_percent"]
    # how much of a core the busy loop gets depends on what else runs (CI measured 28 %): /proc
    # agreeing is the check above; here only that the busy step shows the CPU it took
    # (two 10 ms ticks over 0.5 s: 4 %; the busy loop had 10 % of a core at the least loaded)
    assert shown["busy"] > shown["idle"] + 4, shown


def test_an_allocation_raises_the_rss_by_what_proc_says() -> None:
    t = Telemetry(window_s=0)
    before = t.step_end(t.step_start())["rss_bytes"]
    assert abs(before - proc_rss()) < 4 << 20
    block = b"\x01" * (200 << 20)  # written, so resident
    after = t.step_end(t.step_start())["rss_bytes"]
    assert abs(after - proc_rss()) < 4 << 20
    assert after - before > 190 << 20
    assert t.process()["rss_bytes"] >= after - (4 << 20)
    del block


def test_the_window_rates_follow_the_process_and_the_node() -> None:
    t = Telemetry(window_s=0)
    assert t.rates["cpu_percent"] is None  # no window closed yet
    t.tick()
    a0, c0, (b0, n0) = time.monotonic(), proc_cpu_s(), proc_node_cpu()
    busy(0.5)
    t.tick()
    dt = time.monotonic() - a0
    (b1, n1) = proc_node_cpu()
    assert abs(t.rates["cpu_percent"] - 100 * (proc_cpu_s() - c0) / dt) < 8  # type: ignore[operator]
    node = t.rates["node_cpu_percent"]
    assert node is not None and abs(node - 100 * (b1 - b0) / (n1 - n0)) < 8
    assert t.rates["net_sent_bytes_s"] is not None and t.rates["net_sent_bytes_s"] >= 0


def test_the_thread_closes_windows_by_itself() -> None:
    t = Telemetry(window_s=0.1)
    try:
        deadline = time.monotonic() + 5
        while t.process()["cpu_percent"] is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert t.node()["cpu_percent"] is not None
    finally:
        t.close()


def test_memory_io_and_network_against_proc(tmp_path: Path) -> None:
    t = Telemetry(window_s=0)
    meminfo = {
        line.split(":")[0]: int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
    }
    node = t.node()
    assert node["memory_total_bytes"] == meminfo["MemTotal"]
    used = meminfo["MemTotal"] - meminfo["MemAvailable"]
    assert abs(node["memory_used_bytes"] - used) < max(64 << 20, used // 20)
    assert node["cpus"] == os.cpu_count()

    def net() -> tuple[int, int]:
        rows = [
            line.split(":")[1].split()
            for line in Path("/proc/net/dev").read_text().splitlines()[2:]
        ]
        return sum(int(r[8]) for r in rows), sum(int(r[0]) for r in rows)

    sent0, recv0 = net()
    node = t.node()
    sent1, recv1 = net()
    assert sent0 <= node["net_sent_bytes"] <= sent1 and recv0 <= node["net_recv_bytes"] <= recv1

    with open(tmp_path / "f", "wb") as f:  # some storage I/O of this process's own
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    p = t.process()
    assert (p["io_read_bytes"], p["io_write_bytes"]) == (
        int(io["read_bytes"]),
        int(io["write_bytes"]),
    )
    assert p["threads"] == len(os.listdir("/proc/self/task"))


class FakeCuda:
    """``torch.cuda`` as a process on a node of three GPUs sees it: it uses devices 0 and 1 (its
    allocator holds memory there), device 2 is another worker's. Device 0 answers NVML, device 1
    does not (as without nvidia-ml-py). Every call is logged."""

    def __init__(self, initialized: bool = True) -> None:
        self.initialized = initialized
        self.calls: list[tuple[str, int]] = []
        self.peak = {0: 5 << 30, 1: 3 << 30}

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        assert self.initialized, "device_count before CUDA was initialised"
        return 3

    def _log(self, name: str, i: int) -> None:
        assert self.initialized, f"{name} before CUDA was initialised"
        self.calls.append((name, i))

    def memory_allocated(self, i: int) -> int:
        self._log("memory_allocated", i)
        return (i + 1) << 30

    def memory_reserved(self, i: int) -> int:
        self._log("memory_reserved", i)
        return (i + 2) << 30 if i < 2 else 0

    def max_memory_allocated(self, i: int) -> int:
        self._log("max_memory_allocated", i)
        return self.peak[i]

    def reset_peak_memory_stats(self, i: int) -> None:
        self._log("reset_peak_memory_stats", i)

    def get_device_properties(self, i: int) -> Any:
        self._log("get_device_properties", i)
        return SimpleNamespace(total_memory=80 << 30)

    def utilization(self, i: int) -> int:
        self._log("utilization", i)
        if i == 1:
            raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")
        return 37


def test_gpus_through_a_fake_torch_cuda() -> None:
    cuda = FakeCuda()
    reg = CollectorRegistry()
    t = Telemetry(reg, window_s=0, cuda=cuda)
    assert t.gpus() == [
        {
            "device": 0,
            "memory_allocated_bytes": 1 << 30,
            "memory_reserved_bytes": 2 << 30,
            "memory_total_bytes": 80 << 30,
            "utilization_percent": 37.0,
        },
        {
            "device": 1,
            "memory_allocated_bytes": 2 << 30,
            "memory_reserved_bytes": 3 << 30,
            "memory_total_bytes": 80 << 30,
            "utilization_percent": None,  # unknown, not 0
        },
    ]
    assert all(i < 2 for name, i in cuda.calls if name != "memory_reserved")  # not device 2's
    cuda.calls.clear()
    start = t.step_start()
    assert [c for c in cuda.calls if c[0] == "reset_peak_memory_stats"] == [
        ("reset_peak_memory_stats", 0),
        ("reset_peak_memory_stats", 1),
    ]
    assert t.step_end(start)["gpu_peak_bytes"] == 8 << 30
    samples = {
        (s.name, s.labels.get("device")): s.value
        for fam in text_string_to_metric_families(generate_latest(reg).decode())
        for s in fam.samples
    }
    assert samples[("dmsc_worker_gpu_memory_allocated_bytes", "1")] == 2 << 30
    assert samples[("dmsc_node_gpu_utilization_percent", "0")] == 37
    assert ("dmsc_node_gpu_utilization_percent", "1") not in samples


def test_a_process_that_never_initialised_cuda_reads_no_gpu() -> None:
    cuda = FakeCuda(initialized=False)
    reg = CollectorRegistry()
    t = Telemetry(reg, window_s=0, cuda=cuda)
    assert t.gpus() == [] and t.step_end(t.step_start())["gpu_peak_bytes"] is None
    assert "gpu" not in generate_latest(reg).decode()
    assert cuda.calls == []


def test_only_training_replies_carry_the_step_telemetry() -> None:
    t = Telemetry(window_s=0)
    run = t.traced(lambda m: {"stage": 0})
    assert set(run(SimpleNamespace(train=True))["telemetry"]) == {
        "cpu_percent",
        "rss_bytes",
        "gpu_peak_bytes",
        "node_cpu_percent",
    }
    assert run(SimpleNamespace(train=False)) == {"stage": 0}
    # the node's CPU: the last window the thread closed (none yet: unknown), for a busy node
    assert t.step_end(t.step_start())["node_cpu_percent"] is None
    time.sleep(0.05)
    t.tick()
    node = t.step_end(t.step_start())["node_cpu_percent"]
    assert node is not None and node == t.rates["node_cpu_percent"] and 0 <= node <= 100
    health = t.reported(lambda m: {"status": "ok"})(None)
    assert set(health["telemetry"]) == {"process", "node", "gpus"}


@pytest.mark.parametrize("name", ["dmsc_worker_memory_rss_bytes", "dmsc_node_memory_total_bytes"])
def test_the_collector_scrapes_what_the_readings_say(name: str) -> None:
    reg = CollectorRegistry()
    t = Telemetry(reg, window_s=0)
    text = generate_latest(reg).decode()
    assert f"# HELP {name} " in text
    value = next(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    )
    want = proc_rss() if "rss" in name else t.node()["memory_total_bytes"]
    assert abs(value - want) < 4 << 20


def test_a_reading_that_fails_never_fails_the_step_or_health() -> None:
    """psutil raises when /proc cannot be read (a hardened container): the step and the Health
    answer go through without telemetry."""
    import psutil

    reg = CollectorRegistry()
    t = Telemetry(reg, window_s=0)

    class Refused:
        def __getattr__(self, name: str) -> Any:
            raise psutil.AccessDenied(os.getpid())

    t.proc = Refused()  # type: ignore[assignment]
    assert t.traced(lambda m: {"stage": 0})(SimpleNamespace(train=True)) == {"stage": 0}
    assert t.reported(lambda m: {"status": "ok"})(None) == {"status": "ok"}
    scraped = generate_latest(reg).decode()  # a scrape too: the node's readings, not the process's
    assert "\ndmsc_node_memory_total_bytes " in scraped  # a sample line, not only its HELP
    assert "\ndmsc_worker_memory_rss_bytes " not in scraped


def test_the_node_share_stays_within_0_and_100_when_the_counters_round_or_step_back() -> None:
    """Busy time is every counter less idle and iowait: floats of about a million seconds whose
    difference over an idle window came out at -4e-9 (a test saw it), and Linux's iowait may
    step back. The share is clamped, never below 0 nor above 100."""
    t = Telemetry(window_s=0)
    marks = iter(
        [
            Mark(0.0, 1.0, 1_000_000.000_000_004, 2_000_000.0, 0, 0),
            Mark(1.0, 1.0, 1_000_000.0, 2_000_000.5, 0, 0),  # busy stepped back
            Mark(2.0, 1.0, 1_000_001.0, 2_000_000.75, 0, 0),  # more busy than time passed
        ]
    )
    t.mark = lambda: next(marks)  # type: ignore[method-assign]
    t._last = t.mark()
    t.tick()
    assert t.rates["node_cpu_percent"] == 0.0
    t.tick()
    assert t.rates["node_cpu_percent"] == 100.0
