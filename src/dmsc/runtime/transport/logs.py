"""Log files a user can find: every process of a deployment writes under ``$DMSC_HOME/logs``.

The control plane writes ``control.log``, each stage worker ``<SID>.log``: JSON lines (see
:class:`dmsc.runtime.transport.observe.JsonFormatter`), rotated at 5 MiB with three old files
kept (``logging.handlers.RotatingFileHandler``). What a process prints to its standard error
outside the logger (a traceback at start, a warning of a library) goes to ``<name>.stderr``
beside it, so a crash before logging started still leaves its reason. ``dmsc logs`` reads them.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
from collections import deque
from pathlib import Path

from dmsc.runtime.transport.observe import JsonFormatter

MAX_BYTES = 5 * 1024 * 1024
BACKUPS = 3
CONTROL = "control"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable and writable by its owner only (mode 0600, also when
    the file existed with a wider mode): for files that hold a credential."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def log_dir(home: Path) -> Path:
    """The folder of a deployment's logs under its data directory ``home``."""
    path = home / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_file(home: Path, name: str) -> Path:
    """The JSON log of process ``name`` (``control`` or a SID)."""
    return log_dir(home) / f"{name}.log"


def stderr_file(home: Path, name: str) -> Path:
    """Where process ``name``'s standard error goes."""
    return log_dir(home) / f"{name}.stderr"


def open_stderr(home: Path, name: str) -> int:
    """A file descriptor for a child's standard error (appended: a restart keeps the history)."""
    return os.open(stderr_file(home, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def file_logger(name: str, path: Path, level: int = logging.INFO) -> logging.Logger:
    """A logger writing JSON lines to ``path``, rotated (see the module docstring)."""
    log = logging.getLogger(name)
    for h in list(log.handlers):
        if isinstance(h, logging.handlers.RotatingFileHandler):
            log.removeHandler(h)
            h.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS)
    handler.setFormatter(JsonFormatter())
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False
    return log


def tail(path: Path, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of ``path`` (none when it does not exist)."""
    if not path.is_file():
        return []
    with path.open(errors="replace") as f:
        return [line.rstrip("\n") for line in deque(f, maxlen=lines)]


def last_words(home: Path, name: str, lines: int = 10) -> str:
    """The end of a process's log and standard error, for an error message."""
    parts = []
    for path in (log_file(home, name), stderr_file(home, name)):
        got = tail(path, lines)
        if got:
            parts.append(f"--- {path}\n" + "\n".join(got))
    return "\n".join(parts)


def render(line: str) -> str:
    """A JSON log line as ``time level [context] message``; any other line as it is."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return line
    if not isinstance(rec, dict) or "msg" not in rec:
        return line
    context = " ".join(f"{k}={rec[k]}" for k in JsonFormatter.CONTEXT if k in rec and k != "sid")
    head = f"{rec.get('ts', '')} {str(rec.get('level', '')).upper():7} {rec.get('sid', '')}"
    text = f"{head.rstrip()} {context} {rec['msg']}".replace("  ", " ")
    if rec.get("exc"):
        text += "\n" + str(rec["exc"])
    return text
