"""A run of gpt-mini on the two-sites-cpu example, planned, with measurements written as the
runtime writes them (metrics and step traces), for the tests of the functional modules
(:mod:`dmsc.runtime.control.advisors`) and of ``dmsc replan``.

The traces are synthetic but built from the planner's own figures: each stage's compute per
micro-batch and each boundary's transfer time for the plan's placement, scaled where a test
slows something down, laid out on a GPipe timeline (all forwards, then all backwards).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry

from dmsc.data.db import Database, RunRecord
from dmsc.data.traces import add_step_traces
from dmsc.planner.placement.from_specs import build_problem
from dmsc.planner.placement.problem import Reservation, boundary_us
from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[1]
TWO_SITES = ROOT / "examples" / "clusters" / "two-sites-cpu.yaml"
JOB = JobSpec(global_batch=16, micro_batch=4, pp=2, dp=2)
DP_BYTES = 3_500_000  # per replica and step, to the other replica of its stage


def two_sites() -> ClusterSpec:
    return load_spec(ClusterSpec, TWO_SITES)


def make_plan(cluster: ClusterSpec, job: JobSpec = JOB) -> Plan:
    return plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan


@dataclass(frozen=True)
class Nominal:
    """The planner's figures for the plan's placement: per stage and per boundary."""

    compute_s: list[float]  # per micro-batch
    transfer_s: list[float]  # per micro-batch, all replicas together
    bytes_per_microbatch: list[float]  # all replicas together


def nominal(cluster: ClusterSpec, plan: Plan) -> Nominal:
    built = build_problem(cluster, resolve_model("gpt-mini"), plan.job)
    p = built.problem
    dcs = tuple(p.dc_names.index(st.datacenter) for st in plan.stages)
    paths = {r.after_stage: r for r in plan.paths}
    routes = tuple(
        None if dcs[b] == dcs[b + 1] else Reservation(0, paths[b].units, paths[b].first_unit)
        for b in range(len(dcs) - 1)
    )
    comm = boundary_us(p, dcs, routes)
    return Nominal(
        [(p.compute_us[s][d] or 0) * 1e-6 for s, d in enumerate(dcs)],
        [c * 1e-6 for c in comm],
        list(p.boundary_bytes),
    )


def step_traces(
    compute_s: list[float],
    gap_s: list[float],
    bytes_mb: list[float],
    microbatches: int,
    dp: int,
    t0: float,
) -> tuple[dict[tuple[int, int], tuple[list[Any], dict[str, int]]], float]:
    """One step's traces (as ``Deployment.train_step`` returns them) and its end time: GPipe,
    forwards a third of a micro-batch's compute, backwards the rest; ``bytes_mb`` per boundary
    and micro-batch for all replicas together."""
    stages = len(compute_s)
    out: dict[tuple[int, int], tuple[list[Any], dict[str, int]]] = {}
    end = t0
    for r in range(dp):
        f_end: dict[tuple[int, int], float] = {}
        spans: dict[int, list[Any]] = {s: [] for s in range(stages)}
        free = [t0] * stages
        for s in range(stages):
            for i in range(microbatches):
                ready = f_end[(s - 1, i)] + gap_s[s - 1] if s else t0
                start = max(free[s], ready)
                f_end[(s, i)] = start + compute_s[s] / 3
                free[s] = f_end[(s, i)]
                spans[s].append(["F", i, start, f_end[(s, i)]])
        b_end: dict[tuple[int, int], float] = {}
        for s in reversed(range(stages)):
            for i in range(microbatches):
                ready = b_end[(s + 1, i)] + gap_s[s] if s < stages - 1 else free[s]
                start = max(free[s], ready)
                b_end[(s, i)] = start + compute_s[s] * 2 / 3
                free[s] = b_end[(s, i)]
                spans[s].append(["B", i, start, b_end[(s, i)]])
        for s in range(stages):
            sent: dict[str, int] = {}
            if s + 1 < stages:
                sent[f"{s + 1}/{r}"] = round(bytes_mb[s] / dp * microbatches)
            if s > 0:
                sent[f"{s - 1}/{r}"] = round(bytes_mb[s - 1] / dp * microbatches)
            for other in range(dp):
                if other != r:
                    sent[f"{s}/{other}"] = DP_BYTES
            out[(s, r)] = (spans[s], sent)
        end = max(end, *free)
    return out, end


def fill_run(
    db: Database,
    cluster: ClusterSpec,
    plan: Plan,
    steps: int = 30,
    compute_scale: dict[int, float] | None = None,
    gap_scale: dict[int, float] | None = None,
    step_s: Callable[[int], float] | None = None,
    task_steps: int = 1000,
    gap_by_step: Callable[[int], float] | None = None,
) -> tuple[int, int]:
    """A run of ``plan`` with a running training task that did ``steps`` steps: the planner's
        figures, each stage's compute times ``compute_scale[stage]`` and each boundary's transfer
        ``gap_scale[boundary]``; ``step_s(step)`` the recorded step time (default the plan's
        prediction); ``gap_by_step(step)`` multiplies every boundary's transfer at that step (a link
    whose load changes). Returns the run and the task."""
    run = db.new_run(plan.model, plan.cluster, json.loads(plan.model_dump_json()))
    task = db.new_task(run.id, "train", {"steps": task_steps, "first_step": 0}, state="running")
    nom = nominal(cluster, plan)
    compute = [c * (compute_scale or {}).get(s, 1.0) for s, c in enumerate(nom.compute_s)]
    gaps = [g * (gap_scale or {}).get(b, 1.0) for b, g in enumerate(nom.transfer_s)]
    t = 1_700_000_000.0
    for step in range(steps):
        at = gap_by_step(step) if gap_by_step is not None else 1.0
        traces, end = step_traces(
            compute,
            [g * at for g in gaps],
            nom.bytes_per_microbatch,
            plan.job.microbatches,
            plan.job.dp,
            t,
        )
        took = step_s(step) if step_s is not None else plan.prediction.iteration_time_s
        db.add_metric(task.id, step, 4.0 - step * 0.01, took, 1000.0 / took)
        add_step_traces(db, task.id, step, traces, {})
        t = end + 0.01
    return run.id, task.id


def stand_in_plane(
    db: Database, run: int, plan: Plan, cluster: ClusterSpec | None = None
) -> SimpleNamespace:
    """What the control loop reads of a control plane, over the real database ``db`` and its
    run ``run``: the plan, the cluster (None: the plan's), gpt-mini, its lock, no inference in
    flight and a metrics registry of its own."""
    with db.sessions() as s:
        record = s.get(RunRecord, run)
    return SimpleNamespace(
        db=db,
        run=record,
        plan=plan,
        cluster=cluster,
        model=resolve_model("gpt-mini"),
        lock=threading.Lock(),
        inference=SimpleNamespace(in_flight=lambda: 0, pool=None),
        metrics=CollectorRegistry(),
    )
