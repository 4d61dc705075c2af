"""A task's measured step is compared with the prediction for the job that ran (issue 29, 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_helpers import MEASURED_CPU

from dmsc.planner.solve import plan_job
from dmsc.runtime.compute.calibrate import calibrated_cluster
from dmsc.runtime.control.advisors.prediction import (
    predict_segments,
    prediction_for,
    routed,
    stored_routing,
)
from dmsc.runtime.control.training.params import TrainParams
from dmsc.runtime.control.training.report import TrainReport
from dmsc.runtime.control.training.resize import resized_plan
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, load_spec, resolve_model

CLUSTERS = Path(__file__).resolve().parents[4] / "examples" / "clusters"
LOCAL = CLUSTERS / "local-cpu.yaml"
FIGURES = MEASURED_CPU
JOB = JobSpec(global_batch=16, micro_batch=4, pp=3, schedule="1f1b", overlap_dp_comm=False)


def _cluster(template_path: Path = LOCAL, **changes: float) -> ClusterSpec:
    template = load_spec(ClusterSpec, template_path)
    return ClusterSpec.model_validate(calibrated_cluster(template, {**FIGURES, **changes}))


@pytest.fixture(scope="module")
def model() -> TransformerSpec:
    spec = resolve_model("gpt-mini")
    assert isinstance(spec, TransformerSpec)
    return spec


def test_the_plans_own_job_takes_the_plans_prediction(model: TransformerSpec) -> None:
    cluster = _cluster()
    plan = plan_job(cluster, model, JOB, fixed=True).plan
    for known in (cluster, None):
        p = prediction_for(plan, known, model, 16, 4, 1)
        assert p.step_s == plan.prediction.iteration_time_s and p.basis == "the plan's"


def test_another_batch_is_re_estimated_for_the_batch_that_ran(model: TransformerSpec) -> None:
    """`dmsc train --batch 32` was compared with the batch-16 prediction ("409% slower")."""
    cluster = _cluster()
    plan = plan_job(cluster, model, JOB, fixed=True).plan
    p = prediction_for(plan, cluster, model, 32, 4, 1)
    job32 = JobSpec.model_validate({**JOB.model_dump(), "global_batch": 32, "micro_batch": 8})
    assert p.step_s == plan_job(cluster, model, job32, fixed=True).plan.prediction.iteration_time_s
    assert p.step_s > 1.5 * plan.prediction.iteration_time_s
    assert "re-estimated for batch 32 in 4 micro-batches at dp 1" in p.basis
    # without the cluster spec there is nothing to re-estimate on: said so, no figure
    q = prediction_for(plan, None, model, 32, 4, 1)
    assert q.step_s is None and q.basis.startswith("not comparable:") and "batch 32" in q.basis
    assert q.as_json()["not_comparable"] == q.basis


def test_after_a_resize_the_job_that_ran_is_predicted(model: TransformerSpec) -> None:
    """A task that resized to dp 2 kept its 4 micro-batches per replica (of 2 sequences); the
    resized plan predicts 2 micro-batches of 4: another job."""
    cluster = _cluster(CLUSTERS / "three-sites-cpu.yaml")
    plan = plan_job(cluster, model, JOB, fixed=True).plan
    resized = resized_plan(plan, model, cluster, 2)
    assert resized.job.microbatches == 2
    p = prediction_for(resized, cluster, model, 16, 4, 2)
    ran = JobSpec.model_validate({**JOB.model_dump(), "micro_batch": 2, "dp": 2})
    assert p.step_s == plan_job(cluster, model, ran, fixed=True).plan.prediction.iteration_time_s
    assert p.step_s != resized.prediction.iteration_time_s


def test_a_recalibrated_spec_re_estimates_the_plans_job(model: TransformerSpec) -> None:
    plan = plan_job(_cluster(), model, JOB, fixed=True).plan
    slower = _cluster(block_s=0.06)
    p = prediction_for(plan, slower, model, 16, 4, 1)
    assert p.step_s is not None and p.step_s > 1.3 * plan.prediction.iteration_time_s
    assert "cluster spec now in force" in p.basis


def test_an_uncalibrated_cpu_is_not_compared(model: TransformerSpec) -> None:
    """The tiny Llama on the uncalibrated local-cpu predicted 8 ms against 70 ms measured: the
    spec's CPU figures are guesses, so there is nothing to compare with."""
    guesses = load_spec(ClusterSpec, LOCAL)
    plan = plan_job(guesses, model, JOB, fixed=True).plan
    p = prediction_for(plan, guesses, model, 16, 4, 1)
    assert p.step_s is None and "device type cpu" in p.basis and "dmsc calibrate" in p.basis


