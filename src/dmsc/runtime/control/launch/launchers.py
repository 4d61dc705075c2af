"""Starting and stopping stage-worker processes: the :class:`Launcher` protocol and the local one.

A deployment asks its launcher for a worker per stage replica (and for warm spares); it never
starts processes itself, so that another launcher (containers, a remote host) can take the local
one's place. :class:`LocalLauncher` runs ``python -m dmsc.runtime.compute.worker`` on this
machine and waits for its ``READY host:port`` line.

Logs a user can find: each worker logs JSON lines to ``<home>/logs/<SID>.log`` (rotated by the
worker, see :mod:`dmsc.runtime.transport.logs`) and its standard error is appended to
``<home>/logs/<SID>.stderr``, so a worker that dies before its logger starts still leaves its
traceback there. ``home`` is the data directory when a control plane runs (``$DMSC_HOME``), the
deployment's working directory otherwise. A worker that fails to start raises
:class:`WorkerStartError` carrying the last lines of both files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

from dmsc.runtime.compute import sealing
from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.control.launch.forked import start_forked, wanted
from dmsc.runtime.transport import logs, tls


class Process(Protocol):
    """What the control plane uses of a worker process: a local ``subprocess.Popen`` or a
    process on another machine behind its launcher."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...

    def terminate(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...


@dataclass
class WorkerHandle:
    """A started worker process: its configuration, process and gRPC address."""

    config: WorkerConfig
    process: Process
    address: str


class WorkerStartError(RuntimeError):
    """A worker process exited (or said something else) before it was ready."""


class Launcher(Protocol):
    """Starts and stops worker processes somewhere."""

    def prepare(self, cfgs: list[WorkerConfig]) -> None:
        """Check, before any starts, that the workers ``cfgs`` can be started (ValueError)."""

    def start(self, cfg: WorkerConfig, workdir: Path) -> WorkerHandle: ...

    def stop(self, handle: WorkerHandle) -> None: ...

    def alive(self, handle: WorkerHandle) -> bool: ...

    def exit_reason(self, handle: WorkerHandle) -> str: ...

    def close(self) -> None:
        """Give back what :meth:`prepare` reserved, once the deployment's workers are stopped."""


def with_secrets(cfg: WorkerConfig) -> WorkerConfig:
    """``cfg`` with a leaf certificate of its SID and epoch when this process issues them
    (:func:`dmsc.runtime.transport.tls.issuer`; made at each start, so that a replacement holds
    its own epoch's and the fenced one's is refused), and the checkpoint key when checkpoints
    are sealed (:mod:`dmsc.runtime.compute.sealing`)."""
    issue, key = tls.issuer(), sealing.current()
    leaf = issue(cfg.sid, cfg.epoch).wire() if issue is not None else None
    return replace(cfg, tls=leaf, checkpoint_key=key.hex() if key is not None else None)


def runs_here(launcher: Launcher | None) -> bool:
    """Whether ``launcher`` starts its workers on this machine (None: the local one's default)."""
    return launcher is None or isinstance(launcher, LocalLauncher)


class LocalLauncher:
    """Worker processes on this machine (``python -m dmsc.runtime.compute.worker``); their logs
    go under ``home`` (default: the ``workdir`` each start is given)."""

    def __init__(
        self, ready_timeout_s: float = 60.0, home: Path | None = None, fork: bool | None = None
    ) -> None:
        self.ready_timeout_s = ready_timeout_s
        self.home = home
        # forked from a server that imported the worker once (.forked), unless DMSC_WORKER_START
        # is "exec" (a fresh interpreter per worker, as before)
        self.fork = fork if fork is not None else wanted()

    def prepare(self, cfgs: list[WorkerConfig]) -> None:
        """Every worker runs on this machine: nothing to check."""

    def close(self) -> None:
        """Nothing was reserved."""

    def start(self, cfg: WorkerConfig, workdir: Path) -> WorkerHandle:
        home = self.home if self.home is not None else workdir
        cfg = replace(cfg, log_file=str(logs.log_file(home, cfg.sid)), owner_pid=os.getpid())
        cfg = with_secrets(cfg)
        path = workdir / f"{cfg.sid}.json"  # holds the credential and the leaf's key: owner only
        logs.write_private(path, json.dumps(asdict(cfg)))
        proc: Process
        if self.fork:
            proc = forked = start_forked(path, home, cfg.sid)
            line = forked.stdout.readline()  # blocks until READY or exit
        else:
            stderr = logs.open_stderr(home, cfg.sid)
            try:
                popen = subprocess.Popen(
                    [sys.executable, "-m", "dmsc.runtime.compute.worker", "--config", str(path)],
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                )
            finally:
                os.close(stderr)  # the child holds its own copy
            assert popen.stdout is not None
            proc, line = popen, popen.stdout.readline()  # blocks until READY or exit
        path.unlink(missing_ok=True)  # read at start: the credential stays in no file
        if not line.startswith("READY "):
            proc.kill()
            proc.wait(timeout=10)  # its last words are written once it has gone
            said = f" (it said {line.strip()!r})" if line.strip() else ""
            raise WorkerStartError(
                f"worker {cfg.sid} failed to start{said}; its last log lines:\n"
                + (logs.last_words(home, cfg.sid) or "(none)")
            )
        return WorkerHandle(cfg, proc, line.split()[1])

    def stop(self, handle: WorkerHandle) -> None:
        handle.process.terminate()
        try:
            handle.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            handle.process.kill()
            handle.process.wait(timeout=10)

    def alive(self, handle: WorkerHandle) -> bool:
        return handle.process.poll() is None

    def exit_reason(self, handle: WorkerHandle) -> str:
        code = handle.process.poll()
        return f"exited (signal {-code})" if code is not None and code < 0 else f"exited ({code})"
