"""Loading a model version into a replica while requests decode on it (issue 30): on real
workers, a request finishes on the version it started on, with the keys and values it holds at
the stages; requests that start after the load are answered by the new version; a training task
that wants the weights meanwhile waits for the load, and nothing deadlocks."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import control_plane, local_plan, wait_for

from dmsc.runtime.control.plane import ControlPlane
from dmsc.runtime.control.serving.held import holding
from dmsc.runtime.control.serving.model_store import promote
from dmsc.runtime.transport.messages import Sampling, TrainRequest

pytestmark = pytest.mark.integration

PROMPT, TOKENS, PAUSE_AT = "def ", 48, 5
SAMPLED = Sampling(temperature=1.0, seed=7)  # seeded: the same weights draw the same


@contextmanager
def two_versions(home: Path) -> Iterator[tuple[ControlPlane, int, int]]:
    """A control plane whose one replica serves version v1 (production), with a second version
    v2 trained (a candidate, not loaded)."""
    with control_plane(local_plan(), home) as cp:
        cp.log.propagate = True
        assert cp.inference.count == 1  # new requests cannot go to another replica
        v1 = cp.train(TrainRequest(steps=2, lr=3e-3))["model_version"]
        v2 = cp.train(TrainRequest(steps=2, lr=3e-3))["model_version"]
        cp.inference.sync_versions()  # training changed the weights: v1 again
        assert holding(cp.db, cp.run.id)["replica-0"].version == v1
        yield cp, v1, v2


def answer(cp: ControlPlane, on_token: Callable[[int], None] | None = None) -> dict[str, Any]:
    """A seeded request through the replicas: its text's version and token ids, or its error."""
    ids: list[int] = []
    try:
        _, text = cp.inference.generate(PROMPT, TOKENS, SAMPLED, on_token=on_token, ids=ids)
    except Exception as exc:
        return {"error": repr(exc)}
    return {"version": getattr(text, "model_version", "unlabelled"), "ids": ids}


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(target()), daemon=True)
    thread.start()
    return thread, out


class Paused:
    """An ``on_token`` that holds its request after ``PAUSE_AT`` tokens (between two tokens,
    its session open at every stage, no turn held) until ``go`` is set."""

    def __init__(self) -> None:
        self.reached, self.go, self.seen = threading.Event(), threading.Event(), 0

    def __call__(self, _: int) -> None:
        self.seen += 1
        if self.seen == PAUSE_AT:
            self.reached.set()
            assert self.go.wait(120)


def test_a_request_under_way_finishes_on_its_version_and_later_ones_get_the_new(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with two_versions(tmp_path) as (cp, v1, v2), caplog.at_level(logging.INFO, "dmsc.control"):
        ref1 = answer(cp)
        assert ref1["version"] == v1
        paused = Paused()
        first, got_first = in_thread(lambda: answer(cp, paused))
        assert paused.reached.wait(120)
        promote(cp.db, v2)
        syncer, _ = in_thread(cp.inference.sync_versions)
        # the load has begun (it waits for the request under way), or is over (the defect)
        wait_for(
            lambda: "waits for 1 request" in caplog.text or not syncer.is_alive(), 120, "a load"
        )
        # a request that comes now waits for the load (the one replica is being loaded)
        second, got_second = in_thread(lambda: answer(cp))
        second.join(0.5)
        waited = second.is_alive() and cp.inference.in_flight("replica-0") == 1
        paused.go.set()
        for thread in (first, syncer, second):
            thread.join(120)
            assert not thread.is_alive()
        # the request under way kept its session and its weights: v1's tokens, labelled v1
        assert got_first == [ref1]
        assert waited and holding(cp.db, cp.run.id)["replica-0"].version == v2
        ref2 = answer(cp)
        assert ref2["version"] == v2 and ref2["ids"] != ref1["ids"]
        assert got_second == [ref2]  # it started after the load: v2's tokens, labelled v2
        assert f"replica-0 serves version {v2}" in caplog.text


def test_a_load_put_off_past_the_drain_timeout_loses_no_request_and_comes_next_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with two_versions(tmp_path) as (cp, v1, v2), caplog.at_level(logging.INFO, "dmsc.control"):
        ref1 = answer(cp)
        cp.inference.drain_timeout_s = 0.5
        paused = Paused()
        first, got_first = in_thread(lambda: answer(cp, paused))
        assert paused.reached.wait(120)
        promote(cp.db, v2)
        cp.inference.sync_versions()  # gives up waiting after 0.5 s: v1 still serves
        assert holding(cp.db, cp.run.id)["replica-0"].version == v1
        assert f"loading version {v2} is put off" in caplog.text
        paused.go.set()
        first.join(120)
        assert got_first == [ref1]
        cp.inference.sync_versions()  # nothing in flight now: v2 loads
        assert holding(cp.db, cp.run.id)["replica-0"].version == v2
        assert answer(cp)["version"] == v2


def test_a_training_task_waits_for_a_load_that_waits_for_a_request(tmp_path: Path) -> None:
    with two_versions(tmp_path) as (cp, v1, v2):
        ref1 = answer(cp)
        assert ref1["version"] == v1
        paused = Paused()
        first, got_first = in_thread(lambda: answer(cp, paused))
        assert paused.reached.wait(120)
        promote(cp.db, v2)
        syncer, _ = in_thread(cp.inference.sync_versions)
        wait_for(lambda: cp.lock.locked() or not syncer.is_alive(), 120, "the load")
        trainer, trained = in_thread(lambda: cp.train(TrainRequest(steps=1, lr=3e-3)))
        trainer.join(0.5)
        waited = trainer.is_alive()  # the load holds the weights: the task waits for it
        paused.go.set()
        for thread in (first, syncer, trainer):
            thread.join(180)
            assert not thread.is_alive()
        assert got_first == [ref1]
        assert waited
        assert trained and trained[0]["model_version"] is not None
