"""The watchdog: repairs failed workers while no task runs.

A training task recovers its own failures (:mod:`dmsc.runtime.control.training.session`); between
tasks nobody would notice a dead worker until the next request hit it. Every second, while the
control plane's lock is free, the watchdog looks for workers that exited, stopped heartbeating, or
do not answer ``Health`` within the registry's TTL (alive and heartbeating is not enough: a stuck
worker does both), and heals each affected replica's pipeline
(:func:`dmsc.runtime.control.launch.recovery.heal`, loading the run's newest checkpoint that
verifies). A replica that a failed request took out of routing, but whose workers all answer, simply
comes back. Every heal is recorded in the ``faults`` table and the replacements in ``services``.

A heal that had to skip a corrupt checkpoint records a ``checkpoint`` fault too, and, since the
replica is now older than the others, every other replica goes back to the same checkpoint (the
run continues from there). A heal that found no checkpoint that verifies leaves the replica out
of routing (it holds fresh weights) and training refused (``ControlPlane.weights_lost``).
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from dmsc.data.db import Database, RunRecord
from dmsc.runtime.control.launch import recovery
from dmsc.runtime.control.launch.deployment import Checkpoint, Deployment
from dmsc.runtime.control.launch.failures import WorkerFailure, key_of
from dmsc.runtime.control.launch.fallback import Restored
from dmsc.runtime.control.launch.recovery import Recovery
from dmsc.runtime.control.serving.inference import Replicas
from dmsc.runtime.control.training.session import fault_record
from dmsc.runtime.transport.messages import Health


class Healed(Protocol):
    """What the watchdog reads and changes of the control plane (:class:`~.plane.ControlPlane`):
    its deployment and replicas, the replicas kept out of routing (``unrestored``) and why
    (``weights_lost``), the step the run is at, and the records of checkpoints, faults and
    services it writes."""

    deployment: Deployment
    inference: Replicas
    db: Database
    run: RunRecord
    log: logging.Logger
    lock: threading.Lock
    stopped: threading.Event
    unrestored: set[int]
    weights_lost: str | None
    undeployed: str | None  # a failed shrink left no workers: nothing to heal
    steps_done: int

    def checkpoints(self, task_id: int | None = None) -> list[Checkpoint]: ...

    def record_refused(self, restored: Restored, task_id: int | None = None) -> None: ...

    def record_services(self, sids: list[str] | None = None) -> None: ...


def heal_once(cp: Healed) -> None:
    """One round: find failed workers and heal their replicas (the caller holds ``cp.lock``);
    none while a failed shrink left no deployment (the next training task redeploys)."""
    if cp.undeployed:
        return
    dep, replicas = cp.deployment, cp.inference
    found = dep.suspects()
    found.update({k: v for k, v in dep.probe(dep.registry.ttl_s).items() if k not in found})
    sids = {key_of(h): h.config.sid for h in dep.handles}
    ep = dep.layout.ep  # at ep > 1 a group of replicas serves as its first (forwarding)
    for r in sorted({k[1] - k[1] % ep for k in found} | set(replicas.down)):
        mine = {k: v for k, v in found.items() if k[1] - k[1] % ep == r}
        if not mine and r in cp.unrestored:  # alive, but with weights no checkpoint restored
            continue
        if not mine:  # marked down by a failed request, but every worker is alive
            try:
                for key in dep.instance(r):
                    dep.clients[key].send("Health", Health(), timeout_s=3)
            except Exception:
                continue
            replicas.down.discard(r)
            continue
        replicas.down.add(r)
        with replicas.locks[r]:
            rec = recovery.heal(dep, WorkerFailure(mine, sids), r, cp.checkpoints())
        # The checkpoints it skipped first: whoever sees the healed worker's fault (its
        # recovered_at) sees why it went back where it did (a test read the one without the other).
        cp.record_refused(rec.restored)
        cp.db.add(fault_record(rec, cp.run.id))
        cp.record_services(rec.failed)
        if rec.lost:
            cp.unrestored.add(r)
            cp.weights_lost = f"replica {r} healed without weights: {rec.restored.error()}"
            cp.log.error("replica %d stays out of routing: %s", r, cp.weights_lost)
            continue
        if rec.restored.refused:
            _align(cp, r, rec)
        cp.unrestored.discard(r)
        replicas.healed(r)
        cp.log.info("replica %d healed", r, extra={"run": cp.run.id})


def _align(cp: Healed, healed: int, rec: Recovery) -> None:
    """After a heal fell back to an older checkpoint: every other replica goes back to it too,
    so that the replicas hold the same weights and the run continues from that step."""
    dep, replicas = cp.deployment, cp.inference
    ckpt = rec.checkpoint
    assert ckpt is not None
    for r in range(dep.layout.replicas):
        if r != healed and r not in replicas.down:  # (one down is healed, from there, in turn)
            with replicas.locks[r]:
                dep.restore(ckpt, dep.pipeline(r))
            replicas.healed(r)  # its model version is loaded again too
    cp.steps_done = ckpt.step
    cp.log.warning(
        "the run went back to the checkpoint of step %d", ckpt.step, extra={"run": cp.run.id}
    )


def watch_workers(cp: Healed, interval_s: float = 1.0) -> None:
    """Heal failed workers every ``interval_s`` while no task runs, until the plane stops."""
    while not cp.stopped.wait(interval_s):
        if not cp.lock.acquire(blocking=False):
            continue
        try:
            heal_once(cp)
        except Exception as exc:  # keep watching; the next round tries again
            cp.log.warning("healing failed: %s", exc, extra={"run": cp.run.id})
        finally:
            cp.lock.release()
