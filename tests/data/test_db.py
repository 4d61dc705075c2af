from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmsc.data.db import Database, ModelVersionRecord, ServiceRecord


def test_runs_tasks_metrics_versions(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'x.sqlite'}")
    run = db.new_run("gpt-mini", "local-cpu", {"stages": 2})
    task = db.new_task(run.id, "train", {"steps": 3})
    assert task.state == "queued"
    db.set_task_state(task.id, "running")
    for step in range(3):
        db.add_metric(task.id, step, 5.0 - step, 0.1, 1000.0)
    db.set_task_state(task.id, "done")
    db.set_task_result(task.id, {"sync": {"mode": "diloco:50", "dp_bytes": 7}})
    db.add(ServiceRecord(run_id=run.id, sid="s0", stage=0, replica=0, address="127.0.0.1:1"))
    db.add(ModelVersionRecord(run_id=run.id, step=3, path="/x", sha256="0" * 64))
    # A second connection (as after a restart) sees everything.
    again = Database(db.url)
    [t] = again.tasks(run.id)
    assert t.state == "done" and t.started_at is not None and t.finished_at is not None
    assert json.loads(t.result_json or "{}")["sync"]["mode"] == "diloco:50"
    assert [m.loss for m in again.metrics(task.id)] == [5.0, 4.0, 3.0]
    assert again.versions(run.id)[0].step == 3
    with pytest.raises(KeyError):
        again.set_task_state(999, "done")
    with pytest.raises(KeyError):
        again.set_task_result(999, {})


def test_postgresql_server() -> None:
    """The same records through a real PostgreSQL server (``make test`` starts one)."""
    import os
    import uuid

    url = os.environ.get("DMSC_TEST_POSTGRES_URL")
    assert url, "DMSC_TEST_POSTGRES_URL is not set: run the tests with `make test`"
    db = Database(url)
    tag = uuid.uuid4().hex[:8]
    run = db.new_run(f"gpt-mini-{tag}", "local-cpu", {"tag": tag})
    task = db.new_task(run.id, "train", {})
    db.set_task_state(task.id, "running")
    db.add_metric(task.id, 0, 1.5, 0.1, 10.0, val_loss=1.7)
    db.set_task_state(task.id, "failed", error="boom")
    again = Database(url)
    [t] = again.tasks(run.id)
    assert (t.state, t.error) == ("failed", "boom")
    assert again.metrics(task.id)[0].val_loss == 1.7
    assert again.engine.dialect.name == "postgresql"


