"""The one error type of the spec layer: a bad input, located by file and field."""

from __future__ import annotations

import re

from pydantic import ValidationError


class SpecError(Exception):
    """A spec file, preset name or flag that cannot be used, with where and why.

    ``source`` names the file (or ``--flag``/preset), ``field`` the dotted path inside it and
    ``reason`` what is wrong. ``str()`` is the one line the CLI prints before exiting with code 2.
    """

    def __init__(self, source: str, field: str, reason: str) -> None:
        self.source = source
        self.field = field
        self.reason = reason
        super().__init__(self.line())

    def line(self) -> str:
        where = f"{self.source}: {self.field}" if self.field else self.source
        return f"{where}: {self.reason}"


def _loc_to_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def spec_error_from_validation(
    source: str, exc: ValidationError, union_tags: tuple[str, ...] = ()
) -> SpecError:
    """The first problem pydantic found, as a :class:`SpecError` (more are counted in the reason).

    ``union_tags`` are the tags of a discriminated union, which pydantic puts first in locations.
    """
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    if loc and loc[0] in union_tags:
        loc = loc[1:]
    reason = str(first["msg"])
    if reason.startswith("Value error, "):
        reason = reason[len("Value error, ") :]
    if "input" in first and first["type"] in {"extra_forbidden"}:
        reason = "unknown field"
    path = _loc_to_path(loc)
    if not path:
        # Cross-field checks of a whole spec say which field they mean as "field: reason".
        m = re.match(r"^([A-Za-z_][\w.\[\]-]*): (.+)$", reason)
        if m:
            path, reason = m.group(1), m.group(2)
    if len(errors) > 1:
        reason += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return SpecError(source, path or "<root>", reason)
