"""A stage worker's expert-parallel side (:mod:`dmsc.runtime.compute.ep_worker`): what a training
task may ask of a deployment at ep > 1, and what a worker refuses to build (ep with tp runs:
tests/integration/test_expert_parallel_deployment.py). The worker's run
against one process is tests/integration/test_expert_parallel_deployment.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

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


class _Experts(nn.Module):
    """A stage's parameters as a worker names them: two experts' matrices and a dense one."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 3, bias=False) for _ in range(2)])
        self.router = nn.Linear(4, 2, bias=False)


def _with_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    for i, p in enumerate(module.parameters()):
        p.grad = torch.full_like(p, float(i + 1))
    module.experts[1].weight.grad = None  # an expert no token reached
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_at_dp_equal_to_ep_the_experts_gradients_are_divided_where_the_backward_left_them() -> None:
    module = _Experts()
    before = _with_grads(module)
    first = module.experts[0].weight.grad
    ranks = ExpertRanks(_cfg(replicas=2, ep=2, replica=1), lambda: 0)
    ranks.average_expert_grads(module)
    assert module.experts[0].weight.grad is first  # no copy: the same tensor, divided
    assert torch.equal(first, before["experts.0.weight"] / 2)
    assert torch.equal(module.experts[1].weight.grad, torch.zeros(3, 4))
    assert torch.equal(module.router.weight.grad, before["router.weight"])  # the collective's


def test_over_the_holders_the_experts_gradients_are_views_of_one_summed_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = _Experts()
    before = _with_grads(module)
    ranks = ExpertRanks(_cfg(replicas=4, ep=2, replica=1), lambda: 0)
    alone = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))  # type: ignore[attr-defined]
    monkeypatch.setattr(ranks, "_holders", lambda: alone)
    ranks.average_expert_grads(module)
    grads = [module.experts[i].weight.grad for i in range(2)]
    assert torch.equal(grads[0], before["experts.0.weight"] / 4)
    assert torch.equal(grads[1], torch.zeros(3, 4))
    assert grads[0].untyped_storage().data_ptr() == grads[1].untyped_storage().data_ptr()
