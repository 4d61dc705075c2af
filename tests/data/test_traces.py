"""Step traces in the database: kept, read back by step, and summed into traffic per link."""

from __future__ import annotations

from pathlib import Path

from dmsc.data.db import Database
from dmsc.data.traces import add_step_traces, link_bytes, step_traces, traced_tasks


def _db(tmp_path: Path) -> tuple[Database, int]:
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run = db.new_run("gpt-mini", "local", {})
    return db, db.new_task(run.id, "train", {}).id


def test_traces_round_trip_and_keep_the_last_steps(tmp_path: Path) -> None:
    db, task = _db(tmp_path)
    for step in range(5):
        traces = {
            (0, 0): ([("F", 0, 1.0 + step, 1.5 + step)], {"1/0": 100}),
            (1, 0): ([("F", 0, 1.5 + step, 2.0 + step)], {"0/0": 60 + step}),
        }
        add_step_traces(db, task, step, traces, {"0/0": 0.5, "1/0": 0.25})
    got = step_traces(db, task, last=2)
    assert [(t.step, t.stage) for t in got] == [(3, 0), (3, 1), (4, 0), (4, 1)]
    assert got[0].spans == [("F", 0, 4.0, 4.5)] and got[0].compute_s == 0.5
    assert got[1].sent == {(0, 0): 63}
    assert len(step_traces(db, task)) == 10
    assert traced_tasks(db, 1) == [task]


def test_link_bytes_are_the_mean_per_step_of_each_directed_link(tmp_path: Path) -> None:
    db, task = _db(tmp_path)
    for step in range(4):
        add_step_traces(db, task, step, {(0, 1): ([], {"1/1": 10 * step, "0/0": 5})}, {})
    assert link_bytes(step_traces(db, task)) == {((0, 1), (1, 1)): 15.0, ((0, 1), (0, 0)): 5.0}


def test_a_recovery_drops_the_traces_of_the_steps_run_again(tmp_path: Path) -> None:
    db, task = _db(tmp_path)
    for step in range(4):
        add_step_traces(db, task, step, {(0, 0): ([], {})}, {})
    db.drop_metrics_from(task, 2)
    assert [t.step for t in step_traces(db, task)] == [0, 1]
