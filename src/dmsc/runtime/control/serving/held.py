"""What each serving replica holds: the one record of which model version serves.

A replica's stages hold whatever was last loaded into them or trained there. Every change is
written to ``replica_weights`` (:class:`~dmsc.data.db.ReplicaWeightsRecord`): per stage the
SHA-256 of the checkpoint file the worker loaded (as the worker reports it, having checked it),
and the model version whose files have exactly those digests. A training task changes the
weights step by step: while it runs, and until a version is loaded again, the replica holds no
version (``version`` None, its digests empty). ``dmsc models list``, the answers'
``model_version`` (``dmsc infer``, the gateway), the log and the dashboard read this, not the
versions' status: a promoted version serves once every replica has loaded it.

Loading is all or nothing per replica (:func:`load_files`): a stage that refuses its file
(missing, failing its hash, unreadable) raises
:class:`~dmsc.runtime.control.launch.failures.CheckpointRefused` naming every stage that did, with
the worker's reason (never a raw gRPC error), and the caller puts the replica back
(:mod:`.version_sync`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from sqlalchemy import delete, select

from dmsc.data.db import Database, ModelVersionRecord, ReplicaWeightsRecord, RunRecord
from dmsc.runtime.compute.checkpoints import replica_file, stage_file
from dmsc.runtime.control.launch.deployment import Deployment
from dmsc.runtime.control.launch.failures import CheckpointRefused, Key
from dmsc.runtime.transport.messages import Load

TRAINING = "training weights (no model version holds them)"


@dataclass
class Held:
    """The weights of one replica: each stage's SHA-256 ("" where unknown), the model version
    they are (None: none is), and in words."""

    digests: dict[int, str]
    version: int | None
    what: str

    @property
    def label(self) -> str:
        return f"version {self.version}" if self.version is not None else self.what


def version_files(v: ModelVersionRecord, keys: Collection[Key]) -> dict[Key, tuple[str, str]]:
    """The (path, SHA-256) each worker of ``keys`` loads for version ``v``: its stage's file, or
    its replica's own where the version saved every replica's (task heads)."""
    digests = json.loads(v.metrics_json or "{}")
    out = {}
    for s, r in keys:
        path = str(stage_file(Path(v.path), s))
        own = str(replica_file(Path(v.path), s, r))
        path = own if r and own in digests else path
        out[(s, r)] = (path, digests.get(path, ""))
    return out


def version_of(
    all_versions: Sequence[ModelVersionRecord], digests: dict[int, str], replica: int = 0
) -> int | None:
    """The version whose files for replica ``replica`` have exactly ``digests`` (None: none)."""
    if not digests or "" in digests.values():
        return None
    keys = [(s, replica) for s in digests]
    for v in reversed(all_versions):
        files = version_files(v, keys)
        if all(files[(s, replica)][1] == sha for s, sha in digests.items()):
            return v.id
    return None


def load_files(
    dep: Deployment, files: dict[Key, tuple[str, str]], timeout_s: float = 120.0
) -> dict[int, str]:
    """Load ``files`` ((path, SHA-256) by worker) into those workers at once; each stage's
    SHA-256 as its worker reports it. :class:`CheckpointRefused` names every worker that
    refused its file and why; a worker that fails raises
    :class:`~dmsc.runtime.control.launch.failures.WorkerFailure`."""

    def message(path: str, sha: str) -> object:
        return lambda epoch: Load(path=path, sha256=sha, epoch=epoch)

    futures = {k: dep.calls("Load", message(*files[k]), [k], timeout_s)[k] for k in files}  # type: ignore[arg-type]
    try:
        replies = dep.gather(futures, timeout_s)
    except CheckpointRefused:
        refused = {}
        for k, fut in futures.items():
            exc = fut.exception()  # waits for the call to end
            if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.DATA_LOSS:
                refused[k] = str(exc.details())
        raise CheckpointRefused(refused) from None
    return {k[0]: str(reply.get("sha256") or files[k][1]) for k, reply in replies.items()}


def record(db: Database, run_id: int, replica: str, held: Held) -> None:
    """Write what ``replica`` now holds (replacing what it held)."""
    with db.sessions() as s, s.begin():
        mine = (ReplicaWeightsRecord.run_id == run_id) & (ReplicaWeightsRecord.replica == replica)
        s.execute(delete(ReplicaWeightsRecord).where(mine))
        for stage, sha in sorted(held.digests.items()):
            s.add(
                ReplicaWeightsRecord(
                    run_id=run_id,
                    replica=replica,
                    stage=stage,
                    sha256=sha,
                    version_id=held.version,
                    what=held.what,
                )
            )


def forget(db: Database, run_id: int, replica: str) -> None:
    """``replica`` stopped: it holds nothing any more."""
    with db.sessions() as s, s.begin():
        mine = (ReplicaWeightsRecord.run_id == run_id) & (ReplicaWeightsRecord.replica == replica)
        s.execute(delete(ReplicaWeightsRecord).where(mine))


def holding(db: Database, run_id: int | None = None) -> dict[str, Held]:
    """What every replica of run ``run_id`` (default: the running runs) holds, by name."""
    with db.sessions() as s:
        q = select(ReplicaWeightsRecord)
        if run_id is None:
            running = select(RunRecord.id).where(RunRecord.status == "running")
            q = q.where(ReplicaWeightsRecord.run_id.in_(running))
        else:
            q = q.where(ReplicaWeightsRecord.run_id == run_id)
        rows = list(s.scalars(q.order_by(ReplicaWeightsRecord.replica, ReplicaWeightsRecord.stage)))
    out: dict[str, Held] = {}
    for row in rows:
        held = out.setdefault(row.replica, Held({}, row.version_id, row.what))
        held.digests[row.stage] = row.sha256
    return out


class Labelled(str):
    """An answer's text, carrying the model version of the weights that produced it (None:
    none, such as training's; or the weights changed while it was produced)."""

    model_version: int | None = None

    @classmethod
    def of(cls, text: str, version: int | None) -> Labelled:
        out = cls(text)
        out.model_version = version
        return out
