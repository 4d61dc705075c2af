"""The database of the commands that use it directly (``dmsc token``, ``dmsc models``, ``dmsc
demo``), opened with two checks first.

Opening a SQLite database creates it when its file is missing. While a control plane runs on this
home that is never what the user wants: its database was deleted or moved (the control plane
stops on its own and says so in its log), or this command names another database than the
control plane's (``DMSC_DATABASE_URL`` set in one shell only). A key created there is one the
gateway refuses, a promoted version one it never serves: the command refuses instead.

A database that cannot be opened or written raises :class:`~dmsc.data.db.StorageError` (the CLI
prints its one line and exits 1); so does a data directory that cannot be made.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from dmsc.spec import SpecError

if TYPE_CHECKING:
    from dmsc.data.db import Database


def running_database() -> tuple[int, str | None] | None:
    """The pid of the control plane running on this home and the database it uses (``None``
    when its ``control.json`` does not say), or ``None`` when none runs."""
    from dmsc.data.db import control_file
    from dmsc.runtime.transport import processes

    path = control_file()
    try:
        info = json.loads(path.read_text())
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not processes.alive(pid):
        return None
    database = info.get("database")
    return pid, str(database) if database else None


def check_against_control_plane(url: str) -> None:
    """Refuse (a :class:`SpecError`) to use ``url`` when a control plane runs on this home and
    its database file is missing, or it uses another database than ``url``."""
    from dmsc.data import storage

    running = running_database()
    if running is None:
        return
    pid, theirs = running
    mine = storage.location(url)
    theirs = theirs or mine
    if theirs != mine:
        raise SpecError(
            "database",
            "",
            f"the control plane running on this home (pid {pid}) uses {theirs}, this command "
            f"{mine}: set DMSC_DATABASE_URL as for `dmsc up`",
        )
    file = storage.sqlite_file(url)
    if file is not None and not file.exists():
        raise SpecError(
            "database",
            "",
            f"{file} is missing while the control plane (pid {pid}) runs on this home: it was "
            "deleted or moved. Not creating a new, empty one the control plane would not use; "
            "the control plane stops and saves what its database held beside it "
            "(see `dmsc logs`)",
        )


def open_database() -> Database:
    """The database of this home (``DMSC_DATABASE_URL`` or ``$DMSC_HOME/dmsc.sqlite``), after
    :func:`check_against_control_plane`."""
    from dmsc.data.db import Database, StorageError, default_url

    try:
        url = default_url()  # makes the data directory
    except OSError as exc:
        where = exc.filename or os.environ.get("DMSC_HOME", ".dmsc")
        raise StorageError(
            f"cannot make the data directory {Path(where).absolute()}: "
            f"{(exc.strerror or str(exc)).lower()}"
        ) from None
    check_against_control_plane(url)
    return Database(url)
