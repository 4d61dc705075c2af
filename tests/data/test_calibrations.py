"""Recalibrations in the database: step traces laid out from the cost model's own figures (known
device speed and link bandwidths) are measured and fitted back to those figures, and the fit is
kept with its run and found again by cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmsc.cli.recalibrate import describe
from dmsc.data.calibrations import (
    fit_task,
    fitted_spec,
    newest_fit,
    record_fit,
    run_figures,
    run_fits,
)
from dmsc.data.db import Database
from dmsc.data.traces import add_step_traces
from dmsc.planner.placement.from_specs import build_problem
from dmsc.planner.placement.problem import boundary_us
from dmsc.planner.plan import Plan
from dmsc.planner.recalibrate import iteration_s, plan_placement, scaled
from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[2]
MODEL = resolve_model("gpt-mini")


def demo() -> tuple[Plan, ClusterSpec]:
    cluster = load_spec(ClusterSpec, ROOT / "examples/clusters/local-cpu.yaml")
    job = JobSpec(global_batch=16, micro_batch=4, pp=3, schedule="1f1b", overlap_dp_comm=False)
    return plan_job(cluster, MODEL, job, fixed=True).plan, cluster


def lay_out(
    plan: Plan, true: ClusterSpec, step: int, slow: float = 1.0
) -> dict[tuple[int, int], tuple[list[tuple[str, int, float, float]], dict[str, int]]]:
    """One step's traces as workers on ``true`` report them (``slow``: every op that many times
    longer): all forwards then all backwards, each op as soon as its input has arrived and its
    stage is free; a forward a third of a stage's micro-batch, a backward the rest."""
    built = build_problem(true, MODEL, plan.job)
    place = plan_placement(built, plan)
    p, m = built.problem, plan.job.microbatches
    op_s = [(p.compute_us[s][d] or 0) * 1e-6 * slow for s, d in enumerate(place.dcs)]
    hop = [t * 1e-6 for t in boundary_us(p, place.dcs, place.routes)]
    n = len(op_s)
    spans: list[list[tuple[str, int, float, float]]] = [[] for _ in range(n)]
    free, t0 = [0.0] * n, 100.0 * step
    fwd_end: dict[tuple[int, int], float] = {}
    for mb in range(m):
        for s in range(n):
            start = max(free[s], fwd_end[(s - 1, mb)] + hop[s - 1] if s else t0)
            fwd_end[(s, mb)] = free[s] = start + op_s[s] / 3
            spans[s].append(("F", mb, start, free[s]))
    bwd_end: dict[tuple[int, int], float] = {}
    for mb in range(m):
        for s in reversed(range(n)):
            arrive = bwd_end[(s + 1, mb)] + hop[s] if s < n - 1 else free[s]
            start = max(free[s], arrive)
            bwd_end[(s, mb)] = free[s] = start + op_s[s] * 2 / 3
            spans[s].append(("B", mb, start, free[s]))
    out = {}
    for s in range(n):
        sent = {f"{s + 1}/0": int(p.boundary_bytes[s]) * m} if s < n - 1 else {}
        out[(s, 0)] = (spans[s], sent)
    return out


def test_traces_laid_out_from_known_figures_are_fitted_back_to_them(tmp_path: Path) -> None:
    plan, cluster = demo()
    true = scaled(cluster, {"cpu": 0.5}, {"dc-0-dc-1": 0.2, "dc-1-dc-2": 0.4})
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run = db.new_run("gpt-mini", plan.cluster, {})
    task = db.new_task(run.id, "train", {}).id
    for step in range(5):  # the first is a warm-up, ten times slower: left out
        traces = lay_out(plan, true, step, slow=10.0 if step == 0 else 1.0)
        add_step_traces(db, task, step, traces, {})
    step_s = iteration_s(plan, true, MODEL)
    fit = fit_task(db, run.id, task, plan, cluster, step_s)
    assert fit.steps == 4
    assert fit.span_speed["cpu"] == pytest.approx(0.5, rel=1e-3)
    assert fit.device_speed["cpu"] == pytest.approx(0.5, rel=2e-3)
    assert fit.link_scale == pytest.approx({"dc-0-dc-1": 0.2, "dc-1-dc-2": 0.4}, rel=1e-2)
    assert fit.predicted_after_s == pytest.approx(step_s, rel=1e-3)
    figures = run_figures([], plan.job.microbatches, step_s)
    assert figures.stage_s == {} and figures.boundaries == {}

    kept = record_fit(db, run.id, task, plan.cluster, fit)
    assert newest_fit(db, plan.cluster) is not None
    assert newest_fit(db, plan.cluster).id == kept.id  # type: ignore[union-attr]
    spec = ClusterSpec.model_validate(fitted_spec(kept))
    assert spec.name == cluster.name  # the same cluster, refitted
    assert spec.device_types["cpu"].peak_tflops["fp32"] == pytest.approx(
        true.device_types["cpu"].peak_tflops["fp32"], rel=2e-3
    )
    # a task that could not be fitted keeps its reason, and is never the newest fit
    record_fit(db, run.id, task, plan.cluster, "the task timed no step")
    assert [r.reason for r in run_fits(db, run.id)] == ["the task timed no step", None]
    assert newest_fit(db, plan.cluster).id == kept.id  # type: ignore[union-attr]
    assert newest_fit(db, "another") is None


