"""Where a database URL keeps its data, and the one-line reason it cannot be used."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from dmsc.data.storage import failure, location, sqlite_file


def test_sqlite_files_and_other_engines(tmp_path: Path) -> None:
    assert sqlite_file(f"sqlite:///{tmp_path}/d.sqlite") == tmp_path / "d.sqlite"
    assert sqlite_file(f"sqlite:///file:{tmp_path}/d.sqlite?mode=ro&uri=true") == (
        tmp_path / "d.sqlite"
    )
    assert sqlite_file("sqlite://") is None
    assert sqlite_file("postgresql+psycopg://u:pw@db/dmsc") is None
    assert location("postgresql+psycopg://u:pw@db/dmsc") == "postgresql+psycopg://u:***@db/dmsc"


def test_failure_names_the_database_and_the_reason_only(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/d.sqlite"
    err = sqlite3.OperationalError("attempt to write a readonly database")
    said = failure(url, "INSERT INTO api_keys VALUES (?)", err, connected=True)
    assert (
        said
        == f"cannot write the database {tmp_path}/d.sqlite: attempt to write a readonly database"
    )
    (tmp_path / "d.sqlite").mkdir()
    said = failure(url, None, sqlite3.OperationalError("unable to open database file"), False)
    assert said.startswith(
        f"cannot open the database {tmp_path}/d.sqlite: a folder is in its place"
    )
