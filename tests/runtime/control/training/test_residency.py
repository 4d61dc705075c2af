"""The runtime's residency refusals (issue 33, point 5), each naming the rule: a training task
whose data a reading stage may not read, or whose checkpoints the home may not store (the
control plane, in this process, without workers: its check runs before a task queues); a move
of the deployment to a forbidden datacenter (the control loop's and ``dmsc replan``'s
``apply_move``, on a measured run); an export of a resident model version at the home."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from modules_helpers import fill_run, make_plan, two_sites
from runtime_helpers import local_plan

from dmsc.data.db import Database, ModelVersionRecord
from dmsc.data.traces import step_traces
from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors.base import Proposal
from dmsc.runtime.control.loop.moves import apply_move
from dmsc.runtime.control.plane import ControlPlane
from dmsc.runtime.control.serving.model_store import export_version
from dmsc.runtime.control.training.residency import (
    check_move,
    check_task,
    holding_datacenters,
    reading_datacenters,
)
from dmsc.runtime.transport.messages import TrainRequest
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.spec import ClusterSpec
from dmsc.spec.residency import ResidencyError, ResidencySpec, record_residency, recorded_residency

EXAMPLES = Path(__file__).resolve().parents[4] / "examples" / "clusters"


def _ruled(cluster: ClusterSpec, residency: dict[str, object]) -> ClusterSpec:
    data = cluster.model_dump(mode="json", exclude_none=True)
    return ClusterSpec.model_validate({**data, "residency": residency})


def _local(residency: dict[str, object]) -> ClusterSpec:
    from dmsc.spec import load_spec

    return _ruled(load_spec(ClusterSpec, EXAMPLES / "local-cpu.yaml"), residency)


def test_a_rule_on_derived_data_judges_every_stage_a_task_sends_activations_to() -> None:
    from dmsc.planner.solve import plan_job
    from dmsc.spec import JobSpec, load_spec, resolve_model

    cluster = load_spec(ClusterSpec, EXAMPLES / "local-cpu.yaml")
    job = JobSpec(global_batch=8, micro_batch=2, pp=3)
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    readers, holders = reading_datacenters(plan), holding_datacenters(plan)
    middle = sorted(set(holders) - set(readers))
    assert middle, "the middle stage reads no tokens: it only receives activations"
    rule = {"name": "clinic", "datasets": ["/srv/clinic"], "datacenters": readers}
    check_task(_local({"rules": [rule]}), plan, "/srv/clinic/a.txt", "the task")  # reads only
    strict = _local({"rules": [{**rule, "derived": True}]})
    with pytest.raises(ResidencyError, match=rf"'clinic'.*activations and gradients.*{middle[0]}"):
        check_task(strict, plan, "/srv/clinic/a.txt", "the task")
    check_task(strict, plan, "/srv/public/a.txt", "the task")  # another dataset: no rule


def test_a_task_is_checked_where_its_stages_read_and_store() -> None:
    plan = local_plan()  # gpt-mini, two stages on local-cpu's datacenters
    readers = reading_datacenters(plan)
    assert readers == holding_datacenters(plan) and len(readers) == 2
    data_rule = {"name": "clinic", "datasets": ["/srv/clinic"], "datacenters": readers[:1]}
    cluster = _local({"rules": [data_rule]})
    check_task(cluster, plan, "/srv/public/a.txt", "the task")  # no rule names it
    with pytest.raises(ResidencyError, match=rf"'clinic'.*/srv/clinic/a.txt.*{readers[1]}"):
        check_task(cluster, plan, "/srv/clinic/a.txt", "the task")
    store = {"name": "weights-home", "models": [plan.model], "datacenters": readers}
    others = [dc.name for dc in cluster.datacenters if dc.name not in readers]
    home = _local({"home": others[0], "rules": [store]})
    with pytest.raises(ResidencyError, match=r"'weights-home'.*checkpoints") as info:
        check_task(home, plan, None, "the task")
    assert info.value.rule == "weights-home"
    check_task(_local({"home": readers[0], "rules": [store]}), plan, None, "the task")


def test_a_move_to_a_forbidden_datacenter_is_refused() -> None:
    plan = local_plan()
    cluster = _local(
        {
            "rules": [
                {"name": "stay", "models": ["gpt-*"], "datacenters": [plan.stages[0].datacenter]}
            ]
        }
    )
    with pytest.raises(ResidencyError, match=rf"'stay'.*{plan.stages[1].datacenter}"):
        check_move(cluster, plan, "the move of stage 1")
    check_move(None, plan, "the move of stage 1")


def test_the_control_plane_refuses_the_task_before_it_queues(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "clinic").mkdir(parents=True)
    (root / "clinic" / "notes.txt").write_text("x" * 20_000)
    plan = local_plan()
    rule = {"name": "clinic-notes", "datasets": [str(root / "clinic")],
            "datacenters": [plan.stages[0].datacenter]}  # fmt: skip
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    cp = ControlPlane(plan, db, home=tmp_path, data_roots=[root], cluster=_local({"rules": [rule]}))
    try:
        with pytest.raises(BadRequest, match=r"residency rule 'clinic-notes'"):
            cp.train_params(TrainRequest(steps=1, data=str(root / "clinic")))
        assert db.tasks(cp.run.id) == []  # refused before it queued
    finally:
        cp.stopped.set()
        cp.deployment.shutdown()


@dataclass
class _Plane:
    """What ``apply_move`` reads of a control plane."""

    plan: Plan
    cluster: ClusterSpec | None

    def relayout(self, plan: Plan, action: str, why: str) -> None:
        raise AssertionError("a move the rules forbid was applied")


def test_apply_move_names_the_rule_that_leaves_no_placement(tmp_path: Path) -> None:
    cluster = two_sites()
    plan = make_plan(cluster)  # pp=2, dp=2: both sites (two devices each)
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    _, task = fill_run(db, cluster, plan, steps=3)
    rule = {"name": "only-a", "models": [plan.model], "datacenters": ["site-a"]}
    proposal = Proposal("paths", "move-stage", "stage 1", "site-b's link is slow")
    with pytest.raises(BadRequest, match=r"residency rule 'only-a'"):
        apply_move(
            _Plane(plan, _ruled(cluster, {"rules": [rule]})), step_traces(db, task), proposal
        )


def test_an_export_at_a_forbidden_home_is_refused(tmp_path: Path) -> None:
    plan = local_plan()
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run = db.new_run(plan.model, plan.cluster, json.loads(plan.model_dump_json()))
    version = db.add(ModelVersionRecord(run_id=run.id, step=1, path=str(tmp_path), sha256=""))
    residency = ResidencySpec.model_validate(
        {"home": "dc-2", "rules": [{"name": "v-stays", "models": [f"{plan.model}@{version.id}"],
                                    "datacenters": ["dc-0"]}]}
    )  # fmt: skip
    record_residency(tmp_path, residency)  # what dmsc up --cluster leaves for dmsc export
    assert recorded_residency(tmp_path) == residency
    with pytest.raises(ResidencyError, match=rf"'v-stays'.*export of version {version.id}"):
        export_version(db, version.id, tmp_path / "out", recorded_residency(tmp_path))
    assert not (tmp_path / "out").exists()
    record_residency(tmp_path, None)
    assert recorded_residency(tmp_path) is None
