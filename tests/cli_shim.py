"""The ``dmsc`` command the docs tests' shell runs: a small client that has the test process fork
the call (:mod:`cli_fork`) instead of starting a fresh interpreter that imports the CLI.

The pages' commands run under ``bash -c`` exactly as written (pipes, ``$VARS``, ``&&``); only the
``dmsc`` on the shell's ``PATH`` changes. A fresh ``python -m dmsc`` spends about a second of
CPU importing the CLI before it parses its first argument, and the live docs test runs some
sixty; this client starts Python without ``site`` (tens of milliseconds), connects to a Unix
socket the test process serves, and sends its arguments, environment, directory and its three
standard descriptors (``SCM_RIGHTS``). The test process forks the call from the server that has
imported the CLI, with those descriptors as its standard input, output and error, and answers
the call's pid, then its exit status, which the client exits with (a signal's death as the same
signal). A SIGINT or SIGTERM the client gets (``Ctrl-C``: the shell's process group) goes on to
the call; a client that dies (a kill -9 at a test's timeout) takes its call with it.

``DMSC_TEST_CLI=exec`` keeps the fresh interpreter (the shell's ``dmsc`` then ``exec``s
``python -m dmsc``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
from multiprocessing.connection import Connection
from pathlib import Path

# The client: what `python -S -E cli_shim.py SOCKET ARGS...` runs (the standard library only,
# before anything of the test's is imported below).


def client(path: str, args: list[str]) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    call = json.dumps({"args": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(sock, [len(call).to_bytes(4, "big") + call], [0, 1, 2])
    answers = sock.makefile("r")
    pid = int(answers.readline().split()[1])

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    line = answers.readline()
    code = int(line.split()[1]) if line.startswith("exit ") else 1
    if code < 0:  # killed by a signal: die of the same one, as the shell would see it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    client(sys.argv[1], sys.argv[2:])


# The server, in the test process.


def _child(
    main: str,
    args: list[str],
    env: dict[str, str],
    cwd: str,
    inp: Connection,
    out: Connection,
    err: Connection,
) -> None:
    """In the forked call: the client's standard input too, then :func:`cli_fork.child`."""
    import cli_fork

    os.dup2(inp.fileno(), 0)
    inp.close()
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own, for its life
    cli_fork.child(main, args, env, cwd, out, err)


def _serve_one(conn: socket.socket) -> None:
    import cli_fork

    from dmsc.runtime.control.launch import forked

    with conn:
        head, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        n = int.from_bytes(head[:4], "big")
        body = head[4:]
        while len(body) < n:
            more = conn.recv(n - len(body))
            if not more:
                for fd in fds:
                    os.close(fd)
                return
            body += more
        call = json.loads(body)
        ends = [Connection(fd) for fd in fds]
        try:
            proc = forked.fork(
                _child, (cli_fork.MAIN, call["args"], call["env"], call["cwd"], *ends), "dmsc"
            )
        finally:
            for end in ends:
                end.close()
        conn.sendall(f"pid {proc.pid}\n".encode())
        gone = threading.Event()

        def watch_client() -> None:  # the client killed: its call goes too
            with contextlib.suppress(OSError):
                while conn.recv(1):
                    pass
            if not gone.is_set():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid or 0, signal.SIGKILL)

        threading.Thread(target=watch_client, daemon=True).start()
        proc.join()
        gone.set()
        code = proc.exitcode if proc.exitcode is not None else 1
        with contextlib.suppress(OSError):
            conn.sendall(f"exit {code}\n".encode())


class ShimServer:
    """The Unix socket the shell's ``dmsc`` calls reach (a thread per call), in a directory of
    its own under the system's temporary one (a socket's path is limited to 108 bytes)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dmsc-shim-"))
        self.path = str(self.dir / "s")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                conn, _ = self.sock.accept()
                threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()

    def command(self) -> str:
        """The shell script that is ``dmsc``."""
        return f'#!/bin/sh\nexec "{sys.executable}" -S -E "{__file__}" "{self.path}" "$@"\n'

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            self.dir.rmdir()
