"""Step traces in the database: kept, read back by step, and summed into traffic per link."""

from __future__ import annotations

from pathlib import Path

from dmsc.data.db import Database
from dmsc.data.traces import (
    add_step_traces,
    link_bytes,
    record_step,
    step_traces,
    traced_tasks,
    worker_usage,
)


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


def test_each_step_keeps_what_each_worker_used_and_a_task_sums_it_up(tmp_path: Path) -> None:
    db, task = _db(tmp_path)
    for step, (cpu, rss) in enumerate([(80.0, 3 << 30), (100.0, 5 << 30), (90.0, 4 << 30)]):
        reply = {
            "traces": {(0, 0): ([], {}), (1, 0): ([], {})},
            "compute_s": {"0/0": 0.1},
            "telemetry": {
                (0, 0): {
                    "cpu_percent": cpu,
                    "rss_bytes": rss,
                    "gpu_peak_bytes": None,
                    "node_cpu_percent": cpu / 2,
                }
            },
        }
        record_step(db, task, step, reply)
    got = step_traces(db, task)
    assert [t.node_cpu_percent for t in got if t.stage == 0] == [40.0, 50.0, 45.0]
    assert [(t.cpu_percent, t.rss_bytes) for t in got if t.stage == 0] == [
        (80.0, 3 << 30),  # above 2**31: kept whole
        (100.0, 5 << 30),
        (90.0, 4 << 30),
    ]
    assert all(t.cpu_percent is None and t.rss_bytes is None for t in got if t.stage == 1)
    usage = worker_usage(db, task)
    assert usage["0/0"] == {
        "steps": 3,
        "cpu_percent_mean": 90.0,
        "cpu_percent_max": 100.0,
        "rss_bytes_max": 5 << 30,
        "gpu_peak_bytes_max": None,
    }
    assert usage["1/0"]["steps"] == 0 and usage["1/0"]["cpu_percent_mean"] is None


def test_a_database_from_before_the_telemetry_gets_its_columns(tmp_path: Path) -> None:
    import sqlite3

    db, task = _db(tmp_path)
    add_step_traces(db, task, 0, {(0, 0): ([], {})}, {})
    db.engine.dispose()
    con = sqlite3.connect(tmp_path / "dmsc.sqlite")
    for col in ("cpu_percent", "rss_bytes", "gpu_peak_bytes", "node_cpu_percent"):
        con.execute(f"ALTER TABLE step_traces DROP COLUMN {col}")
    con.commit()
    con.close()
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    record_step(
        db, task, 1, {"traces": {(0, 0): ([], {})}, "telemetry": {(0, 0): {"rss_bytes": 7}}}
    )
    assert [(t.step, t.rss_bytes) for t in step_traces(db, task)] == [(0, None), (1, 7)]
