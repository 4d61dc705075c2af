"""The orchestrator applying a move on a running deployment: an inter-stage link slowed in the
data plane, measured, the stage moved off it from a checkpoint, and the steps faster after."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from runtime_helpers import control_plane

from dmsc.planner.solve import plan_job
from dmsc.runtime.control.replanning import replan_now
from dmsc.runtime.transport.messages import ReplanRequest, TrainRequest
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def three_sites() -> ClusterSpec:
    """examples/clusters/three-sites-cpu.yaml: two-sites-cpu with a detour through site-c."""
    return load_spec(ClusterSpec, ROOT / "examples/clusters/three-sites-cpu.yaml")


def test_a_slowed_link_is_measured_and_the_stage_moved_off_it(tmp_path: Path) -> None:
    cluster = three_sites()
    job = JobSpec(global_batch=16, micro_batch=4, pp=2, dp=2)  # each stage fills a site
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    assert [st.datacenter for st in plan.stages] == ["site-a", "site-b"]
    with control_plane(plan, tmp_path, start=False) as cp:
        cp.cluster = cluster
        # the direct link at 4 Mbit/s (nominal 100), the detour through site-c as planned
        cp.deployment.layout.link_mbps = {
            ("site-a", "site-b"): 4.0,
            ("site-a", "site-c"): 100.0,
            ("site-c", "site-b"): 100.0,
        }
        cp.start()
        before = cp.train(TrainRequest(steps=6))
        dry = replan_now(cp, ReplanRequest(dry_run=True))
        (move,) = [d for d in dry["decisions"] if d["module"] == "paths"]
        assert move["kind"] == "move-stage" and move["decision"] == "apply", move
        assert dry["applied"] is None and dry["datacenters"] == ["site-a", "site-b"]
        out = replan_now(cp, ReplanRequest(dry_run=False))
        assert out["applied"] is not None and "site-b" not in out["datacenters"][:1]
        assert out["datacenters"] != ["site-a", "site-b"]
        after = cp.train(TrainRequest(steps=6))
        slow = statistics.median(m.step_s for m in cp.db.metrics(before["task"])[1:])
        fast = statistics.median(m.step_s for m in cp.db.metrics(after["task"])[1:])
        events = [e.action for e in cp.db.scale_events(cp.run.id)]
    # an activation and its gradient cross the slowed link per micro-batch: about 1 s a step
    assert fast < slow - 0.5, (slow, fast)
    assert events == ["move"]
