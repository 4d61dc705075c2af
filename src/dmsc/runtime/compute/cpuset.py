"""The cores a worker runs on: a node's cpuset on a machine that holds several nodes.

A cluster spec may give a node group ``cpus`` (:class:`dmsc.spec.cluster.NodeGroupSpec`): the
cores of this machine its nodes run their workers on, as a container's cpuset would. The local
launcher hands each worker its node's cores (``WorkerConfig.cpus``); the worker pins itself to
them before it starts a thread (:func:`pin`, which also moves every thread already running, for
a warm spare that takes a stage over on another node), and its telemetry reads its node's CPU %
over those cores only (:func:`node_cpu_times`): one node burning its cores is busy, the node
beside it on the same machine is not, which the control loop's busy-node check compares.

Linux only (``os.sched_setaffinity``); elsewhere a spec with ``cpus`` is refused at
``dmsc up`` (:func:`check_cores`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import psutil


def available() -> set[int] | None:
    """The cores this process may run on (None: the platform cannot say or pin)."""
    get = getattr(os, "sched_getaffinity", None)
    return set(get(0)) if get is not None else None


def pin(cpus: Sequence[int]) -> None:
    """This process, every thread of it, on ``cpus`` (nothing when empty)."""
    if not cpus:
        return
    cores = set(cpus)
    os.sched_setaffinity(0, cores)
    for task in os.listdir("/proc/self/task"):  # threads started before: each has its own mask
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:  # a thread that ended meanwhile
            continue


def node_cores() -> int:
    """How many cores this process's node has: its cpuset's, else the machine's."""
    mine = available()
    return len(mine) if mine else psutil.cpu_count() or 1


def node_cpu_times() -> tuple[float, float]:
    """(busy, all) CPU seconds of the cores this process may run on: the whole machine's when
    it may run on all of them, else the sum over its cpuset's cores (its node's)."""
    mine = available()
    every = psutil.cpu_count() or 1
    if mine is None or len(mine) >= every:
        return _busy_all([psutil.cpu_times()])
    per = psutil.cpu_times(percpu=True)
    return _busy_all(per[c] for c in sorted(mine) if c < len(per))


def _busy_all(times: Iterable[object]) -> tuple[float, float]:
    busy = total = 0.0
    for t in times:
        # Linux counts guest time inside user and nice as well: count it once
        all_s = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)  # type: ignore[call-overload]
        total += all_s
        busy += all_s - getattr(t, "idle", 0.0) - getattr(t, "iowait", 0.0)
    return busy, total


def check_cores(wanted: dict[str, list[int]]) -> None:
    """ValueError naming the first field whose cores this machine does not let the control plane
    run on (``wanted``: a spec field such as ``datacenters[0].nodes[1].cpus`` -> its cores)."""
    if not wanted:
        return
    mine = available()
    if mine is None:
        field = next(iter(wanted))
        raise ValueError(f"{field}: pinning workers to cores needs Linux (sched_setaffinity)")
    for field, cores in wanted.items():
        missing = sorted(set(cores) - mine)
        if missing:
            raise ValueError(
                f"{field}: core(s) {missing} are not among this machine's "
                f"({', '.join(map(str, sorted(mine)))})"
            )
