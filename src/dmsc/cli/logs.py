"""``dmsc logs``: read a deployment's logs under ``$DMSC_HOME/logs``.

The control plane writes ``control.log``, each stage worker ``<SID>.log`` (JSON lines, rotated;
see :mod:`dmsc.runtime.transport.logs`). Lines are rendered as ``time level [context] message``
unless ``--raw``. ``--follow`` polls the file, like ``tail -F``: polling needs nothing but the
standard library and a log line a fifth of a second late is fine for a person watching. When the
file is rotated (replaced by a new one) or truncated, the rest of the old file is printed and the
new one is read from its start.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Annotated

import typer

from dmsc.spec import SpecError

POLL_S = 0.2


def logs(
    service: Annotated[
        str | None, typer.Option("--service", help="A worker's SID (a unique prefix will do).")
    ] = None,
    control: Annotated[
        bool, typer.Option("--control", help="The control plane's log (the default).")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines until Ctrl-C.")
    ] = False,
    lines: Annotated[
        int, typer.Option("--lines", "-n", help="Lines from the end to print first.")
    ] = 50,
    raw: Annotated[bool, typer.Option("--raw", help="Print the JSON lines as they are.")] = False,
) -> None:
    """Show the log of the control plane (default) or of one worker (--service SID)."""
    from dmsc.data.db import data_dir
    from dmsc.runtime.transport import logs as log_files

    if service is not None and control:
        raise SpecError("command line", "--service", "give --service or --control, not both")
    if lines < 0:
        raise SpecError("command line", "--lines", "must be 0 or positive")
    home = data_dir()
    name = choose_log(log_files.log_dir(home), service)
    path = log_files.log_file(home, name)

    def show(line: str) -> None:
        print(line if raw else log_files.render(line), flush=True)

    with path.open("rb") as f:  # bytes: a position to compare with the file's size
        for line in deque(f, maxlen=lines) if lines else ():
            show(line.decode(errors="replace").rstrip("\n"))
        if follow:
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a follow ends
                _follow(path, f, show)


def choose_log(folder: Path, service: str | None) -> str:
    """The name of the log to show: ``control`` without a service, else the SID that ``service``
    is or uniquely begins. A name with no log is an error that lists the logs there are."""
    have = sorted(p.stem for p in folder.glob("*.log"))
    workers = [n for n in have if n != "control"]
    wanted = service if service is not None else "control"
    if wanted in have:
        return wanted
    if service is not None:
        matches = [n for n in workers if n.startswith(service)]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise SpecError(
                "command line", "--service", f"{service!r} matches {', '.join(matches)}"
            )
    what = f"service {service!r}" if service is not None else "the control plane"
    where = f"; its standard error: {folder / f'{wanted}.stderr'}"
    stderr_note = where if (folder / f"{wanted}.stderr").is_file() else ""
    listing = ", ".join(have) if have else "none yet"
    raise SpecError(str(folder), "", f"no log of {what}{stderr_note} (logs there: {listing})")


def _follow(path: Path, f: IO[bytes], show: Callable[[str], None]) -> None:
    """Print what is appended to ``path`` (open as ``f``, at its end) until interrupted."""
    first = f
    inode = path.stat().st_ino
    partial = b""
    try:
        while True:
            chunk = f.read()
            if chunk:
                *done, partial = (partial + chunk).split(b"\n")
                for line in done:
                    show(line.decode(errors="replace"))
                continue
            try:
                st = path.stat()
            except FileNotFoundError:  # between a rotation's rename and the new file
                time.sleep(POLL_S)
                continue
            # Rotated (a new file under the name; the old one is drained above) or truncated in
            # place: read the file from its start.
            if st.st_ino != inode or st.st_size < f.tell():
                if partial:
                    show(partial.decode(errors="replace"))
                    partial = b""
                if f is not first:
                    f.close()
                f = path.open("rb")
                inode = st.st_ino
                continue
            time.sleep(POLL_S)
    finally:
        if f is not first:
            f.close()
