"""The one-off cost of a move, stated: what moving stage layers from where they run costs
before the deployment trains again (path optimisation's ``move-stage``, the busy node's
``move-node``, the decision rule's payback).

A checkpoint holds the float32 weights and AdamW's two moments
(:mod:`dmsc.runtime.compute.checkpoints`), written and read back at :data:`DISK_BYTES_S`; the
moved stages' state crosses the slowest measured inter-datacenter boundary; the workers restart
in the run's median measured recovery time, else in the time this deployment's workers took to
start (measured when it started), else in :data:`WORKER_START_S` when nothing was measured.
"""

from __future__ import annotations

import statistics

from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors.base import FaultInfo

STATE_BYTES_PER_PARAM = 12
DISK_BYTES_S = 200e6  # a conservative local disk or network file system
WORKER_START_S = 20.0  # start a worker process, import torch, build its stage, load its state


def move_cost_s(
    plan: Plan,
    moved_layers: int,
    link_bytes_s: float | None,
    faults: tuple[FaultInfo, ...],
    start_s: float | None = None,
) -> tuple[float, dict[str, float]]:
    """The one-off seconds of a move that changes where ``moved_layers`` layers run, and its
    parts: a checkpoint of the whole state written and read back, the moved layers' state over
    ``link_bytes_s`` (the slowest measured inter-datacenter boundary), and a restart (``start_s``:
    how long the deployment's workers took to start, when measured)."""
    state = plan.params * STATE_BYTES_PER_PARAM
    total_layers = sum(st.layers for st in plan.stages) or 1
    moved = state * moved_layers / total_layers
    recoveries = [
        f.recovered_s - f.detected_s
        for f in faults
        if f.kind == "worker" and f.recovered_s is not None and f.recovered_s > f.detected_s
    ]
    if recoveries:
        restart = statistics.median(recoveries)
    else:
        restart = start_s if start_s is not None and start_s > 0 else WORKER_START_S
    parts = {
        "checkpoint_s": state / DISK_BYTES_S,
        "transfer_s": moved / link_bytes_s if moved and link_bytes_s else 0.0,
        "load_s": state / DISK_BYTES_S,
        "restart_s": restart,
    }
    return sum(parts.values()), parts
