"""The one error type of the spec layer: a bad input, located by file and field."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from dmsc.spec.suggest import close_field, fields_at


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


def _without_functions(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    return tuple(p for p in loc if not (isinstance(p, str) and p.startswith("function-")))


def spec_error_from_validation(
    source: str,
    exc: ValidationError,
    union_tags: tuple[str, ...] = (),
    model: Any = None,
    later: tuple[str, ...] = (),
) -> SpecError:
    """The first problem pydantic found, as a :class:`SpecError` (more are counted in the reason).

    ``union_tags`` are the tags of a discriminated union, which pydantic puts first in locations.
    ``model`` is the type validated (a model class or a union of them): an unknown field is then
    reported first, with the known field it most likely misspells (a misspelt field also makes
    the right one missing). Problems with the top-level fields in ``later`` come last.
    """
    errors = exc.errors(include_url=False)
    unknown: dict[int, tuple[str | None, list[str]]] = {}
    for i, err in enumerate(errors):
        loc = _without_functions(err["loc"])
        if err["type"] == "extra_forbidden" and loc and model is not None:
            known = fields_at(model, loc)
            unknown[i] = (close_field(str(loc[-1]), known), known)

    def rank(i: int) -> int:
        loc = _without_functions(errors[i]["loc"])
        if loc and loc[0] in union_tags:
            loc = loc[1:]
        if i in unknown:
            return 0 if unknown[i][0] else 1
        return 3 if loc and loc[0] in later else 2

    index = min(range(len(errors)), key=lambda i: (rank(i), i))
    first = errors[index]
    raw = _without_functions(first["loc"])
    loc = raw[1:] if raw and raw[0] in union_tags else raw
    reason = str(first["msg"])
    if reason.startswith("Value error, "):
        reason = reason[len("Value error, ") :]
    others = len(errors) - 1
    if first["type"] == "extra_forbidden":
        reason = "unknown field"
        guess, known = unknown.get(index, (None, []))
        if guess is not None:
            reason += f"; did you mean {guess}?"
            # The right field reported missing is the same problem.
            twin = (*raw[:-1], guess)
            others -= sum(
                1 for e in errors if e["type"] == "missing" and _without_functions(e["loc"]) == twin
            )
        elif known:
            reason += f" (known: {', '.join(known)})"
    path = _loc_to_path(loc)
    if not path:
        # Cross-field checks of a whole spec say which field they mean as "field: reason".
        m = re.match(r"^([A-Za-z_][\w.\[\]-]*): (.+)$", reason)
        if m:
            path, reason = m.group(1), m.group(2)
    if others > 0:
        reason += f" (and {others} more problem{'s' if others > 1 else ''})"
    return SpecError(source, path or "<root>", reason)
