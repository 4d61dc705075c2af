"""``dmsc plan``: split a model into stages, choose its parallelism and place it on the cluster.

The strategy is searched unless ``--tp --pp --dp`` (and ``--ep``) fix it; ``--compare`` places
the chosen strategy with every solver, each as ``--solver`` would (so each row's time is that
plan's), ``--gantt`` draws one iteration. An infeasible job exits with code 1.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dmsc.cli.app import EXIT_DOES_NOT_FIT, console, err_console
from dmsc.cli.options import ClusterOpt, JsonOpt, ModelOpt
from dmsc.cli.sync_flags import CompressOpt, SyncOpt, sync_fields
from dmsc.spec import SpecError

if TYPE_CHECKING:
    from dmsc.planner.plan import Plan
    from dmsc.planner.solve import PlanOutcome


class Solver(StrEnum):
    milp = "milp"
    tabu = "tabu"
    greedy = "greedy"
    compute_first = "compute-first"
    random = "random"


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
    ep: Annotated[
        int | None, typer.Option(help="Expert parallelism, dividing dp (fixed strategy).")
    ] = None,
    expert_imbalance: Annotated[
        float | None,
        typer.Option(
            help="The busiest expert-parallel rank's routed tokens over an even share, 1 to ep "
            "(fixed strategy; a run's trace measures it)."
        ),
    ] = None,
    micro_batch: Annotated[int | None, typer.Option(help="Micro-batch (fixed strategy).")] = None,
    schedule: Annotated[str | None, typer.Option(help="Schedule (fixed strategy).")] = None,
    interleave: Annotated[int | None, typer.Option(help="Chunks (fixed strategy).")] = None,
    recompute: Annotated[str | None, typer.Option(help="Recompute (fixed strategy).")] = None,
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
            help="Sequence parallelism (fixed strategy; default: on when tp > 1).",
        ),
    ] = None,
    zero: Annotated[int | None, typer.Option(help="ZeRO stage 0-3.")] = None,
    allreduce: Annotated[
        str | None,
        typer.Option(
            help="Data-parallel all-reduce: auto (the fastest), ring, tree, hierarchical."
        ),
    ] = None,
    sync: SyncOpt = None,
    compress: CompressOpt = None,
    top_k: Annotated[int, typer.Option(help="Runner-up strategies to keep.")] = 5,
    seed: Annotated[int, typer.Option(help="Seed of the randomised solvers.")] = 0,
    time_limit: Annotated[float, typer.Option(help="Seconds the exact solver may take.")] = 10.0,
    paths: Annotated[int, typer.Option(help="Candidate routes per datacenter pair.")] = 2,
    out: Annotated[str | None, typer.Option(help="Write the plan (JSON) here.")] = None,
    gantt: Annotated[str | None, typer.Option(help="Draw one iteration to this PNG.")] = None,
    compare: Annotated[bool, typer.Option(help="Run every solver side by side.")] = False,
    calibrated: Annotated[
        bool,
        typer.Option(
            help="Plan on the cluster's newest recalibration (the fit of a run's step traces, "
            "kept in the database) instead of the spec file's figures."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Split a model into stages, choose its parallelism and place it on the cluster."""
    from dmsc.cli.options import build_job, build_model, load_cluster, pin_checkpoint
    from dmsc.cli.paths import check_output
    from dmsc.cli.plan_render import plan_json, print_plan
    from dmsc.netmodel import DoesNotFit
    from dmsc.planner.placement.problem import Infeasible
    from dmsc.planner.solve import plan_job

    check_output(out, "--out")
    check_output(gantt, "--gantt", image=True)
    cluster_spec = load_cluster(cluster)
    used = measured = routing = None
    if calibrated:
        from dmsc.cli.recalibrate import calibrated as recalibrated

        cluster_spec, used, measured, routing = recalibrated(cluster_spec, cluster)
        (err_console if as_json else console).print(used, highlight=False, soft_wrap=True)
    model_spec = build_model(model, {})
    model_spec = pin_checkpoint(model_spec)
    fixed = tp is not None and pp is not None and dp is not None
    learned = learned_routing(routing, measured, model_spec.name, ep if fixed else None)
    if expert_imbalance is None and learned is not None:
        expert_imbalance = learned
        (err_console if as_json else console).print(
            f"the routing's imbalance that run measured, {learned:.2f} of an even share on the "
            "busiest expert-parallel rank, is priced (--expert-imbalance gives another)",
            highlight=False,
            soft_wrap=True,
        )
    flags: dict[str, Any] = {
        "mode": mode,
        "global_batch": global_batch,
        "zero": zero,
        "allreduce": allreduce,
        "attention": attention,
        "precision": precision,
        "sync": sync_fields(sync, compress),
    }
    if fixed:
        flags.update(
            tp=tp,
            pp=pp,
            dp=dp,
            ep=ep,
            expert_imbalance=expert_imbalance,
            micro_batch=micro_batch,
            schedule=schedule,
            interleave=interleave,
            recompute=recompute,
            sequence_parallel=(tp or 1) > 1 if sequence_parallel is None else sequence_parallel,
        )
    elif sequence_parallel is not None:
        raise SpecError(
            "command line", "--sequence-parallel", "only with a fixed strategy (--tp --pp --dp)"
        )
    elif ep is not None:
        raise SpecError("command line", "--ep", "only with a fixed strategy (--tp --pp --dp)")
    elif expert_imbalance is not None:
        raise SpecError(
            "command line", "--expert-imbalance", "only with a fixed strategy (--tp --pp --dp)"
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
            from dmsc.planner.compare import compare_solvers

            rows = [
                row.as_dict()
                for row in compare_solvers(
                    cluster_spec, model_spec, outcome, solver.value, seed, time_limit, paths,
                    lambda name: progress.update(task, description=f"solver {name}"),
                )
            ]  # fmt: skip
    if measured is not None:  # the fit is exact for the placement it measured only
        from dmsc.planner.measured_choice import prefer_measured

        outcome, why = prefer_measured(outcome, measured, cluster_spec, model_spec)
        if why is not None:
            used = f"{used}; {why}"
            (err_console if as_json else console).print(why, highlight=False, soft_wrap=True)
    the_plan = outcome.plan
    if out is not None:
        Path(out).write_text(the_plan.model_dump_json(indent=2))
    drawn = None
    if gantt is not None:
        drawn = _draw_gantt(outcome, gantt)
    if as_json:
        out_obj = plan_json(the_plan)
        if used is not None:
            out_obj["calibrated"] = used
        if compare:
            out_obj["compare"] = rows
        typer.echo(json.dumps(out_obj))
        return
    print_plan(console, the_plan)
    if compare:
        _print_compare(rows)
    if drawn is not None:
        console.print(drawn, highlight=False, soft_wrap=True)


def _draw_gantt(outcome: PlanOutcome, path: str) -> str:
    """Draw one iteration of the plan to ``path``; the line that says so, with its total."""
    from dmsc.cli.plan_render import draw_gantt
    from dmsc.cli.render import human_seconds
    from dmsc.planner.gantt import span

    plan = outcome.plan
    ops = outcome.iteration_ops()
    total = human_seconds(span(ops))
    j = plan.job
    note = f", interleaved v={j.interleave}" if j.chunks > 1 else ""
    draw_gantt(
        ops,
        outcome.built.problem.n_stages,
        path,
        f"{plan.model}: one iteration, {total} ({plan.search.solver} placement{note})",
    )
    return f"Gantt chart of one iteration ({total}{note}) written to {path}"


def _print_compare(rows: list[dict[str, Any]]) -> None:
    """The solvers side by side: the iteration of each one's plan (as `--solver` gives it), its
    pipeline part, distance to the best, optimality gap, placement time."""
    from dmsc.cli.render import fit_table, human_seconds

    best = min((row["iteration_s"] for row in rows if not row["blocked"]), default=None)
    t = fit_table("solver", "iteration", "pipeline", "vs best", "gap", "seconds", keep=(0,))
    for row in rows:
        if row["blocked"]:
            t.add_row(row["solver"], "blocked", "", "", "", row["reason"])
            continue
        t.add_row(
            row["solver"],
            human_seconds(row["iteration_s"]),
            human_seconds(row["pipeline_s"]),
            f"+{(row['iteration_s'] / best - 1) * 100:.1f}%" if best else "",
            "optimal"
            if row["optimal"]
            else (f"{row['gap_pct']:.1f}%" if row["gap_pct"] is not None else "-"),
            f"{row['seconds']:.2f}",
        )
    console.print(t)


def learned_routing(
    routing: float | None, measured: Plan | None, model: str, ep: int | None
) -> float | None:
    """The routing's imbalance a recalibrated run measured, where it stands for the plan asked:
    the same model at the same expert-parallel degree, a fixed strategy (``ep``; None: the
    strategy is searched, and another ep would route otherwise); None elsewhere."""
    if routing is None or measured is None or ep is None or ep < 2:
        return None
    if measured.model != model or measured.job.ep != ep:
        return None
    return float(routing)
