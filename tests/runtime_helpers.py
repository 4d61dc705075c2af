"""Helpers of the runtime tests: a plan, a one-box cluster and a deployment with a gateway, made
with the ``dmsc`` command as a user runs it, in a data directory ``home`` of the test's own; and
a control plane in the test's process (real workers) where a test must reach into it; and the
single-process reference losses, trained once per test process."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from conftest import EXAMPLES, ROOT, run_dmsc

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.data.db import Database
from dmsc.planner.plan import Plan
from dmsc.runtime.business.gateway import wait_ready
from dmsc.runtime.compute.reference import train_reference
from dmsc.runtime.compute.worker import WorkerConfig
from dmsc.runtime.control.plane import ControlPlane
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, load_spec, resolve_model

T = TypeVar("T")

# What `dmsc calibrate` measures, as it hands it to calibrated_cluster: a CPU whose figures were
# measured (a cluster of guessed figures gives no comparable prediction).
MEASURED_CPU = {
    "matmul_flops": 60e9,
    "memory_bytes_s": 12e9,
    "loopback_bytes_s": 1.2e9,
    "loopback_rtt_s": 400e-6,
    "op_overhead_s": 30e-6,
    "block_s": 0.03,
    "cores": 2.0,
    "source": 1.8e9,
}


def dmsc(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """:func:`conftest.run_dmsc` with ``home`` first (the runtime tests' way of calling it)."""
    return run_dmsc(*args, home=home, timeout=timeout)


_PLANS: dict[tuple[str, int, int], str] = {}  # (cluster file's text, pp, dp) -> the plan's JSON


def make_plan(home: Path, cluster: Path | None = None, pp: int = 2, dp: int = 1) -> Path:
    """``dmsc plan`` for gpt-mini (global batch 8, micro-batch 2, tp 1) into ``home/plan.json``;
    the same cluster, pp and dp again in this test process copy the plan ``dmsc plan`` made (a
    plan holds no path of its home): the tests of ``dmsc plan`` itself are under tests/cli."""
    plan = home / "plan.json"
    path = cluster or ROOT / "examples/clusters/local-cpu.yaml"
    key = (path.read_text(), pp, dp)
    if key in _PLANS:
        plan.write_text(_PLANS[key])
        return plan
    res = dmsc(
        home,
        "plan",
        "--cluster",
        str(path),
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
    _PLANS[key] = plan.read_text()
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


def local_plan() -> Plan:
    """gpt-mini in two stages on the local CPU cluster (what :func:`make_plan` makes), planned in
    this process."""
    from dmsc.planner.solve import plan_job

    cluster = load_spec(ClusterSpec, EXAMPLES / "local-cpu.yaml")
    job = JobSpec(global_batch=8, micro_batch=2, pp=2)
    return plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan


@contextmanager
def control_plane(
    plan: Plan, home: Path, start: bool = True, data_roots: list[Path] | None = None
) -> Iterator[ControlPlane]:
    """A started control plane on ``home`` (its database there) with real workers (not started
    with ``start=False``: the test starts it); tasks' data inside ``data_roots`` (default:
    ``home``). Leaving it does not end the run: that is a crash, and the next control plane on
    ``home`` resumes it."""
    db = Database(f"sqlite:///{home / 'dmsc.sqlite'}")
    cp = ControlPlane(plan, db, home=home, data_roots=data_roots)
    try:
        if start:
            cp.start()
        yield cp
    finally:
        cp.stopped.set()
        cp.deployment.shutdown()


def wait_for(predicate: Callable[[], T], seconds: float, what: str, every: float = 0.1) -> T:
    """``predicate()`` once it is true; AssertionError after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


# train_reference's runs of this process: (settings, each step's batch digest and micro-batch
# count, losses).
_REFERENCES: list[tuple[tuple[Any, ...], list[tuple[bytes, int]], list[float]]] = []


def reference_losses(
    spec: TransformerSpec,
    seed: int,
    lr: float,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    microbatches: int | list[int],
    optimizer: str = "adamw",
) -> list[float]:
    """``train_reference(spec, seed, lr, batches, microbatches, optimizer)``, trained once per
    test process: a run asked for again, or the first steps of a longer run already trained on
    the same batches, is read back (a step's loss depends only on the steps before it), so that
    the tests comparing a deployment with single-process training share their reference."""
    counts = microbatches if isinstance(microbatches, list) else [microbatches] * len(batches)
    steps = [
        (hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).digest(), m)
        for (x, y), m in zip(batches, counts, strict=True)
    ]
    key = (spec.model_dump_json(), seed, lr, optimizer)
    for known, done, losses in _REFERENCES:
        if known == key and done[: len(steps)] == steps:
            return losses[: len(steps)]
    losses = train_reference(spec, seed, lr, batches, microbatches, optimizer)
    _REFERENCES.append((key, steps, losses))
    return list(losses)


def text_batches(
    spec: TransformerSpec, steps: int, batch: int = 8, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` training batches of ``batch`` sequences of the standard library's text."""
    train, _ = stdlib_text(max_bytes=200_000)
    corpus = Corpus(train, spec.seq, seed=seed)
    return [corpus.batch(s, batch) for s in range(steps)]


def run_figures_on(plan: Plan, true: ClusterSpec, model: Any, step_s: float | None = None) -> Any:
    """What a run of ``plan`` on the cluster ``true`` measures, as the cost model predicts it:
    each stage's compute per micro-batch, each boundary's bytes and transfer, the step (the
    recalibration tests' figures, fitted back to ``true``)."""
    from dmsc.planner.placement.from_specs import build_problem
    from dmsc.planner.placement.problem import boundary_us
    from dmsc.planner.recalibrate import RunFigures, iteration_s, plan_placement

    built = build_problem(true, model, plan.job)
    place = plan_placement(built, plan)
    p = built.problem
    stage_s = {s: (p.compute_us[s][d] or 0) * 1e-6 for s, d in enumerate(place.dcs)}
    transfer = boundary_us(p, place.dcs, place.routes)
    bounds = {b: (p.boundary_bytes[b], transfer[b] * 1e-6) for b in range(len(transfer))}
    step = step_s if step_s is not None else iteration_s(plan, true, model)
    return RunFigures(stage_s, bounds, step, steps=10)
