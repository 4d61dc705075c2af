"""A full disk while checkpointing, and checkpoints kept by a retention policy (issue 29, point
15): a checkpoint that finds no room is one clear fault that fails the task (no worker faults,
no rollbacks, no retries, no half-written ``stepN/``), a task's old checkpoints are pruned, and a
task always reaches an end even while the database cannot be written.

How the disk is filled, honestly: a non-root test cannot mount a small file system, so the real
tests lower a worker process's file size limit (``RLIMIT_FSIZE`` through ``prlimit``): its
writes then fail with EFBIG, which dmsc treats as ENOSPC (no room to write). ENOSPC itself is
injected at the write (the safetensors writer's error, as it words it) in a unit test.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from runtime_helpers import control_plane, local_plan, wait_for
from safetensors import SafetensorError

from dmsc.data.db import Database, FaultRecord, StorageError, TaskRecord
from dmsc.runtime.compute import checkpoints
from dmsc.runtime.compute.checkpoints import DiskFull, write_checkpoint
from dmsc.runtime.compute.models.chain import StageModule
from dmsc.runtime.control.tasks import work_loop
from dmsc.runtime.control.tasks.lanes import Handoff
from dmsc.runtime.control.tasks.task_queue import TaskQueue
from dmsc.runtime.control.training.params import TrainParams
from dmsc.runtime.control.training.retention import Retention
from dmsc.spec import resolve_model

SPEC = resolve_model("gpt-mini")


def _stage() -> tuple[StageModule, torch.optim.Optimizer]:
    from dmsc.runtime.compute.models.chain import build_stage

    module = build_stage(SPEC, 0, "embedding", "block_1")
    return module, torch.optim.AdamW(module.parameters(), lr=1e-3)


def test_enospc_at_the_write_is_disk_full_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, opt = _stage()
    real = checkpoints.save_file
    calls: list[str] = []

    def full(tensors: dict[str, torch.Tensor], name: str, metadata: dict[str, str]) -> None:
        calls.append(name)
        if len(calls) == 2:  # the optimizer's file went in; the weights find the disk full
            real(tensors, name, metadata=metadata)  # half a file written first
            raise SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )
        real(tensors, name, metadata=metadata)

    monkeypatch.setattr(checkpoints, "save_file", full)
    path = tmp_path / "step2" / "stage0.safetensors"
    with pytest.raises(
        DiskFull, match=r"^no space left on device: .*stage0\.safetensors, .* free$"
    ):
        write_checkpoint(path, SPEC, module, opt, 2)
    assert list((tmp_path / "step2").iterdir()) == []  # no stage file, no optimizer, no temp


def test_a_real_file_size_limit_is_disk_full_and_leaves_nothing(tmp_path: Path) -> None:
    """The same through a real write: a process whose files may not pass 64 KB."""
    script = f"""
import resource
from pathlib import Path
import torch
from dmsc.runtime.compute.checkpoints import DiskFull, write_checkpoint
from dmsc.runtime.compute.models.chain import build_stage
from dmsc.spec import resolve_model
spec = resolve_model("gpt-mini")
module = build_stage(spec, 0, "embedding", "block_1")
opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
try:
    write_checkpoint(Path({str(tmp_path)!r}) / "stage0.safetensors", spec, module, opt, 1)
except DiskFull as exc:
    print("DISKFULL", exc)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("DISKFULL file size limit reached: "), out.stdout + out.stderr
    assert list(tmp_path.iterdir()) == []


def _limit_files(pid: int, limit: int) -> None:
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def test_a_full_disk_fails_the_task_once_and_old_checkpoints_are_pruned(tmp_path: Path) -> None:
    """Before: checkpoints were never pruned, and a write with no room was 5 worker faults
    (each a rollback), then the task failed, was retried, and left ``stepN/`` with stage 0
    only."""
    with control_plane(local_plan(), tmp_path) as cp:
        cp.retention = Retention(keep=2)
        queue = TaskQueue(cp.db, cp.run.id)
        threading.Thread(target=cp.work_queue, args=(queue,), daemon=True).start()
        try:
            params = {"steps": 5, "checkpoint_every": 1}
            first = queue.submit("train", params).id
            wait_for(lambda: _state(cp.db, first) == "done", 300, "the first task done")
            folder = cp.run_dir / f"task{first}"
            steps = sorted(p.name for p in folder.iterdir())
            assert steps == ["step4", "step5"], steps  # 6 taken (0..5), the newest 2 kept
            rows = cp.db.checkpoints(cp.run.id, first, refused=True)
            assert sum(r.refused is None for r in rows) == 2 and len(rows) == 6
            assert all(r.refused.startswith("pruned") for r in rows if r.refused)

            stage1 = next(h["pid"] for h in cp.deployment.health() if h["stage"] == 1)
            _limit_files(int(stage1), 256 * 1024)  # its stage file is ~5 MB
            second = queue.submit("train", params).id
            wait_for(lambda: _state(cp.db, second) == "failed", 300, "the second task failed")
            with cp.db.sessions() as s:
                task = s.get(TaskRecord, second)
                assert task is not None
                faults = list(s.query(FaultRecord).filter(FaultRecord.task_id == second))
            assert task.attempts == 1  # not retried: it would meet the same wall
            assert task.error is not None and task.error.startswith("file size limit reached: ")
            assert f"task{second}" in task.error and " free" in task.error
            assert faults == []  # no worker taken for failed, no rollback
            left = [p.name for p in cp.run_dir.rglob("*") if "partial" in p.name]
            assert left == []
            assert not (cp.run_dir / f"task{second}" / "step0").exists()
        finally:
            cp.stopped.set()


