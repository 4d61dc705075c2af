"""Errors a user sees when the control plane is gone (issue 11, item 11): a reason, never a raw
gRPC error or a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

from conftest import run_dmsc


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_killed_control_plane_is_reported_as_gone(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "control.json").write_text(
        json.dumps({"address": f"127.0.0.1:{_closed_port()}", "pid": dead.pid, "run": 1})
    )
    for command in (["status"], ["down"], ["infer", "--prompt", "x"]):
        res = run_dmsc(*command, home=tmp_path, timeout=60)
        assert res.returncode == 2, res.stderr
        assert f"pid {dead.pid} is gone" in res.stderr
        assert "Traceback" not in res.stderr and "failed to connect" not in res.stderr


def test_a_control_plane_that_does_not_answer(tmp_path: Path) -> None:
    (tmp_path / "control.json").write_text(
        json.dumps({"address": f"127.0.0.1:{_closed_port()}", "pid": os.getpid(), "run": 1})
    )
    res = run_dmsc("status", home=tmp_path, timeout=60)
    assert res.returncode == 1, res.stderr
    assert "control plane: not answering" in res.stderr
    assert "Traceback" not in res.stderr and "failed to connect" not in res.stderr


def test_up_with_the_gateways_port_in_use_fails_at_once_and_leaves_nothing_running(
    tmp_path: Path,
) -> None:
    """The port was taken after the deployment started: ``dmsc up`` said it was up, with a
    control plane and workers but no gateway (seen as a flaky test: a worker's server took the
    port the test had picked)."""
    import time

    from runtime_helpers import make_plan

    plan = make_plan(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        res = run_dmsc("up", "--plan", str(plan), "--gateway", f"127.0.0.1:{port}", home=tmp_path)
        took = time.monotonic() - t0
    assert res.returncode == 2, res.stdout
    assert f"cannot serve the gateway on 127.0.0.1:{port}" in res.stderr
    assert "in use" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "control.json").exists() and not list(tmp_path.glob("workers/*"))
    assert took < 30  # before any worker was started
