"""Reading every log of a deployment from one place: ``dmsc logs --grep PATTERN --since DURATION``,
and the failure symptoms the control loop raises alerts for.

The logs are those of :mod:`.logs`: ``control.log`` and each worker's ``<SID>.log`` (JSON lines,
with the rotated ``.log.1`` ... ``.log.3`` before them), and each process's ``<name>.stderr`` (a
crash's traceback, a library's warning: plain lines, no time of their own).

- :func:`search` reads them all, keeps the lines that match a regular expression (on the line
  as ``dmsc logs`` renders it: time, level, context, message and traceback) and that were
  written since a time, and merges them in time order, each with the service it came from. A
  plain line takes the time of the JSON line before it in its file (a traceback continues the
  record above it); a standard-error file has none, so ``--since`` leaves it out;
- :func:`parse_since` reads a duration (``90``, ``30s``, ``5m``, ``2h``, ``1d``);
- :func:`symptom_of` says which failure a line shows: running out of memory, an NCCL or a gloo
  error, a checkpoint that cannot be written, read or verified (:data:`SYMPTOMS`, the patterns
  with the messages they were written from);
- :class:`LogTail` reads what was appended to the logs since it last looked (the control loop's
  tick), following a rotation as ``dmsc logs --follow`` does.
"""

from __future__ import annotations

import datetime as dt
import heapq
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dmsc.runtime.transport.logs import BACKUPS, render

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_since(text: str) -> float:
    """Seconds in a duration: a number of seconds, or one with a unit (``s``, ``m``, ``h``,
    ``d``); ValueError says what was expected."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"{text!r}: expected a duration such as 90, 30s, 5m, 2h or 1d")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


@dataclass(frozen=True)
class Entry:
    """One log line: the service that wrote it, its time (unix seconds; None: not known) and
    the line as written."""

    service: str
    ts: float | None
    line: str

    def rendered(self) -> str:
        return render(self.line)


def line_time(line: str) -> float | None:
    """The time of a JSON log line (its ``ts``, UTC), None for any other line."""
    if not line.startswith("{"):
        return None
    try:
        rec = json.loads(line)
        stamp = rec["ts"]
        when = dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except (ValueError, KeyError, TypeError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def log_files(folder: Path) -> dict[str, list[Path]]:
    """Each service's files in ``folder``, oldest first: rotated logs, the log, its stderr."""
    out: dict[str, list[Path]] = {}
    for path in sorted(folder.glob("*.log")):
        rotated = [path.with_name(f"{path.name}.{i}") for i in range(BACKUPS, 0, -1)]
        out[path.stem] = [p for p in rotated if p.is_file()] + [path]
    for path in sorted(folder.glob("*.stderr")):
        out.setdefault(path.stem, []).append(path)
    return out


def _entries(service: str, paths: Iterable[Path]) -> Iterator[Entry]:
    for path in paths:
        last: float | None = None  # a plain line continues the JSON record above it
        stderr = path.suffix == ".stderr"
        with path.open(errors="replace") as f:
            for raw in f:
                line = raw.rstrip("\n")
                if not line:
                    continue
                ts = None if stderr else line_time(line)
                if ts is not None:
                    last = ts
                yield Entry(service, ts if ts is not None else last, line)


def search(
    folder: Path,
    pattern: re.Pattern[str] | None = None,
    since_s: float | None = None,
    services: Iterable[str] | None = None,
) -> list[Entry]:
    """The lines of the logs in ``folder`` (of ``services`` only, when given) that match
    ``pattern`` and were written at or after ``since_s`` (unix seconds), merged in time order
    (module docstring)."""
    files = log_files(folder)
    wanted = set(services) if services is not None else set(files)
    streams = []
    for service in sorted(wanted & set(files)):
        found = [
            e
            for e in _entries(service, files[service])
            if (since_s is None or (e.ts is not None and e.ts >= since_s))
            and (pattern is None or pattern.search(e.rendered()))
        ]
        streams.append(found)
    # each service's lines are in time order already (plain lines: their record's time)
    return list(heapq.merge(*streams, key=lambda e: e.ts if e.ts is not None else 0.0))


@dataclass(frozen=True)
class Symptom:
    """A failure a log line can show, and the pattern that finds it."""

    name: str  # the alert's name: log:NAME
    what: str  # for the alert's reason
    pattern: re.Pattern[str]


