"""The database file deleted or replaced under a running control plane (issue 11, item 4): the
control plane stops loudly (its log and standard error name the file and what happened, exit
status 1, the workers shut down) and saves what the lost file held beside it, instead of writing
on into an unlinked file."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runtime_helpers import ROOT, dmsc, make_plan

from dmsc.runtime.control.db_watch import SHADOW_S
from dmsc.runtime.transport.messages import ControlSettings
from dmsc.runtime.transport.processes import alive


def _start_control_plane(home: Path, plan: Path) -> subprocess.Popen[str]:
    """The control-plane process as ``dmsc up`` starts it, but a child of the test (its exit
    status is the test's to read)."""
    settings = ControlSettings(plan=str(plan), home=str(home), failure_timeout_s=5)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dmsc.runtime.control.daemon"],
        cwd=ROOT,
        env={**os.environ, "DMSC_HOME": str(home)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(settings.model_dump_json() + "\n")
    proc.stdin.close()
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    return proc


def _lose(db: Path, how: str) -> None:
    if how == "deleted":
        for path in db.parent.glob(db.name + "*"):  # the file, its write-ahead log and index
            path.unlink()
    elif how == "emptied":  # truncate -s 0 dmsc.sqlite (issue 29: went unnoticed)
        os.truncate(db, 0)
    else:  # a copy of the file (a restored backup) moved over it: another inode
        copy = db.with_name("copy.sqlite")
        shutil.copyfile(db, copy)
        os.replace(copy, db)


@pytest.mark.parametrize("how", ["deleted", "replaced", "emptied"])
def test_a_lost_database_stops_the_control_plane_loudly(tmp_path: Path, how: str) -> None:
    plan = make_plan(tmp_path)
    key = dmsc(tmp_path, "token", "create", "--tenant", "t", "--scopes", "read")
    assert key.returncode == 0, key.stderr
    proc = _start_control_plane(tmp_path, plan)
    code: int | None = None
    try:
        assert dmsc(tmp_path, "infer", "--prompt", "hello", "--tokens", "2").returncode == 0
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        workers = [s["pid"] for s in status["services"]]
        assert workers and all(alive(pid) for pid in workers)
        db = tmp_path / "dmsc.sqlite"
        if how == "emptied":  # what is saved then is the watch's copy, up to SHADOW_S old
            time.sleep(SHADOW_S + 1.5)
        _lose(db, how)
        with contextlib.suppress(subprocess.TimeoutExpired):  # before the fix: it runs on
            code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()  # its workers exit once orphaned
        proc.wait()
        err = proc.stderr.read() if proc.stderr else ""
    assert code == 1, err
    said = f"the database {db} was {how}"
    if how == "emptied":
        said += " or overwritten (0 bytes, no SQLite header)"
    assert said in err and "Traceback" not in err
    assert said in (tmp_path / "logs" / "control.log").read_text()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers), "workers outlived their control plane"
    assert not (tmp_path / "control.json").exists()
    # What the lost file held is saved beside it, the run still running (to be resumed).
    saved = list(tmp_path.glob("dmsc.sqlite.salvaged-*"))
    assert len(saved) == 1 and str(saved[0]) in err
    with sqlite3.connect(saved[0]) as copy:
        assert copy.execute("SELECT status FROM runs").fetchall() == [("running",)]
        assert copy.execute("SELECT kind, state FROM tasks").fetchall() == [("infer", "done")]
        assert copy.execute("SELECT count(*) FROM api_keys").fetchone() == (1,)
    if how == "replaced":
        return
    # The next command does not make a new, empty database beside the copy: it says where it is.
    listed = dmsc(tmp_path, "token", "list")
    assert listed.returncode == 1 and "Traceback" not in listed.stderr
    assert f"(`mv{saved[0]}{db}`)" in "".join(listed.stderr.split()), listed.stderr[-600:]
    assert not db.exists() or not db.read_bytes().startswith(b"SQLite format 3")
