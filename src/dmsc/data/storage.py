"""Where a database URL keeps its data, and why it cannot be used, in words a user can act on.

:class:`dmsc.data.db.Database` turns a failing statement into a
:class:`~dmsc.data.db.StorageError` with :func:`failure`: the database (a SQLite file's path, or
the URL without its password) and the driver's reason, with what the file system says about the
file when it explains the reason (a read-only file system, no permission, a folder in its
place). Never the statement or its parameters: an API key's hash is one of them.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from urllib.parse import quote

from sqlalchemy.engine import make_url

_WRITES = ("insert", "update", "delete", "create", "alter", "drop", "replace")


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite URL, absolute (``None`` for another engine or an in-memory one)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    name = parsed.database or ""
    if name.startswith("file:"):  # a SQLite URI (``?uri=true``): file:PATH?mode=ro
        name = name[len("file:") :].split("?", 1)[0]
    if not name or name == ":memory:" or parsed.query.get("mode") == "memory":
        return None
    return Path(name).resolve()


SALVAGED = ".salvaged-"  # <file>.salvaged-<time>: what a lost database held (db_watch)


def salvaged_copies(path: Path) -> list[Path]:
    """The salvaged copies of the SQLite file ``path`` lying beside it, oldest first."""
    found = path.parent.glob(f"{path.name}{SALVAGED}*")
    return sorted(p for p in found if not p.name.endswith(("-wal", "-shm", "-journal")))


def is_database(path: Path) -> bool:
    """Whether ``path`` holds a SQLite database (one unreadable for another reason counts as
    one: opening it says why). Asked through SQLite, never by opening the file: closing any
    descriptor of a database file drops every POSIX lock the process holds on it, SQLite's own
    included, and another process may then delete the write-ahead log still in use."""
    try:
        if os.stat(path).st_size < 16:  # emptied, or shorter than SQLite's header
            return False
    except FileNotFoundError:
        return False
    except OSError:
        return True
    uri = f"file:{quote(str(path))}?mode=ro"
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as conn:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except sqlite3.DatabaseError as exc:
        return "locked" in str(exc) or "busy" in str(exc)
    return True


def new_beside_salvaged(path: Path) -> str | None:
    """Why no new database should be made at ``path``: it is missing and a salvaged copy of
    the database a control plane lost lies beside it (a new, empty one would start run 1 again
    and hide that copy); a file that is not a SQLite database (emptied or overwritten in place)
    counts as missing. None when there is no such reason."""
    copies = salvaged_copies(path)
    if not copies or is_database(path):
        return None
    return (
        f"the database {path} is missing or no database and {copies[-1]} lies beside it "
        "(what a control plane saved when it lost its database): move it back "
        f"(`mv {copies[-1]} {path}`) to resume "
        "that run, or start on a new, empty database with `dmsc up --new-database`"
    )


def location(url: str) -> str:
    """The database as a user names it: the SQLite file, or the URL without its password."""
    path = sqlite_file(url)
    if path is not None:
        return str(path)
    return make_url(url).render_as_string(hide_password=True)


def _file_trouble(path: Path) -> str | None:
    """What is wrong with a SQLite file (or its folder) that stops writes, if it shows."""
    folder = path.parent
    if path.is_dir():
        return "a folder is in its place"
    if not folder.exists():
        return f"its folder {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except OSError:
        pass
    if (path.exists() and not os.access(path, os.W_OK)) or not os.access(folder, os.W_OK):
        return "permission denied"
    return None


def failure(url: str, statement: str | None, driver_error: BaseException, connected: bool) -> str:
    """One line: what could not be done to which database, and why (no statement, no
    parameters). ``statement`` is what failed (``None``: a connect, or a commit when
    ``connected``)."""
    if not connected:
        doing = "open"
    elif statement is None or statement.lstrip().lower().startswith(_WRITES):
        doing = "write"
    else:
        doing = "use"
    said = str(driver_error).strip().splitlines()
    reason = said[0] if said else type(driver_error).__name__
    path = sqlite_file(url)
    trouble = _file_trouble(path) if path is not None else None
    if trouble is not None and trouble not in reason:
        reason = f"{trouble} ({reason})"
    return f"cannot {doing} the database {location(url)}: {reason}"
