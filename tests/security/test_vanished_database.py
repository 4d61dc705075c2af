"""CLI commands that open the database while a control plane runs on the home (issue 11, item 4):
they refuse, rather than silently create a new, empty database the control plane does not use
(its keys refused by the gateway, its versions never served)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_dmsc

COMMANDS = (
    ["token", "create", "--tenant", "t", "--scopes", "read"],
    ["token", "revoke", "1"],
    ["models", "list"],
    ["models", "promote", "1"],
)


def _control_plane_running(home: Path, database: Path) -> None:
    """A ``control.json`` of a live process (this test's) using ``database``."""
    info = {"address": "127.0.0.1:1", "pid": os.getpid(), "run": 1, "database": str(database)}
    (home / "control.json").write_text(json.dumps(info))


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_missing_database_of_a_running_control_plane_is_not_recreated(
    tmp_path: Path, command: list[str]
) -> None:
    db = tmp_path / "dmsc.sqlite"
    _control_plane_running(tmp_path, db)
    res = run_dmsc(*command, home=tmp_path, timeout=60)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert f"{db} is missing while the control plane (pid {os.getpid()}) runs" in res.stderr
    assert "Traceback" not in res.stderr
    assert not db.exists()


def test_another_database_than_the_control_planes_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "elsewhere.sqlite"
    theirs.write_bytes(b"")
    _control_plane_running(tmp_path, theirs)
    res = run_dmsc(*COMMANDS[0], home=tmp_path, timeout=60)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert f"uses {theirs}, this command {tmp_path / 'dmsc.sqlite'}" in res.stderr
    assert not (tmp_path / "dmsc.sqlite").exists()


def test_no_control_plane_and_no_database_creates_one(tmp_path: Path) -> None:
    res = run_dmsc(*COMMANDS[0], home=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "dmsc.sqlite").exists()
