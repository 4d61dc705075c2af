"""``dmsc up``'s control plane as the forked test calls start it: a process forked from the call
itself, instead of a fresh ``python -m dmsc.runtime.control.daemon``.

A fresh control plane spends about 3.3 s of CPU importing itself (torch, SQLAlchemy, gRPC,
FastAPI, the planner) before it reads its settings, and the suite starts some dozens. A forked
``dmsc up`` (:mod:`cli_fork`) comes from a server that has already imported all of it, so the
call forks a *standby* the moment it starts, while it is still as clean as that server: one
thread, no file or connection open, no output written. When ``dmsc up`` starts its control
plane (``subprocess.Popen([python, "-m", "dmsc.runtime.control.daemon"], ...)``, the only
command this module takes over), the standby gets the pipes and the log file ``dmsc up`` made
for it, the call's environment and directory at that moment, a session of its own
(``start_new_session``), and runs the module as ``python -m`` does; its exit status is the one
the interpreter would give. ``dmsc up`` sees it through the calls it makes of a ``Popen``: the
pid, the pipes, ``poll`` and ``wait``. A call that never starts one lets its standby go.

Everything else ``dmsc up`` does, and the control plane itself, is the code a user runs;
``DMSC_TEST_CLI=exec`` (every call a fresh interpreter) and the tests that call the CLI in
their own process keep the ``Popen`` path under test.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import pickle
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

DAEMON = ["-m", "dmsc.runtime.control.daemon"]
_REAL_POPEN = subprocess.Popen


class Standby:
    """The forked process that waits to become the control plane."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            ours.close()
            _become_daemon(theirs)  # never returns
        theirs.close()
        self.sock: socket.socket | None = ours
        self.returncode: int | None = None

    def start(self, stdin: int, stdout: int, stderr: int) -> None:
        """Hand the standby its pipes and log file, the environment and directory of now."""
        assert self.sock is not None
        _send(self.sock, [stdin, stdout, stderr], (dict(os.environ), os.getcwd()))
        self.sock.close()
        self.sock = None

    def release(self) -> None:
        """Not needed after all: the standby leaves without a word."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)


def fresh_multiprocessing() -> None:
    """:mod:`multiprocessing` as a fresh interpreter has it: a forked call is a child of the
    test's fork server (a daemonic one, which may not start processes), holding that server's
    descriptors; the call, and the control plane, start their own server and resource
    tracker when they need one."""
    import itertools
    import multiprocessing.context
    import multiprocessing.forkserver
    import multiprocessing.process
    import multiprocessing.resource_tracker
    import multiprocessing.util

    # their private state, as multiprocessing's own child bootstrap sets it
    proc: Any = multiprocessing.process
    server: Any = multiprocessing.forkserver._forkserver
    tracker: Any = multiprocessing.resource_tracker._resource_tracker
    util: Any = multiprocessing.util
    context: Any = multiprocessing.context
    for fd in (
        getattr(proc._parent_process, "_sentinel", None),
        server._forkserver_alive_fd,
        tracker._fd,
    ):
        if isinstance(fd, int):
            with contextlib.suppress(OSError):
                os.close(fd)
    server._forkserver_alive_fd = server._inherited_fds = None
    tracker._fd = tracker._pid = None
    me = proc._current_process  # a main process: not daemonic, no parent, no identity
    me._config["daemon"] = False
    me._identity, me._name, me._parent_pid = (), "MainProcess", None
    proc._parent_process = None
    proc._children = set()
    proc._process_counter = itertools.count(1)
    util._finalizer_registry.clear()
    context._default_context._actual_context = None


def _send(sock: socket.socket, fds: list[int], state: object) -> None:
    """``fds`` and a pickled ``state`` to the process at the other end of ``sock``."""
    data = pickle.dumps(state)
    socket.send_fds(sock, [len(data).to_bytes(8, "big") + data], fds)


def _receive(sock: socket.socket, nfds: int) -> tuple[list[int], Any] | None:
    """What :func:`_send` sent, or ``None`` when the other end closed without a word."""
    head, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, nfds)
    if not fds:
        return None
    size = int.from_bytes(head[:8], "big")
    while len(head) < 8 + size and (more := sock.recv(1 << 20)):
        head += more
    sock.close()
    return fds, pickle.loads(head[8 : 8 + size])


def _as_started(fds: list[int], env: dict[str, str], cwd: str) -> None:
    """Standard input, output and error, environment and directory as a started process has
    them."""
    for fd, target in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False))
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), line_buffering=True, errors="backslashreplace"
    )
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)


_FORKSERVER = "from multiprocessing.forkserver import main; main("


def _fork_server_standby() -> Callable[[], None]:
    """A second standby, a child of the control plane's: its workers' fork server
    (:mod:`dmsc.runtime.control.launch.forked`), which a fresh control plane starts as ``python
    -c "from multiprocessing.forkserver import main; main(...)"`` and which then imports the
    worker (about 2.4 s of CPU). The start goes to the standby, which has imported it; it runs
    the same ``main`` with the same listening socket, pipe, modules and paths. Returns what lets
    the standby go when the control plane never starts one (the Ray launcher)."""
    import multiprocessing.util

    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        code = 0
        try:
            got = _receive(theirs, 5)
            if got is None:
                os._exit(0)
            fds, (args, kwargs, env, cwd) = got
            _as_started(fds[2:], env, cwd)
            from multiprocessing.forkserver import main

            main(fds[0], fds[1], *args, **kwargs)
        except SystemExit as exc:  # the clients are gone
            code = exc.code if isinstance(exc.code, int) else 0
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    util: Any = multiprocessing.util
    real = util.spawnv_passfds

    def spawnv_passfds(path: str, args: list[str], passfds: list[int]) -> int:
        if args[-1].startswith(_FORKSERVER) and ours.fileno() != -1:
            call = ast.parse(args[-1]).body[1]
            assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
            listener, alive, *rest = (ast.literal_eval(a) for a in call.value.args)
            assert [listener, alive] == list(passfds), (args, passfds)
            kwargs = ast.literal_eval(call.value.keywords[0].value)
            _send(ours, [listener, alive, 0, 1, 2], (rest, kwargs, dict(os.environ), os.getcwd()))
            ours.close()
            return pid
        return int(real(path, args, passfds))

    util.spawnv_passfds = spawnv_passfds

    def release() -> None:
        if ours.fileno() != -1:
            ours.close()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    return release


def _become_daemon(sock: socket.socket) -> None:
    """In the standby: nothing of the call's output kept; wait for the control plane's start
    (or the call's end), then ``python -m dmsc.runtime.control.daemon``."""
    code = 0
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        fresh_multiprocessing()
        got = _receive(sock, 3)
        if got is None:  # the call ended without starting a control plane
            os._exit(0)
        fds, (env, cwd) = got
        os.setsid()
        release = _fork_server_standby()
        _as_started(fds, env, cwd)
        # as `python -m` finds it: not imported yet (the server imported it, for its imports)
        sys.modules.pop(DAEMON[1], None)
        from cli_fork import exit_as_the_interpreter

        code = exit_as_the_interpreter(
            lambda: runpy.run_module(DAEMON[1], run_name="__main__", alter_sys=True),
            [sys.executable, *DAEMON],
        )
        release()
    except BaseException:  # the standby's own set-up failed: why, on its standard error
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


class StandbyPopen:
    """``dmsc up``'s ``Popen`` of its control plane, run by the :class:`Standby`."""

    def __init__(self, standby: Standby, args: list[str], **kw: Any) -> None:
        self.args = args
        self._standby = standby
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr = kw.get("stderr")
        err = stderr if isinstance(stderr, int) else os.open(os.devnull, os.O_WRONLY)
        try:
            standby.start(stdin_r, stdout_w, err)
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
            if err is not stderr:
                os.close(err)
        self.pid = standby.pid
        text = bool(kw.get("text"))
        self.stdin = os.fdopen(stdin_w, "w" if text else "wb")
        self.stdout = os.fdopen(stdout_r, "r" if text else "rb")
        self.stderr = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


def take_over(standby: Standby) -> None:
    """``subprocess.Popen`` of this call: the control plane's start goes to ``standby``; every
    other command runs as it would."""
    expected = [sys.executable, *DAEMON]

    class Popen(_REAL_POPEN):  # type: ignore[type-arg]
        def __new__(cls, args: Any, *a: Any, **kw: Any) -> Any:
            wanted = (
                isinstance(args, list)
                and args == expected
                and not a
                and standby.sock is not None
                and kw.get("start_new_session")
                and kw.get("stdin") == subprocess.PIPE
                and kw.get("stdout") == subprocess.PIPE
                and set(kw) <= {"stdin", "stdout", "stderr", "text", "start_new_session"}
            )
            if wanted:
                return StandbyPopen(standby, list(args), **kw)
            return super().__new__(cls)

    subprocess.Popen = Popen  # type: ignore[misc]
