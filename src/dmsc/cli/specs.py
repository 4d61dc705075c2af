"""``dmsc schema``: the JSON Schema of each input file (cluster, model, job) and of the plan, for
editors and for programs that write these files."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any

import typer


class SpecKind(StrEnum):
    cluster = "cluster"
    model = "model"
    job = "job"
    plan = "plan"


def schema_of(kind: SpecKind) -> dict[str, Any]:
    """The JSON Schema of one kind of document."""
    from pydantic import TypeAdapter

    from dmsc.spec import ClusterSpec, JobSpec, ModelSpec

    if kind is SpecKind.cluster:
        return ClusterSpec.model_json_schema()
    if kind is SpecKind.job:
        return JobSpec.model_json_schema()
    if kind is SpecKind.plan:
        from dmsc.planner.plan import Plan

        return Plan.model_json_schema()
    return TypeAdapter(ModelSpec).json_schema()


def schema(kind: Annotated[SpecKind, typer.Argument(help="cluster, model or job")]) -> None:
    """Print the JSON Schema of a spec file (or of the plan)."""
    typer.echo(json.dumps(schema_of(kind), indent=2))
