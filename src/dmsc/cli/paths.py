"""Output paths (``--out``, ``--gantt``, ``--plot``, ``--csv``), checked before any work starts.

A plan or a simulation that takes minutes must not end in a traceback because its file cannot be
written: every command with an output path calls :func:`check_output` on it first. Nothing is
created here: a directory that does not exist is the user's to make (a typo would otherwise leave
new directories anywhere on the disk).
"""

from __future__ import annotations

import os
from pathlib import Path

from dmsc.spec import SpecError


def _image_formats() -> list[str]:
    """The file types matplotlib can save a figure as (``png``, ``pdf``, ``svg`` ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def check_output(path: str | None, flag: str, *, image: bool = False) -> Path | None:
    """``path`` as a :class:`Path` when a file can be written there (``None`` stays ``None``);
    else a :class:`SpecError` naming ``flag``, the path and the reason (exit code 2).

    ``image``: a figure, whose suffix (if any) must be a format matplotlib can save.
    """
    if path is None:
        return None
    if not path.strip():
        raise SpecError("command line", flag, "is empty; name a file")
    p = Path(path)

    def refuse(reason: str) -> SpecError:
        return SpecError("command line", flag, f"cannot write {path}: {reason}")

    if p.is_dir():
        raise refuse("it is a directory; name a file in it")
    parent = p.parent
    if not parent.exists():
        raise refuse(f"directory {parent} does not exist (create it first)")
    if not parent.is_dir():
        raise refuse(f"{parent} is not a directory")
    if p.exists() and not os.access(p, os.W_OK):
        raise refuse("the file is not writable")
    if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise refuse(f"directory {parent} is not writable")
    suffix = p.suffix.lower().lstrip(".")
    if image and suffix:
        formats = _image_formats()
        if suffix not in formats:
            raise refuse(f"cannot draw a .{suffix} file (formats: {', '.join(formats)})")
    return p
