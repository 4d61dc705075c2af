"""``dmsc segment``: split a model into micro-models by layers, by blocks of a graph, or by task
heads, and show each micro-model's device, time and memory."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated

import typer

from dmsc.cli.app import EXIT_DOES_NOT_FIT, console, err_console
from dmsc.cli.options import ClusterOpt, JsonOpt, ModelOpt
from dmsc.spec import SpecError


class SegmentMethod(StrEnum):
    layer = "layer"
    block = "block"
    business = "business"


def segment(
    cluster: ClusterOpt,
    model: ModelOpt = None,
    method: Annotated[SegmentMethod, typer.Option(help="layer, block or business.")] = (
        SegmentMethod.layer
    ),
    stages: Annotated[int, typer.Option(help="Stages (layer) or groups (block).")] = 2,
    global_batch: Annotated[int, typer.Option(help="Samples per iteration.")] = 8,
    micro_batch: Annotated[int, typer.Option(help="Samples per micro-batch.")] = 1,
    recompute: Annotated[str, typer.Option(help="none, selective or full.")] = "none",
    seed: Annotated[int, typer.Option(help="Seed of the tabu search.")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Split a model into micro-models: by layers, by blocks of a graph, or by task heads."""
    from dmsc.cli.options import build_job, load_cluster
    from dmsc.cli.tables import FoldTable
    from dmsc.planner.segmentation.cuts import CyclicBlockGraph, SegmentationInfeasible
    from dmsc.planner.segmentation.from_specs import (
        segment_by_blocks,
        segment_by_business,
        segment_by_layers,
    )
    from dmsc.spec import (
        MODEL_PRESETS,
        BlockGraphSpec,
        parse_any_model,
        read_document,
        resolve_model,
    )

    cluster_spec = load_cluster(cluster)
    if model is None:
        raise SpecError("command line", "--model", "is required")
    if stages <= 0:
        raise SpecError("command line", "--stages", "must be positive")
    note = ""
    try:
        if method is SegmentMethod.layer:
            try:
                spec = resolve_model(model)
            except SpecError as err:
                if err.field != "kind" or "block graph" not in err.reason:
                    raise
                raise SpecError(
                    model, "kind", "a block graph is cut with --method block or --method business"
                ) from None
            job = build_job(
                None,
                {
                    "global_batch": global_batch,
                    "micro_batch": micro_batch,
                    "pp": stages,
                    "recompute": recompute,
                },
            )
            segments = segment_by_layers(cluster_spec, spec, job)
        else:
            needs = (
                f"{method.value} segmentation needs a block graph (a model file with kind: blocks)"
            )
            if model in MODEL_PRESETS:
                raise SpecError(
                    "command line",
                    "--method",
                    f"{needs}; {model} is a transformer preset: use --method layer",
                )
            graph = parse_any_model(read_document(model), model)
            if not isinstance(graph, BlockGraphSpec):
                raise SpecError(
                    model, "kind", f"{needs}, not kind: {graph.kind}; use --method layer"
                )
            if method is SegmentMethod.block:
                segments, how = segment_by_blocks(cluster_spec, graph, stages, micro_batch, seed)
                note = f" ({how} search)"
            else:
                segments = segment_by_business(cluster_spec, graph, micro_batch)
    except CyclicBlockGraph as exc:
        raise SpecError(model, "edges", str(exc)) from None
    except SegmentationInfeasible as exc:
        if as_json:
            typer.echo(json.dumps({"feasible": False, "reasons": [str(exc)]}))
        err_console.print(f"infeasible: {exc}", highlight=False)
        raise typer.Exit(EXIT_DOES_NOT_FIT) from None
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "method": method.value,
                    "slowest_s": max(s.time_s for s in segments),
                    "segments": [
                        {
                            "name": s.name,
                            "members": list(s.members),
                            "device_type": s.device_type,
                            "time_s": s.time_s,
                            "memory_gib": s.memory_gib,
                            "reads_from": s.reads_from,
                        }
                        for s in segments
                    ],
                }
            )
        )
        return
    t = FoldTable(
        "micro-model",
        "members",
        "device",
        "time",
        "memory",
        "reads from",
        title=f"{method.value} segmentation{note}",
    )
    for s in segments:
        first, last = s.members[0], s.members[-1]
        members = first if len(s.members) == 1 else f"{first} .. {last} ({len(s.members)})"
        if method is not SegmentMethod.layer:
            members = ", ".join(s.members)
        t.add_row(
            s.name,
            members,
            s.device_type,
            f"{s.time_s * 1e3:.2f} ms",
            f"{s.memory_gib:.2f} GiB",
            s.reads_from or "",
        )
    console.print(t)