def _traced_task(
    db: Database, plan: Plan, true: ClusterSpec, slow: float, fit: bool = True
) -> tuple[int, int, float]:
    """A run of ``plan`` with one task of 5 steps laid out on ``true`` at ``slow`` (the first a
    warm-up), its steps timed in the metrics; kept fitted when ``fit``: (run, task, step)."""
    run = db.new_run(plan.model, plan.cluster, plan.model_dump(mode="json"))
    task = db.new_task(run.id, "train", {}).id
    step_s = iteration_s(plan, true, MODEL) * slow
    for step in range(5):
        add_step_traces(db, task, step, lay_out(plan, true, step, slow=slow), {})
        db.add_metric(task, step, 1.0, step_s * (10 if step == 0 else 1), 1.0)
    if fit:
        record_fit(
            db, run.id, task, plan.cluster, fit_task(db, run.id, task, plan, plan_cluster(), step_s)
        )
    return run.id, task, step_s


def plan_cluster() -> ClusterSpec:
    return load_spec(ClusterSpec, ROOT / "examples/clusters/local-cpu.yaml")


def test_a_fit_pools_the_earlier_runs_of_the_same_placement_and_only_those(
    tmp_path: Path,
) -> None:
    plan, cluster = demo()
    true = scaled(cluster, {"cpu": 0.5}, {"dc-0-dc-1": 0.2, "dc-1-dc-2": 0.4})
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    # another job on the same cluster (another batch): measured, fitted, never pooled
    other_job = plan.job.model_copy(update={"global_batch": 32, "micro_batch": 8})
    other = plan.model_copy(update={"job": other_job})
    _traced_task(db, other, true, slow=3.0)
    _, first, first_s = _traced_task(db, plan, true, slow=1.2)
    run, task, step_s = _traced_task(db, plan, true, slow=1.0, fit=False)

    alone = fit_task(db, run, task, plan, cluster, step_s, pool=1)
    assert alone.pooled == [] and alone.steps == 4
    assert alone.device_speed["cpu"] == pytest.approx(0.5, rel=2e-3)

    fit = fit_task(db, run, task, plan, cluster, step_s)
    assert fit.pooled == [first]  # the other job's task is not of this placement
    assert fit.steps == 8
    # the reference: the pooled step is the median of the two tasks' warm steps (4 each), and
    # a stage's compute the median of its 8 step values, half at each speed
    assert fit.measured_step_s == pytest.approx((step_s + first_s) / 2)
    for st in fit.stages:
        own = next(a for a in alone.stages if a.stage == st.stage)
        assert st.measured_s == pytest.approx(own.measured_s * (1 + 1.2) / 2, rel=1e-6)
    assert fit.predicted_after_s == pytest.approx(fit.measured_step_s, rel=1e-3)
    record = record_fit(db, run, task, plan.cluster, fit)
    assert json.loads(record.fit_json)["pooled"] == [first]
    # what `dmsc calibrate --from-run` and `dmsc plan --calibrated` say of it
    assert f"run {run}, task {task} pooled with task {first} (8 steps)" in describe(record)


def test_a_mixtures_measured_routing_is_priced_by_the_fit_not_taken_up_by_the_devices(
    tmp_path: Path,
) -> None:
    """moe-mini at dp = 2 x ep = 2 on devices half as fast, its busiest rank receiving 1.5 of
    an even share (the traces' expert tokens): the fit prices that routing and finds the
    devices' speed, 0.5 (within 1%: the mixture's routing, priced as passes over memory, does not
    scale quite as the rest); fitted at an even share, the devices took up the routing's wait
    (0.40 here, before 2026-12-05). The fit keeps the routing for ``dmsc plan --calibrated``."""
    moe = resolve_model("moe-mini")
    cluster = load_spec(ClusterSpec, ROOT / "examples/clusters/two-sites-cpu.yaml")
    job = JobSpec(global_batch=8, micro_batch=4, dp=2, ep=2, overlap_dp_comm=False)
    plan = plan_job(cluster, moe, job, fixed=True).plan
    true = scaled(cluster, {"cpu": 0.5}, {})
    routed = plan.job.model_copy(update={"expert_imbalance": 1.5})
    built = build_problem(true, moe, routed)
    op_s = (built.problem.compute_us[0][0] or 0) * 1e-6  # a micro-batch, the busiest rank's
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run = db.new_run(plan.model, plan.cluster, plan.model_dump(mode="json"))
    task = db.new_task(run.id, "train", {}).id
    step_s = iteration_s(plan.model_copy(update={"job": routed}), true, moe)
    for step in range(5):
        t0 = 100.0 * step
        spans = [("F", 0, t0, t0 + op_s / 3), ("B", 0, t0 + op_s / 3, t0 + op_s)]
        received = {0: 384, 1: 128}  # the busiest 1.5 of its 256 routed, in both mixtures
        comm = {
            (0, r): {"ep": {"s": 0.01, "routed": 256, "received": received[r], "busiest": 384}}
            for r in (0, 1)
        }
        add_step_traces(db, task, step, {(0, r): (spans, {}) for r in (0, 1)}, {}, comm=comm)
    fit = fit_task(db, run.id, task, plan, cluster, step_s)
    assert fit.expert_imbalance == pytest.approx(1.5)
    assert fit.span_speed["cpu"] == pytest.approx(0.5, rel=1e-2)  # 0.40 fitted at even
    record = record_fit(db, run.id, task, plan.cluster, fit)
    assert json.loads(record.fit_json)["expert_imbalance"] == pytest.approx(1.5)