def test_the_train_line_names_what_it_compares_with() -> None:
    from dmsc.cli.render import prediction_words

    assert prediction_words(0.3, None, "not comparable: why") == "not comparable: why"
    assert prediction_words(0.3, 0.2, "the plan's") == (
        "predicted 200.0 ms: measured 50.0% slower than predicted"
    )
    words = prediction_words(0.3, 0.2, "re-estimated for batch 32 in 4 micro-batches at dp 1")
    assert words.startswith("predicted 200.0 ms, re-estimated for batch 32 in 4 micro-batches")


def test_a_task_that_changed_dp_is_compared_segment_by_segment(model: TransformerSpec) -> None:
    """A task that grew from dp 1 to dp 2 between two steps (or shrank after a lost node) was
    compared, all its steps together, with the final dp's prediction only. Each segment of one
    dp is now compared with the prediction for its own dp and plan; the whole with none."""
    cluster = _cluster(CLUSTERS / "three-sites-cpu.yaml")
    plan = plan_job(cluster, model, JOB, fixed=True).plan
    resized = resized_plan(plan, model, cluster, 2)
    params = TrainParams(steps=6, batch=16, microbatches=4, checkpoint_every=0,
                         late_policy="wait", grad_wait_s=1.0)  # fmt: skip
    report = TrainReport(6)
    report.segment(0, 1, plan)
    for dt in (0.30, 0.31, 0.29):
        report.timed(dt)
    report.segment(3, 2, resized)  # the loop's resize before step 3
    for dt in (0.20, 0.21, 0.19):
        report.timed(dt)
    predict_segments(report, resized, cluster, model, params)
    first, second = report.as_json()["segments"]
    assert (first["first_step"], first["dp"], first["steps"]) == (0, 1, 3)
    assert first["median_step_s"] == 0.30 and second["median_step_s"] == 0.20
    assert first["predicted_step_s"] == plan.prediction.iteration_time_s  # dp 1's own plan
    assert first["prediction"] == "the plan's"
    assert second == {
        "first_step": 3,
        "dp": 2,
        "steps": 3,
        "median_step_s": 0.20,
        **prediction_for(resized, cluster, model, 16, 4, 2).as_json(),
    }
    whole = report.as_json()
    assert whole["predicted_step_s"] is None and whole["median_step_s"] == 0.21
    assert whole["not_comparable"].startswith("not comparable: the task ran at dp 1 -> 2")
    # a task that kept its dp: one segment, compared as before, with the plan's prediction
    kept = TrainReport(3)
    kept.segment(0, 1, plan)
    kept.timed(0.3)
    predict_segments(kept, plan, cluster, model, params)
    assert kept.as_json()["predicted_step_s"] == plan.prediction.iteration_time_s
    assert kept.as_json()["segments"][0]["predicted_step_s"] == plan.prediction.iteration_time_s


def test_the_train_output_shows_each_segment_against_its_prediction() -> None:
    from dmsc.cli.tasks import segment_lines
    from dmsc.runtime.transport.replies import SegmentState, TrainReply

    seg = [
        SegmentState(first_step=0, dp=2, steps=4, median_step_s=0.3, predicted_step_s=0.25,
                     prediction="the plan's"),
        SegmentState(first_step=4, dp=1, steps=4, median_step_s=0.5, predicted_step_s=None,
                     prediction="not comparable: why", not_comparable="not comparable: why"),
    ]  # fmt: skip
    reply = TrainReply(
        task=1, state="done", model_version=1, steps=8, loss_first=5.0, loss_last=4.0,
        val_start=5.0, val_end=4.0, median_step_s=0.4, tokens_per_s=100.0, recoveries=[],
        steps_lost=0, restarts=0, skipped=[], sync={}, predicted_step_s=None,
        prediction="not comparable: the task ran at dp 2 -> 1", not_comparable="x", segments=seg,
    )  # fmt: skip
    assert segment_lines(reply) == [
        "  from step 0 at dp 2: 4 steps, step 300.0 ms (predicted 250.0 ms: measured 20.0% "
        "slower than predicted)",
        "  from step 4 at dp 1: 4 steps, step 500.0 ms (not comparable: why)",
    ]
    assert segment_lines(reply.model_copy(update={"segments": seg[:1]})) == []


