"""The ``dmsc`` command."""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.exceptions import TyperException

from dmsc.spec import SpecError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="dmsc: plan, simulate and run distributed AI models across datacenters.",
)
console = Console()
err_console = Console(stderr=True)

EXIT_DOES_NOT_FIT = 1
EXIT_BAD_INPUT = 2


class SpecKind(StrEnum):
    cluster = "cluster"
    model = "model"
    job = "job"


def _schema(kind: SpecKind) -> dict[str, Any]:
    from pydantic import TypeAdapter

    from dmsc.spec import ClusterSpec, JobSpec, ModelSpec

    if kind is SpecKind.cluster:
        return ClusterSpec.model_json_schema()
    if kind is SpecKind.job:
        return JobSpec.model_json_schema()
    return TypeAdapter(ModelSpec).json_schema()


@app.command()
def schema(kind: Annotated[SpecKind, typer.Argument(help="cluster, model or job")]) -> None:
    """Print the JSON Schema of a spec file."""
    typer.echo(json.dumps(_schema(kind), indent=2))


ClusterOpt = Annotated[str, typer.Option("--cluster", help="Cluster spec file (YAML or JSON).")]
ModelOpt = Annotated[
    str | None, typer.Option("--model", help="Model preset name or model spec file.")
]


@app.command()
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
    sequence_parallel: Annotated[
        bool | None, typer.Option("--sequence-parallel/--no-sequence-parallel")
    ] = None,
    zero: Annotated[int | None, typer.Option(help="ZeRO stage 0-3.")] = None,
    overlap_dp_comm: Annotated[
        bool | None, typer.Option("--overlap-dp-comm/--no-overlap-dp-comm")
    ] = None,
    allreduce: Annotated[str | None, typer.Option(help="auto, ring, tree, hierarchical.")] = None,
    layers: Annotated[int | None, typer.Option(help="Override: transformer layers.")] = None,
    hidden: Annotated[int | None, typer.Option(help="Override: hidden size.")] = None,
    heads: Annotated[int | None, typer.Option(help="Override: attention heads.")] = None,
    ffn: Annotated[int | None, typer.Option(help="Override: MLP width.")] = None,
    seq: Annotated[int | None, typer.Option(help="Override: sequence length.")] = None,
    vocab: Annotated[int | None, typer.Option(help="Override: vocabulary size.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
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
        "sequence_parallel": sequence_parallel,
        "zero": zero,
        "overlap_dp_comm": overlap_dp_comm,
        "allreduce": allreduce,
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


@app.command()
def demo() -> None:
    """The main job on its embedded defaults: estimates on the example clusters."""
    from dmsc.cli.options import build_job, build_model, load_cluster
    from dmsc.cli.render import print_estimate
    from dmsc.netmodel import Topology, estimate_iteration

    examples = Path(__file__).resolve().parents[3] / "examples" / "clusters"
    if not examples.is_dir():
        raise SpecError(str(examples), "", "example clusters not found: run from a source checkout")
    runs: list[tuple[str, str, dict[str, Any]]] = [
        (
            "a100-selene.yaml",
            "gpt3-175b",
            dict(
                tp=8,
                pp=8,
                dp=1,
                global_batch=64,
                micro_batch=1,
                schedule="interleaved",
                interleave=3,
                recompute="full",
            ),
        ),
        (
            "nsfnet-4dc.yaml",
            "llama3-70b",
            dict(
                tp=8,
                pp=4,
                dp=32,
                global_batch=512,
                micro_batch=1,
                recompute="selective",
                sequence_parallel=True,
                zero=1,
            ),
        ),
        (
            "a100-selene.yaml",
            "mixtral-8x7b",
            dict(tp=1, pp=4, dp=32, ep=8, global_batch=256, micro_batch=1, recompute="selective"),
        ),
    ]
    for fname, model_name, flags in runs:
        path = examples / fname
        cluster_spec = load_cluster(str(path))
        model_spec = build_model(model_name, {})
        job_spec = build_job(None, flags)
        topo = Topology(cluster_spec)
        est = estimate_iteration(cluster_spec, model_spec, job_spec, topology=topo)
        print_estimate(console, est, cluster_spec, model_spec, job_spec, topo)
        console.print()


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the app, turning bad input into one line and exit code 2."""
    try:
        result = app(args=argv, standalone_mode=False)
    except SpecError as exc:
        err_console.print(f"error: {exc.line()}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_BAD_INPUT)
    except (typer.Exit, typer.Abort) as exc:
        sys.exit(getattr(exc, "exit_code", 130))
    except TyperException as exc:  # a usage error: unknown flag, bad value, missing option
        if type(exc).__name__ == "NoArgsIsHelpError":
            show = getattr(exc, "show", None)
            if show is not None:
                show()
            sys.exit(0)
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        err_console.print(f"error: {message}", highlight=False, soft_wrap=True)
        sys.exit(getattr(exc, "exit_code", EXIT_BAD_INPUT))
    sys.exit(result if isinstance(result, int) else 0)