def test_an_older_database_gets_the_new_columns(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.sqlite"
    con = sqlite3.connect(path)
    con.execute(
        "CREATE TABLE runs (id INTEGER PRIMARY KEY, created_at DATETIME, model VARCHAR(128),"
        " cluster VARCHAR(128), plan_json VARCHAR, status VARCHAR(32))"
    )
    con.execute(
        "CREATE TABLE tasks (id INTEGER PRIMARY KEY, run_id INTEGER, kind VARCHAR(32),"
        " state VARCHAR(32), params_json VARCHAR, created_at DATETIME, started_at DATETIME,"
        " finished_at DATETIME, error VARCHAR)"
    )
    con.execute(
        "INSERT INTO runs (id, model, cluster, plan_json, status) VALUES (1, 'm', 'c', '{}',"
        " 'running')"
    )
    con.execute(
        "INSERT INTO tasks (id, run_id, kind, state, params_json) VALUES (1, 1, 'train',"
        " 'queued', '{}')"
    )
    con.commit()
    con.close()
    db = Database(f"sqlite:///{path}")
    [task] = db.tasks(1)
    assert (task.tenant, task.priority, task.attempts, task.max_attempts) == ("default", 0, 0, 3)


def _db(tmp_path: Path) -> Database:
    return Database(f"sqlite:///{tmp_path / 'x.sqlite'}")


def test_a_new_plan_gets_a_new_run(tmp_path: Path) -> None:
    db = _db(tmp_path)
    run = db.resume_or_new_run("gpt-mini", "local-cpu", {"stages": 2})
    assert run.status == "running" and db.faults(run.id) == []
    other = db.resume_or_new_run("gpt-mini", "local-cpu", {"stages": 3})
    assert other.id != run.id  # another plan: another run


def test_the_same_plan_resumes_its_run_and_requeues_running_tasks(tmp_path: Path) -> None:
    db = _db(tmp_path)
    plan = {"stages": 2, "dp": 1}
    run = db.resume_or_new_run("gpt-mini", "local-cpu", plan)
    queued = db.new_task(run.id, "train", {"steps": 5})
    running = db.new_task(run.id, "train", {"steps": 30, "first_step": 0})
    db.set_task_state(running.id, "running")
    done = db.new_task(run.id, "train", {"steps": 1})
    db.set_task_state(done.id, "done")
    # the control plane is killed; a new one starts with the same plan (a second connection)
    again = Database(db.url)
    resumed = again.resume_or_new_run("gpt-mini", "local-cpu", dict(plan))
    assert resumed.id == run.id
    states = {t.id: t.state for t in again.tasks(run.id)}
    assert states == {queued.id: "queued", running.id: "queued", done.id: "done"}
    [fault] = again.faults(run.id)
    assert fault.kind == "control-plane" and fault.recovered_at is None
    assert fault.reason.endswith(f"requeued: {running.id}")
    # once the workers are back, the restart is closed, with the checkpoint it resumed from
    assert again.close_control_plane_faults(run.id, 20) == 1
    [fault] = again.faults(run.id)
    assert fault.recovered_at is not None and fault.checkpoint_step == 20
    assert again.close_control_plane_faults(run.id, 30) == 0  # closed once
    # a second restart with nothing running says so
    again.resume_or_new_run("gpt-mini", "local-cpu", plan)
    assert again.faults(run.id)[-1].reason.endswith("requeued: none")


def test_a_stopped_run_is_not_resumed(tmp_path: Path) -> None:
    db = _db(tmp_path)
    plan = {"stages": 2}
    run = db.resume_or_new_run("gpt-mini", "local-cpu", plan)
    db.end_run(run.id)
    assert db.resume_or_new_run("gpt-mini", "local-cpu", plan).id != run.id
    db.end_run(12345)  # no such run: nothing to do


def test_services_are_recorded_in_order(tmp_path: Path) -> None:
    db = _db(tmp_path)
    run = db.new_run("gpt-mini", "local-cpu", {})
    db.add_service(run.id, "stage0-r0", 0, 0, "127.0.0.1:1")
    db.add_service(run.id, "stage1-r0", 1, 0, "127.0.0.1:2")
    db.add_service(run.id, "stage1-r0", 1, 0, "127.0.0.1:3")  # its replacement
    got = [(s.sid, s.stage, s.replica, s.address) for s in db.services(run.id)]
    assert got == [
        ("stage0-r0", 0, 0, "127.0.0.1:1"),
        ("stage1-r0", 1, 0, "127.0.0.1:2"),
        ("stage1-r0", 1, 0, "127.0.0.1:3"),
    ]
    assert db.services(run.id + 1) == []


def test_no_new_database_is_made_beside_a_salvaged_copy(tmp_path: Path) -> None:
    """Issue 29, point 16: after a control plane lost its database, the next `dmsc token list`
    made a new, empty one and `dmsc up` started run 1 on it. Now it is refused, saying where
    the copy is, unless asked for explicitly."""
    from dmsc.data.db import StorageError

    path = tmp_path / "dmsc.sqlite"
    salvaged = tmp_path / "dmsc.sqlite.salvaged-20250101-000000"
    Database(f"sqlite:///{salvaged}")
    with pytest.raises(StorageError, match=r"mv .*salvaged-20250101-000000") as err:
        Database(f"sqlite:///{path}")
    assert "--new-database" in str(err.value)
    assert not path.exists()
    Database(f"sqlite:///{path}", new_beside_salvaged=True)
    assert path.exists()
    Database(f"sqlite:///{path}")  # it exists now: opened as usual


def test_two_databases_name_run_1_s_folder_apart(tmp_path: Path) -> None:
    """Run 1 of a new database must not write into the checkpoint folder of run 1 of a lost
    one: folders carry the database's identity, which stays with the file."""
    one = Database(f"sqlite:///{tmp_path / 'a.sqlite'}")
    two = Database(f"sqlite:///{tmp_path / 'b.sqlite'}")
    assert one.run_key(1) != two.run_key(1)
    assert one.run_key(1).startswith("run1-")
    assert Database(f"sqlite:///{tmp_path / 'a.sqlite'}").run_key(1) == one.run_key(1)


def test_a_checkpoint_and_the_task_parameters_it_moves_are_stored_together(
    tmp_path: Path,
) -> None:
    """A task lent its weights: its checkpoint where the other task left them and its moved
    first step go in one transaction, both or neither."""
    from dmsc.data.db import CheckpointRecord

    db = Database(f"sqlite:///{tmp_path / 'x.sqlite'}")
    run = db.new_run("gpt-mini", "local-cpu", {"stages": 2})
    task = db.new_task(run.id, "train", {"steps": 4})
    row = CheckpointRecord(run_id=run.id, task_id=task.id, step=4, files_json="{}")
    db.add(row, (task.id, {"steps": 4, "first_step": 2}))
    [t] = db.tasks(run.id)
    assert json.loads(t.params_json)["first_step"] == 2
    assert [c.step for c in db.checkpoints(run.id, task.id)] == [4]
    stray = CheckpointRecord(run_id=run.id, task_id=task.id, step=9, files_json="{}")
    with pytest.raises(KeyError):
        db.add(stray, (999, {}))  # no such task: the checkpoint is not stored either
    assert [c.step for c in db.checkpoints(run.id, task.id)] == [4]
