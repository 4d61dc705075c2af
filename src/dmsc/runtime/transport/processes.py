"""Whether a process runs, as the services and the CLI ask it of one another.

``os.kill(pid, 0)`` alone answers yes for a process that has exited and waits for its parent
to reap it (a zombie). A control plane started by ``dmsc up`` belongs to init once ``dmsc up``
exits, and an init that reaps late (a container's) keeps a killed one a zombie for a while:
``dmsc up`` then took the dead plane for a live one and refused to start."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["alive"]


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
