"""Loading the model versions the replicas should serve, all or nothing.

Between tasks the control plane calls :func:`sync`: the production version goes into every
replica (the plan's and the elastic serving ones) and, during a gray release, the canary into the
plan's last replica (with two or more). Each load is recorded as what the replica holds
(:mod:`.held`), with the digests its workers report.

A version that a replica cannot load (a stage file missing, failing its hash, unreadable) is not
served anywhere: every replica that loaded it (the failing one included, whose first stages may
have) goes back to the weights it held before (the version it served, else the run's newest
checkpoint that verifies), the version is ``failed`` and production goes back to the version
before it (:func:`dmsc.runtime.control.serving.model_store.refuse`), and a fault of kind
``model-version`` says which stages refused and why, in words (the worker's reason, never a raw
gRPC error). A worker that fails during a load is a worker failure, not the version's: its
replica leaves routing and the watchdog heals it.

A request finishes on the version it started on. A load replaces the weights at every stage and
drops the keys and values they keep for the requests in flight, so it first drains the replica
(:meth:`~.inference.Replicas.drained`): new requests go to another replica or wait for the load,
and the load waits for those in flight to end. The control plane's lock is held meanwhile, so a
training task waits for the load as it would for any (the requests take only the replica's
per-token lock, never the control plane's: nothing waits in a circle). A replica whose requests
outlast the drain timeout is not loaded this time (no request is cut): it keeps serving the
version it holds, and the next sync loads it. Putting a replica back after a refused version
waits for the drain too, but not past it: a refused version must stop serving.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from dmsc.data.db import Database, FaultRecord, ModelVersionRecord
from dmsc.runtime.compute.checkpoints import replica_file
from dmsc.runtime.control.launch import fallback
from dmsc.runtime.control.launch.deployment import Checkpoint, Deployment
from dmsc.runtime.control.launch.failures import CheckpointRefused, WorkerFailure
from dmsc.runtime.control.serving.held import Held, load_files, version_files, version_of
from dmsc.runtime.control.serving.model_store import refuse, versions
from dmsc.runtime.control.serving.turns import FairLock


class Pool(Protocol):
    def names(self) -> list[str]: ...


class Replicas(Protocol):
    """What loading reads and changes of :class:`~.inference.Replicas`."""

    db: Database
    dep: Deployment
    lock: threading.Lock
    log: logging.Logger
    extra: dict[str, int]
    signature: list[tuple[int, str]]
    production: int | None
    count: int
    instances: list[int]  # the replicas routed to (at ep > 1 each group's first)
    down: set[int]
    heads: bool

    @property
    def pool(self) -> Pool | None: ...

    def held_by(self, name: str) -> Held | None: ...

    def hold(self, name: str, held: Held) -> None: ...

    def failed(self, name: str, why: str) -> None: ...

    def route(self, replica: str) -> tuple[Deployment, int, FairLock]: ...

    def drained(self, name: str, why: str) -> AbstractContextManager[int]: ...


def sync(rep: Replicas) -> None:
    """Load the versions the replicas should serve (module docstring)."""
    all_versions = versions(rep.db)
    signature = [(v.id, v.status) for v in all_versions]
    if signature == rep.signature:
        return
    production = next((v for v in all_versions if v.status == "production"), None)
    canary = next((v for v in all_versions if v.status == "canary"), None)
    before, rep.production = rep.production, production.id if production is not None else None
    last = rep.instances[-1] if len(rep.instances) > 1 else None  # the canary's
    wanted: list[tuple[str, ModelVersionRecord | None]] = [
        (f"replica-{r}", canary if (canary is not None and r == last) else production)
        for r in rep.instances
        if r not in rep.down
    ]
    wanted += [(name, production) for name in (rep.pool.names() if rep.pool is not None else [])]
    switched: list[tuple[str, int | None]] = []  # replicas loaded here, and what they held
    put_off = False  # a replica's requests outlasted the drain: the next sync loads it
    for name, want in wanted:
        prior = rep.held_by(name)
        if want is None or (prior is not None and prior.version == want.id):
            continue
        try:
            if not load(rep, name, want, all_versions):
                put_off = True
                continue
        except CheckpointRefused as exc:
            back = [*switched, (name, prior.version if prior is not None else None)]
            _refused(rep, want, name, exc, back, all_versions, before)
            return  # the versions changed: the next sync loads what serves now
        except WorkerFailure as exc:
            rep.failed(name, f"loading version {want.id}: {exc}")
            continue
        switched.append((name, prior.version if prior is not None else None))
    if not put_off:
        rep.signature = signature


def load(
    rep: Replicas,
    name: str,
    v: ModelVersionRecord,
    all_versions: list[ModelVersionRecord],
    put_off: bool = True,
) -> bool:
    """Load version ``v`` into replica ``name`` once its requests in flight ended; False when
    they outlasted the drain timeout and ``put_off`` (nothing loaded then; else it loads all
    the same). CheckpointRefused: a stage refused it."""
    dep, r, lock = rep.route(name)
    keys = dep.instance(r)  # at ep > 1 every replica of its group
    files = version_files(v, keys)
    with rep.lock, rep.drained(name, f"loading version {v.id}") as left:
        if left and put_off:
            why = f"{left} requests still in flight after the drain; the next sync loads it"
            rep.log.warning(
                "%s: loading version %d is put off: %s", name, v.id, why, extra=rep.extra
            )
            return False
        with lock:
            digests = load_files(dep, files)
        expected = {s: files[(s, r)][1] for s, _ in keys}
        held = Held(digests, v.id if digests == expected else None, f"version {v.id}")
        if held.version is None:
            held.version = version_of(all_versions, digests, r)
        if r and dep is rep.dep:  # a version of task heads saved every replica's last stage
            last = (dep.stages - 1, r)
            rep.heads = files[last][0] == str(replica_file(Path(v.path), *last))
        rep.hold(name, held)  # before the gate opens: the next request reads its version
    rep.log.info("%s serves version %d", name, v.id, extra=rep.extra)
    if dep is rep.dep:
        rep.log.info("replica %d serves version %d", r, v.id, extra=rep.extra)
    return True


def _back(
    rep: Replicas, name: str, prior: int | None, all_versions: list[ModelVersionRecord]
) -> str:
    """Put replica ``name`` back on version ``prior`` (else the run's newest checkpoint that
    verifies); what it holds now, in words."""
    old = next((v for v in all_versions if v.id == prior), None)
    if old is not None:
        try:
            load(rep, name, old, all_versions, put_off=False)
            return f"version {old.id}"
        except (CheckpointRefused, WorkerFailure) as exc:
            rep.log.error("%s cannot go back to version %d: %s", name, old.id, exc, extra=rep.extra)
    dep, r, lock = rep.route(name)
    candidates = [
        Checkpoint.from_json(c.step, c.files_json, c.id)
        for c in rep.db.checkpoints(rep.extra["run"])
    ]
    with rep.lock, rep.drained(name, "going back to a checkpoint"):
        with lock:
            restored = fallback.restore_newest(dep, candidates, dep.instance(r))
        if restored.checkpoint is None:
            rep.failed(name, "no version or checkpoint it held before loads")
            return "nothing: out of routing"
        ckpt = restored.checkpoint
        digests = {s: ckpt.replicas.get((s, r), ckpt.files[s])[1] for s in range(dep.stages)}
        version = version_of(all_versions, digests, r)
        rep.hold(name, Held(digests, version, f"the checkpoint of step {ckpt.step}"))
    return f"the checkpoint of step {ckpt.step}" + (f" (version {version})" if version else "")


def _refused(
    rep: Replicas,
    want: ModelVersionRecord,
    name: str,
    exc: CheckpointRefused,
    back: list[tuple[str, int | None]],
    all_versions: list[ModelVersionRecord],
    before: int | None,
) -> None:
    """``want`` did not load on ``name``: every replica in ``back`` returns to what it held,
    the version fails, and the fault is recorded."""
    detected, dep = time.time(), rep.route(name)[0]
    where = "; ".join(f"stage {k[0]}: {why}" for k, why in sorted(exc.refused.items()))
    now = [f"{n} on {_back(rep, n, prior, all_versions)}" for n, prior in back]
    serving = refuse(rep.db, want.id, before if want.status == "production" else None)
    rep.production = serving
    outcome = (
        f"version {serving} in production again" if serving is not None else "no version serves"
    )
    reason = f"version {want.id} did not load on {name} ({where}); {outcome}; {', '.join(now)}"
    rep.db.add(
        FaultRecord(
            run_id=rep.extra["run"],
            kind="model-version",
            services=",".join(dep.sid(*k) for k in sorted(exc.refused)),
            reason=reason[:2000],
            detected_at=detected,
            recovered_at=time.time(),
            checkpoint_step=want.step,
        )
    )
    rep.log.error("model version fault: %s", reason, extra=rep.extra)
