"""Helpers of the runtime tests: a plan, a one-box cluster and a deployment with a gateway, made
with the ``dmsc`` command as a user runs it, in a data directory ``home`` of the test's own."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Any

from conftest import ROOT, run_dmsc

from dmsc.runtime.business.gateway import wait_ready
from dmsc.runtime.compute.worker import WorkerConfig
from dmsc.spec import resolve_model


def dmsc(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """:func:`conftest.run_dmsc` with ``home`` first (the runtime tests' way of calling it)."""
    return run_dmsc(*args, home=home, timeout=timeout)


def make_plan(home: Path, cluster: Path | None = None, pp: int = 2, dp: int = 1) -> Path:
    plan = home / "plan.json"
    res = dmsc(
        home,
        "plan",
        "--cluster",
        str(cluster or ROOT / "examples/clusters/local-cpu.yaml"),
        "--model",
        "gpt-mini",
        "--global-batch",
        "8",
        "--micro-batch",
        "2",
        "--tp",
        "1",
        "--pp",
        str(pp),
        "--dp",
        str(dp),
        "--out",
        str(plan),
    )
    assert res.returncode == 0, res.stderr
    return plan


def one_box(home: Path, devices: int) -> Path:
    """A cluster of one datacenter with one host of ``devices`` CPU devices (data parallelism on
    this machine)."""
    cluster = home / "one-box.yaml"
    cluster.write_text(
        "device_types: {cpu: {peak_tflops: {fp32: 0.1}, memory_gib: 4, memory_bw_gbyte_s: 10}}\n"
        f"node_types: {{host: {{device: cpu, devices: {devices},\n"
        "                      link: {bandwidth_gbit_s: 10}}}\n"
        "datacenters: [{name: dc, nodes: [{type: host, count: 1}],\n"
        "               network: {gbit_s_per_node: 10}}]\n"
    )
    return cluster


def up_with_gateway(home: Path, plan: Path, *extra: str) -> str:
    """``dmsc up`` with a gateway on a free port; returns the gateway's base URL once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = dmsc(home, "up", "--plan", str(plan), "--gateway", f"127.0.0.1:{port}", *extra)
    assert res.returncode == 0, res.stderr
    base = f"http://127.0.0.1:{port}"
    assert wait_ready(base), "gateway did not come up"
    return base


def first_stage(registry: str, **overrides: Any) -> WorkerConfig:
    """The config of gpt-mini's stage 0 of two (embedding .. block_1), registering at
    ``registry``: the worker tests' standard stage."""
    fields: dict[str, Any] = {
        "sid": "s0",
        "stage": 0,
        "stages": 2,
        "model": resolve_model("gpt-mini").model_dump(),
        "first": "embedding",
        "last": "block_1",
        "registry": registry,
    }
    return WorkerConfig(**{**fields, **overrides})
