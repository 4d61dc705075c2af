"""The control plane's watch on its database file: deleted, replaced, emptied or overwritten,
the control plane stops.

A SQLite connection keeps writing to a file that was unlinked: the runs, tasks and versions go
to a file no one can open again, and the next ``dmsc`` command that opens the database creates a
new, empty one at the path. So the control plane holds the file open from the start (its own
read-only connection) and looks at the path every second: when the path is gone, names another
file (another inode: a copy moved over it, a restored backup), or the file itself no longer
holds this database (emptied: ``truncate -s 0``, so shorter than a SQLite header or without
one; overwritten in place: its identity row, :class:`~dmsc.data.records.IdentityRecord`, is
another database's or cannot be read), the watch

- refuses every new connection of the control plane's engine (a new connection would create an
  empty file at the path; the ones open keep their file),
- copies what the held connection still reads into ``<file>.salvaged-<time>`` beside it (the
  SQLite backup API, consistent); a file emptied or overwritten in place took its contents
  with it, so the watch also keeps a copy in memory, taken again (at most every
  :data:`SHADOW_S`) whenever the database changed, and that copy is what is saved then, and
- reports it (the daemon writes it to its log and its standard error) and sets the stop event:
  the daemon shuts the workers down and exits non-zero, leaving the run ``running`` in the copy
  so that moving it back and ``dmsc up`` with the same plan resumes it.

A PostgreSQL (or any non-SQLite) URL has no file to watch: the server owns its storage and a
lost server fails every statement loudly, so no watch runs there.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import event

from dmsc.data.db import Database, StorageError
from dmsc.data.storage import SALVAGED, sqlite_file

FileId = tuple[int, int]  # (device, inode)
HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
SHADOW_S = 5.0  # the in-memory copy is at most this old (when the database changed)


def file_id(path: Path) -> FileId | None:
    """The file at ``path`` (device and inode), or None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:  # its folder was replaced by a file
        return None
    return st.st_dev, st.st_ino


def change(before: FileId, now: FileId | None) -> str | None:
    """What happened to the file once ``before`` when the path now shows ``now``."""
    if now is None:
        return "was deleted"
    if now != before:
        return "was replaced by another file"
    return None