def test_a_re_estimate_keeps_the_placement_that_ran(model: TransformerSpec) -> None:
    """On a fit, `dmsc plan --calibrated` kept the measured placement (its margin) while the
    search re-cut the layers for a predicted 7% gain; the task of the kept plan was compared
    with the search's figure, for a placement that never ran (recalibration run 2: 221.7 ms
    beside the kept plan's 239.4)."""
    from dmsc.planner.measured_choice import prefer_measured
    from dmsc.planner.recalibrate import iteration_s, scaled

    spec = load_spec(ClusterSpec, LOCAL).model_dump()
    spec["device_types"]["cpu"]["op_overhead_us"] = 30.0  # measured (else not compared)
    local = ClusterSpec.model_validate(spec)
    measured = plan_job(local, model, JOB, fixed=True).plan
    fit = scaled(local, {"cpu": 1.0}, {"dc-0-dc-1": 0.13, "dc-1-dc-2": 0.12})
    found = plan_job(fit, model, JOB, fixed=True)
    kept, why = prefer_measured(found, measured, fit, model)
    assert why is not None and "kept the measured plan's placement" in why
    searched = found.plan.prediction.iteration_time_s
    assert searched < 0.99 * kept.plan.prediction.iteration_time_s
    p = prediction_for(measured, fit, model, 16, 4, 1)
    assert p.step_s == pytest.approx(kept.plan.prediction.iteration_time_s)
    assert "cluster spec now in force" in p.basis
    # another batch on the same replicas: the placement that ran, not the search's
    job32 = measured.job.model_copy(update={"global_batch": 32, "micro_batch": 8})
    q = prediction_for(measured, fit, model, 32, 4, 1)
    assert q.step_s == iteration_s(measured.model_copy(update={"job": job32}), fit, model)
    assert q.step_s != plan_job(fit, model, job32, fixed=True).plan.prediction.iteration_time_s


def test_a_task_with_another_sync_than_the_plans_is_re_estimated_with_its_own(
    model: TransformerSpec,
) -> None:
    """A task that trained with `--sync diloco:10 --compress int8` on a plan made for every-step
    averaging was compared with the every-step prediction, labelled "the plan's"."""
    from dmsc.planner.recalibrate import iteration_s
    from dmsc.runtime.control.advisors.prediction import task_prediction
    from dmsc.runtime.transport.messages import SyncSettings

    cluster = _cluster(CLUSTERS / "three-sites-cpu.yaml")
    job = JOB.model_copy(update={"dp": 2})
    plan = plan_job(cluster, model, job, fixed=True).plan
    assert plan.job.sync.mode == "every-step" and plan.job.microbatches == 2
    planned = plan.prediction.iteration_time_s
    # the plan's own sync, named or not: the plan's figure
    for same in (None, SyncSettings()):
        assert prediction_for(plan, cluster, model, 16, 2, 2, same).basis == "the plan's"
    local = SyncSettings(mode="diloco", inner_steps=10, compress="int8")
    p = prediction_for(plan, cluster, model, 16, 2, 2, local)
    sync = {"mode": "diloco", "inner_steps": 10, "compress": "int8"}
    ran = JobSpec.model_validate({**plan.job.model_dump(), "sync": sync})
    assert p.step_s == iteration_s(plan.model_copy(update={"job": ran}), cluster, model)
    assert p.step_s is not None and p.step_s < planned  # a tenth of the exchanges, int8
    # by part, for the per-mode table: that job's figures, adding up to its step
    assert p.breakdown_s is not None and sum(p.breakdown_s.values()) == pytest.approx(p.step_s)
    # a round of 10 steps: a tenth of every step's int8 exchange (each exposed whole, its
    # codec's passes included: on this CPU cluster they cost more than the bytes they save)
    every = prediction_for(plan, cluster, model, 16, 2, 2, SyncSettings(compress="int8"))
    assert every.breakdown_s is not None
    # and a round forms its pseudo-gradient (20 bytes an element) where every step flattens
    # its gradients, which become views of the answer (8: codec_work.around_bytes)
    tenth = every.breakdown_s["dp_comm"] / 10
    assert tenth < p.breakdown_s["dp_comm"] < tenth * 1.2
    own = prediction_for(plan, cluster, model, 16, 2, 2)
    assert own.breakdown_s == plan.prediction.breakdown_s
    assert p.basis == (
        "re-estimated for batch 16 in 2 micro-batches at dp 2, sync diloco of 10 steps, compress "
        "int8 (the plan's job: batch 16 in 2 micro-batches at dp 2, sync every-step, compress none)"
    )
    # as the task's stored parameters hold it
    params = TrainParams(steps=4, batch=16, microbatches=2, checkpoint_every=0,
                         late_policy="wait", grad_wait_s=1.0, sync=local)  # fmt: skip
    assert task_prediction(plan, cluster, model, params.as_json()) == p
    # without the cluster spec: not comparable, naming both syncs
    q = prediction_for(plan, None, model, 16, 2, 2, local)
    assert q.step_s is None and "sync diloco of 10 steps, compress int8, and without" in q.basis


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"aggregator": "median"}, "the median aggregator"),
        ({"secure": True}, "secure aggregation"),
        ({"privacy_clip": 1.0, "privacy_noise": 0.5}, "central differential privacy"),
    ],
)
def test_replicas_agreeing_through_the_leader_are_compared_with_the_leaders_star(
    model: TransformerSpec, settings: dict[str, object], words: str
) -> None:
    """With a robust aggregator, central DP or secure aggregation the replicas agree through the
    stage leader: the task is compared with the job re-estimated with the leader's star
    (``via: leader``), not with the all-reduce's prediction as "the plan's" (as it was at
    first), nor with nothing ("not comparable", as it was while the star was unpriced)."""
    from dmsc.runtime.transport.messages import SyncSettings

    cluster = _cluster(CLUSTERS / "three-sites-cpu.yaml")
    job = JOB.model_copy(update={"dp": 2})
    plan = plan_job(cluster, model, job, fixed=True).plan
    star = SyncSettings.model_validate(settings)
    p = prediction_for(plan, cluster, model, 16, 2, 2, star)
    assert p.step_s is not None and p.basis.startswith("re-estimated for ")
    assert f"through the stage leader ({words})" in p.basis
    # the same job by the collective: the same compute and pipeline, a faster exchange
    ring = prediction_for(plan, cluster, model, 16, 2, 2, SyncSettings())
    assert p.breakdown_s is not None and ring.breakdown_s is not None
    assert p.breakdown_s["dp_comm"] > ring.breakdown_s["dp_comm"] > 0
    for part in ("compute", "pp_comm", "optimizer"):
        assert p.breakdown_s[part] == pytest.approx(ring.breakdown_s[part])
    # one replica has no exchange: the plan's job
    one = plan_job(cluster, model, JOB, fixed=True).plan
    assert prediction_for(one, cluster, model, 16, 4, 1, star).basis == "the plan's"


