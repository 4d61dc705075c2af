"""``dmsc logs``: read a deployment's logs under ``$DMSC_HOME/logs``.

The control plane writes ``control.log``, each stage worker ``<SID>.log`` (JSON lines, rotated;
see :mod:`dmsc.runtime.transport.logs`). Lines are rendered as ``time level [context] message``
unless ``--raw``. ``--grep PATTERN`` and ``--since DURATION`` search every log at once (the
control plane's, every worker's, their rotated files and standard errors), merged in time order,
each line after the service that wrote it (``--raw``: one JSON object a line, with a
``service`` field); for a deployment on Ray, the logs its nodes hold on other machines too,
through the control plane (:mod:`dmsc.runtime.control.launch.ray_logs`); ``--service`` or
``--control`` narrow it to one (:func:`dmsc.runtime.transport.log_search.search`); with
``--follow`` ``--grep`` filters the one log followed. ``--follow`` polls the file, like ``tail
-F``: polling needs nothing but the standard library and a log line a fifth of a second late is
fine for a person watching. When the file is rotated (replaced by a new one) or truncated, the
rest of the old file is printed and the new one is read from its start.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Annotated, Any

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
    grep: Annotated[
        str | None,
        typer.Option(
            "--grep",
            help="Only lines matching this regular expression, searched in every log "
            "(the control plane's and every worker's) unless --service or --control.",
        ),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            help="Only lines written in this last duration (90, 30s, 5m, 2h, 1d), "
            "searched in every log unless --service or --control.",
        ),
    ] = None,
) -> None:
    """Show the log of the control plane (default) or of one worker (--service SID); search
    every log at once with --grep and --since."""
    from dmsc.data.db import data_dir
    from dmsc.runtime.transport import logs as log_files

    if service is not None and control:
        raise SpecError("command line", "--service", "give --service or --control, not both")
    if lines < 0:
        raise SpecError("command line", "--lines", "must be 0 or positive")
    pattern = _pattern(grep)
    home = data_dir()
    if since is not None or (grep is not None and not follow):
        if follow:
            raise SpecError(
                "command line", "--follow", "--since searches the logs once; not with --follow"
            )
        folder = log_files.log_dir(home)
        _search(folder, pattern, since, service, control, lines, raw)
        return
    if grep is not None and service is None and not control:
        raise SpecError(
            "command line", "--follow", "--grep with --follow reads one log: name it with "
            "--service SID or --control",
        )  # fmt: skip
    name = choose_log(log_files.log_dir(home), service)
    path = log_files.log_file(home, name)

    def show(line: str) -> None:
        if pattern is None or pattern.search(log_files.render(line)):
            print(line if raw else log_files.render(line), flush=True)

    with path.open("rb") as f:  # bytes: a position to compare with the file's size
        for line in deque(f, maxlen=lines) if lines else ():
            show(line.decode(errors="replace").rstrip("\n"))
        if follow:
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a follow ends
                _follow(path, f, show)


def _pattern(grep: str | None) -> re.Pattern[str] | None:
    if grep is None:
        return None
    try:
        return re.compile(grep)
    except re.error as exc:
        why = f"{grep!r} is not a regular expression: {exc}"
        raise SpecError("command line", "--grep", why) from None


def _search(
    folder: Path,
    pattern: re.Pattern[str] | None,
    since: str | None,
    service: str | None,
    control: bool,
    lines: int,
    raw: bool,
) -> None:
    """Print the last ``lines`` (0: all) matching lines of the logs in ``folder`` and, for a
    deployment on Ray, of the logs its nodes hold on other machines."""
    from dmsc.runtime.control.launch.ray_logs import merged
    from dmsc.runtime.transport.log_search import parse_since, search

    since_s = None
    if since is not None:
        try:
            since_s = time.time() - parse_since(since)
        except ValueError as exc:
            raise SpecError("command line", "--since", str(exc)) from None
    remote = _ray_entries(pattern, since_s, lines)
    if service is None and not control:
        only = None
    elif remote and service is not None and not any(e.service == service for e in remote):
        only = [service]  # on another machine: its lines, or nothing found
        with contextlib.suppress(SpecError):
            only = [choose_log(folder, service)]
    else:
        only = [choose_log(folder, service)]
    if only is not None:
        remote = [e for e in remote if e.service in only]
    found = merged(search(folder, pattern, since_s, only), remote)
    for e in found[-lines:] if lines else found:
        if raw:
            try:
                rec = json.loads(e.line)
            except json.JSONDecodeError:
                rec = None
            body = rec if isinstance(rec, dict) else {"msg": e.line}
            print(json.dumps({"service": e.service, **body}), flush=True)
        else:
            print(f"{e.service}  {e.rendered()}", flush=True)


def _ray_entries(pattern: re.Pattern[str] | None, since_s: float | None, lines: int) -> list[Any]:
    """The matching lines that a running deployment's Ray nodes hold on other machines
    (:mod:`dmsc.runtime.control.launch.ray_logs`); none for a local deployment or none running.
    A node that does not answer is named on standard error, and the search goes on."""
    from dmsc.data.db import control_file

    try:
        info = json.loads(control_file().read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(info, dict) or info.get("launcher") != "ray":
        return []
    import grpc

    from dmsc.cli.runtime import control_client
    from dmsc.runtime.transport.log_calls import MAX_LINES, LogsRequest
    from dmsc.runtime.transport.log_search import Entry

    request = LogsRequest(
        pattern=pattern.pattern if pattern is not None else None,
        since_s=since_s,
        lines=min(lines, MAX_LINES) if lines else MAX_LINES,
    )
    try:
        reply = control_client().logs(request)
    except (SpecError, grpc.RpcError) as exc:
        why = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"dmsc logs: other Ray nodes' logs not searched: {why}", file=sys.stderr)
        return []
    for node in reply.unreachable:
        print(f"dmsc logs: Ray node {node} did not answer; its logs are missing", file=sys.stderr)
    return [Entry(service, ts, line) for service, ts, line in reply.entries]


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
