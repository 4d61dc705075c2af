"""Workers forked from the launcher's server are owned as ``subprocess.Popen`` children are: the
pid to signal, the exit code a kill leaves (read by many threads at once), the working directory
of the moment they start."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from dmsc.runtime.compute.worker import WorkerConfig
from dmsc.runtime.control.launch import forked
from dmsc.runtime.control.launch.forked import ForkedProcess, start_forked
from dmsc.spec import resolve_model

pytestmark = pytest.mark.integration


@pytest.fixture
def silent_registry() -> Iterator[str]:
    """A port that takes connections and never answers: a worker waits on its Register."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    srv.close()


def _start(tmp_path: Path, registry: str, sid: str) -> ForkedProcess:
    cfg = WorkerConfig(
        sid=sid,
        stage=0,
        stages=1,
        model=resolve_model("gpt-mini").model_dump(),
        first="embedding",
        last="head",
        registry=registry,
    )
    path = tmp_path / f"{sid}.json"
    path.write_text(json.dumps(asdict(cfg)))
    return start_forked(path, tmp_path / "home", sid)


def test_a_killed_worker_says_signal_9_to_every_thread_that_asks(
    tmp_path: Path, silent_registry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "cwd"
    run.mkdir()
    monkeypatch.chdir(run)
    proc = _start(tmp_path, silent_registry, "forked-r0")
    assert proc.poll() is None
    cwd, deadline = Path(f"/proc/{proc.pid}/cwd"), time.monotonic() + 30
    while cwd.resolve() != run.resolve():  # this moment's directory, once the child set it up
        assert time.monotonic() < deadline, cwd.resolve()
        time.sleep(0.01)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.05)
    os.kill(proc.pid, signal.SIGKILL)  # as dmsc chaos and the chaos tests do, by pid
    codes: list[int | None] = []
    go = threading.Barrier(8)

    def ask() -> None:
        go.wait()
        deadline = time.monotonic() + 30
        while (code := proc.poll()) is None and time.monotonic() < deadline:
            pass
        codes.append(code)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [-signal.SIGKILL] * 8
    assert proc.wait(timeout=1) == -signal.SIGKILL
    proc.kill()  # a gone process: nothing to signal, no error


def test_terminate_and_wait_as_popen_does(tmp_path: Path, silent_registry: str) -> None:
    proc = _start(tmp_path, silent_registry, "forked-r1")
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM  # it is still registering: the default
    assert proc.poll() == -signal.SIGTERM


def test_warm_starts_the_server_the_next_worker_is_forked_from(
    tmp_path: Path, silent_registry: str
) -> None:
    """``dmsc up``'s control plane warms the server before it imports itself: the server is
    this process's child at once, and the worker started later is that server's child."""
    import psutil

    forked.warm()
    forked.warm()  # a second call starts no second server
    servers = [
        p
        for p in psutil.Process().children()
        if "multiprocessing.forkserver" in " ".join(p.cmdline())
    ]
    assert len(servers) == 1, servers
    proc = _start(tmp_path, silent_registry, "warmed")
    try:
        assert psutil.Process(proc.pid).ppid() == servers[0].pid
    finally:
        proc.kill()
        proc.wait(10)