# The patterns, each from messages the libraries write: PyTorch's allocator ("CUDA out of memory.
# Tried to allocate ...", torch.OutOfMemoryError), Python's MemoryError, the C library's "Cannot
# allocate memory" and the kernel's "oom-kill" lines; NCCL's "NCCL error", "ncclInternalError",
# "ncclSystemError" and "NCCL WARN" lines, c10d's ProcessGroupNCCL watchdog timeouts; gloo's "Gloo
# connectFullMesh failed", "[gloo/transport/tcp/pair.cc] Connection closed by peer" and "Timed out
# waiting ... for recv operation"; and this project's checkpoint errors
# (dmsc.runtime.compute.checkpoints: "checkpoint fails its hash", "checkpoint cannot be read",
# "checkpoint does not fit this stage"; dmsc.runtime.control: "checkpoint skipped while ...",
# "none of task N's checkpoints is usable", "no checkpoint verifies").
SYMPTOMS: tuple[Symptom, ...] = (
    Symptom(
        "out-of-memory",
        "out of memory",
        re.compile(
            r"out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory"
            r"|oom[-_ ]kill",
            re.IGNORECASE,
        ),
    ),
    Symptom(
        "nccl",
        "an NCCL error",
        re.compile(
            r"NCCL (?:error|WARN)|nccl(?:Internal|System|Invalid\w*|Unhandled\w*)Error"
            r"|ProcessGroupNCCL.*(?:timeout|timed out|error)",
            re.IGNORECASE,
        ),
    ),
    Symptom(
        "gloo",
        "a gloo error",
        re.compile(
            r"gloo\W.*(?:error|failed|closed|timed? ?out|refused)|ProcessGroupGloo.*(?:error|fail)"
            r"|Gloo connectFullMesh failed",
            re.IGNORECASE,
        ),
    ),
    Symptom(
        "checkpoint",
        "a checkpoint error",
        re.compile(
            r"checkpoint (?:fails its hash|cannot be (?:read|written|loaded)|does not fit"
            r"|skipped|failed|is corrupt)|no checkpoint verifies|checkpoints? (?:is|are) usable"
            r"|NoGoodCheckpoint|CheckpointError",
            re.IGNORECASE,
        ),
    ),
)
OWN = re.compile(r'"msg": "alert \d+')  # the loop's own alert lines quote the symptom


def symptom_of(line: str) -> Symptom | None:
    """The failure ``line`` shows (the first of :data:`SYMPTOMS` that matches), None when it
    shows none or is the control loop's own alert line (which quotes the line it raised on)."""
    if OWN.search(line):
        return None
    text = render(line)
    return next((s for s in SYMPTOMS if s.pattern.search(text)), None)


class LogTail:
    """What was appended to the logs of a folder since the last :meth:`read`. The first read
    starts at the files' ends (what was there before is not new), or, with ``since_s``, keeps
    the JSON lines written from then on (and the plain lines that continue them): a control
    plane's own start, resuming from a checkpoint, comes before its loop's first tick."""

    def __init__(self, folder: Path, since_s: float | None = None) -> None:
        self.folder, self.since_s = folder, since_s
        self._at: dict[Path, tuple[int, int]] = {}  # path -> (inode, offset)
        self._started = False

    def read(self) -> list[Entry]:
        """The new lines of every ``*.log`` and ``*.stderr``, by service; a file replaced by
        a rotation or truncated is read from its start."""
        out: list[Entry] = []
        first = not self._started
        self._started = True
        since = self.since_s if first and self.since_s is not None else None
        paths = sorted([*self.folder.glob("*.log"), *self.folder.glob("*.stderr")])
        for path in paths:
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            at_end = first and self.since_s is None
            inode, offset = self._at.get(path, (st.st_ino, st.st_size if at_end else 0))
            if inode != st.st_ino or st.st_size < offset:
                offset = 0  # rotated or truncated: the new file from its start
            if st.st_size > offset:
                with path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read(st.st_size - offset)
                done = chunk.rfind(b"\n") + 1  # whole lines only: the rest next time
                last: float | None = None
                for raw in chunk[:done].splitlines():
                    line = raw.decode(errors="replace")
                    ts = line_time(line)
                    last = ts if ts is not None else last
                    if line and not (since is not None and (last is None or last < since)):
                        out.append(Entry(path.stem, ts, line))
                offset += done
            self._at[path] = (st.st_ino, offset)
        return out
