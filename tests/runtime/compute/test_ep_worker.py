"""A stage worker's expert-parallel side (:mod:`dmsc.runtime.compute.ep_worker`): what a training
task may ask of a deployment at ep > 1, and what a worker refuses to build (ep with tp runs:
tests/integration/test_expert_parallel_deployment.py). The worker's run
against one process is tests/integration/test_expert_parallel_deployment.py."""

from __future__ import annotations

import pytest

from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.compute.ep_worker import ExpertRanks, task_problem
from dmsc.runtime.transport.messages import SyncSettings

PLAIN = SyncSettings()


@pytest.mark.parametrize(
    ("ep", "dp", "sync", "late", "problem"),
    [
        (1, 4, SyncSettings(mode="diloco", inner_steps=5), "skip", None),  # no experts shared
        (2, 2, PLAIN, "wait", None),
        (2, 4, PLAIN, "skip", "late_policy: at ep = 2"),
        (2, 4, PLAIN, "restart", "none can be left out (restart)"),
        (2, 2, SyncSettings(mode="fedavg", inner_steps=2), "wait", "sync: at ep = 2"),
        (2, 2, SyncSettings(compress="int8"), "wait", "sync: at ep = 2"),
        (2, 4, PLAIN, "wait", "dp: the deployment runs ep = 2 over 2 replicas"),
    ],
)
def test_a_task_at_ep_above_one_averages_plainly_waiting_at_the_planned_dp(
    ep: int, dp: int, sync: SyncSettings, late: str, problem: str | None
) -> None:
    planned = 2 if "over 2 replicas" in (problem or "") else dp
    got = task_problem(ep, planned, dp, sync, late)  # type: ignore[arg-type]
    assert (got is None) if problem is None else (got is not None and problem in got), got


def _cfg(**fields: int) -> WorkerConfig:
    cfg = WorkerConfig(sid="s", stage=0, stages=1, model={}, first="a", last="b", registry="")
    for key, value in fields.items():
        setattr(cfg, key, value)
    return cfg


@pytest.mark.parametrize(
    ("replicas", "ep", "replica", "group", "share", "holding"),
    [
        (2, 2, 1, 0, 1, (1,)),  # dp = ep: one group, every expert held once
        (4, 2, 1, 0, 1, (1, 3)),
        (4, 2, 2, 1, 0, (0, 2)),
        (6, 3, 5, 1, 2, (2, 5)),
    ],
)
def test_a_replica_finds_its_groups_where_the_cost_model_puts_them(
    replicas: int, ep: int, replica: int, group: int, share: int, holding: tuple[int, ...]
) -> None:
    ranks = ExpertRanks(_cfg(replicas=replicas, ep=ep, replica=replica), lambda: 0)
    assert (ranks.group, ranks.rank, ranks.holding) == (group, share, holding)
    assert ranks.averaging.divisor == replicas  # every expert's gradient over all the tokens


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"tp": 2, "replicas": 2, "sequence_parallel": True}, "with sequence parallelism"),
        ({"replicas": 3}, "divide the"),
    ],
)
def test_a_worker_refuses_expert_shares_it_cannot_hold(fields: dict[str, int], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        ExpertRanks(_cfg(ep=2, **fields), lambda: 0)
