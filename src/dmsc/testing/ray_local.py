"""A Ray cluster of several datacenter nodes on this machine, to try the Ray launcher, test it and
measure it without a second machine: a head node and more node processes on 127.0.0.1, each
offering a datacenter's ``dc:NAME`` resource (Ray's own ``ray.cluster_utils.Cluster``).

Also the faults a node can suffer, made on such a cluster: a node lost (its processes killed:
``Cluster.remove_node``) and a node partitioned (every process of it stopped with SIGSTOP, so
that it answers nobody, then let go with SIGCONT), and the memory Ray's own processes take.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from dmsc.data.corpus import Corpus
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.launch.ray_launcher import RayLauncher, ray_module
from dmsc.runtime.control.launch.ray_private import (
    GCS_WAIT_ENV,
    LOOPBACK_ENV,
    START_WAIT_S,
    STARTUP_TIMEOUT,
    tried,
)
from dmsc.runtime.control.training.report import TrainReport
from dmsc.runtime.control.training.session import Recovering, train
from dmsc.runtime.transport.processes import descendants
from dmsc.testing.chaos import FaultReport

NodeFault = Literal["lose", "partition"]

# A node that stops answering is declared dead after a few seconds (Ray's defaults: tens of s),
# so that a test or a benchmark of node loss does not wait on Ray's health check: 5 checks in a
# row unanswered, each given 1 s, one every 0.5 s (a killed node refuses them at once: about
# 2.5 s; a frozen one lets them time out: about 7.5 s). Until 2026-12-04 three checks of 0.5 s:
# on 2 cores busy with the test suite a live dc-0 raylet missed them, GCS declared its node
# dead ("missed too many heartbeats ... busy workload") and the raylet exited, before the
# test's own loss (tests/integration/test_ray_shrink.py failed in CI so).
FAST_HEALTH_CHECK = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 5,
}


@contextlib.contextmanager
def local_cluster(
    head: dict[str, float], nodes: list[dict[str, float]], cpus: int = 4
) -> Iterator[Any]:
    """A running cluster (connected: ``ray.init`` done) whose head offers the resources
    ``head`` and with one more node per entry of ``nodes``; everything stops on exit."""
    with _on_loopback():
        yield from _local_cluster(head, nodes, cpus)


@contextlib.contextmanager
def _on_loopback() -> Iterator[None]:
    """Ray advertises the machine's address even for a node started on 127.0.0.1 unless
    ``LOOPBACK_ENV`` is 0. The processes it starts read the variable; this process read it when
    it first imported Ray, which may have been before (another test, a benchmark's import), so
    the flag Ray keeps from it is set too (``ray._private.ray_constants``: no public setting)."""
    from ray._private import ray_constants

    env_was, flag_was = os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = flag_was
        if env_was is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = env_was


def _local_cluster(
    head: dict[str, float], nodes: list[dict[str, float]], cpus: int
) -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    ray = ray_module()

    args = {"num_cpus": cpus, "resources": head, "node_ip_address": "127.0.0.1",
            "include_dashboard": False, "_system_config": FAST_HEALTH_CHECK}  # fmt: skip
    wait_was = os.environ.get(GCS_WAIT_ENV)
    os.environ[GCS_WAIT_ENV] = wait_was or str(START_WAIT_S)  # read by Ray as the head starts
    c: Any = None
    try:
        # the head's registration waited for below, as long as the others' (Ray's own wait: 30 s)
        c = tried(lambda: Cluster(initialize_head=True, head_node_args={**args, "wait": False}))
        c.wait_for_nodes(timeout=START_WAIT_S)
    except Exception as e:
        if c is not None:
            c.shutdown()
        if not isinstance(e, RuntimeError | TimeoutError) and STARTUP_TIMEOUT not in str(e):
            raise
        raise RuntimeError(f"the Ray head did not start: {e}\n{gcs_log_tail()}") from e
    finally:
        if wait_was is None:
            os.environ.pop(GCS_WAIT_ENV, None)
    try:
        # connected here rather than by Cluster: without the nodes' logs copied to this
        # process's output (a benchmark's --json output is one JSON object)
        ray.init(address=c.address, log_to_driver=False, logging_level=logging.WARNING)
        c.connected = True
        for res in nodes:
            add_node(c, res, cpus)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def add_node(c: Any, resources: dict[str, float], cpus: int = 4) -> Any:
    """One more node process offering ``resources``, once the cluster sees it."""
    node = tried(lambda: c.add_node(wait=False, num_cpus=cpus, resources=resources,
                                     node_ip_address="127.0.0.1"))  # fmt: skip
    c.wait_for_nodes(timeout=START_WAIT_S)
    return node


def gcs_log_tail(lines: int = 20, root: Path = Path("/tmp/ray/session_latest/logs")) -> str:
    """The last ``lines`` lines of the newest session's GCS server logs, to say why a head did
    not start."""
    out = []
    for name in ("gcs_server.err", "gcs_server.out"):
        with contextlib.suppress(OSError):
            tail = (root / name).read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {root / name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(out) or f"(no GCS server log under {root})"


def lost_by_itself(c: Any) -> list[str]:
    """The nodes of ``c`` whose raylet has exited though nobody removed the node (a node removed
    with ``Cluster.remove_node`` is no longer one of ``c``'s), each as ``node ID: raylet pid P
    exited with CODE`` (a negative code is the signal that ended it: -9 a SIGKILL from outside
    Ray, which logs its own exits). A test that loses a node on purpose can tell by this that
    one was lost before it did anything."""
    out = []
    for node in [c.head_node, *c.worker_nodes]:
        if node is None:
            continue
        for info in node.all_processes.get("raylet", []):
            code = info.process.poll()
            if code is not None:
                out.append(f"node {node.node_id}: raylet pid {info.process.pid} exited with {code}")
    return out


def live_nodes(c: Any, resource: str) -> list[Any]:
    """The non-head nodes of ``c`` offering ``resource`` that Ray counts alive."""
    nodes = ray_module().nodes()
    alive = {n["NodeID"] for n in nodes if n["Alive"] and n["Resources"].get(resource)}
    return [n for n in c.worker_nodes if n.node_id in alive]


def node_of(c: Any, node_id: str) -> Any:
    """The node of ``c`` with Ray node ID ``node_id``."""
    return next(n for n in [c.head_node, *c.worker_nodes] if n.node_id == node_id)


def node_pids(node: Any) -> list[int]:
    """Every process of a node: its raylet and daemons, the workers below them (Ray's actors,
    and dmsc's stage workers below those)."""
    return [
        pid
        for infos in node.all_processes.values()
        for info in infos
        for pid in descendants(info.process.pid)
    ]


def signal_node(node: Any, sig: int) -> None:
    """Send ``sig`` to every process of ``node``: SIGSTOP partitions it (to the rest of the
    cluster it stops answering, as behind a cut link), SIGCONT heals the partition."""
    for pid in node_pids(node):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def partition(node: Any) -> None:
    signal_node(node, signal.SIGSTOP)


def heal(node: Any) -> None:
    signal_node(node, signal.SIGCONT)


def pss_mib(pids: list[int]) -> float:
    """The proportional set size of processes ``pids`` (shared pages split between their users,
    so that a sum over processes counts each page once), in MiB."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
    return total / 1024


def ray_pids(c: Any, but: set[int] | None = None) -> list[int]:
    """Every process of the cluster ``c`` (its nodes' daemons and Ray workers), less ``but``
    (dmsc's own stage workers, which run below Ray's workers)."""
    skip = but or set()
    pids = {p for n in [c.head_node, *c.worker_nodes] for p in node_pids(n)}
    return sorted(pids - skip)


def train_through_node_fault(
    c: Any,
    layout: StageLayout,
    corpus: Corpus,
    valid: Corpus,
    steps: int,
    batch: int,
    microbatches: int,
    fault: NodeFault,
    target: tuple[int, int] = (1, 0),
    at_step: int = 3,
    launcher: RayLauncher | None = None,
    home: Path | None = None,
    checkpoint_every: int = 2,
    registry_ttl_s: float = 3.0,
    after: Callable[[Deployment, Any], None] | None = None,
) -> tuple[TrainReport, FaultReport]:
    """Train ``steps`` steps on cluster ``c`` and, once step ``at_step`` is done, lose (its
    processes killed) or partition (frozen; healed once training is over) the node running the
    worker at ``target``. ``after(dep, node)`` runs before the deployment stops. The fault
    report's ``extra`` says on which node the stage ran before and after."""
    launcher = launcher if launcher is not None else RayLauncher(home=home)
    struck: list[float] = []
    with Deployment(layout, launcher=launcher, home=home, registry_ttl_s=registry_ttl_s) as dep:
        victim = dep.handle(target)
        node = node_of(c, victim.process.node)  # type: ignore[attr-defined]
        fr = FaultReport(f"{fault} node", victim.config.sid)

        def on_step(step: int, _out: dict[str, Any]) -> None:
            if step == at_step and not struck:
                if fault == "lose":
                    c.remove_node(node, allow_graceful=False)
                    # The worker goes with its node's processes, but not at once: training
                    # went on meanwhile and, on a busy machine, could end before the loss was
                    # seen (no recovery; CI saw the stage still on the lost node). The next
                    # step starts once the worker is gone, so the loss is always met.
                    end = time.monotonic() + 30
                    while dep.launcher.alive(victim) and time.monotonic() < end:
                        time.sleep(0.05)
                else:
                    partition(node)
                struck.append(time.time())

        folder = None if home is None else home / "checkpoints"
        keep = Recovering(checkpoint_every=checkpoint_every, checkpoint_dir=folder)
        try:
            report = train(dep, corpus, valid, steps, batch, microbatches, on_step=on_step,
                           recovering=keep, validate=False)  # fmt: skip
        finally:
            if fault == "partition" and struck:
                heal(node)
        if struck and report.recoveries:
            fr.detected_after_s = report.recoveries[0].detected_at - struck[0]
            fr.recovered_after_s = report.recoveries[0].recovered_at - struck[0]
        fr.steps_lost = report.steps_lost
        fr.extra = {
            "node_before": victim.process.node,  # type: ignore[attr-defined]
            "node_after": dep.handle(target).process.node,  # type: ignore[attr-defined]
            "old_pid": victim.process.pid,
        }
        if after is not None:
            after(dep, node)
    if fault == "partition":
        with contextlib.suppress(Exception):  # dead to Ray already; its processes go now
            c.remove_node(node, allow_graceful=False)
    return report, fr