def test_the_leaders_rule_is_priced_in_the_re_estimate(model: TransformerSpec) -> None:
    """A task's aggregator reaches the re-estimate (``SyncSpec.aggregator``), and so do its
    central privacy and its secure aggregation: over the same star of 2 replicas, secure
    aggregation's masking and unmasking (340 bytes an element, and a mask) cost more than the
    median's passes (124); before 2026-12-04 it was priced as the plain mean (36), less."""
    from dmsc.runtime.control.advisors.prediction import ran_sync
    from dmsc.runtime.transport.messages import SyncSettings

    cluster = _cluster(CLUSTERS / "three-sites-cpu.yaml")
    plan = plan_job(cluster, model, JOB.model_copy(update={"dp": 2}), fixed=True).plan
    median = SyncSettings(aggregator="median")
    assert ran_sync(plan, median, 2).aggregator == "median"
    assert ran_sync(plan, SyncSettings(secure=True), 2).aggregator == "mean"
    assert ran_sync(plan, SyncSettings(secure=True), 2).secure
    assert not ran_sync(plan, median, 2).secure
    # central privacy reaches it too: clipped, and noised where the multiplier is above 0
    clip = SyncSettings(privacy_clip=1.0)
    noise = SyncSettings(privacy_clip=1.0, privacy_noise=0.8)
    assert ran_sync(plan, clip, 2).privacy == "clip"
    assert ran_sync(plan, noise, 2).privacy == "noise"
    assert ran_sync(plan, median, 2).privacy == "none"
    noised = prediction_for(plan, cluster, model, 16, 2, 2, noise).breakdown_s
    clipped = prediction_for(plan, cluster, model, 16, 2, 2, clip).breakdown_s
    assert noised is not None and clipped is not None
    assert noised["dp_comm"] > clipped["dp_comm"]
    by_median = prediction_for(plan, cluster, model, 16, 2, 2, median)
    by_sum = prediction_for(plan, cluster, model, 16, 2, 2, SyncSettings(secure=True))
    assert by_median.breakdown_s is not None and by_sum.breakdown_s is not None
    assert by_sum.breakdown_s["dp_comm"] > by_median.breakdown_s["dp_comm"]


MOE_JOB = JobSpec(global_batch=8, micro_batch=4, dp=2, ep=2, schedule="1f1b")


