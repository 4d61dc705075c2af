"""A training task's text: where it may lie (the control plane's data roots), and its corpora
read once for the task (the check when it is submitted and its run share the read).

``data`` names a file or a directory on the control plane's machine, from either door (``dmsc
train --data`` or the gateway's ``POST /v1/tasks``): it is accepted only as an absolute path that
lies, symlinks followed, inside one of the roots ``dmsc up --data-root`` named (by default the
directory ``dmsc up`` was started in), and the task stores the resolved path.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from dmsc.data.corpus import Corpus, text_files

Read = Callable[[str | None, int], tuple[Corpus, Corpus]]
KEEP = 2  # the corpora of this many (data, seed) pairs stay in memory


def inside_roots(data: str, roots: Sequence[Path]) -> str:
    """``data`` resolved (symlinks followed), when it lies inside one of ``roots`` (resolved
    too); ValueError, with the roots and the flag that adds one, when it does not."""
    if not Path(data).is_absolute():
        raise ValueError(f"data: {data} is not an absolute path")
    path = Path(data).resolve()
    if any(path.is_relative_to(root.resolve()) for root in roots):
        return str(path)
    named = ", ".join(str(r) for r in roots) or "none"
    raise ValueError(
        f"data: {data} lies outside the control plane's data roots ({named}); "
        "start it with `dmsc up --data-root DIR` to allow another"
    )


def _signature(data: str) -> tuple[tuple[str, int, int], ...]:
    """The files ``data`` reads, with their sizes and times: a change to any is a new read."""
    stats = ((p, p.stat()) for p in text_files(Path(data)))
    return tuple((str(p), s.st_size, s.st_mtime_ns) for p, s in stats)


class TaskTexts:
    """The corpora of the latest tasks' data, by path, seed and the files' sizes and times."""

    def __init__(self, read: Read, keep: int = KEEP) -> None:
        self.read, self.keep = read, keep
        self._kept: OrderedDict[tuple[object, ...], tuple[Corpus, Corpus]] = OrderedDict()
        self._lock = threading.Lock()  # the gateway's submits and the consumers' runs

    def get(self, data: str | None, seed: int) -> tuple[Corpus, Corpus]:
        """The (training, validation) corpora of ``data`` at ``seed`` (ValueError: unreadable)."""
        if data is None:
            return self.read(None, seed)
        try:
            key = (data, seed, _signature(data))
        except (OSError, ValueError):  # missing, empty: the read says why
            return self.read(data, seed)
        with self._lock:
            if key not in self._kept:
                self._kept[key] = self.read(data, seed)
                while len(self._kept) > self.keep:
                    self._kept.popitem(last=False)
            self._kept.move_to_end(key)
            return self._kept[key]
