"""Elastic serving replicas: pipelines beyond the plan's that serve inference, added and removed
with the load.

The plan's ``dp`` replicas train and serve, and are always up. ``dmsc up --autoscale`` adds
whole pipelines that only serve: each is a deployment of its own (its workers, its registry),
placed by :func:`dmsc.planner.elastic.place_replica` on devices of the plan's cluster that no
replica uses, and loaded with the production model version (else the run's newest checkpoint;
else the same initial weights the plan's replicas started from), and loaded again when another
version goes to production (:mod:`.version_sync`). Training never touches them.

- **Scale out**: the replica goes to the idlest nodes with room, by the CPU % the training
  steps' telemetry measured on them (:meth:`ServingPool.node_load`); the devices are reserved
  before the workers start, so two decisions never place on the same device; the replica
  joins routing once its weights are loaded. Its workers start with the local launcher, or
  with a Ray launcher of its own (``dmsc up --launcher ray``: one placement group for the
  pipeline, on the Ray nodes of the datacenters it was placed in).
- **Scale in**: the replica leaves routing first (no new request reaches it), then its requests
  in flight finish (drained: none is lost) and only then do its workers stop.
- A serving replica whose worker fails is dropped from routing at once and stopped; the
  autoscaler adds another if the load still wants it.
- Every change, and every scale-out refused for lack of free devices, is a row of
  ``scale_events`` (:class:`~dmsc.data.db.ScaleEventRecord`) with its reason and placement.

:func:`autoscale_loop` drives the pool with :class:`~.autoscale.ScalePolicy` on the number of
requests in flight that :class:`~.inference.Replicas` counts.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmsc.data.db import Database, ScaleEventRecord
from dmsc.data.traces import latest_worker_cpu
from dmsc.planner.elastic import devices_in_use, node_load, place_replica
from dmsc.planner.plan import Plan, ReplicaRecord
from dmsc.runtime.compute.checkpoints import stage_file
from dmsc.runtime.control.launch.deployment import Checkpoint, Deployment, StageLayout
from dmsc.runtime.control.launch.launchers import Launcher
from dmsc.runtime.control.serving.autoscale import ScalePolicy
from dmsc.runtime.control.serving.held import Held, forget, record, version_of
from dmsc.runtime.control.serving.model_store import versions
from dmsc.runtime.control.serving.turns import FairLock
from dmsc.spec import ClusterSpec, TransformerSpec

DRAIN_TIMEOUT_S = 120.0  # the longest a removed replica waits for its requests in flight


@dataclass
class ServingReplica:
    """One serving pipeline: its deployment, where it runs, and its requests in flight."""

    name: str
    dep: Deployment
    placement: list[ReplicaRecord]
    lock: FairLock = field(init=False)  # its requests' turns, as many at once as it holds
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    held: Held | None = None  # the weights it loaded (held.py)

    def __post_init__(self) -> None:
        self.lock = FairLock(self.dep.layout.tokens_in_flight)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "placement": [
                [s, r.datacenter, r.devices, r.device] for s, r in enumerate(self.placement)
            ],
            "started_at": self.started_at,
            "draining": self.draining,
        }


def serving_checkpoint(db: Database, run_id: int, stages: int) -> Checkpoint | None:
    """The weights a new serving replica loads: the production version's stage files, else the
    run's newest checkpoint; None when there is neither (the initial weights then)."""
    production = next((v for v in versions(db) if v.status == "production"), None)
    if production is not None:
        digests = json.loads(production.metrics_json or "{}")
        files = {}
        for s in range(stages):
            path = str(stage_file(Path(production.path), s))
            files[s] = (path, digests.get(path, ""))
        return Checkpoint(production.step, files)
    last = db.last_checkpoint(run_id)
    return None if last is None else Checkpoint.from_json(last.step, last.files_json, last.id)


