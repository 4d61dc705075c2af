"""A database that cannot be written or opened (issue 11, item 11): the error names the database
and the reason, never a traceback, a statement or its parameters (an API key's hash is one).

Read-only for real, as root too: root ignores file modes, so as root the file is made immutable
(``chattr +i``: even root's writes fail, as on a read-only mount) and the test is skipped where
the file system has no such flag; as another user the file's mode is 0444. Two faults bite for
anyone: a folder where the database file should be, and a data directory under a regular file.
A SQLite URI with ``mode=ro`` reproduces the write failure of the gateway's task submission.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_dmsc

from dmsc.data.db import ApiKeyRecord, Database
from dmsc.runtime.control.tasks.task_queue import TaskQueue

HASH = re.compile(r"\b[0-9a-f]{64}\b")


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` read-only for this process, root or not."""
    if os.geteuid() != 0:
        path.chmod(0o444)
        try:
            yield
        finally:
            path.chmod(0o644)
        return
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"root, and no immutable flag here: {made.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def _clean(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert "sqlalchemy" not in stderr.lower() and "[SQL" not in stderr, stderr
    assert HASH.search(stderr) is None, stderr


def _create_key(home: Path) -> subprocess.CompletedProcess[str]:
    return run_dmsc("token", "create", "--tenant", "t", "--scopes", "read", home=home, timeout=60)


def test_token_create_on_a_read_only_database(tmp_path: Path) -> None:
    assert _create_key(tmp_path).returncode == 0
    db = tmp_path / "dmsc.sqlite"
    with read_only(db):
        res = _create_key(tmp_path)
    _clean(res.stderr)
    assert res.returncode == 1, res.stderr
    assert f"error: cannot write the database {db}: " in res.stderr
    assert "readonly" in res.stderr or "read-only" in res.stderr


def test_a_folder_in_place_of_the_database(tmp_path: Path) -> None:
    (tmp_path / "dmsc.sqlite").mkdir()
    res = _create_key(tmp_path)
    _clean(res.stderr)
    assert res.returncode == 1, res.stderr
    assert f"cannot open the database {tmp_path / 'dmsc.sqlite'}: a folder is in its place" in (
        res.stderr
    )


def test_a_data_directory_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    home = tmp_path / "file" / "home"
    for command in (["token", "create", "--tenant", "t", "--scopes", "read"], ["models", "list"]):
        res = run_dmsc(*command, home=home, timeout=60)
        _clean(res.stderr)
        assert res.returncode == 1, res.stderr
        assert f"cannot make the data directory {home}: not a directory" in res.stderr


def test_writes_to_a_read_only_database_raise_a_storage_error(tmp_path: Path) -> None:
    """What the gateway's ``POST /v1/tasks`` and key checks meet: a ``StorageError`` (503 there)
    naming the file, not SQLAlchemy's error with the statement and its parameters."""
    path = tmp_path / "dmsc.sqlite"
    run_id = Database(f"sqlite:///{path}").new_run("gpt-mini", "c", {}).id
    db = Database(f"sqlite:///file:{path}?mode=ro&uri=true")
    secret = "ab" * 32
    for write in (
        lambda: db.add(ApiKeyRecord(key_hash=secret, tenant="t", scopes="read")),
        lambda: TaskQueue(db, run_id).submit("train", {"steps": 1}, tenant="t"),
    ):
        with pytest.raises(Exception) as info:
            write()
        err = info.value
        assert type(err).__name__ == "StorageError" and isinstance(err, RuntimeError), repr(err)
        assert str(err).startswith(f"cannot write the database {path}: "), str(err)
        assert "readonly database" in str(err)
        assert secret not in str(err) and "INSERT" not in str(err)
    assert len(db.tasks(run_id)) == 0  # reads still work


def test_a_task_submitted_while_the_database_is_read_only_gets_503_with_the_reason(
    tmp_path: Path,
) -> None:
    """``POST /v1/tasks`` on a database that cannot be written: 503 naming the database and
    why (it was a 500), and the gateway goes on serving."""
    from fastapi.testclient import TestClient

    from dmsc.runtime.business.auth import create_key
    from dmsc.runtime.business.gateway import create_app

    class Backend:
        def replicas(self) -> list[str]:
            return []

        def services(self) -> list[dict[str, str]]:
            return []

        def stage_count(self) -> int:
            return 1

        def infer_on(self, *a: object, **k: object) -> str:
            return ""

    path = tmp_path / "dmsc.sqlite"
    writable = Database(f"sqlite:///{path}")
    run_id = writable.new_run("gpt-mini", "c", {}).id
    _, key = create_key(writable, "t", ["submit", "read"])
    db = Database(f"sqlite:///file:{path}?mode=ro&uri=true")
    client = TestClient(create_app(Backend(), db, TaskQueue(db, run_id)))
    h = {"Authorization": f"Bearer {key}"}
    r = client.post("/v1/tasks", json={"steps": 5}, headers=h)
    assert r.status_code == 503, r.text
    assert r.json()["detail"].startswith(f"cannot write the database {path}: ")
    assert key not in r.text and "INSERT" not in r.text
    assert client.get("/v1/models", headers=h).status_code == 200
