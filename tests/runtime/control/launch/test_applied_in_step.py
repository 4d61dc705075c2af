"""When each stage applies a training step at the end of its part, without a Commit round."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dmsc.runtime.control.launch.deployment import Deployment
from dmsc.runtime.transport.messages import SyncSettings


def _applies(applied: bool, replicas: int, policy: str, sync: object, outer: bool) -> bool:
    dep = SimpleNamespace(applied=applied, layout=SimpleNamespace(replicas=replicas))
    return Deployment.applies_in_step(dep, policy, sync, outer)  # type: ignore[arg-type]


def test_a_step_is_applied_in_it_once_a_failure_can_only_go_back_to_a_checkpoint() -> None:
    every = SyncSettings()
    assert _applies(True, 1, "wait", None, False)
    assert _applies(True, 4, "skip", every, False)
    assert _applies(True, 1, "restart", None, False)  # one replica: nobody to restart for
    assert not _applies(False, 1, "wait", None, False)  # the first step: a Commit round
    assert not _applies(True, 2, "restart", None, False)  # a late step is run again


@pytest.mark.parametrize("outer", [False, True])
def test_a_sync_mode_of_rounds_keeps_the_commit_round(outer: bool) -> None:
    rounds = SyncSettings(mode="diloco", inner_steps=4)
    assert rounds.outer
    assert not _applies(True, 2, "wait", rounds, outer)
    assert not _applies(True, 1, "wait", None, True)