class ServingPool:
    """The serving replicas of one run (module docstring)."""

    def __init__(
        self,
        plan: Plan,
        model: TransformerSpec,
        cluster: ClusterSpec,
        db: Database,
        run_id: int,
        home: Path,
        log: logging.Logger,
        in_flight: Callable[[str], int],
        registry_ttl_s: float = 10.0,
        launcher: Callable[[], Launcher] | None = None,
    ) -> None:
        self.plan, self.model, self.cluster = plan, model, cluster
        self.launcher = launcher  # a new one per replica (None: the local launcher)
        self.db, self.run_id, self.home, self.log = db, run_id, home, log
        self.in_flight = in_flight  # requests in flight on a replica, by name
        self.registry_ttl_s = registry_ttl_s
        self.replicas: dict[str, ServingReplica] = {}
        self._reserved: dict[str, set[int]] = {}  # devices held by replicas being started
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)

    # -- routing ---------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """The serving replicas in routing (one being drained is not)."""
        with self._lock:
            return [n for n, r in self.replicas.items() if not r.draining]

    def get(self, name: str) -> ServingReplica:
        with self._lock:
            rep = self.replicas.get(name)
        if rep is None or rep.draining:
            raise KeyError(f"{name} does not serve (any more)")
        return rep

    def count(self) -> int:
        """The pipelines serving inference: the plan's and the pool's in routing."""
        return self.plan.job.dp + len(self.names())

    # -- scaling ---------------------------------------------------------------------------------
    def _record(
        self, action: str, name: str, in_flight: float, reason: str, where: list[Any]
    ) -> None:
        self.db.add(
            ScaleEventRecord(
                run_id=self.run_id,
                action=action,
                replica=name,
                replicas_after=self.count(),
                in_flight=in_flight,
                reason=reason,
                placement_json=json.dumps(where),
            )
        )
        self.log.info("scale %s %s: %s", action, name, reason, extra={"run": self.run_id})

    def scale_out(self, reason: str, in_flight: float = 0.0) -> str | None:
        """Start one more serving replica; its name, or None when the cluster has no room."""
        with self._lock:
            taken = devices_in_use(self.plan)
            for rep in self.replicas.values():
                taken |= {d for r in rep.placement for d in r.devices}
            for held in self._reserved.values():
                taken |= held
            k = next(self._numbers)
            name = f"serve-{k}"
            rank, load = self.plan.job.dp + k - 1, self.node_load()
            placement = place_replica(self.plan, self.cluster, taken, rank, load)
            if placement is not None:
                self._reserved[name] = {d for r in placement for d in r.devices}
        if placement is None:
            self._record("refused", name, in_flight, f"{reason}; no free devices left", [])
            return None
        where = [[s, r.datacenter, r.devices] for s, r in enumerate(placement)]
        layout = StageLayout(
            model=self.model,
            ranges=[st.chunks[0] for st in self.plan.stages],
            chunks=[list(st.chunks) for st in self.plan.stages] if self.plan.job.chunks > 1 else [],
            replicas=1,
            sids=[f"{st.sid}-e{k}" for st in self.plan.stages],
            devices={(s, 0): r.device for s, r in enumerate(placement)},
            datacenters={(s, 0): r.datacenter for s, r in enumerate(placement)},
        )
        dep = Deployment(
            layout,
            launcher=self.launcher() if self.launcher is not None else None,
            workdir=self.home / "workers",
            registry_ttl_s=self.registry_ttl_s,
            home=self.home,
        )
        try:
            dep.start()
            ckpt = serving_checkpoint(self.db, self.run_id, len(self.plan.stages))
            if ckpt is not None:
                dep.restore(ckpt)
            loaded = self._held(ckpt)
        except Exception as exc:
            dep.shutdown()
            with self._lock:
                self._reserved.pop(name, None)
            self._record("failed", name, in_flight, f"{reason}; the start failed: {exc}", where)
            return None
        with self._lock:
            self._reserved.pop(name, None)
            self.replicas[name] = ServingReplica(name, dep, placement, held=loaded)
        record(self.db, self.run_id, name, loaded)
        self._record("out", name, in_flight, reason, where)
        return name

    def node_load(self) -> dict[int, float]:
        """Each node's CPU load as the newest training task's steps measured it (its workers'
        mean CPU %, :func:`dmsc.planner.elastic.node_load`): a new replica goes to the idlest."""
        cpu = latest_worker_cpu(self.db, self.run_id)
        return node_load(self.plan, self.cluster, cpu) if cpu else {}

    def scale_in(
        self, name: str, reason: str, in_flight: float = 0.0, drain_s: float = DRAIN_TIMEOUT_S
    ) -> None:
        """Take ``name`` out of routing, wait for its requests in flight, then stop it."""
        with self._lock:
            rep = self.replicas.get(name)
            if rep is None or rep.draining:
                return
            rep.draining = True
        deadline = time.monotonic() + drain_s
        while self.in_flight(name) > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.in_flight(name)
        rep.dep.shutdown()
        with self._lock:
            self.replicas.pop(name, None)
        forget(self.db, self.run_id, name)
        where = [[s, r.datacenter, r.devices] for s, r in enumerate(rep.placement)]
        drained = "drained" if left == 0 else f"{left} requests still in flight after {drain_s:g} s"
        self._record("in", name, in_flight, f"{reason}; {drained}", where)

    def failed(self, name: str, why: str) -> None:
        """A worker of ``name`` failed: out of routing and stopped at once."""
        with self._lock:
            rep = self.replicas.pop(name, None)
        if rep is None:
            return
        rep.draining = True
        with contextlib.suppress(Exception):
            rep.dep.shutdown()
        forget(self.db, self.run_id, name)
        self._record("failed", name, 0.0, why, [])

    def _held(self, ckpt: Checkpoint | None) -> Held:
        """What a replica that loaded ``ckpt`` (None: the initial weights) holds."""
        if ckpt is None:
            return Held({s: "" for s in range(len(self.plan.stages))}, None, "initial weights")
        digests = {s: sha for s, (_, sha) in ckpt.files.items()}
        return Held(digests, version_of(versions(self.db), digests), f"step {ckpt.step}")

    def newest(self) -> str | None:
        names = self.names()
        return names[-1] if names else None

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            reps = list(self.replicas.values())
        return [{**r.as_json(), "in_flight": self.in_flight(r.name)} for r in reps]

    def shutdown(self) -> None:
        with self._lock:
            reps = list(self.replicas.values())
            self.replicas.clear()
        for rep in reps:
            with contextlib.suppress(Exception):
                rep.dep.shutdown()


def autoscale_loop(
    pool: ServingPool,
    policy: ScalePolicy,
    load: Callable[[], int],
    stop: threading.Event,
    interval_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    arrivals: Callable[[], int] | None = None,
) -> None:
    """Sample the load (and the ``arrivals`` counter, for the forecast) every ``interval_s``
    and add or remove one serving replica as ``policy`` says, with its reason, until ``stop``
    is set."""
    while not stop.wait(interval_s):
        now, in_flight, current = clock(), load(), pool.count()
        arrived = None if arrivals is None else arrivals()
        wanted = policy.observe(now, in_flight, current, arrived)
        try:
            if wanted > current:
                if pool.scale_out(policy.why, in_flight) is not None:
                    ready = clock()
                    policy.changed(ready, ready_s=ready - now)
            elif wanted < current and (name := pool.newest()) is not None:
                pool.scale_in(name, policy.why, in_flight)
                policy.changed(clock())
        except Exception:  # a failed change must not stop the autoscaler
            pool.log.exception("autoscaling failed")
