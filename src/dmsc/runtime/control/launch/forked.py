"""Stage workers forked from a process that has imported them once.

``python -m dmsc.runtime.compute.worker`` spends about 2 s of CPU importing torch and the worker
before it can serve (2.0-2.2 s measured on the 2-core CI machine), and so does every replacement
after a failure. The standard library's forkserver (:mod:`multiprocessing`) serves here: the
first worker a process starts brings up one server process that imports the worker module once;
every worker after it is forked from that server, ready to run in milliseconds. The server
imports, and never runs, torch (no OpenMP pool, no CUDA context is forked).

A forked worker is owned as a ``subprocess.Popen`` one is: :class:`ForkedProcess` gives its pid
(``dmsc chaos`` and the tests signal it), its exit code (negative for a signal, as Popen says it)
and kill / terminate / wait. Each worker gets the environment and working directory of the moment
it starts (the server's are those of its own start), its standard error appended to its
``<SID>.stderr`` and its standard output to a pipe the launcher reads ``READY host:port`` from.

Why one lock for every call into :mod:`multiprocessing`: a forkserver child's exit code is read
once from a pipe, and ``Process.start`` polls the other children; two threads polling one child
at once (a deployment starts its workers in parallel and watches them from others) could both see
the pipe readable and the second read nothing, taking exit code 255 for a kill -9.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TextIO

from dmsc.runtime.transport import logs

# torch._dynamo: what a stage imports when it builds its optimizer (about half a second of CPU)
_PRELOAD = ["dmsc.runtime.compute.worker", "torch._dynamo"]
_LOCK = threading.Lock()


def _serve(
    config: str, home: str, sid: str, out: Connection, env: dict[str, str], cwd: str
) -> None:
    """In the forked child: the caller's environment, standard error to the SID's file, standard
    output to the launcher's pipe, then the worker's own ``main``."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    err = logs.open_stderr(Path(home), sid)
    os.dup2(err, 2)
    os.close(err)
    os.dup2(out.fileno(), 1)
    out.close()
    from dmsc.runtime.compute.worker import main

    main(["--config", config])


class ForkedProcess:
    """A forked worker, seen through :class:`~.launchers.Process` (``subprocess.Popen``'s
    calls)."""

    def __init__(self, proc: BaseProcess, stdout: TextIO) -> None:
        self._proc = proc
        self.pid: int = proc.pid or 0
        self.args = ["forkserver", *_PRELOAD]
        self.stdout = stdout  # kept open: a worker that prints after READY must not get EPIPE

    def poll(self) -> int | None:
        with _LOCK:
            return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        wait([self._proc.sentinel], timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a gone process's pid may already be another's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


@contextlib.contextmanager
def _no_main() -> Iterator[None]:
    """While a worker is forked, a bare ``__main__``: multiprocessing would otherwise have the
    child import the launcher's main module again (``python -m dmsc.runtime.control.daemon``'s
    whole control plane, about 1 s of CPU a worker) before it runs its target."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def wanted() -> bool:
    """Whether local workers are forked (the default) or each started as its own interpreter
    (``DMSC_WORKER_START=exec``)."""
    return os.environ.get("DMSC_WORKER_START") != "exec"


def warm() -> None:
    """Start the server now, without forking a worker: it imports the worker while the caller
    goes on with its own start."""
    with _LOCK, _no_main():
        multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
        multiprocessing.forkserver.ensure_running()


def start_forked(config: Path, home: Path, sid: str) -> ForkedProcess:
    """Fork a worker reading ``config`` (its ``stdout`` is the read end of its standard
    output)."""
    ctx = multiprocessing.get_context("forkserver")
    read, write = ctx.Pipe(duplex=False)
    args = (str(config), str(home), sid, write, dict(os.environ), os.getcwd())
    # daemon: a launcher that exits normally takes its workers with it (a kill -9 does not: they
    # leave once they find the launcher gone: .compute.worker.owner_gone)
    proc = ctx.Process(target=_serve, args=args, name=sid, daemon=True)
    with _LOCK, _no_main():
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: the first time only
        proc.start()
    write.close()
    stdout = os.fdopen(os.dup(read.fileno()), "r")
    read.close()
    return ForkedProcess(proc, stdout)