def test_a_mixtures_task_is_compared_at_the_routing_it_measured() -> None:
    """moe-mini's routing measured 1.28 of an even share at ep = 2, and its task was compared
    with the plan's prediction at an even share: the routing's cost read as the devices'."""
    moe = resolve_model("moe-mini")
    assert isinstance(moe, TransformerSpec)
    cluster = _cluster(CLUSTERS / "two-sites-cpu.yaml")
    plan = plan_job(cluster, moe, MOE_JOB, fixed=True).plan
    assert plan.job.expert_imbalance == 1.0
    p = prediction_for(plan, cluster, moe, 8, 1, 2, None, 1.283)
    at = MOE_JOB.model_copy(update={"expert_imbalance": 1.28})
    # the plan's placement kept, priced at the routing measured (as fit_task prices it)
    from dmsc.planner.recalibrate import iteration_s

    ran = plan.model_copy(update={"job": at})
    assert p.step_s == iteration_s(ran, cluster, moe)
    assert p.step_s > plan.prediction.iteration_time_s
    assert p.breakdown_s is not None
    assert p.breakdown_s["ep_comm"] > plan.prediction.breakdown_s["ep_comm"]
    assert "routing 1.28 of an even share" in p.basis
    assert "(the plan's job: batch 8 in 1 micro-batches at dp 2, routing 1.00" in p.basis
    # within 2% of the plan's routing, or none measured: the plan's own figure
    for routing in (None, 1.015, 0.9):
        q = prediction_for(plan, cluster, moe, 8, 1, 2, None, routing)
        assert q.step_s == plan.prediction.iteration_time_s and q.basis == "the plan's"
    # without the cluster spec it cannot be priced again: said so
    r = prediction_for(plan, None, moe, 8, 1, 2, None, 1.283)
    assert r.step_s is None and "routing 1.28 of an even share" in r.basis


def test_the_routing_is_taken_between_even_and_one_ranks_all() -> None:
    moe = resolve_model("moe-mini")
    assert isinstance(moe, TransformerSpec)
    plan = plan_job(_cluster(CLUSTERS / "two-sites-cpu.yaml"), moe, MOE_JOB, fixed=True).plan
    assert routed(plan, 2.7) == 2.0  # at ep = 2 no rank gets more than all
    assert routed(plan, 1.2834) == 1.28
    assert routed(plan, 1.01) is None and routed(plan, None) is None
    dense = plan.model_copy(update={"job": JOB})
    assert routed(dense, 1.5) is None  # no expert parallelism: nothing routed


def test_a_finished_tasks_routing_is_read_from_its_result() -> None:
    from dmsc.data.db import TaskRecord

    def task(result: object) -> TaskRecord:
        return TaskRecord(kind="train", result_json=json.dumps(result))

    assert stored_routing(task({"expert_imbalance": {"measured": 1.4, "planned": 1.0}})) == 1.4
    assert stored_routing(task({"steps": 3})) is None
    assert stored_routing(task({"expert_imbalance": "garbled"})) is None
    assert stored_routing(TaskRecord(kind="train", result_json=None)) is None
    assert stored_routing(TaskRecord(kind="train", result_json="{not json")) is None


def test_a_running_mixtures_segments_are_compared_at_the_routing_measured_so_far() -> None:
    """The dashboard's running segments (TaskPredictions.segments) read the routing the task's
    traces measured so far, as the task's result will (status.finished); a dense plan's
    never asks."""
    from dmsc.runtime.control.advisors.prediction import TaskPredictions

    moe = resolve_model("moe-mini")
    assert isinstance(moe, TransformerSpec)
    cluster = _cluster(CLUSTERS / "two-sites-cpu.yaml")
    plan = plan_job(cluster, moe, MOE_JOB, fixed=True).plan
    asked: list[int] = []

    def routing(task: int) -> float | None:
        asked.append(task)
        return 1.4

    params = TrainParams(
        steps=4, batch=8, microbatches=1, checkpoint_every=0, late_policy="wait", grad_wait_s=1.0
    )
    predictions = TaskPredictions(routing)
    report = TrainReport(4, first_step=0)
    predictions.begin(7, params, report)
    report.segment(0, 2, plan)
    report.timed(0.1)
    (seg,) = predictions.segments(7, plan, cluster, moe) or []
    want = prediction_for(plan, cluster, moe, 8, 1, 2, None, 1.4)
    assert seg["predicted_step_s"] == want.step_s and "routing 1.40" in seg["prediction"]
    assert asked == [7]
    dense = plan_job(cluster, resolve_model("gpt-mini"), MOE_JOB.model_copy(update={"ep": 1}))
    predictions.segments(7, dense.plan, cluster, resolve_model("gpt-mini"))  # type: ignore[arg-type]
    assert asked == [7]  # no mixture: its traces are not read
