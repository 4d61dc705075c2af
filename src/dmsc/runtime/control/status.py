"""What ``dmsc status`` shows: the services and their health, tasks, faults, spares.

Health is asked of every worker at once (:func:`dmsc.runtime.control.launch.failures.probe`), so a
dead worker costs one timeout, not one per worker. The faults are read before the services: a heal
replaces the handles before it records its fault, so a fault shown as recovered is never shown
beside the worker it replaced.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from dmsc.data.db import Database
from dmsc.runtime.control.launch.deployment import Deployment
from dmsc.runtime.control.launch.failures import key_of

HEALTH_TIMEOUT_S = 3.0


def services(dep: Deployment) -> list[dict[str, Any]]:
    """Every serving worker: address, pid, whether it answers, registered, last heartbeat."""
    ranks = dep.tp.handles  # a replica's tensor-parallel ranks past the first
    handles = sorted([*dep.handles, *ranks], key=lambda h: (key_of(h), h.config.tp_rank))
    silent = dep.probe(HEALTH_TIMEOUT_S)
    silent_ranks = dep.tp.silent(HEALTH_TIMEOUT_S) if ranks else set()
    out: list[dict[str, Any]] = [
        {
            "sid": h.config.sid,
            "stage": h.config.stage,
            "replica": h.config.replica,
            "tp_rank": h.config.tp_rank,
            "address": h.address,
            "health": "unreachable"
            if (h.config.sid in silent_ranks if h.config.tp_rank else key_of(h) in silent)
            else "ok",
            "pid": h.process.pid,
            "node": getattr(h.process, "ip", "local"),
        }
        for h in handles
    ]
    seen = {s.sid for s in dep.registry.lookup()}
    for s in out:
        s["registered"] = s["sid"] in seen
        s["heartbeat_age_s"] = dep.registry.heartbeat_age(s["sid"])
    return out


def faults(db: Database, run_id: int) -> list[dict[str, Any]]:
    """The run's faults and what was done about each."""
    return [
        {
            "id": f.id,
            "kind": f.kind,
            "task": f.task_id,
            "services": f.services,
            "reason": f.reason,
            "detected_at": f.detected_at,
            "recovered_at": f.recovered_at,
            "checkpoint_step": f.checkpoint_step,
            "steps_lost": f.steps_lost,
            "epoch": f.epoch,
        }
        for f in db.faults(run_id)
    ]


def report(
    dep: Deployment,
    db: Database,
    run_id: int,
    model: str,
    steps: int,
    replicas_down: Collection[int],
) -> dict[str, Any]:
    """The reply of ``Status``."""
    faults_now = faults(db, run_id)  # before the services (see the module docstring)
    down = sorted(replicas_down)
    return {
        "run": run_id,
        "model": model,
        "steps": steps,
        "epoch": dep.epoch,
        "services": services(dep),
        "tasks": [{"id": t.id, "kind": t.kind, "state": t.state} for t in db.tasks(run_id)],
        "faults": faults_now,
        "replicas_down": down,
        "spares": [
            {"sid": h.config.sid, "address": h.address, "pid": h.process.pid}
            for h in dep.spares.handles
        ],
    }
