"""Reading a file a user names, within bounds: the checks are made before the read starts.

A path is resolved (symlinks followed) and, when ``within`` is given, must stay inside that
directory; what it opens must be a regular file (not ``/dev/zero``, a FIFO or a socket: a FIFO is
opened without blocking) of at most ``max_bytes`` by its size, and no more than that is read even
if it grows meanwhile. Every refusal is a :class:`FileRefused` (a ``ValueError``) whose message
names the path and the reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 22


class FileRefused(ValueError):
    """A file that is not read: the message names it and says why."""


class TooLarge(FileRefused):
    """A file over the size it may have."""


Within = Path | tuple[Path, ...] | None


def resolve_within(path: Path, within: Within = None) -> Path:
    """``path`` with its symlinks resolved; FileRefused when it leads outside ``within`` (a
    directory, or one of several)."""
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        raise FileRefused(f"{path}: no such file") from None
    except (OSError, RuntimeError) as exc:  # a symlink loop, a permission
        raise FileRefused(f"{path}: cannot resolve it ({exc})") from None
    if within is not None:
        roots = [r.resolve() for r in (within if isinstance(within, tuple) else (within,))]
        if not any(real == root or root in real.parents for root in roots):
            raise FileRefused(f"{path}: leads to {real}, outside {roots[0]}")
    return real


@contextlib.contextmanager
def open_bounded(path: Path, max_bytes: int, within: Within = None) -> Iterator[BinaryIO]:
    """``path`` opened for reading once it is known to be a regular file (inside ``within``
    when given) of at most ``max_bytes``."""
    real = resolve_within(path, within)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise FileRefused(f"{path}: cannot open it ({exc.strerror})") from None
    try:
        info = os.fstat(fd)  # of what was opened, not of what the name pointed to before
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(f"{path}: not a regular file")
        if info.st_size > max_bytes:
            raise TooLarge(f"{path}: {info.st_size:,} bytes, more than the {max_bytes:,} allowed")
        os.set_blocking(fd, True)
        fh = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with fh:
        yield fh


def read_bounded(path: Path, max_bytes: int, within: Within = None) -> bytes:
    """The bytes of ``path`` (:func:`open_bounded`'s checks); FileRefused when it passes
    ``max_bytes`` while being read."""
    with open_bounded(path, max_bytes, within) as fh:
        try:
            data = fh.read(max_bytes + 1)
        except OSError as exc:
            raise FileRefused(f"{path}: cannot read it ({exc.strerror})") from None
    if len(data) > max_bytes:
        raise TooLarge(f"{path}: more than the {max_bytes:,} bytes allowed")
    return data


def hash_bounded(digest: hashlib._Hash, path: Path, max_bytes: int, within: Within = None) -> int:
    """Feed ``path`` to ``digest`` in pieces (:func:`open_bounded`'s checks); its size."""
    total = 0
    with open_bounded(path, max_bytes, within) as fh:
        while chunk := fh.read(CHUNK):
            total += len(chunk)
            if total > max_bytes:
                raise TooLarge(f"{path}: more than the {max_bytes:,} bytes allowed")
            digest.update(chunk)
    return total
