"""``dmsc estimate``: the cost model on one job and one cluster, as a table or one JSON object.

Every flag that is given overrides the job file; the shape flags (``--layers`` ...) override or
define the model. A job that does not fit exits with code 1 and says why.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from dmsc.cli.app import EXIT_DOES_NOT_FIT, console, err_console
from dmsc.cli.options import ClusterOpt, JsonOpt, ModelOpt
from dmsc.cli.sync_flags import CompressOpt, SyncOpt, sync_fields


def estimate(
    cluster: ClusterOpt,
    model: ModelOpt = None,
    job: Annotated[str | None, typer.Option(help="Job spec file; flags override it.")] = None,
    mode: Annotated[str | None, typer.Option(help="train or infer.")] = None,
    global_batch: Annotated[int | None, typer.Option(help="Samples per iteration.")] = None,
    micro_batch: Annotated[int | None, typer.Option(help="Samples per micro-batch.")] = None,
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel degree.")] = None,
    pp: Annotated[int | None, typer.Option(help="Pipeline-parallel degree.")] = None,
    dp: Annotated[int | None, typer.Option(help="Data-parallel degree.")] = None,
    ep: Annotated[int | None, typer.Option(help="Expert-parallel degree.")] = None,
    schedule: Annotated[str | None, typer.Option(help="gpipe, 1f1b or interleaved.")] = None,
    interleave: Annotated[int | None, typer.Option(help="Chunks per device (interleaved).")] = None,
    recompute: Annotated[str | None, typer.Option(help="none, selective or full.")] = None,
    attention: Annotated[
        str | None,
        typer.Option(help="Attention kernel: flash (fused, the default) or standard."),
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option(
            help="Training recipe: mixed (the default), autocast (plain PyTorch), pure or fp8."
        ),
    ] = None,
    sequence_parallel: Annotated[
        bool | None,
        typer.Option(
            "--sequence-parallel/--no-sequence-parallel",
            help="Split norm and dropout activations over the tensor-parallel group (tp > 1).",
        ),
    ] = None,
    zero: Annotated[int | None, typer.Option(help="ZeRO stage 0-3.")] = None,
    overlap_dp_comm: Annotated[
        bool | None,
        typer.Option(
            "--overlap-dp-comm/--no-overlap-dp-comm",
            help="Overlap the gradient all-reduce with the last backward pass (default: on).",
        ),
    ] = None,
    allreduce: Annotated[str | None, typer.Option(help="auto, ring, tree, hierarchical.")] = None,
    sync: SyncOpt = None,
    compress: CompressOpt = None,
    layers: Annotated[int | None, typer.Option(help="Override: transformer layers.")] = None,
    hidden: Annotated[int | None, typer.Option(help="Override: hidden size.")] = None,
    heads: Annotated[int | None, typer.Option(help="Override: attention heads.")] = None,
    ffn: Annotated[int | None, typer.Option(help="Override: MLP width.")] = None,
    seq: Annotated[int | None, typer.Option(help="Override: sequence length.")] = None,
    vocab: Annotated[int | None, typer.Option(help="Override: vocabulary size.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Predict time, memory and traffic of one iteration of a job on a cluster."""
    from dmsc.cli.options import build_job, build_model, load_cluster
    from dmsc.cli.render import estimate_json, print_estimate
    from dmsc.netmodel import DoesNotFit, Topology, estimate_iteration

    cluster_spec = load_cluster(cluster)
    model_spec = build_model(
        model,
        {
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "ffn": ffn,
            "seq": seq,
            "vocab": vocab,
        },
    )
    flags = {
        "mode": mode,
        "global_batch": global_batch,
        "micro_batch": micro_batch,
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "ep": ep,
        "schedule": schedule,
        "interleave": interleave,
        "recompute": recompute,
        "attention": attention,
        "precision": precision,
        "sequence_parallel": sequence_parallel,
        "zero": zero,
        "overlap_dp_comm": overlap_dp_comm,
        "allreduce": allreduce,
        "sync": sync_fields(sync, compress),
    }
    job_spec = build_job(job, flags)
    topo = Topology(cluster_spec)
    try:
        est = estimate_iteration(cluster_spec, model_spec, job_spec, topology=topo)
    except DoesNotFit as exc:
        if as_json:
            typer.echo(json.dumps({"fits": False, "reasons": exc.reasons}))
        for reason in exc.reasons:
            err_console.print(f"does not fit: {reason}", highlight=False)
        raise typer.Exit(EXIT_DOES_NOT_FIT) from None
    if as_json:
        out = {"fits": True, **estimate_json(est, cluster_spec, model_spec, job_spec, topo)}
        typer.echo(json.dumps(out))
    else:
        print_estimate(console, est, cluster_spec, model_spec, job_spec, topo)
