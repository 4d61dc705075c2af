"""The watch on the control plane's database file: what counts as lost, and the salvage."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dmsc.data.db import Database, StorageError
from dmsc.runtime.control.db_watch import DbWatch, change, watch_database


def test_change_is_deleted_replaced_or_nothing() -> None:
    assert change((1, 2), None) == "was deleted"
    assert change((1, 2), (1, 3)) == "was replaced by another file"
    assert change((1, 2), (1, 2)) is None


def test_a_deleted_file_is_salvaged_from_the_held_connection(tmp_path: Path) -> None:
    path = tmp_path / "dmsc.sqlite"
    db = Database(f"sqlite:///{path}")
    db.new_run("gpt-mini", "c", {})
    watch = DbWatch(path, interval_s=0.05)
    assert watch.check() is None
    for f in tmp_path.glob("dmsc.sqlite*"):
        f.unlink()
    db.new_run("gpt-mini", "c", {"later": 1})  # the engine's open connection writes on
    assert watch.check() == "was deleted"
    report = watch.report("was deleted")
    saved = next(tmp_path.glob("dmsc.sqlite.salvaged-*"))
    assert f"the database {path} was deleted" in report and str(saved) in report
    with sqlite3.connect(saved) as copy:
        assert copy.execute("SELECT count(*) FROM runs").fetchone() == (2,)


def test_a_loss_refuses_new_connections_and_sets_the_stop(tmp_path: Path) -> None:
    path = tmp_path / "dmsc.sqlite"
    db = Database(f"sqlite:///{path}")
    stop, said = threading.Event(), []
    watch = watch_database(db, stop, said.append, interval_s=0.05)
    assert watch is not None
    other = tmp_path / "other.sqlite"
    Database(f"sqlite:///{other}")
    os.replace(other, path)
    assert stop.wait(10)
    assert said and "was replaced by another file" in said[0] and watch.lost == said[0]
    db.engine.dispose()  # the open connections go; a new one is refused, no empty file made
    with pytest.raises(StorageError, match="was replaced"):
        db.tasks()


def test_a_missing_file_cannot_be_watched(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="does not exist"):
        DbWatch(tmp_path / "none.sqlite")


def _keys(db: Database) -> None:
    from dmsc.runtime.business.auth import create_key

    create_key(db, "t", ["read"], None, None)


@pytest.mark.parametrize("how", ["emptied", "overwritten"])
def test_a_file_emptied_or_overwritten_in_place_is_lost_and_salvaged_from_memory(
    tmp_path: Path, how: str
) -> None:
    """Issue 29, point 16: ``truncate -s 0 dmsc.sqlite`` (same inode) went unnoticed and took
    every run, key and task with it. Now the watch sees it, and saves the copy it keeps in
    memory."""
    path = tmp_path / "dmsc.sqlite"
    db = Database(f"sqlite:///{path}")
    db.new_run("gpt-mini", "c", {})
    _keys(db)
    watch = DbWatch(path, interval_s=0.05)
    inode = os.stat(path).st_ino
    if how == "emptied":
        os.truncate(path, 0)
        want = "was emptied or overwritten (0 bytes, no SQLite header)"
    else:  # another database's bytes written over this one's, same file
        other = tmp_path / "other.sqlite"
        odb = Database(f"sqlite:///{other}")
        odb.engine.dispose()
        path.write_bytes(other.read_bytes())
        for side in tmp_path.glob("dmsc.sqlite-*"):  # its log and index, of the old contents
            side.unlink()
        want = "was overwritten"
    assert os.stat(path).st_ino == inode  # the same file: deletion's check cannot see it
    what = watch.check()
    assert what is not None and what.startswith(want)
    report = watch.report(what)
    saved = next(tmp_path.glob("dmsc.sqlite.salvaged-*"))
    assert str(saved) in report
    with sqlite3.connect(saved) as copy:
        assert copy.execute("SELECT count(*) FROM runs").fetchone() == (1,)
        assert copy.execute("SELECT count(*) FROM api_keys").fetchone() == (1,)


def test_the_watch_stops_the_plane_when_its_file_is_emptied(tmp_path: Path) -> None:
    path = tmp_path / "dmsc.sqlite"
    db = Database(f"sqlite:///{path}")
    stop, said = threading.Event(), []
    watch_database(db, stop, said.append, interval_s=0.05)
    os.truncate(path, 0)
    assert stop.wait(10)
    assert "was emptied" in said[0]


def test_an_unchanged_busy_database_is_not_lost(tmp_path: Path) -> None:
    path = tmp_path / "dmsc.sqlite"
    db = Database(f"sqlite:///{path}")
    watch = DbWatch(path, interval_s=0.05)
    for n in range(20):
        db.new_run("gpt-mini", "c", {"n": n})
        assert watch.check() is None
    watch.refresh_shadow(force=True)
    saved = watch.salvage(in_place=True)
    with sqlite3.connect(saved) as copy:
        assert copy.execute("SELECT count(*) FROM runs").fetchone() == (20,)


def _runs_seen_by_another_process(path: Path) -> int:
    """The runs another process reads (its connection closes as the last one it holds)."""
    code = (
        "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
        "print(c.execute('SELECT count(*) FROM runs').fetchone()[0]); c.close()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


def test_looking_at_the_file_keeps_the_processes_locks_and_its_writes(tmp_path: Path) -> None:
    """The watch (and the salvage check a new Database makes) never open() the database file:
    closing that descriptor dropped every POSIX lock of the process, SQLite's too, so another
    process's closing connection deleted the write-ahead log the control plane went on writing,
    and every later task was lost (the control plane saw 3 tasks, any other process 1)."""
    path = tmp_path / "dmsc.sqlite"
    db = Database(f"sqlite:///{path}")
    db.new_run("gpt-mini", "c", {})
    (tmp_path / "dmsc.sqlite.salvaged-20260101-000000").write_bytes(b"")  # makes it look
    watch = DbWatch(path, interval_s=0.05)
    for n in range(2, 5):
        assert watch.check() is None
        Database(f"sqlite:///{path}")  # a second one in the same process looks at the file too
        assert _runs_seen_by_another_process(path) == n - 1
        db.new_run("gpt-mini", "c", {"n": n})
        assert _runs_seen_by_another_process(path) == n
    assert (tmp_path / "dmsc.sqlite-wal").exists()
