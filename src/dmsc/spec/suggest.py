""" "Did you mean ...?" for an unknown field: the field names of the model that holds it, found by
walking a spec type (models, dicts, lists, tuples, unions) along a validation error's location."""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterator
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel


def _members(tp: Any) -> list[Any]:
    """``tp`` without ``Annotated``, a union as its members."""
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, types.UnionType):
        return [m for arg in get_args(tp) for m in _members(arg)]
    return [tp]


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _tags(model: type[BaseModel]) -> set[str]:
    """What pydantic may put in a location for this member of a union: its name, its literals."""
    tags = {model.__name__}
    for field in model.model_fields.values():
        if get_origin(field.annotation) is Literal:
            tags.update(str(v) for v in get_args(field.annotation))
    return tags


def _step(tp: Any, part: int | str) -> Iterator[Any]:
    """The types that a location part leads to from ``tp``."""
    members = _members(tp)
    models = [m for m in members if _is_model(m)]
    if len(models) > 1 and isinstance(part, str):
        tagged = [m for m in models if part in _tags(m)]
        if tagged:  # a union's member named in the location
            yield from tagged
            return
    for member in members:
        origin, args = get_origin(member), get_args(member)
        if _is_model(member):
            field = member.model_fields.get(str(part))
            if field is not None:
                yield field.annotation
        elif origin is dict and len(args) == 2:
            yield args[1]
        elif origin is list and args and isinstance(part, int):
            yield args[0]
        elif origin is tuple and isinstance(part, int):
            if len(args) == 2 and args[1] is Ellipsis:
                yield args[0]
            elif part < len(args):
                yield args[part]


def fields_at(root: Any, loc: tuple[int | str, ...]) -> list[str]:
    """The field names of the model(s) that ``loc[-1]`` belongs to, in ``root`` (a model class or
    any type of them); empty when the location does not lead to a model."""
    current = [root]
    for part in loc[:-1]:
        current = [nxt for tp in current for nxt in _step(tp, part)]
    names: list[str] = []
    for tp in current:
        for member in _members(tp):
            if _is_model(member):
                names.extend(n for n in member.model_fields if n not in names)
    return names


def close_field(name: str, known: list[str]) -> str | None:
    """The known field ``name`` is most likely a misspelling of, if any is close enough."""
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return match[0] if match else None
