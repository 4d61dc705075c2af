"""The control loop grows a training task's dp between two of its steps (the policy's ``elastic``
range on a broken step-time objective): checkpoint, re-plan, resume. The losses are those of a
run that never resized (as tests/integration/test_resize.py compares them), and the decision's
row says why and when it was made."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import control_plane, one_box, wait_for

from dmsc.data.control_records import decisions
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.loop.objectives import Policy
from dmsc.runtime.control.loop.runner import ControlLoop
from dmsc.runtime.control.loop.tick import LoopConfig
from dmsc.runtime.transport.messages import TrainRequest
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

pytestmark = pytest.mark.integration

STEPS = 12


def _losses(cp: Any, task: int) -> list[float]:
    return [m.loss for m in cp.db.metrics(task)]


def test_the_loop_grows_dp_mid_task_and_trains_as_without(tmp_path: Path) -> None:
    cluster = load_spec(ClusterSpec, one_box(tmp_path, 4))
    job = JobSpec(global_batch=8, micro_batch=2, pp=2, dp=1)
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    # every step breaks the objective; one tick confirms a move; dp may grow to 2, at a cost
    # the task's few steps pay back
    elastic = {"dp_max": 2, "cost_s": 0.1}
    policy = Policy.model_validate(
        {"slos": {"step_time_s": 1e-6}, "elastic": elastic, "confirm_ticks": 1}
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with control_plane(plan, tmp_path / "a") as cp:  # the run that never resizes
        want = _losses(cp, cp.train(TrainRequest(steps=STEPS))["task"])
    with control_plane(plan, tmp_path / "b") as cp:
        cp.cluster = cluster
        loop = ControlLoop(cp, LoopConfig(policy), 1.0, logging.getLogger("test"), modules=[])
        ran: dict[str, Any] = {}
        trainer = threading.Thread(target=lambda: ran.update(cp.train(TrainRequest(steps=STEPS))))
        trainer.start()
        try:
            task = wait_for(
                lambda: next((t.id for t in cp.db.tasks(cp.run.id) if cp.db.metrics(t.id)), 0),
                60,
                "the task's first step",
            )
            wait_for(lambda: len(cp.db.metrics(task)) >= 3, 60, "three steps to judge")
            loop.once()  # the tick the test drives: its decision is handed to the task
        finally:
            trainer.join(timeout=120)
        assert ran["state"] == "done", ran
        rows = [d for d in decisions(cp.db, cp.run.id, 10) if d.kind == "resize-dp"]
        assert len(rows) == 1, [(d.verdict, d.reason, d.outcome) for d in rows]
        assert cp.deployment.layout.replicas == 2 and cp.plan.job.dp == 2
        got = _losses(cp, task)
        events = [(e.action, e.replicas_after) for e in cp.db.scale_events(cp.run.id)]
        # the session handed its report to the dashboard's reader as it ran: the same segments
        live = cp._predictions.segments(task, cp.plan, cp.cluster, cp.model) or []
    row = rows[0]
    assert (row.verdict, row.target) == ("apply", "dp 1->2")
    assert "median step" in row.reason and "grows dp within 1..2" in row.reason, row.reason
    assert row.outcome.startswith("applied before step"), row.outcome
    made_at = int(row.outcome.split("before step ")[1].split(",")[0])
    assert 3 <= made_at < STEPS  # between two of the task's steps
    assert events == [("loop-dp", 2)]
    # the steps at each dp, each compared with its own prediction; the whole with none
    segments = [(s["first_step"], s["dp"], s["steps"]) for s in ran["segments"]]
    assert segments == [(0, 1, made_at), (made_at, 2, STEPS - made_at)], ran["segments"]
    assert all(s["prediction"] for s in ran["segments"]), ran["segments"]
    assert live == ran["segments"], (live, ran["segments"])
    assert ran["not_comparable"].startswith("not comparable: the task ran at dp 1 -> 2"), ran
    assert len(got) == len(want) == STEPS
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4, (got, want)
