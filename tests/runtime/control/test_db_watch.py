"""The watch on the control plane's database file: what counts as lost, and the salvage."""

from __future__ import annotations

import os
import sqlite3
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
