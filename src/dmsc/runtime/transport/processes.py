"""Whether a process runs, as the services and the CLI ask it of one another.

``os.kill(pid, 0)`` alone answers yes for a process that has exited and waits for its parent
to reap it (a zombie). A control plane started by ``dmsc up`` belongs to init once ``dmsc up``
exits, and an init that reaps late (a container's) keeps a killed one a zombie for a while:
``dmsc up`` then took the dead plane for a live one and refused to start."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

__all__ = ["alive", "children", "descendants", "die_with", "process_tree"]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs. A zombie does not; another user's live process does."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, and another user's
        return True
    try:  # the state is the first field after the command's closing parenthesis
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # reaped between the two looks
        return False
    except (OSError, IndexError):  # no /proc here: what kill said
        return True
    return state not in ("Z", "X")


def process_tree() -> dict[int, list[int]]:
    """Each process's children, read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return children


def children(pid: int) -> list[int]:
    return process_tree().get(pid, [])


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (read from /proc)."""
    children = process_tree()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def die_with(parent: int) -> bool:
    """Be killed when process ``parent``, this one's parent, ends (Linux ``PR_SET_PDEATHSIG``).
    Called by the child itself at its start rather than between fork and exec: a
    ``preexec_fn`` makes subprocess fork instead of vfork, which runs gRPC's fork handlers in a
    parent that has used gRPC, and those aborted a child once in 40 here. Returns False when
    ``parent`` is no longer the parent (it ended before the request took effect): the caller
    leaves. Elsewhere than Linux, True and nothing done."""
    if not sys.platform.startswith("linux"):
        return True
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    return os.getppid() == parent
