"""A run whose deployment never started is not resumed as a restart (issue 29, point 8)."""

from __future__ import annotations

from pathlib import Path

from dmsc.data.db import Database


def test_a_run_that_never_started_is_taken_again_without_a_restart_fault(tmp_path: Path) -> None:
    """``dmsc up`` made a run, then its deployment failed to start (the Ray cluster lacked
    CPUs): nothing ran, so the next ``dmsc up`` of the same plan starts that run afresh; it
    does not record "the control plane restarted" (shown as going back to step None)."""
    db = Database(f"sqlite:///{tmp_path / 'x.sqlite'}")
    plan = {"stages": 3}
    failed = db.resume_or_new_run("gpt-mini", "local-cpu", plan)
    again = Database(db.url).resume_or_new_run("gpt-mini", "local-cpu", plan)
    assert again.id == failed.id and again.status == "running"
    assert db.faults(failed.id) == []
    # once its services are recorded, it has run: a later start is a restart
    db.add_service(failed.id, "stage0-r0", 0, 0, "127.0.0.1:1")
    db.resume_or_new_run("gpt-mini", "local-cpu", plan)
    [fault] = db.faults(failed.id)
    assert fault.kind == "control-plane"
