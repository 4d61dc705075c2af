"""The tests' forked ``dmsc`` calls (:mod:`cli_fork`) give what a fresh ``python -m dmsc`` gives:
the same standard output, standard error and exit status, for a help page, a table, a refused
spec (exit 2), a command that needs the data directory, and an uncaught exception; and the
control plane a forked ``dmsc up`` starts from its standby (:mod:`cli_daemon`) is started as
``Popen`` starts it."""

from __future__ import annotations

import json
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


def _children(pid: int) -> list[int]:
    return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_up_starts_its_control_plane_as_a_started_process(tmp_path: Path) -> None:
    """The control plane a forked ``dmsc up`` starts from its standby (tests/cli_daemon.py) is
    a process as ``Popen`` would have started it: a session of its own, the call's environment
    and directory, standard output on the pipe ``up`` read READY from, standard error on the
    control log; its workers' fork server is its own child; nothing of the call kept open."""
    from runtime_helpers import make_plan

    from dmsc.runtime.transport.processes import alive

    plan = make_plan(tmp_path)
    env = {**os.environ, "DMSC_HOME": str(tmp_path)}  # read from the call's environment
    up = cli_fork.run(["up", "--plan", str(plan)], env, str(ROOT), timeout=120)
    assert up.returncode == 0, up.stderr
    pid = int(json.loads((tmp_path / "control.json").read_text())["pid"])
    try:
        assert f"(pid {pid})" in up.stdout
        assert os.getsid(pid) == pid and pid != os.getpid()
        assert Path(f"/proc/{pid}/cwd").resolve() == ROOT.resolve()
        fds = {int(fd.name): os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
        assert fds[1].startswith("pipe:") and fds[2] == str(tmp_path / "logs" / "control.stderr")
        server = [
            k for k in _children(pid) if b"forkserver" in Path(f"/proc/{k}/cmdline").read_bytes()
        ]
        assert len(server) == 1, _children(pid)
        workers = [
            s["pid"]
            for s in json.loads(cli_fork.run(["status", "--json"], env, str(ROOT), 60).stdout)[
                "services"
            ]
        ]
        assert len(workers) == 2 and all(w in _children(server[0]) for w in workers)
    finally:
        assert cli_fork.run(["down"], env, str(ROOT), timeout=60).returncode == 0
    assert not alive(pid)
