"""MkDocs hook: the benchmark figures the pages quote are read from ``benchmarks/results/*.json``
when the pages are built, never typed by hand.

A page writes a figure as ``{{ FILE.json#/POINTER : FORMAT }}``. ``POINTER`` is a JSON pointer
(RFC 6901: keys separated by ``/``, ``~1`` for a ``/`` in a key, a number for a list's item),
where a ``KEY=VALUE`` segment picks the first object of a list whose ``KEY`` is ``VALUE``.
``FORMAT`` is a Python format spec (``.3f``, ``.1%``, ``,.0f``; ``g`` when left out), after an
optional scale (``*1000.0f``: seconds as milliseconds), or ``len`` (the number of items of a
list); there is no ``|``, so a placeholder may sit in a table's cell. Inside a table,
``{{ from FILE.json#/POINTER }}`` (rendered as nothing) sets a base, and a placeholder without a
file (``{{ every-step/val_loss : .3f }}``) is read below it, until the next base. A placeholder
that names no file or value stops the build (so ``make docs`` fails), naming the page and the
placeholder."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PLACEHOLDER = re.compile(r"\{\{\s*(from\s+)?(.+?)(?:\s+:\s+(\S*?))?\s*\}\}")


class FigureError(ValueError):
    """A placeholder that does not name a figure of benchmarks/results/."""


def lookup(document: Any, pointer: str) -> Any:
    """The value at ``pointer`` (``/a/b/0/key=value/c``) in ``document``."""
    value = document
    for raw in pointer.strip("/").split("/") if pointer.strip("/") else []:
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict):
            if key not in value:
                raise FigureError(f"no key {key!r} (keys: {', '.join(map(str, value))})")
            value = value[key]
        elif isinstance(value, list):
            if "=" in key:
                field, wanted = key.split("=", 1)
                found = [v for v in value if isinstance(v, dict) and str(v.get(field)) == wanted]
                if not found:
                    raise FigureError(f"no item with {field} = {wanted!r}")
                value = found[0]
            elif key.isdigit() and int(key) < len(value):
                value = value[int(key)]
            else:
                raise FigureError(f"{key!r} is not an index of a list of {len(value)}")
        else:
            raise FigureError(f"{key!r} below a {type(value).__name__}")
    return value


def load(name: str) -> Any:
    path = RESULTS / name
    if not path.is_file():
        raise FigureError(f"no file {path.relative_to(ROOT)}")
    return json.loads(path.read_text())


def render(markdown: str, where: str = "") -> str:
    """``markdown`` with each placeholder replaced by its figure."""
    base: tuple[str, str] | None = None

    def one(match: re.Match[str]) -> str:
        nonlocal base
        is_base, target, spec = match.group(1), match.group(2).strip(), match.group(3)
        try:
            if "#" in target:
                name, pointer = target.split("#", 1)
            elif base is not None:
                name, pointer = base[0], base[1].rstrip("/") + "/" + target
            else:
                raise FigureError("no file named, and no {{ from FILE#/POINTER }} before it")
            if is_base:
                base = (name, pointer)
                lookup(load(name), pointer)
                return ""
            value = lookup(load(name), pointer)
            if spec == "len" and isinstance(value, (dict, list)):
                return str(len(value))
            if isinstance(value, (dict, list)):
                raise FigureError(f"{pointer} is a {type(value).__name__}, not a figure")
            scale = re.match(r"\*(\d+)(.*)", spec or "")
            if scale:  # `*1000.0f`: seconds as milliseconds
                value, spec = value * int(scale.group(1)), scale.group(2)
            if not spec:
                return value if isinstance(value, str) else format(value, "g")
            return format(value, spec)
        except (FigureError, ValueError, TypeError) as error:
            raise FigureError(f"{where}: {match.group(0)}: {error}") from error

    return PLACEHOLDER.sub(one, markdown)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """MkDocs' hook: every page's Markdown before it is rendered."""
    return render(markdown, page.file.src_uri)
