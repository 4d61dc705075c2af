"""The tests' forked ``dmsc`` calls (:mod:`cli_fork`) give what a fresh ``python -m dmsc`` gives:
the same standard output, standard error and exit status, for a help page, a table, a refused
spec (exit 2), a command that needs the data directory, and an uncaught exception."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cli_fork
import pytest
from conftest import EXAMPLES, ROOT

pytestmark = pytest.mark.integration


def _exec(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dmsc", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["estimate", "--cluster", str(EXAMPLES / "local-cpu.yaml"), "--model", "gpt-mini"],
        ["estimate", "--cluster", "no-such.yaml", "--model", "gpt-mini"],
        ["status"],
        ["tasks", "list"],
        ["topology", "--cluster", str(EXAMPLES / "nsfnet-4dc.yaml")],
    ],
    ids=["help", "estimate", "bad-spec", "status", "tasks", "topology"],
)
def test_a_forked_call_prints_and_exits_as_a_fresh_interpreter(
    args: list[str], tmp_path: Path
) -> None:
    env = {**os.environ, "DMSC_HOME": str(tmp_path)}
    forked = cli_fork.run(args, env, str(ROOT), timeout=120)
    fresh = _exec(args, env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )
    assert forked.args == fresh.args


def test_an_uncaught_exception_exits_1_with_its_traceback(tmp_path: Path) -> None:
    """The CLI lets no exception out on purpose; a working directory that does not exist makes
    one: status 1 and the traceback on standard error, as the interpreter gives them."""
    env = {**os.environ, "DMSC_HOME": str(tmp_path)}
    got = cli_fork.run(["--help"], env, str(tmp_path / "gone"), timeout=60)
    assert got.returncode == 1
    assert "Traceback" in got.stderr and "FileNotFoundError" in got.stderr


def test_a_call_past_its_time_limit_is_killed(tmp_path: Path) -> None:
    env = {**os.environ, "DMSC_HOME": str(tmp_path)}
    with pytest.raises(subprocess.TimeoutExpired):
        cli_fork.run(["calibrate", "--out", str(tmp_path / "c.yaml")], env, str(ROOT), 0.5)
