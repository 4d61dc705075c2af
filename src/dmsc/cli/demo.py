"""``dmsc demo``: the main job on its embedded defaults. gpt-mini trained as micro-model services
on this machine (calibrated, planned, deployed, trained, compared with the prediction, sampled),
then the cost model, the planner and the simulator on the example clusters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from dmsc.cli.app import console, err_console
from dmsc.cli.options import build_job, build_model, load_cluster
from dmsc.cli.render import prediction_words
from dmsc.cli.runtime import calibrated_path, do_calibrate
from dmsc.cli.simulate import run_simulation
from dmsc.spec import SpecError


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
    """Calibrate, plan gpt-mini on this machine, deploy, train, compare, sample, shut down."""
    from dmsc.cli.database import open_database
    from dmsc.cli.plan_render import print_plan
    from dmsc.data.corpus import Corpus, stdlib_text
    from dmsc.data.db import ModelVersionRecord, ServiceRecord, data_dir
    from dmsc.planner.solve import plan_job
    from dmsc.runtime.control.advisors.prediction import prediction_for
    from dmsc.runtime.control.launch.deployment import Deployment
    from dmsc.runtime.control.training.training import layout_from_plan, train
    from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, load_spec, resolve_model

    console.rule("runtime: gpt-mini as three micro-model services on this machine")
    do_calibrate(None, None, console)
    cluster = load_spec(ClusterSpec, calibrated_path())
    model = resolve_model("gpt-mini")
    assert isinstance(model, TransformerSpec)
    job = JobSpec(global_batch=16, micro_batch=4, pp=3, schedule="1f1b", overlap_dp_comm=False)
    plan = plan_job(cluster, model, job, fixed=True).plan
    print_plan(console, plan)
    db = open_database()
    run = db.new_run(plan.model, plan.cluster, json.loads(plan.model_dump_json()))
    train_text, valid_text = stdlib_text()
    corpus, valid = Corpus(train_text, model.seq, 0), Corpus(valid_text, model.seq, 1)
    with Deployment(layout_from_plan(plan, model), home=data_dir()) as dep:
        for h in dep.handles:
            db.add(
                ServiceRecord(
                    run_id=run.id,
                    sid=h.config.sid,
                    stage=h.config.stage,
                    replica=h.config.replica,
                    address=h.address,
                )
            )
        console.print(
            "services: " + ", ".join(f"{h.config.sid}@{h.address}" for h in dep.handles),
            highlight=False,
        )
        task = db.new_task(run.id, "train", {"steps": steps}, state="running")
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as progress:
            bar = progress.add_task("training", total=steps)

            def on_step(step: int, out: dict[str, Any]) -> None:
                progress.update(
                    bar,
                    advance=1,
                    description=(
                        f"step {step + 1}/{steps} loss {out['loss']:.3f} "
                        f"{out['tokens_per_s']:,.0f} tok/s {out['step_s'] * 1e3:.0f} ms"
                    ),
                )

            report = train(
                dep,
                corpus,
                valid,
                steps,
                job.global_batch,
                job.microbatches,
                "1f1b",
                db,
                task.id,
                on_step,
            )
        db.set_task_state(task.id, "done")
        saved = dep.clients[(0, 0)].call(
            "Save",
            {
                "path": str(
                    Path(db.url.split("///")[-1]).parent
                    / "checkpoints"
                    / f"demo-run{run.id}.safetensors"
                )
            },
        )
        db.add(
            ModelVersionRecord(
                run_id=run.id, step=steps, path=saved["path"], sha256=saved["sha256"]
            )
        )
        sample = bytes(dep.generate(b"def main(", 80))
    # the prediction for the job that ran, on the calibration just measured
    ran = prediction_for(plan, cluster, model, job.global_batch, job.microbatches, job.dp)
    predicted, measured = ran.step_s, report.median_step_s
    console.print(
        f"validation loss {report.val_start:.3f} -> {report.val_end:.3f}; step time measured "
        f"{measured * 1e3:.1f} ms ({prediction_words(measured, predicted, ran.basis)})",
        highlight=False,
        soft_wrap=True,
    )
    console.print(
        "sample: def main(" + sample.decode("utf-8", errors="replace"),
        highlight=False,
        markup=False,
    )
    console.print(f"run {run.id} recorded in {db.url}", highlight=False)
    return {
        "val_start": report.val_start,
        "val_end": report.val_end,
        "measured_step_s": measured,
        "predicted_step_s": predicted,
    }