class DbWatch:
    """One SQLite file, held open since construction, and what became of its path."""

    def __init__(self, path: Path, interval_s: float = 1.0) -> None:
        before = file_id(path)
        if before is None:
            raise StorageError(f"cannot watch the database {path}: it does not exist")
        self.path, self.interval_s, self.before = path, interval_s, before
        self.lost: str | None = None
        # mode=rw never creates the file; nothing is written through this connection. One read
        # opens the write-ahead log too, so both stay readable once unlinked.
        self._held = sqlite3.connect(
            f"file:{quote(str(path))}?mode=rw", uri=True, check_same_thread=False
        )
        self._held.execute("SELECT count(*) FROM sqlite_master").fetchall()
        self.identity = self._identity(self._held)
        self._shadow = sqlite3.connect(":memory:", check_same_thread=False)
        self._shadow_version: int | None = None
        self._shadow_at = 0.0
        self.refresh_shadow()

    @staticmethod
    def _identity(conn: sqlite3.Connection) -> str | None:
        """The identity token the database at ``conn`` holds (None: none)."""
        try:
            row = conn.execute("SELECT token FROM dmsc_identity ORDER BY id LIMIT 1").fetchone()
        except sqlite3.OperationalError:  # an older database, made before the table
            return None
        return str(row[0]) if row else None

    def refresh_shadow(self, force: bool = False) -> None:
        """Copy the database into memory again if it changed and the copy is old enough."""
        version = self._held.execute("PRAGMA data_version").fetchone()[0]
        fresh = time.monotonic() - self._shadow_at < SHADOW_S
        if not force and (version == self._shadow_version or fresh):
            return
        copy = sqlite3.connect(":memory:", check_same_thread=False)
        self._held.backup(copy)
        if self._identity(copy) != self.identity or self.content() is not None:
            copy.close()  # emptied or overwritten meanwhile: keep the copy from before
            return
        self._shadow.close()
        self._shadow, self._shadow_version, self._shadow_at = copy, version, time.monotonic()

    def content(self) -> str | None:
        """What happened to the contents of the file the path still names, or None: it is
        emptied or cut short (no SQLite header), or holds another database (another identity)
        or none that can be read."""
        # Never open() the file itself: closing any descriptor of it drops every POSIX lock this
        # process holds on it, SQLite's own included; another process's connection then deleted
        # the write-ahead log the control plane was still writing (its later tasks were lost).
        # Its size comes from stat, its header and identity through a SQLite connection (SQLite
        # keeps its descriptors open while others hold locks).
        try:
            size = os.stat(self.path).st_size
        except OSError:  # gone meanwhile: the next look sees it
            return None
        if size < len(HEADER):
            return f"was emptied or overwritten ({size} bytes, no SQLite header)"
        uri = f"file:{quote(str(self.path))}?mode=ro"
        try:
            with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as conn:
                conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
                now = self._identity(conn)
        except sqlite3.DatabaseError as exc:
            if "locked" in str(exc) or "busy" in str(exc):  # a writer holds it: look again
                return None
            return f"was overwritten: it no longer reads as a database ({exc})"
        if self.identity is None:  # nothing to compare with
            return None
        if now != self.identity:
            return "was overwritten by another database (its identity row differs)"
        return None

    def check(self) -> str | None:
        """What happened to the file, or None while the path still names it, unchanged."""
        return change(self.before, file_id(self.path)) or self.content()

    def salvage(self, in_place: bool = False) -> Path:
        """Copy what the held connection reads into a new file beside the lost one (the copy in
        memory when the file was emptied or overwritten ``in_place``: the held connection
        reads that same file)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.path.with_name(f"{self.path.name}{SALVAGED}{stamp}")
        with contextlib.closing(sqlite3.connect(target)) as out:
            (self._shadow if in_place else self._held).backup(out)
        return target

    def report(self, what: str) -> str:
        """Salvage the contents and say what happened, where they are and what to do."""
        in_place = what.startswith("was emptied") or what.startswith("was overwritten")
        try:
            saved = self.salvage(in_place)
        except (sqlite3.Error, OSError) as exc:
            kept = f"its contents could not be saved ({exc})"
        else:
            age = f" (as it was up to {SHADOW_S:g} s before)" if in_place else ""
            kept = (
                f"what it held{age} is saved in {saved}: move that file to {self.path} and "
                "`dmsc up` the same plan to resume the run"
            )
        return (
            f"the database {self.path} {what} while the control plane ran; {kept}. "
            "Stopping the control plane and its workers"
        )

    def run(self, stop: threading.Event, on_lost: Callable[[str], None]) -> None:
        """Look every ``interval_s`` until ``stop``; on a loss call ``on_lost`` with the report
        and return."""
        while not stop.wait(self.interval_s):
            what = self.check()
            if what is not None:
                self.lost = self.report(what)
                on_lost(self.lost)
                return
            with contextlib.suppress(sqlite3.Error):  # emptied meanwhile: the next look sees it
                self.refresh_shadow()


def refuse_connections(db: Database, reason: str) -> None:
    """Make ``db``'s engine refuse new connections (SQLite would create an empty file)."""

    def refuse(*_args: Any) -> None:
        raise StorageError(reason)

    event.listen(db.engine, "do_connect", refuse)


def watch_database(
    db: Database,
    stop: threading.Event,
    report: Callable[[str], None],
    interval_s: float = 1.0,
) -> DbWatch | None:
    """Start watching ``db``'s file in a thread: a loss refuses new connections, calls
    ``report`` and sets ``stop``. None (no watch) for a database that is not a SQLite file."""
    path = sqlite_file(db.url)
    if path is None:  # PostgreSQL and the like: no file to lose (see the module's doc)
        return None
    watch = DbWatch(path, interval_s)

    def lost(message: str) -> None:
        refuse_connections(db, message)
        report(message)
        stop.set()

    threading.Thread(target=watch.run, args=(stop, lost), name="db-watch", daemon=True).start()
    return watch
