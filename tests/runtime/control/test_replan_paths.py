"""``dmsc replan --dry-run`` and ``dmsc replan`` decide the same way on the same prediction
(issue 29, point 5): one code path (:func:`dmsc.runtime.control.replanning.decide_on`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from modules_helpers import TWO_SITES, fill_run, make_plan

from dmsc.data.db import Database
from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors.prediction import prediction_for
from dmsc.runtime.control.replanning import replan_now
from dmsc.runtime.transport.messages import ReplanRequest
from dmsc.spec import ClusterSpec, TransformerSpec, resolve_model


def measured_two_sites() -> ClusterSpec:
    """two-sites-cpu as measured (a kernel overhead of its own: what dmsc calibrate writes)."""
    data = yaml.safe_load(TWO_SITES.read_text())
    data["device_types"]["cpu"]["op_overhead_us"] = 5.0
    return ClusterSpec.model_validate(data)


@dataclass
class Plane:
    """What replan_now reads of a control plane."""

    db: Database
    plan: Plan
    cluster: ClusterSpec
    run: Any
    model: TransformerSpec = field(default_factory=lambda: resolve_model("gpt-mini"))  # type: ignore[arg-type,return-value]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def relayout(self, plan: Plan, action: str, why: str) -> None:
        raise AssertionError("no move expected")


@dataclass
class Run:
    id: int


def _plane(tmp_path: Path, step_ratio: float) -> tuple[Plane, int]:
    cluster = measured_two_sites()
    plan = make_plan(cluster)
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    slow = step_ratio * plan.prediction.iteration_time_s
    run_id, task = fill_run(db, cluster, plan, steps=20, step_s=lambda s: slow)
    return Plane(db, plan, cluster, Run(run_id)), task


def _decisions(doc: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    return [(d["module"], d["target"], d["decision"], d["why"]) for d in doc["decisions"]]


def test_a_dry_run_decides_what_the_real_one_does(tmp_path: Path) -> None:
    cp, _ = _plane(tmp_path, 3.0)
    dry = replan_now(cp, ReplanRequest(dry_run=True))
    real = replan_now(cp, ReplanRequest(dry_run=False))
    assert (
        dry["predicted_step_s"] == real["predicted_step_s"] == cp.plan.prediction.iteration_time_s
    )
    assert _decisions(dry) == _decisions(real)
    (breach,) = [d for d in real["decisions"] if d["target"] == "slo:step-time"]
    assert breach["decision"] == "raise" and len(real["exceptions_raised"]) == 1
    # raised within the hour: the dry run no longer says it would raise it, nor does the real
    again_dry = replan_now(cp, ReplanRequest(dry_run=True))
    again = replan_now(cp, ReplanRequest(dry_run=False))
    assert _decisions(again_dry) == _decisions(again) and again["exceptions_raised"] == []
    (noted,) = [d for d in again["decisions"] if d["target"] == "slo:step-time"]
    assert noted["decision"] == "note" and f"task {real['exceptions_raised'][0]}" in noted["why"]


def test_the_step_objective_compares_the_job_that_ran(tmp_path: Path) -> None:
    """A task of batch 32 measured at 3x the batch-16 prediction is within 2x of its own."""
    cp, task = _plane(tmp_path, 3.0)
    cp.db.set_task_params(task, {"steps": 1000, "first_step": 0, "batch": 32, "microbatches": 4})
    want = prediction_for(cp.plan, cp.cluster, cp.model, 32, 4, cp.plan.job.dp)
    assert want.step_s is not None and want.step_s > 1.5 * cp.plan.prediction.iteration_time_s
    dry = replan_now(cp, ReplanRequest(dry_run=True))
    real = replan_now(cp, ReplanRequest(dry_run=False))
    for doc in (dry, real):
        assert doc["predicted_step_s"] == want.step_s and "batch 32" in doc["prediction"]
        assert "slo:step-time" not in {d["target"] for d in doc["decisions"]}
    assert real["exceptions_raised"] == []


def test_the_dry_run_command_asks_the_running_control_plane(monkeypatch: Any, capsys: Any) -> None:
    """With a control plane up, `dmsc replan --dry-run` is its answer (the deployment's current
    plan), not an offline reading of the database's first plan."""
    import json

    from dmsc.cli import modules
    from dmsc.runtime.transport.replies import ReplanReply

    asked: list[tuple[str, dict[str, Any]]] = []
    answer = {"run": 1, "dry_run": True, "decide_s": 0.01, "decisions": []}
    answer |= {"task": None, "steps_measured": 0, "median_step_s": None, "remaining_steps": None}
    answer |= {"predicted_step_s": None, "prediction": "no task", "not_comparable": "no task"}

    class Client:
        def replan(self, req: ReplanRequest) -> ReplanReply:
            asked.append(("Replan", req.model_dump()))
            return ReplanReply.model_validate(answer)

    monkeypatch.setattr(modules, "_running_plane", lambda: Client())
    modules.replan(dry_run=True, cluster=None, run=None, as_json=True)
    assert asked == [("Replan", {"dry_run": True, "threshold": 0.05, "horizon_steps": 1000})]
    assert json.loads(capsys.readouterr().out)["decide_s"] == 0.01
