"""Whether a process runs (``dmsc.runtime.transport.processes``): a killed control plane that
init has not reaped yet (a zombie) is dead to ``dmsc up``, ``dmsc status`` and the workers.

The defect this pins: CI's ``dmsc up`` after a ``kill -9`` of the control plane answered
"already running" because ``os.kill(pid, 0)`` succeeds on a zombie, and the machine's init
reaped the orphaned plane late."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dmsc.cli.database import running_database
from dmsc.cli.up_settings import control_settings
from dmsc.runtime.compute.worker import owner_gone
from dmsc.runtime.control.client import ControlClient
from dmsc.runtime.transport.processes import alive
from dmsc.spec import SpecError


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def zombie() -> Iterator[int]:
    """A child that has exited and is not reaped yet."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while _state(pid) != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        yield pid
    finally:
        os.waitpid(pid, 0)


def test_a_live_process_runs_and_a_zombie_or_a_reaped_one_does_not(zombie: int) -> None:
    os.kill(zombie, 0)  # what the old check asked: the kernel still knows the pid
    assert alive(os.getpid())
    assert not alive(zombie)
    assert not alive(0) and not alive(-1)


def test_a_reaped_process_does_not_run() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert not alive(pid)


def _control_file(home: Path, pid: int) -> Path:
    path = home / "control.json"
    path.write_text(json.dumps({"pid": pid, "address": "127.0.0.1:1", "run": 1}))
    return path


def test_the_client_calls_a_zombie_control_plane_gone(tmp_path: Path, zombie: int) -> None:
    with pytest.raises(SpecError, match=f"pid {zombie} is gone without a clean stop"):
        ControlClient.connect(_control_file(tmp_path, zombie))


def test_commands_see_no_control_plane_in_a_zombie(
    tmp_path: Path, zombie: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    _control_file(tmp_path, zombie)
    assert running_database() is None
    assert owner_gone(zombie)
    assert not owner_gone(os.getpid())


def test_up_takes_a_zombie_control_planes_file_for_stale(
    tmp_path: Path, zombie: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runtime_helpers import make_plan

    plan = make_plan(tmp_path)
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    stale = _control_file(tmp_path, zombie)
    settings = control_settings(str(plan), tmp_path, None, "round_robin", 3.0, 0)
    assert settings.plan == str(plan.resolve())
    assert not stale.exists()
    _control_file(tmp_path, os.getpid())  # a live one is refused, and its file kept
    with pytest.raises(SpecError, match="already running"):
        control_settings(str(plan), tmp_path, None, "round_robin", 3.0, 0)
    assert stale.exists()


def test_a_child_that_asked_to_die_with_its_parent_dies_with_it(tmp_path: Path) -> None:
    """``die_with``: the Ray launcher's worker, started from an actor, is killed when that actor
    dies. A middle process starts the child and is killed; the child must go too, and a child
    whose named parent is not its parent says so at once."""
    import signal
    import subprocess
    import sys

    child = (
        "import os, sys, time\n"
        "from dmsc.runtime.transport.processes import die_with\n"
        "ok = die_with(int(sys.argv[1]))\n"
        "print(os.getpid(), ok, flush=True)\n"
        "time.sleep(60)\n"
    )
    middle = (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())])\n"
        "time.sleep(60)\n"
    )
    mid = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE, text=True)
    try:
        assert mid.stdout is not None
        pid, ok = mid.stdout.readline().split()
        assert ok == "True" and alive(int(pid))
        mid.send_signal(signal.SIGKILL)
        mid.wait(10)
        deadline = time.monotonic() + 10
        while alive(int(pid)):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.02)
    finally:
        mid.kill()
        mid.wait(10)
    wrong = subprocess.run(
        [sys.executable, "-c", child.replace("time.sleep(60)", ""), "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.stdout.split()[1] == "False", wrong
