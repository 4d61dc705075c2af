"""How many checkpoints a training task keeps, and how many bytes a tenant's may take.

After each checkpoint a session takes (:func:`prune`), its checkpoints past the newest
:attr:`Retention.keep` go: their folder is removed and their database record marked (``refused``,
"pruned ...": a recovery never tries it). Never removed: the newest checkpoint (a rollback's
target), and a folder a model version names (the model store serves it). ``keep`` 0 keeps all.

A tenant's checkpoints (of every task it submitted that are still on disk) may take at most
:attr:`Retention.quota_bytes`; past it, after pruning, :class:`QuotaExceeded` fails the task
with the sizes (a retry would meet the same). ``dmsc up --keep-checkpoints N
--checkpoint-quota BYTES`` sets both.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select

from dmsc.data.db import CheckpointRecord, Database, ModelVersionRecord, TaskRecord
from dmsc.runtime.compute.checkpoints import size_text
from dmsc.runtime.control.launch.layout import Checkpoint

DEFAULT_KEEP = 3  # the newest three: a rollback target and two older ones to fall back on


class QuotaExceeded(RuntimeError):
    """A tenant's checkpoints take more bytes than its quota."""


@dataclass(frozen=True)
class Retention:
    """A task's newest checkpoints kept (0: all) and a tenant's checkpoint bytes (None: no
    limit)."""

    keep: int = DEFAULT_KEEP
    quota_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.keep < 0:
            raise ValueError(f"keep must be 0 (all) or more, not {self.keep}")
        if self.quota_bytes is not None and self.quota_bytes <= 0:
            raise ValueError(f"the checkpoint quota must be positive, not {self.quota_bytes}")


def folder_of(ckpt: Checkpoint) -> Path | None:
    """The one folder that holds every file of ``ckpt`` (None: no files, or they are spread)."""
    paths = [Path(p) for p, _ in [*ckpt.files.values(), *ckpt.replicas.values()]]
    if not paths:
        return None
    folder = paths[0].parent
    inside = all(p.is_relative_to(folder) for p in paths)
    return folder if inside and folder.name.startswith("step") else None


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder`` (0 when it is gone)."""
    total = 0
    for f in folder.rglob("*") if folder.is_dir() else []:
        with contextlib.suppress(OSError):  # removed meanwhile
            total += f.stat().st_size if f.is_file() else 0
    return total


def version_folders(db: Database) -> set[Path]:
    """The folders model versions name (never pruned)."""
    with db.sessions() as s:
        return {Path(p).resolve() for p in s.scalars(select(ModelVersionRecord.path))}


def prune(
    history: list[Checkpoint], retention: Retention, db: Database | None = None
) -> list[Checkpoint]:
    """Remove from ``history`` (oldest first) and from disk the checkpoints past the newest
    ``retention.keep``, but none a model version names; returns those removed."""
    if retention.keep == 0 or len(history) <= retention.keep:
        return []
    kept = version_folders(db) if db is not None else set()
    gone = []
    for ckpt in history[: -retention.keep]:
        folder = folder_of(ckpt)
        if folder is None or folder.resolve() in kept:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        gone.append(ckpt)
    for ckpt in gone:
        history.remove(ckpt)
    if db is not None:
        why = f"pruned: past the newest {retention.keep} (retention policy)"
        mark(db, (c.id for c in gone if c.id is not None), why)
    return gone


def mark(db: Database, ids: Iterable[int], why: str) -> None:
    """Mark the records ``ids`` as gone from disk (recoveries skip them)."""
    with db.sessions() as s, s.begin():
        for rec in s.scalars(select(CheckpointRecord).where(CheckpointRecord.id.in_(list(ids)))):
            rec.refused = why


def tenant_bytes(db: Database, tenant: str) -> int:
    """The bytes the checkpoints of ``tenant``'s tasks take on disk (those not pruned)."""
    with db.sessions() as s:
        rows = s.execute(
            select(CheckpointRecord.step, CheckpointRecord.files_json, CheckpointRecord.id)
            .join(TaskRecord, TaskRecord.id == CheckpointRecord.task_id)
            .where(TaskRecord.tenant == tenant, CheckpointRecord.refused.is_(None))
        ).all()
    folders = {folder_of(Checkpoint.from_json(step, files, i)) for step, files, i in rows}
    return sum(folder_bytes(f) for f in folders if f is not None)


def check_quota(db: Database, task_id: int, retention: Retention) -> None:
    """:class:`QuotaExceeded` when the checkpoints of ``task_id``'s tenant pass its quota."""
    if retention.quota_bytes is None:
        return
    with db.sessions() as s:
        tenant = s.scalar(select(TaskRecord.tenant).where(TaskRecord.id == task_id))
    if tenant is None:
        return
    used = tenant_bytes(db, tenant)
    if used > retention.quota_bytes:
        raise QuotaExceeded(
            f"checkpoint quota exceeded: tenant {tenant!r}'s checkpoints take {size_text(used)}, "
            f"over its quota of {size_text(retention.quota_bytes)} (each task keeps its newest "
            f"{retention.keep or 'all'}); checkpoint less often or ask for a larger quota"
        )
