"""Which workers a request runs on and whose turn it takes (no workers: the deployment's
bookkeeping alone; tests/integration/test_expert_parallel_deployment.py decodes on real ones)."""

from __future__ import annotations

import threading

import pytest

from dmsc.runtime.control.launch.forwarding import ForwardRequests
from dmsc.runtime.control.launch.layout import StageLayout
from dmsc.spec import TransformerSpec, resolve_model


class _Requests(ForwardRequests):
    """The part of a deployment :class:`ForwardRequests` reads, for ``replicas`` at ``ep``."""

    def __init__(self, replicas: int, ep: int, stages: int = 2) -> None:
        spec = resolve_model("moe-mini")
        assert isinstance(spec, TransformerSpec)
        self.layout = StageLayout(spec, [("embedding", "head")], replicas=replicas, ep=ep)
        self.group_locks = [threading.RLock() for _ in range(0, replicas, ep)]
        self.n = stages

    def pipeline(self, replica: int) -> list[tuple[int, int]]:
        return [(s, replica) for s in range(self.n)]


def test_a_request_runs_on_every_pipeline_of_its_expert_parallel_group() -> None:
    assert _Requests(4, 1).instance(2) == [(0, 2), (1, 2)]  # ep = 1: its own pipeline
    two = _Requests(4, 2)
    assert two.instance(3) == two.instance(2) == [(0, 2), (1, 2), (0, 3), (1, 3)]
    assert two.instance(0) == [(0, 0), (1, 0), (0, 1), (1, 1)]


def _held_elsewhere(lock: threading.RLock) -> bool:
    """Whether another thread holds ``lock``."""
    out: list[bool] = []

    def probe() -> None:
        got = lock.acquire(blocking=False)
        out.append(not got)
        if got:
            lock.release()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return out[0]


@pytest.mark.parametrize("ep", [1, 2])
def test_a_call_to_every_group_waits_for_each_groups_request(ep: int) -> None:
    # at ep > 1 a request holds its group's lock, a step or a Save every group's: a forward
    # must not pair with a backward or a Save's gathers in a group; at ep = 1 none is taken
    dep = _Requests(4, ep)
    with dep.in_turn(3):
        held = [_held_elsewhere(lock) for lock in dep.group_locks]
        assert held == ([False, True] if ep == 2 else [False] * 4)
    with dep.in_turn():
        assert all(_held_elsewhere(lock) for lock in dep.group_locks) == (ep == 2)
    assert not any(_held_elsewhere(lock) for lock in dep.group_locks)
