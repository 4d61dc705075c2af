"""Options several commands share, and turning command-line flags into validated specs (errors
name the flag)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError

from dmsc.spec import (
    ClusterSpec,
    JobSpec,
    LayerListSpec,
    SpecError,
    TransformerSpec,
    load_spec,
    parse_sync,
    read_document,
    resolve_model,
)
from dmsc.spec.errors import spec_error_from_validation

# Options several commands share, declared once so that they read the same everywhere.
ClusterOpt = Annotated[str, typer.Option("--cluster", help="Cluster spec file (YAML or JSON).")]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model", help="Model preset name, model spec file, or hf:DIR (a Hugging Face checkpoint)."
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")]


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def load_cluster(path: str) -> ClusterSpec:
    from dmsc.netmodel import Topology

    cluster = load_spec(ClusterSpec, path)
    try:
        Topology(cluster)  # unknown link endpoints, disconnected datacenters
    except ValueError as exc:
        field, _, reason = str(exc).partition(": ")
        raise SpecError(path, field, reason or str(exc)) from None
    return cluster


def build_model(name: str | None, shape: dict[str, int | None]) -> TransformerSpec | LayerListSpec:
    return resolve_model(name, shape)


def pin_checkpoint(model: TransformerSpec | LayerListSpec) -> TransformerSpec | LayerListSpec:
    """``model`` with the SHA-256 of its checkpoint's files, which ``dmsc up`` checks."""
    if not isinstance(model, TransformerSpec) or model.checkpoint is None:
        return model
    from dmsc.spec.hf import checkpoint_sha256

    digest = checkpoint_sha256(Path(model.checkpoint.path))
    ref = model.checkpoint.model_copy(update={"sha256": digest})
    return model.model_copy(update={"checkpoint": ref})


def build_job(job_file: str | None, flags: dict[str, Any]) -> JobSpec:
    """A job from an optional file, with every flag that was given (not None) on top."""
    data: dict[str, Any] = {}
    source = "command line"
    if job_file is not None:
        doc = read_document(job_file)
        if not isinstance(doc, dict):
            raise SpecError(job_file, "<root>", "expected a mapping of fields at the top level")
        data.update(doc)
        source = job_file
    given = {k: v for k, v in flags.items() if v is not None}
    for key, value in given.items():
        old = data.get(key)
        if key == "sync" and isinstance(old, str):  # the file's short form, diloco:50
            with contextlib.suppress(ValueError):  # a bad one is reported as the file's
                old = parse_sync(old).model_dump(exclude={"compress"})
        # a mapping from flags (--sync and --compress) goes over the file's, field by field
        data[key] = {**old, **value} if isinstance(value, dict) and isinstance(old, dict) else value
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        if "global_batch" not in data and exc.error_count() == 1:
            raise SpecError(source, "--global-batch", "is required") from None
        # A bad flag (--tp 0) or a misspelt field is the problem to name, not the missing batch.
        err = spec_error_from_validation(source, exc, model=JobSpec, later=("global_batch",))
        field = err.field.split(".")[0]
        if field in given:
            raise SpecError("command line", flag_name(field), err.reason) from None
        raise err from None


M = TypeVar("M", bound=BaseModel)


def message_from_flags(model: type[M], flags: dict[str, str], **values: Any) -> M:
    """A typed control message (:mod:`dmsc.runtime.transport.messages`) from command-line
    values: the message's own limits check them, and an error names the flag (``flags`` maps a
    field to its flag) with the message's reason, before anything is sent."""
    try:
        return model(**values)
    except ValidationError as exc:
        err = spec_error_from_validation("command line", exc)
        field = err.field.split(".")[0]
        raise SpecError("command line", flags.get(field, flag_name(field)), err.reason) from None
