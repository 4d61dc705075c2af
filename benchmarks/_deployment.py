"""What the runtime benchmarks share: a temporary data directory, the ``dmsc`` command run in
it, a gpt-mini pp=2 x dp=2 plan on a one-box cluster of four CPU devices, a free port, and
closed-loop clients of a gateway."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ONE_BOX = (
    "device_types: {cpu: {peak_tflops: {fp32: 0.1}, memory_gib: 4, memory_bw_gbyte_s: 10}}\n"
    "node_types: {host: {device: cpu, devices: 4, link: {bandwidth_gbit_s: 10}}}\n"
    "datacenters: [{name: dc, nodes: [{type: host, count: 1}],\n"
    "               network: {gbit_s_per_node: 10}}]\n"
)


def cpu_s() -> float:
    """CPU seconds so far of this process and every process under it (the stage workers)."""
    import psutil

    me, total = psutil.Process(), 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # gone meanwhile
            continue
        total += t.user + t.system
    return total


@dataclass
class Answers:
    """What closed-loop clients got: per answer, when it was sent (``time.time``), when it came
    (``time.monotonic``) and its latency (``time.perf_counter``); the statuses of the others."""

    sent: list[float] = field(default_factory=list)
    ended: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    errors: list[int] = field(default_factory=list)


def closed_loop(
    url: str, body: dict[str, Any], headers: dict[str, str], clients: int, seconds: float
) -> Answers:
    """``clients`` closed-loop clients POSTing ``body`` to ``url`` for ``seconds``, each on its
    own kept-alive connection, sending the next request when the last is answered."""
    import httpx

    got = Answers()
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(timeout=120) as c:
            while time.monotonic() < stop:
                sent, t = time.time(), time.perf_counter()
                r = c.post(url, json=body, headers=headers)
                with lock:
                    if r.status_code == 200:
                        got.sent.append(sent)
                        got.latency.append(time.perf_counter() - t)
                        got.ended.append(time.monotonic())
                    else:
                        got.errors.append(r.status_code)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return got


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def home_and_dmsc(prefix: str) -> tuple[Path, Callable[..., str]]:
    """A new data directory and a function running ``dmsc ARGS`` there (its stdout; a failure
    ends the benchmark with the command's stderr)."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    env = {**os.environ, "DMSC_HOME": str(home)}

    def dmsc(*args: str) -> str:
        res = subprocess.run(
            [sys.executable, "-m", "dmsc", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if res.returncode:
            raise SystemExit(f"dmsc {' '.join(args)} failed: {res.stderr}")
        return res.stdout.strip()

    return home, dmsc


def two_by_two_plan(home: Path, dmsc: Callable[..., str]) -> Path:
    """gpt-mini, pp=2 x dp=2, on one box of four CPU devices: the plan file."""
    cluster = home / "one-box.yaml"
    cluster.write_text(ONE_BOX)
    plan = home / "plan.json"
    dmsc(
        *("plan", "--cluster", str(cluster), "--model", "gpt-mini", "--global-batch", "8"),
        *("--micro-batch", "2", "--tp", "1", "--pp", "2", "--dp", "2", "--out", str(plan)),
    )
    return plan