def _state(db: Database, task_id: int) -> str | None:
    with db.sessions() as s:
        task = s.get(TaskRecord, task_id)
        return task.state if task is not None else None


class _Plane:
    """The control plane as the loop sees it; its task ends in ``ends``' way."""

    def __init__(self, db: Database, queue: TaskQueue, ends: BaseException | None) -> None:
        import logging

        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.stopped, self.lock, self.weights_lost = threading.Event(), threading.Lock(), None
        self.log = logging.getLogger("test-work-loop")
        reg = CollectorRegistry()
        self.m_queue = Gauge("q", "q", registry=reg)
        self.m_tasks = Counter("t", "t", ["kind", "state"], registry=reg)
        self.inference = type("I", (), {"sync_versions": lambda self: None})()
        self.run = type("R", (), {"id": queue.run_id})()
        self.ends, self.queue = ends, queue
        self.handoff = Handoff(self.lock)  # the weights, taken by the lanes' consumers
        self.plan = type("P", (), {"job": type("J", (), {"dp": 1})()})()
        self.cluster = None

    def train_params(self, req: object) -> TrainParams:
        return TrainParams(1, 8, 1, 0, "wait", 1.0)

    def run_task(self, task_id: int, params: object, lend: object = None) -> tuple[object, int]:
        self.queue.cancel(task_id)  # someone cancels meanwhile
        if self.ends is not None:
            raise self.ends
        return type("Report", (), {"cancelled": True})(), 0


@pytest.mark.parametrize("ends", [None, DiskFull("no space left on device: /x, 0 B free")])
def test_a_task_reaches_an_end_while_the_database_refuses_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends: BaseException | None
) -> None:
    """Before: the end's write failed (a full disk), the queue's thread died, and the task
    stayed ``running`` (its cancel ``cancelling``) for good."""
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run = db.new_run("gpt-mini", "local", {})
    queue = TaskQueue(db, run.id)
    task = queue.submit("train", {"steps": 1}).id
    plane = _Plane(db, queue, ends)
    monkeypatch.setattr(work_loop, "RETRY_S", 0.05)
    refusals = {"left": 3}
    real_set = db.set_task_state

    def full_disk(*args: object, **kwargs: object) -> None:
        if refusals["left"]:
            refusals["left"] -= 1
            raise StorageError("cannot write the database x: database or disk is full")
        real_set(*args, **kwargs)  # type: ignore[arg-type]

    real_fail = queue.fail

    def fail(*args: object, **kwargs: object) -> str:
        if refusals["left"]:
            refusals["left"] -= 1
            raise StorageError("cannot write the database x: database or disk is full")
        return real_fail(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(db, "set_task_state", full_disk)
    monkeypatch.setattr(queue, "fail", fail)
    monkeypatch.setattr(work_loop, "parse", lambda _cls, params: params)
    loop = threading.Thread(target=work_loop.work_queue, args=(plane, queue), daemon=True)
    loop.start()
    try:
        wait_for(lambda: _state(db, task) == "cancelled", 30, "the task cancelled")
    finally:
        plane.stopped.set()
        loop.join(10)
    assert refusals["left"] == 0 and not loop.is_alive()
    if ends is not None:
        with db.sessions() as s:
            row = s.get(TaskRecord, task)
            assert row is not None and row.error == str(ends)


def test_a_disk_full_task_is_not_retried(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    queue = TaskQueue(db, db.new_run("gpt-mini", "local", {}).id)
    task = queue.submit("train", {"steps": 1}).id
    queue.claim("priority")
    exc = DiskFull("no space left on device: /x, 0 B free")
    stop = threading.Event()
    state = work_loop.record_end(queue, task, stop, __import__("logging").getLogger("t"), exc)
    assert state == "failed"  # attempts were left: a passing fault would go back to the queue
