"""A move applied while an inference batch runs, on real workers: the move waits for the request
in flight, holds the next ones at the replica's gate while the workers restart, and every request
of the batch is answered (before, the restart cut the request in flight: "Channel closed"). Then
a move of a stage to another node of its datacenter (the loop's move-node) on the same workers."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from conftest import EXAMPLES
from runtime_helpers import control_plane, local_plan, wait_for

from dmsc.runtime.control.advisors import Proposal
from dmsc.runtime.control.loop import moves
from dmsc.runtime.transport.messages import InferBatch, InferRequest
from dmsc.spec import ClusterSpec, load_spec

pytestmark = pytest.mark.integration


def test_a_move_during_an_inference_batch_answers_every_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = local_plan()
    # the re-plan finds the same placement: the move restarts the workers where they are
    monkeypatch.setattr(moves, "replan", lambda p, c, t, busy=(): SimpleNamespace(new_plan=p))
    with control_plane(plan, tmp_path) as cp:
        cp.cluster = load_spec(ClusterSpec, EXAMPLES / "local-cpu.yaml")
        old = [h.address for h in cp.deployment.handles]
        requests = [InferRequest(prompt=f"request {i} ", tokens=24) for i in range(5)]
        out: dict[str, Any] = {}
        batch = threading.Thread(
            target=lambda: out.update(cp.batches.call(InferBatch(requests=requests)))
        )
        batch.start()
        wait_for(lambda: cp.inference.in_flight() > 0, 60, "a request of the batch in flight")
        proposal = Proposal("paths", "move-stage", "stage 1: here -> here", "test", 1.0, 2.0, 1.0)
        done = moves.apply_move(cp, (), proposal)
        batch.join(120)
        assert not batch.is_alive()
        assert [h.address for h in cp.deployment.handles] != old  # the workers restarted
        # a move to another node of the same datacenter (.busy's move-node): dc-1 given a
        # second node (device 2; dc-2's device is 3 now, which the plan does not use), each of
        # its nodes pinned to a core of its own (a cpuset: the moved worker runs on the new one)
        stage = next(st for st in cp.plan.stages if st.datacenter == "dc-1")
        assert stage.replicas[0].devices == [1]
        spec = cp.cluster.model_dump(exclude_none=True)
        spec["datacenters"][1]["nodes"] = [
            {"type": "host", "count": 1, "cpus": [0]},
            {"type": "host", "count": 1, "cpus": [1]},
        ]
        cp.cluster = ClusterSpec.model_validate(spec)
        node = {"stage": stage.index, "replica": 0, "datacenter": "dc-1", "from": 1, "to": 2}
        target = f"stage {stage.index} replica 0: node 1 -> node 2 in dc-1"
        to_node = Proposal("busy-node", "move-node", target, "test", 1.0, 2.0, 1.0, {"node": node})
        before = [h.address for h in cp.deployment.handles]
        moves.apply_move(cp, (), to_node)
        assert cp.plan.stages[stage.index].replicas[0].devices == [2]
        assert [h.address for h in cp.deployment.handles] != before
        moved = next(h for h in cp.deployment.handles if h.config.stage == stage.index)
        assert moved.config.cpus == [1]
        assert psutil.Process(moved.process.pid).cpu_affinity() == [1]
        others = [h for h in cp.deployment.handles if h is not moved]  # not pinned: dc-0, dc-2
        mine = psutil.Process().cpu_affinity()
        assert all(psutil.Process(h.process.pid).cpu_affinity() == mine for h in others)
        assert cp.batches.call(InferBatch(requests=requests[:1]))["state"] == "done"
    assert done["drain_s"] > 0  # it waited for the request in flight
    answers = out["answers"]
    assert out["state"] == "done" and len(answers) == len(requests)
    assert [a.get("error") for a in answers] == [None] * len(requests)
    assert all(a["text"] for a in answers)
