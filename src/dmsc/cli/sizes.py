"""Sizes on the command line: ``500MB``, ``2GB``, ``1.5GiB`` or a number of bytes."""

from __future__ import annotations

from dmsc.spec import SpecError

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """The bytes of ``text`` (ValueError when it is not a size of at least one byte)."""
    clean = text.strip().upper().replace(" ", "")
    number = clean.rstrip("BIKMGT")
    try:
        value = float(number) * UNITS[clean[len(number) :]]
    except (ValueError, KeyError):
        raise ValueError(f"expected a size such as 2GB or 500MB, not {text!r}") from None
    if not 1 <= value < 2**63:
        raise ValueError(f"expected a size of at least one byte, not {text!r}")
    return int(value)


def size_flag(flag: str, text: str | None) -> int | None:
    """The bytes of a size option (None when not given); a :class:`SpecError` naming ``flag``."""
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise SpecError("command line", flag, str(exc)) from None
