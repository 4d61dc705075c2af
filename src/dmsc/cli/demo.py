"""``dmsc demo``: the main job on its embedded defaults. gpt-mini trained as micro-model services
on this machine (calibrated, planned, deployed, trained, compared with the prediction, sampled),
then the cost model, the planner and the simulator on the example clusters."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from dmsc.cli.app import console, err_console
from dmsc.cli.options import build_job, build_model, load_cluster
from dmsc.cli.progress import find_task
from dmsc.cli.render import prediction_words
from dmsc.cli.runtime import calibrated_path, control_client, do_calibrate, down, up
from dmsc.cli.simulate import run_simulation
from dmsc.runtime.transport.messages import InferRequest, TrainRequest
from dmsc.spec import SpecError

if TYPE_CHECKING:
    from dmsc.runtime.control.client import ControlClient


def demo(
    steps: Annotated[
        int, typer.Option(min=1, max=100_000, help="Training steps of gpt-mini on this machine.")
    ] = 200,
) -> None:
    """The main job on its embedded defaults: gpt-mini trained as micro-model services on this
    machine, then estimates, a plan and a simulation on the example clusters."""
    runtime_demo(console, steps)
    console.rule("cost model, planner and simulator on the example clusters")
    from dmsc.cli.plan_render import print_plan
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


def runtime_demo(console: Console, steps: int = 200) -> dict[str, Any]:
    """Calibrate, plan gpt-mini on this machine, then what a user does: ``dmsc up``, train,
    compare with the prediction, sample, ``dmsc down``: the same control plane, through the
    same client (:class:`~dmsc.runtime.control.client.ControlClient`)."""
    from dmsc.cli.plan_render import print_plan
    from dmsc.data.db import data_dir
    from dmsc.planner.solve import plan_job
    from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, load_spec, resolve_model

    console.rule("runtime: gpt-mini as three micro-model services on this machine")
    do_calibrate(None, None, console)
    cluster_file = calibrated_path()
    cluster = load_spec(ClusterSpec, cluster_file)
    model = resolve_model("gpt-mini")
    assert isinstance(model, TransformerSpec)
    job = JobSpec(global_batch=16, micro_batch=4, pp=3, schedule="1f1b", overlap_dp_comm=False)
    plan = plan_job(cluster, model, job, fixed=True).plan
    print_plan(console, plan)
    plan_file = data_dir() / "demo-plan.json"
    plan_file.write_text(plan.model_dump_json(indent=1))
    up(plan_file=str(plan_file), cluster=str(cluster_file))
    try:
        return _train_and_sample(console, control_client(), steps)
    finally:
        down()


def _train_and_sample(console: Console, client: ControlClient, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps on the running control plane (a bar per step), compare the step
    time with the prediction, sample."""
    from dmsc.cli.database import open_database

    status = client.status()
    console.print(
        "services: " + ", ".join(f"{s.sid}@{s.address}" for s in status.services),
        highlight=False,
    )
    db = open_database()
    since = time.time()
    pending = client.train_future(TrainRequest(steps=steps))
    task_id: int | None = None
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        bar = progress.add_task("training", total=steps)

        def show(task: int) -> None:
            metrics = db.metrics(task)
            if metrics:
                m = metrics[-1]
                progress.update(
                    bar,
                    completed=len(metrics),
                    description=(
                        f"step {len(metrics)}/{steps} loss {m.loss:.3f} "
                        f"{m.tokens_per_s:,.0f} tok/s {m.step_s * 1e3:.0f} ms"
                    ),
                )

        while not pending.done():
            time.sleep(0.25)
            task_id = task_id if task_id is not None else find_task(db, since)
            if task_id is not None:
                show(task_id)
        report = pending.result()
        show(report.task)
    measured, predicted = report.median_step_s, report.predicted_step_s
    assert measured is not None and report.val_start is not None  # it trained: steps >= 1
    console.print(
        f"validation loss {report.val_start:.3f} -> {report.val_end:.3f}; step time measured "
        f"{measured * 1e3:.1f} ms ({prediction_words(measured, predicted, report.prediction)})",
        highlight=False,
        soft_wrap=True,
    )
    prompt = "def main("
    sample = client.infer(InferRequest(prompt=prompt, tokens=80, seed=0))
    console.print("sample: " + prompt + sample.text, highlight=False, markup=False)
    console.print(
        f"run {status.run} recorded in {db.url} (model version {report.model_version})",
        highlight=False,
    )
    return {
        "val_start": report.val_start,
        "val_end": report.val_end,
        "measured_step_s": measured,
        "predicted_step_s": predicted,
    }
