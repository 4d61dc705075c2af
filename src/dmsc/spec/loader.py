"""Reading spec files (YAML or JSON) into validated spec objects."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from dmsc.spec.errors import SpecError, spec_error_from_validation

SpecT = TypeVar("SpecT", bound=BaseModel)


def read_document(path: str | Path) -> Any:
    """The parsed content of a YAML or JSON file; a :class:`SpecError` when it cannot be read."""
    p = Path(path)
    source = str(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(source, "", "no such file") from None
    except IsADirectoryError:
        raise SpecError(source, "", "is a directory, not a spec file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(source, "", f"cannot be read ({exc.__class__.__name__})") from None
    try:
        if p.suffix.lower() == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise SpecError(source, f"line {exc.lineno}", f"invalid JSON: {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SpecError(source, where, f"invalid YAML: {problem}") from None


def validate_document(model: type[SpecT], data: Any, source: str) -> SpecT:
    """``data`` validated as ``model``; errors name ``source`` and the field."""
    if not isinstance(data, dict):
        raise SpecError(source, "<root>", "expected a mapping of fields at the top level")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise spec_error_from_validation(source, exc, model=model) from None


def load_spec(model: type[SpecT], path: str | Path) -> SpecT:
    """Read and validate one spec file."""
    return validate_document(model, read_document(path), str(path))
