"""A checkpoint folder written whole or not at all.

The stage workers and the control plane write one checkpoint's files (every stage's, then the
Hugging Face index and config) into a hidden folder beside the checkpoint's
(``.stepN.partial-<id>``); only when every file is there is it renamed to ``stepN``. A save that
fails half-way (a worker lost, a full disk) removes the hidden folder: no ``stepN/`` with stage 0
only is ever left for a recovery or a reader to meet. A folder of the same name already there (a
step checkpointed again after a rollback) is swapped out and removed after the rename.

A full disk anywhere in the save (a worker's ``DiskFull``, answered RESOURCE_EXHAUSTED, or the
control plane's own writes) leaves as one :class:`~dmsc.runtime.compute.checkpoints.DiskFull`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from dmsc.runtime.compute.checkpoints import (
    DiskFull,
    disk_full,
    no_room,
    replica_file,
    stage_file,
)
from dmsc.runtime.compute.models.hf import write_index
from dmsc.runtime.control.launch.failures import WorkerFailure
from dmsc.runtime.control.launch.layout import Checkpoint, StageLayout
from dmsc.runtime.transport.messages import Save
from dmsc.runtime.transport.rpc import NoRoom

Key = tuple[int, int]  # (stage, replica)


class Saving(Protocol):
    """What a save asks of a deployment: its layout, and calls to its workers."""

    layout: StageLayout

    @property
    def stages(self) -> int: ...

    def calls(
        self, method: str, message: Callable[[int], BaseModel], keys: Collection[Key], t: float
    ) -> dict[Key, Any]: ...

    def gather(self, futures: dict[Key, Any], deadline_s: float) -> dict[Key, dict[str, Any]]: ...


def save_checkpoint(dep: Saving, step: int, final: Path, every: bool = False) -> Checkpoint:
    """Save every stage of ``dep`` between two steps into ``final``: replica 0 (replicas hold
    the same weights), or ``every`` replica (mid-round their weights and inner optimizers
    differ: sync modes). At ep > 1 the first ``ep`` replicas are asked, each holding a share
    of the experts; they gather the stage and replica 0 writes it. The files go to a hidden
    folder renamed ``final`` once all are in."""
    with staged(final) as folder:

        def save(k: Key) -> Callable[[int], Save]:
            path = stage_file(folder, k[0]) if not k[1] else replica_file(folder, *k)
            return lambda epoch: Save(path=str(path), epoch=epoch)

        count = dep.layout.replicas if every else dep.layout.ep
        keys = [(s, r) for s in range(dep.stages) for r in range(count)]
        futures = {k: dep.calls("Save", save(k), [k], 120.0)[k] for k in keys}
        try:
            out = dep.gather(futures, 120.0)
        except BaseException as exc:
            # Every Save over before the folder goes (none writes after), but for the workers
            # found failed: a frozen one never answers, and waiting held the recovery that
            # replaces it for the Save's whole deadline. Its call is cancelled; should it still
            # write, it writes into a hidden folder no load reads.
            failed = exc.failed if isinstance(exc, WorkerFailure) else {}
            for k, fut in futures.items():
                if k in failed:
                    fut.cancel()
                else:
                    fut.exception()
            raise
        out = {k: r for k, r in out.items() if r["tensors"] or not k[1]}  # ep: who wrote
        names = {Path(r["path"]).name: r["tensors"] for k, r in out.items() if not k[1]}
        write_index(dep.layout.model, folder, names)  # the folder loads in transformers
    return moved(Checkpoint.of(step, out), folder, final)


PARTIAL = ".partial-"


def partial_folder(folder: Path) -> Path:
    """The hidden folder a save of ``folder`` writes into first."""
    return folder.with_name(f".{folder.name}{PARTIAL}{uuid.uuid4().hex[:12]}")


@contextlib.contextmanager
def staged(folder: Path) -> Iterator[Path]:
    """Yield a hidden folder to write the checkpoint ``folder`` into; on a clean exit it becomes
    ``folder``, on an exception it is removed (a full disk re-raised as :class:`DiskFull`)."""
    tmp = partial_folder(folder)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        publish(tmp, folder)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, DiskFull):
            raise
        if isinstance(exc, NoRoom):  # a worker's DiskFull, as its answer carried it
            raise DiskFull(str(exc)) from None
        if isinstance(exc, OSError) and no_room(exc):
            raise disk_full(Path(exc.filename or folder), exc) from None
        raise


def publish(tmp: Path, folder: Path) -> None:
    """Rename the complete ``tmp`` to ``folder`` (an older ``folder`` is moved aside first and
    removed after)."""
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:12]}")
        os.replace(folder, old)
    os.replace(tmp, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def moved(ckpt: Checkpoint, tmp: Path, folder: Path) -> Checkpoint:
    """``ckpt`` written in ``tmp`` with its paths in ``folder``."""

    def at(path: str) -> str:
        p = Path(path)
        return str(folder / p.relative_to(tmp)) if p.is_relative_to(tmp) else path

    files = {s: (at(p), sha) for s, (p, sha) in ckpt.files.items()}
    replicas = {k: (at(p), sha) for k, (p, sha) in ckpt.replicas.items()}
    return Checkpoint(ckpt.step, files, ckpt.id, replicas)
