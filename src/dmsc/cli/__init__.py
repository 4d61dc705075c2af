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
    plan = "plan"


class SegmentMethod(StrEnum):
    layer = "layer"
    block = "block"
    business = "business"


class Solver(StrEnum):
    milp = "milp"
    tabu = "tabu"
    greedy = "greedy"
    compute_first = "compute-first"
    random = "random"


def _schema(kind: SpecKind) -> dict[str, Any]:
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


@app.command()
def schema(kind: Annotated[SpecKind, typer.Argument(help="cluster, model or job")]) -> None:
    """Print the JSON Schema of a spec file (or of the plan)."""
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
def plan(
    cluster: ClusterOpt,
    model: ModelOpt = None,
    global_batch: Annotated[int | None, typer.Option(help="Samples per iteration.")] = None,
    gpus: Annotated[int | None, typer.Option(help="Devices to use (default: all).")] = None,
    solver: Annotated[Solver, typer.Option(help="Placement solver.")] = Solver.milp,
    mode: Annotated[str | None, typer.Option(help="train or infer.")] = None,
    tp: Annotated[int | None, typer.Option(help="Fix tensor parallelism (with --pp --dp).")] = None,
    pp: Annotated[int | None, typer.Option(help="Fix pipeline parallelism.")] = None,
    dp: Annotated[int | None, typer.Option(help="Fix data parallelism.")] = None,
    micro_batch: Annotated[int | None, typer.Option(help="Micro-batch (fixed strategy).")] = None,
    schedule: Annotated[str | None, typer.Option(help="Schedule (fixed strategy).")] = None,
    interleave: Annotated[int | None, typer.Option(help="Chunks (fixed strategy).")] = None,
    recompute: Annotated[str | None, typer.Option(help="Recompute (fixed strategy).")] = None,
    zero: Annotated[int | None, typer.Option(help="ZeRO stage 0-3.")] = None,
    top_k: Annotated[int, typer.Option(help="Runner-up strategies to keep.")] = 5,
    seed: Annotated[int, typer.Option(help="Seed of the randomised solvers.")] = 0,
    time_limit: Annotated[float, typer.Option(help="Seconds the exact solver may take.")] = 10.0,
    paths: Annotated[int, typer.Option(help="Candidate routes per datacenter pair.")] = 2,
    out: Annotated[str | None, typer.Option(help="Write the plan (JSON) here.")] = None,
    gantt: Annotated[str | None, typer.Option(help="Draw one iteration to this PNG.")] = None,
    compare: Annotated[bool, typer.Option(help="Run every solver side by side.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Split a model into stages, choose its parallelism and place it on the cluster."""
    from dmsc.cli.options import build_job, build_model, load_cluster
    from dmsc.cli.plan_render import plan_json, print_plan
    from dmsc.netmodel import DoesNotFit
    from dmsc.planner.placement.problem import Infeasible, score_to_seconds
    from dmsc.planner.solve import SOLVERS, plan_job, run_solver

    cluster_spec = load_cluster(cluster)
    model_spec = build_model(model, {})
    fixed = tp is not None and pp is not None and dp is not None
    flags = {"mode": mode, "global_batch": global_batch, "zero": zero}
    if fixed:
        flags.update(
            tp=tp,
            pp=pp,
            dp=dp,
            micro_batch=micro_batch,
            schedule=schedule,
            interleave=interleave,
            recompute=recompute,
            sequence_parallel=(tp or 1) > 1,
        )
    elif any(v is not None for v in (tp, pp, dp)):
        raise SpecError("command line", "--tp/--pp/--dp", "give all three to fix the strategy")
    job_spec = build_job(None, flags)
    if gpus is not None and gpus <= 0:
        raise SpecError("command line", "--gpus", "must be positive")
    if paths <= 0:
        raise SpecError("command line", "--paths", "must be positive")
    if time_limit <= 0:
        raise SpecError("command line", "--time-limit", "must be positive")

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=as_json,
    ) as progress:
        task = progress.add_task("searching strategies", total=None)
        try:
            outcome = plan_job(
                cluster_spec,
                model_spec,
                job_spec,
                solver.value,
                gpus,
                fixed,
                seed,
                time_limit,
                top_k,
                progress=lambda n: progress.update(task, description=f"strategies costed: {n}"),
                k_paths=paths,
            )
        except (DoesNotFit, Infeasible) as exc:
            reasons = exc.reasons if isinstance(exc, DoesNotFit) else [str(exc)]
            if as_json:
                typer.echo(json.dumps({"feasible": False, "reasons": reasons}))
            for reason in reasons:
                err_console.print(f"infeasible: {reason}", highlight=False)
            raise typer.Exit(EXIT_DOES_NOT_FIT) from None
        rows: list[dict[str, Any]] = []
        if compare:
            problem = outcome.built.problem
            for name in SOLVERS:
                progress.update(task, description=f"solver {name}")
                try:
                    res = run_solver(name, problem, seed, time_limit)
                    rows.append(
                        {
                            "solver": name,
                            "pipeline_s": score_to_seconds(problem, res.objective),
                            "seconds": res.seconds,
                            "optimal": res.optimal,
                            "gap_pct": res.gap_pct,
                            "blocked": False,
                        }
                    )
                except Infeasible as exc:
                    rows.append({"solver": name, "blocked": True, "reason": str(exc)})
    the_plan = outcome.plan
    if out is not None:
        Path(out).write_text(the_plan.model_dump_json(indent=2))
    if gantt is not None:
        from dmsc.planner.gantt import draw_gantt, replay
        from dmsc.planner.placement.problem import boundary_us

        pb = outcome.built.problem
        dcs, routes = outcome.result.placement.dcs, outcome.result.placement.routes
        comm = [c * 1e-6 for c in boundary_us(pb, dcs, routes)]
        per_mb = [(pb.compute_us[s][dcs[s]] or 0) * 1e-6 for s in range(pb.n_stages)]
        ops = replay(
            [t / 3 for t in per_mb],
            [2 * t / 3 for t in per_mb],
            comm,
            pb.microbatches,
            the_plan.job.schedule,
        )
        draw_gantt(
            ops,
            pb.n_stages,
            gantt,
            f"{the_plan.model}: one iteration ({the_plan.search.solver} placement)",
        )
    if as_json:
        out_obj = plan_json(the_plan)
        if compare:
            out_obj["compare"] = rows
        typer.echo(json.dumps(out_obj))
        return
    print_plan(console, the_plan)
    if compare:
        from rich.table import Table

        best = min((row["pipeline_s"] for row in rows if not row["blocked"]), default=None)
        t = Table("solver", "pipeline time", "vs best", "gap", "seconds")
        for row in rows:
            if row["blocked"]:
                t.add_row(row["solver"], "blocked", "", "", row["reason"])
                continue
            t.add_row(
                row["solver"],
                f"{row['pipeline_s']:.3f} s",
                f"+{(row['pipeline_s'] / best - 1) * 100:.1f}%" if best else "",
                "optimal"
                if row["optimal"]
                else (f"{row['gap_pct']:.1f}%" if row["gap_pct"] is not None else "-"),
                f"{row['seconds']:.2f}",
            )
        console.print(t)


@app.command()
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
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Split a model into micro-models: by layers, by blocks of a graph, or by task heads."""
    from rich.table import Table

    from dmsc.cli.options import build_job, load_cluster
    from dmsc.planner.segmentation.cuts import SegmentationInfeasible
    from dmsc.planner.segmentation.from_specs import (
        segment_by_blocks,
        segment_by_business,
        segment_by_layers,
    )
    from dmsc.spec import BlockGraphSpec, parse_any_model, read_document, resolve_model

    cluster_spec = load_cluster(cluster)
    if model is None:
        raise SpecError("command line", "--model", "is required")
    if stages <= 0:
        raise SpecError("command line", "--stages", "must be positive")
    note = ""
    try:
        if method is SegmentMethod.layer:
            spec = resolve_model(model)
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
            graph = parse_any_model(read_document(model), model)
            if not isinstance(graph, BlockGraphSpec):
                raise SpecError(model, "kind", f"--method {method.value} needs kind: blocks")
            if method is SegmentMethod.block:
                segments, how = segment_by_blocks(cluster_spec, graph, stages, micro_batch, seed)
                note = f" ({how} search)"
            else:
                segments = segment_by_business(cluster_spec, graph, micro_batch)
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
    t = Table(
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


@app.command()
def simulate(
    scenario: Annotated[str, typer.Option(help="Scenario file (YAML or JSON).")],
    scheduler: Annotated[str, typer.Option(help="baseline, cba or joint.")] = "cba",
    compare: Annotated[
        str | None, typer.Option(help="Comma-separated schedulers to run side by side.")
    ] = None,
    loads: Annotated[str | None, typer.Option(help="Comma-separated loads in Erlang.")] = None,
    seeds: Annotated[int, typer.Option(help="Seeds per point (confidence intervals).")] = 1,
    arrivals: Annotated[int | None, typer.Option(help="Job arrivals per run.")] = None,
    plot: Annotated[str | None, typer.Option(help="Draw blocking vs load to this PNG.")] = None,
    csv_out: Annotated[str | None, typer.Option("--csv", help="Per-run rows to this CSV.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Simulate training jobs arriving over a multi-datacenter optical network."""
    from dmsc.cli.simulate import parse_list
    from dmsc.cli.simulate import simulate as run_simulation

    names = parse_list(compare, "--compare", str) if compare else [scheduler]
    load_list = parse_list(loads, "--loads", float) if loads else None
    run_simulation(
        scenario, names, load_list, seeds, arrivals, as_json, plot, csv_out, console, err_console
    )


@app.command()
def calibrate(
    cluster: Annotated[
        str | None, typer.Option(help="Template cluster (default local-cpu).")
    ] = None,
    out: Annotated[str | None, typer.Option(help="Where to write the calibrated spec.")] = None,
) -> None:
    """Measure this machine (FLOP/s, memory, loopback) into a cluster spec."""
    from dmsc.cli.runtime import do_calibrate

    do_calibrate(cluster, out, console)


@app.command()
def up(
    plan_file: Annotated[str, typer.Option("--plan", help="Plan file (dmsc plan --out).")],
    gateway: Annotated[
        str | None, typer.Option(help="Serve the HTTP gateway on HOST:PORT.")
    ] = None,
    router: Annotated[
        str, typer.Option(help="round_robin, least_outstanding, latency, p2c or sticky.")
    ] = "least_outstanding",
    failure_timeout: Annotated[
        float,
        typer.Option(help="Seconds without a heartbeat before a worker is declared failed."),
    ] = 10.0,
    spares: Annotated[
        int, typer.Option(help="Warm spare workers that take a failed worker's stage over.")
    ] = 0,
) -> None:
    """Start the control plane and one worker process per stage replica."""
    from dmsc.cli.runtime import do_up

    do_up(plan_file, console, gateway, router, failure_timeout, spares)


token_app = typer.Typer(help="API keys of the gateway.", no_args_is_help=True)
app.add_typer(token_app, name="token")


@token_app.command("create")
def token_create(
    tenant: Annotated[str, typer.Option(help="Tenant the key acts for.")],
    scopes: Annotated[str, typer.Option(help="Comma-separated: admin, submit, infer, read.")],
) -> None:
    """Create an API key (printed once; only its hash is stored)."""
    from dmsc.data.db import Database
    from dmsc.runtime.business.auth import create_key

    try:
        key_id, key = create_key(Database(), tenant, [s.strip() for s in scopes.split(",") if s])
    except ValueError as exc:
        raise SpecError("command line", "--scopes", str(exc)) from None
    err_console.print(f"key {key_id} for tenant {tenant!r} (shown once):", highlight=False)
    typer.echo(key)


@token_app.command("revoke")
def token_revoke(key_id: Annotated[int, typer.Argument(help="Key id.")]) -> None:
    """Revoke an API key."""
    from dmsc.data.db import Database
    from dmsc.runtime.business.auth import revoke_key

    try:
        revoke_key(Database(), key_id)
    except KeyError as exc:
        raise SpecError("command line", "KEY_ID", str(exc)) from None
    console.print(f"key {key_id} revoked")


models_app = typer.Typer(
    help="Model versions: list, promote, canary, rollback.", no_args_is_help=True
)
app.add_typer(models_app, name="models")


@models_app.command("list")
def models_list() -> None:
    """Every model version with its status."""
    from rich.table import Table

    from dmsc.data.db import Database
    from dmsc.runtime.control.model_store import versions

    t = Table("version", "run", "step", "sha256", "status", "canary %")
    for v in versions(Database()):
        t.add_row(
            str(v.id),
            str(v.run_id),
            str(v.step),
            v.sha256[:12],
            v.status,
            f"{v.canary_percent:g}" if v.status == "canary" else "",
        )
    console.print(t)


@models_app.command("promote")
def models_promote(version: Annotated[int, typer.Argument()]) -> None:
    """Serve all traffic with VERSION."""
    from dmsc.data.db import Database
    from dmsc.runtime.control.model_store import promote

    try:
        promote(Database(), version)
    except KeyError as exc:
        raise SpecError("command line", "VERSION", str(exc)) from None
    console.print(f"version {version} in production")


@models_app.command("canary")
def models_canary(
    version: Annotated[int, typer.Argument()],
    percent: Annotated[float, typer.Option(help="Share of inference traffic.")] = 10.0,
) -> None:
    """Send a share of inference traffic to VERSION (gray release)."""
    from dmsc.data.db import Database
    from dmsc.runtime.control.model_store import canary

    try:
        canary(Database(), version, percent)
    except (KeyError, ValueError) as exc:
        field = "--percent" if isinstance(exc, ValueError) else "VERSION"
        raise SpecError("command line", field, str(exc)) from None
    console.print(f"version {version} takes {percent:g}% of inference traffic")


@models_app.command("rollback")
def models_rollback() -> None:
    """Back to the previous production version."""
    from dmsc.data.db import Database
    from dmsc.runtime.control.model_store import rollback

    try:
        back = rollback(Database())
    except KeyError as exc:
        raise SpecError("models", "", str(exc)) from None
    console.print(f"rolled back to version {back}")


@app.command()
def status(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Services (SID, stage, address, health) and tasks of the running deployment."""
    from dmsc.cli.runtime import do_status

    do_status(console, as_json)


@app.command(name="train")
def train_cmd(
    steps: Annotated[int, typer.Option(help="Training steps.")] = 200,
    checkpoint_every: Annotated[
        int, typer.Option(help="Steps between checkpoints (0: only one before the first step).")
    ] = 50,
    late_policy: Annotated[
        str,
        typer.Option(help="Late data-parallel gradients: wait, skip (re-weight) or restart."),
    ] = "wait",
    grad_wait: Annotated[
        float, typer.Option(help="Seconds to wait for a replica's gradient (skip, restart).")
    ] = 5.0,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Run a training task on the running services; it survives failed workers."""
    from dmsc.cli.runtime import do_train

    do_train(steps, console, as_json, checkpoint_every, late_policy, grad_wait)


@app.command()
def chaos(
    kill_worker: Annotated[
        str, typer.Option("--kill-worker", help="The worker: stage=N[,replica=R].")
    ],
    after: Annotated[float, typer.Option(help="Seconds to wait before the fault.")] = 0.0,
    freeze: Annotated[
        bool, typer.Option(help="SIGSTOP (a hung worker) instead of kill -9.")
    ] = False,
    watch: Annotated[float, typer.Option(help="Seconds to watch for the recovery.")] = 120.0,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Rehearse a failure: kill (or freeze) a stage worker of the running deployment and report
    how long the control plane took to detect and repair it."""
    from dmsc.cli.runtime import do_chaos

    do_chaos(kill_worker, after, freeze, watch, console, as_json)


@app.command()
def infer(
    prompt: Annotated[str, typer.Option(help="Text to continue.")],
    tokens: Annotated[int, typer.Option(help="Bytes to generate.")] = 80,
) -> None:
    """Sample a continuation through the stage services."""
    from dmsc.cli.runtime import do_infer

    do_infer(prompt, tokens, console)


@app.command()
def down() -> None:
    """Stop the services and the control plane."""
    from dmsc.cli.runtime import do_down

    do_down(console)


@app.command()
def demo() -> None:
    """The main job on its embedded defaults: gpt-mini trained as micro-model services on this
    machine, then estimates, a plan and a simulation on the example clusters."""
    from dmsc.cli.runtime import runtime_demo

    runtime_demo(console)
    console.rule("cost model, planner and simulator on the example clusters")
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

    # The planner: Llama 3 70B over the four NSFNET datacenters, strategy searched, placed by
    # the exact model, beside the communication-unaware baseline.
    from dmsc.cli.plan_render import print_plan
    from dmsc.planner.placement.problem import score_to_seconds
    from dmsc.planner.solve import plan_job, run_solver

    cluster_spec = load_cluster(str(examples / "nsfnet-4dc.yaml"))
    outcome = plan_job(
        cluster_spec, build_model("llama3-70b", {}), build_job(None, {"global_batch": 512})
    )
    print_plan(console, outcome.plan)
    problem = outcome.built.problem
    baseline = run_solver("compute-first", problem)
    ours = score_to_seconds(problem, outcome.result.objective)
    theirs = score_to_seconds(problem, baseline.objective)
    console.print(
        f"network-aware placement: pipeline {ours:.3f} s vs {theirs:.3f} s compute-first "
        f"({(1 - ours / theirs) * 100:.1f}% shorter)",
        highlight=False,
    )

    # The simulator: jobs arriving over the four datacenters, baseline vs CBA vs ours.
    from dmsc.cli.simulate import simulate as run_simulation

    scenario_file = examples.parent / "scenarios" / "nsfnet-cba.yaml"
    run_simulation(
        str(scenario_file),
        ["baseline", "cba", "joint"],
        None,
        1,
        400,
        False,
        None,
        None,
        console,
        err_console,
    )


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
    except Exception as exc:  # a service answered with an error
        import grpc

        if not isinstance(exc, grpc.RpcError):
            raise
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        err_console.print(f"error: {details}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_BAD_INPUT if code == grpc.StatusCode.INVALID_ARGUMENT else 1)
    sys.exit(result if isinstance(result, int) else 0)
