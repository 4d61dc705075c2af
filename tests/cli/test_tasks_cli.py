"""``dmsc tasks show`` reads as fields, and a task's attempts count the same whichever door it
came in by (issue 29, point 9): ``tasks show`` printed a Python dict for the parameters, and a
task ``dmsc train`` started (the control plane makes it ``running`` at once) showed
``attempts 0`` where the same task queued through the gateway and claimed showed 1."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dmsc.cli import main
from dmsc.data.db import Database
from dmsc.runtime.transport.replies import TrainReply


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Database:

    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    return Database()


def run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out = capsys.readouterr()
    assert not exit_.value.code, out.err
    return out.out


def test_a_task_started_at_once_is_on_its_first_attempt(db: Database) -> None:
    from dmsc.runtime.control.tasks.task_queue import TaskQueue

    run_id = db.new_run("gpt-mini", "c", {}).id
    cli = db.new_task(run_id, "train", {"steps": 5}, state="running")  # dmsc train
    queue = TaskQueue(db, run_id)
    queue.submit("train", {"steps": 5})  # POST /v1/train, then the work loop claims it
    claimed = queue.claim()
    assert claimed is not None and claimed.state == cli.state == "running"
    assert cli.attempts == claimed.attempts == 1
    assert db.new_task(run_id, "train", {}).attempts == 0  # queued: not tried yet


def test_tasks_show_prints_fields_not_a_dict(
    db: Database,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dmsc.data.records import TaskRecord
    from dmsc.runtime.control.tasks.task_queue import TaskQueue

    run_id = db.new_run("gpt-mini", "c", {}).id
    task = TaskQueue(db, run_id).submit(
        "train", {"steps": 30, "lr": 0.0003, "lr_schedule": "cosine"}, tenant="ann"
    )
    with db.sessions() as s, s.begin():
        row = s.get(TaskRecord, task.id)
        assert row is not None
        row.state, row.attempts = "done", 1
        row.result_json = json.dumps({"loss_last": 2.5, "version": 4})
    out = run(capsys, "tasks", "show", str(task.id))
    assert "{" not in out and "'" not in out and "None" not in out
    lines = {k: v.strip() for k, v in (line.split(maxsplit=1) for line in out.splitlines())}
    assert lines["params"] == "steps=30, lr=0.0003, lr_schedule=cosine"
    assert lines["attempts"] == "1 of 3"
    assert lines["result"] == "loss_last=2.5, version=4"
    assert lines["error"] == "-"
    assert json.loads(run(capsys, "tasks", "show", str(task.id), "--json"))["params"] == {
        "steps": 30,
        "lr": 0.0003,
        "lr_schedule": "cosine",
    }


class _TrainCall:
    """A stand-in for the control plane's Train call: it makes the task ``running`` when sent
    and answers once the task is asked to stop, as the control plane does after a step."""

    def __init__(self, db: Database) -> None:
        self.db = db
        run_id = db.new_run("gpt-mini", "c", {}).id
        self.task = db.new_task(run_id, "train", {"steps": 50}, state="running").id

    def train_future(self, req: object) -> _TrainCall:
        return self

    def done(self) -> bool:
        from dmsc.data.records import TaskRecord

        with self.db.sessions() as s:
            task = s.get(TaskRecord, self.task)
            return task is not None and task.state in ("cancelling", "cancelled")

    def result(self) -> TrainReply:  # the fields a cancelled task's line reads
        return TrainReply.model_construct(
            task=self.task, state="cancelled", steps=3, model_version=2
        )


def test_ctrl_c_during_train_cancels_the_task_and_exits_130(
    db: Database, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C cancels the task after its current step, says so, and exits 130 (it exited 0,
    as though the training had run its course)."""
    from dmsc.cli import progress, tasks

    call = _TrainCall(db)
    monkeypatch.setattr(tasks, "control_client", lambda: call)
    sleeps = iter([None])

    def sleep(_: float) -> None:  # the second wait for the next step is cut by Ctrl-C
        if next(sleeps, "Ctrl-C") == "Ctrl-C":
            raise KeyboardInterrupt

    monkeypatch.setattr(progress, "time", SimpleNamespace(time=time.time, sleep=sleep))
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--steps", "50"])
    out = capsys.readouterr()
    assert exit_.value.code == 130
    assert f"cancelling task {call.task}" in out.err
    assert f"task {call.task}: cancelled after 3 steps (model version 2)" in out.out
    with db.sessions() as s:
        from dmsc.data.records import TaskRecord

        task = s.get(TaskRecord, call.task)
        assert task is not None and task.state == "cancelling"


class _Sent(_TrainCall):
    """A Train call that has ended already, keeping the request it was sent."""

    def train_future(self, req: object) -> _TrainCall:
        self.req = req
        return self

    def done(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("flags", "placed"), [([], (0, "sync")), (["--priority", "5", "--lane", "async"], (5, "async"))]
)
def test_train_places_its_task_in_the_queue_as_its_flags_say(
    db: Database,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    placed: tuple[int, str],
) -> None:
    """``dmsc train`` queues its task like the gateway's: ``--priority`` and ``--lane`` (the
    short lane, ``sync``, by default) go in the one request both doors take."""
    from dmsc.cli import tasks

    call = _Sent(db)
    monkeypatch.setattr(tasks, "control_client", lambda: call)
    run(capsys, "train", "--steps", "3", *flags)
    assert (call.req.priority, call.req.lane) == placed  # type: ignore[attr-defined]
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--lane", "fast"])
    assert exit_.value.code == 2 and "--lane" in capsys.readouterr().err
