"""``python -m dmsc ARGS`` as the tests run it: a process forked from a server that imported the
CLI once, instead of a fresh interpreter for every call.

A fresh ``python -m dmsc`` spends about a second of CPU importing the CLI, pydantic's specs and
SQLAlchemy before it parses its first argument, and the suite runs some hundreds of them. The
server is the one the runtime forks its stage workers from
(:mod:`dmsc.runtime.control.launch.forked`), started once per test process with the CLI among
the modules it imports. A forked call is still a process of its own: its own pid, working
directory and environment (the caller's at the time of the call), standard output and error on
pipes, ``sys.argv`` and ``__main__`` as ``python -m dmsc`` sets them, the exit status the
interpreter would give (``SystemExit``'s code; 1 and the traceback on standard error for an
uncaught exception), and a kill when it runs past its time limit.

``DMSC_TEST_CLI=exec`` runs every call as a fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path

import cli_daemon

import dmsc
from dmsc.runtime.control.launch import forked

MAIN = os.path.join(os.path.dirname(dmsc.__file__), "__main__.py")
_CLI = Path(MAIN).parent / "cli"
# what `python -m dmsc` imports before it runs a command: the CLI's modules and what its commands
# import when they run (the planner's solver, the control plane's client, the functional modules)
PRELOAD = [
    *sorted(f"dmsc.cli.{p.stem}" for p in _CLI.glob("*.py") if p.stem != "__init__"),
    "dmsc.planner.solve",
    "dmsc.runtime.control.client",
    "dmsc.runtime.control.advisors",
    "dmsc.runtime.control.replanning",
    # what `dmsc up`'s control plane imports, for the standby it forks (tests/cli_daemon.py)
    "dmsc.runtime.control.daemon",
    "dmsc.runtime.control.plane",
    "cli_fork",
]


def wanted() -> bool:
    return os.environ.get("DMSC_TEST_CLI") != "exec"


def add_preload() -> None:
    """The CLI among the modules the server imports when it starts (whoever starts it first: a
    call here or a deployment's first worker)."""
    forked.preload(*PRELOAD)


def _reader(fd: int, into: list[bytes]) -> None:
    with os.fdopen(fd, "rb") as f:
        into.append(f.read())


def run(
    args: list[str], env: dict[str, str], cwd: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python -m dmsc *args`` forked, as :func:`subprocess.run` with ``capture_output`` and
    ``text`` returns it (or raises ``TimeoutExpired`` after killing it)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    # as Connections: what multiprocessing passes to a forked process as descriptors
    ends = (Connection(out_w), Connection(err_w))
    try:
        proc = forked.fork(child, (MAIN, args, env, cwd, *ends), "dmsc")
    finally:
        for end in ends:
            end.close()
    out: list[bytes] = []
    err: list[bytes] = []
    readers = [
        threading.Thread(target=_reader, args=(out_r, out), daemon=True),
        threading.Thread(target=_reader, args=(err_r, err), daemon=True),
    ]
    for t in readers:
        t.start()
    argv = [sys.executable, "-m", "dmsc", *args]
    if not wait([proc.sentinel], timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid or 0, 9)
        proc.join()
        for t in readers:
            t.join()
        raise subprocess.TimeoutExpired(argv, timeout, b"".join(out), b"".join(err))
    proc.join()
    for t in readers:
        t.join()
    code = proc.exitcode if proc.exitcode is not None else -1
    return subprocess.CompletedProcess(
        argv, code, b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace")
    )


def _close_databases() -> None:
    """What the interpreter's shutdown does to the SQLAlchemy engines a command left open: their
    connections closed, so that SQLite ends its write-ahead log as it does after a fresh
    process (a process that leaves without closing them leaves that log for the next one)."""
    import gc

    from sqlalchemy.engine import Engine

    # type(), not isinstance(): isinstance reads __class__, which some of torch's deprecated
    # objects answer with a warning on standard error
    for obj in gc.get_objects():
        if issubclass(type(obj), Engine):
            with contextlib.suppress(Exception):
                obj.dispose()


def exit_as_the_interpreter(run: Callable[[], object], argv: list[str]) -> int:
    """Run ``run`` as ``python`` runs a program (``sys.argv`` is ``argv``), then leave as the
    interpreter's shutdown does: the exit status (``SystemExit``'s code; 1 and the traceback on
    standard error for an uncaught exception), the exit functions run, the databases closed and
    the output flushed. The caller ends the process with the status returned."""
    sys.argv = list(argv)
    code: int = 0
    try:
        run()
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter does: the traceback, exit status 1
        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    _close_databases()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    return code


def child(
    main: str, args: list[str], env: dict[str, str], cwd: str, out: Connection, err: Connection
) -> None:
    """In the forked process: the call's directory, environment and pipes, then ``python -m
    dmsc``'s ``__main__``; the exit status as the interpreter would give it. A call that may
    start a control plane (``up``, ``demo``) forks its standby first (:mod:`cli_daemon`)."""
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    # a main process, as in a fresh interpreter: not the fork server's daemonic child, which
    # may not start processes of its own (`dmsc calibrate` starts two)
    cli_daemon.fresh_multiprocessing()
    standby = None
    if args and args[0] in ("up", "demo") and env.get("DMSC_TEST_DAEMON") != "exec":
        standby = cli_daemon.Standby()
        cli_daemon.take_over(standby)

    def run() -> None:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        runpy.run_module("dmsc", run_name="__main__", alter_sys=True)

    code = exit_as_the_interpreter(run, [main, *args])
    if standby is not None:
        standby.release()
    os._exit(code)
