"""A training task's sync settings checked against its plan before it queues."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_helpers import local_plan

from dmsc.runtime.control.training.params import task_params
from dmsc.runtime.transport.messages import SyncSettings, TrainRequest
from dmsc.spec.sync import SyncSpec


def _req(**sync) -> TrainRequest:  # type: ignore[no-untyped-def]
    late = sync.pop("late_policy", "wait")
    data = sync.pop("data", None)
    return TrainRequest(steps=10, late_policy=late, data=data, sync=SyncSettings(**sync))


@pytest.mark.parametrize(
    ("req", "reason"),
    [
        (_req(mode="diloco", inner_steps=5, late_policy="restart"), "use wait or skip"),
        (_req(mode="fedavg", inner_steps=2, aggregator="krum"), "sync.aggregator"),
        (_req(mode="fedavg", inner_steps=2, local_data=True), "directory of files"),
    ],
    ids=["restart-in-rounds", "krum-with-one-replica", "local-data-without-files"],
)
def test_an_impossible_sync_is_refused_with_its_field(req: TrainRequest, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        task_params(req, local_plan())


def test_a_good_sync_is_kept_in_the_stored_parameters(tmp_path: Path) -> None:
    req = _req(mode="diloco", inner_steps=5, compress="int8", local_data=True, data=str(tmp_path))
    params = task_params(req, local_plan())
    stored = params.as_json()
    assert stored["sync"]["compress"] == "int8"
    assert TrainRequest(**stored).sync == req.sync  # a rerun after a restart reads it back


def test_a_task_without_a_sync_of_its_own_takes_the_plans() -> None:
    plan = local_plan()
    planned = SyncSpec(mode="diloco", inner_steps=20, compress="int8")
    plan = plan.model_copy(update={"job": plan.job.model_copy(update={"sync": planned})})
    got = task_params(TrainRequest(steps=40), plan).sync
    assert (got.mode, got.inner_steps, got.compress) == ("diloco", 20, "int8")
    own = task_params(_req(mode="fedavg", inner_steps=5), plan).sync
    assert (own.mode, own.inner_steps) == ("fedavg", 5)  # the task's own wins
    assert task_params(_req(), plan).sync.mode == "every-step"  # said so: every step


def test_a_tensor_parallel_plan_takes_every_sync_mode_and_any_dp() -> None:
    plan = local_plan()
    plan = plan.model_copy(update={"job": plan.job.model_copy(update={"tp": 2, "dp": 2})})
    assert task_params(TrainRequest(steps=10, batch=8), plan).sync.mode == "every-step"
    assert task_params(_req(mode="diloco", inner_steps=5), plan).sync.mode == "diloco"
    assert task_params(_req(compress="int8"), plan).sync.compress == "int8"
    assert task_params(_req(secure=True), plan).sync.secure
    assert task_params(_req(mode="fedavg", inner_steps=2, privacy_clip=1.0), plan).sync.outer
    staged = plan.model_copy(update={"job": plan.job.model_copy(update={"pp": 2})})
    assert task_params(_req(task_heads=True), staged).sync.task_heads
    assert task_params(TrainRequest(steps=10, batch=8, dp=1), plan).dp == 1  # a resize


def test_an_expert_parallel_plan_takes_plain_averaging_waiting_at_its_own_dp_only() -> None:
    # every replica of an expert-parallel group exchanges tokens in each step: none can be
    # left out of its average, and the star or a round mode would average one share's
    # experts with another's (dmsc.runtime.compute.ep_worker.task_problem)
    plan = local_plan()
    plan = plan.model_copy(update={"job": plan.job.model_copy(update={"dp": 2, "ep": 2})})
    assert task_params(TrainRequest(steps=10, batch=8), plan).late_policy == "wait"
    with pytest.raises(ValueError, match="sync: at ep = 2 the replicas average every step"):
        task_params(_req(mode="diloco", inner_steps=5), plan)
    with pytest.raises(ValueError, match="sync: at ep = 2"):
        task_params(_req(compress="int8"), plan)
    with pytest.raises(
        ValueError, match=r"late_policy: at ep = 2 .* none can be left out \(skip\)"
    ):
        task_params(TrainRequest(steps=10, batch=8, late_policy="skip"), plan)
    with pytest.raises(ValueError, match="resizing is not run"):
        task_params(TrainRequest(steps=10, batch=8, dp=4), plan)
