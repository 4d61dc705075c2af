"""A Ray node's start tried again when Ray gives up on its registration
(``ray_private.tried``): what a private cluster's ``ray.init`` and a test's local cluster go
through; the local cluster's use of it is in tests/testing/test_ray_local.py."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from dmsc.runtime.control.launch import ray_private
from dmsc.runtime.transport import processes

RAYS_WORDS = (
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


def _spawn_tree() -> list[int]:
    """A child of this process with one of its own, as a node's daemons are; their pids."""
    p = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    while len(tree := processes.descendants(p.pid)) < 2:
        pass
    return tree


def _dead(pid: int) -> bool:
    """Whether ``pid`` has stopped (a zombie has), within 10 s."""
    end = time.monotonic() + 10
    while processes.alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not processes.alive(pid)


def test_a_start_that_misses_the_wait_is_tried_again_with_its_processes_killed() -> None:
    trees: list[list[int]] = []

    def start() -> str:
        trees.append(_spawn_tree())
        if len(trees) < ray_private.START_TRIES:
            raise Exception(RAYS_WORDS)  # what ray/_private/node.py raises
        return "node"

    assert ray_private.tried(start) == "node"
    failed = [pid for tree in trees[:-1] for pid in tree]
    assert all(_dead(pid) for pid in failed), "a failed try's process still runs"
    assert all(processes.alive(pid) for pid in trees[-1])  # the started node's are kept
    for pid in trees[-1]:
        os.kill(pid, 9)


def test_other_errors_and_the_last_miss_are_raised_as_they_are() -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("Timed out waiting for file gcs_server_port")

    with pytest.raises(RuntimeError, match="gcs_server_port"):
        ray_private.tried(broken)
    assert calls == [1]  # not tried again: not the registration wait

    def late() -> None:
        calls.append(1)
        raise Exception(RAYS_WORDS)

    with pytest.raises(Exception, match="timed out during startup"):
        ray_private.tried(late)
    assert len(calls) == 1 + ray_private.START_TRIES
