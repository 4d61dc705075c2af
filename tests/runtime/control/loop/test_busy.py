"""A busy node (.busy): the datacenters' node CPU from made-up snapshots, the streak over ticks,
and the tick that hands the busy datacenters to the real path optimisation, which then moves a
stage to the idle site (checked against the planner run directly on that measured cluster)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from modules_helpers import ROOT, fill_run, make_plan

from dmsc.data.db import Database
from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.advisors import read_measurements
from dmsc.runtime.control.advisors.paths import PathOptimisation, device_speeds, scaled_cluster
from dmsc.runtime.control.loop.busy import datacenter_cpu, watch
from dmsc.runtime.control.loop.objectives import BusyNode, Policy
from dmsc.runtime.control.loop.tick import LoopConfig, LoopState, Snapshot, tick
from dmsc.spec import ClusterSpec, load_spec, resolve_model


def three_sites() -> ClusterSpec:
    """Two sites and a third, site-c, of the same devices, linked to both."""
    return load_spec(ClusterSpec, ROOT / "examples/clusters/three-sites-cpu.yaml")


@pytest.fixture(scope="module")
def plan() -> Plan:
    p = make_plan(three_sites())
    assert [st.datacenter for st in p.stages] == ["site-a", "site-b"]
    return p


def _use(node: float | None) -> dict[str, float | None]:
    return {"cpu_percent": 150.0, "rss_bytes": 1e8, "node_cpu_percent": node}


def test_each_datacenter_takes_its_busiest_measured_node(plan: Plan) -> None:
    telemetry = {"0/0": _use(40.0), "0/1": _use(95.0), "1/0": _use(None), "7/0": _use(99.0)}
    assert datacenter_cpu(telemetry, plan) == {"site-a": 95.0}  # stage 7: not in the plan


def test_a_datacenter_is_busy_after_the_policys_ticks_in_a_row() -> None:
    policy = BusyNode(cpu_percent=90, ticks=3)
    streaks: dict[str, int] = {}
    seen = []
    for cpu in (95.0, 97.0, 50.0, 95.0, 96.0, 99.0, 99.0):  # one tick under: counted again
        streaks, busy, became = watch({"site-a": cpu, "site-b": 10.0}, streaks, policy)
        seen.append((streaks.get("site-a", 0), sorted(busy), became))
    assert seen == [
        (1, [], False), (2, [], False), (0, [], False), (1, [], False), (2, [], False),
        (3, ["site-a"], True), (4, ["site-a"], False),
    ]  # fmt: skip


def test_a_busy_site_lends_its_slowness_to_no_idle_site() -> None:
    ratios = {"site-a": [1 / 3], "site-b": [1.0]}
    assert device_speeds(three_sites(), ratios)["site-c"] == pytest.approx(3**-0.5)
    assert device_speeds(three_sites(), ratios, {"site-a"})["site-c"] == pytest.approx(1.0)
    # every measured site busy: nothing says the slowness is not the devices': they stand
    both = device_speeds(three_sites(), ratios, {"site-a", "site-b"})
    assert both["site-c"] == pytest.approx(3**-0.5)


def test_the_tick_hands_a_busy_node_to_path_optimisation_which_moves_its_stage(
    tmp_path: Path, plan: Plan
) -> None:
    """Stage 0's node in site-a is busy (its compute three times the planner's), site-b's is
    not, site-c runs nothing. Not told, path optimisation lends site-a's slowness to site-c as
    their device type's; once site-a's node was over 90% on three ticks in a row, the tick runs
    the modules at once and site-c keeps site-b's speed: stage 0 leaves site-a, with the
    planner's own prediction on the cluster measured so and a larger gain."""
    three = three_sites()
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run, _ = fill_run(db, three, plan, steps=12, compute_scale={0: 3.0})
    measured = read_measurements(db, run, time.time())
    policy = {"confirm_ticks": 1, "busy": {"cpu_percent": 90, "ticks": 3}}
    config = LoopConfig(Policy.model_validate(policy))
    modules = [PathOptimisation(three)]

    def snap(stage0_cpu: float) -> Snapshot:
        use = {f"{s}/{r}": _use(stage0_cpu if s == 0 else 40.0) for s in range(2) for r in
               range(plan.job.dp)}  # fmt: skip
        return Snapshot(measured, telemetry=use)

    (blind,) = tick(snap(50.0), config, LoopState(), modules).decisions
    assert blind.proposal.details["speed_by_datacenter"]["site-c"] == pytest.approx(3**-0.5)
    state, ran = LoopState(), []
    for _ in range(3):
        res = tick(snap(97.0), config, state, modules)
        state, ran = res.state, [*ran, res.modules_ran]
    assert ran == [True, False, True]  # new measurements, then the busy node at its third tick
    (d,) = res.decisions
    p = d.proposal
    assert (p.module, p.kind, d.verdict) == ("paths", "move-stage", "apply")
    assert "stage 0: site-a -> " in p.target
    assert p.reason.startswith("busy node CPU in site-a (97%): predicted")
    assert p.details["busy"] == {"site-a": 97.0}
    speeds = p.details["speed_by_datacenter"]
    assert speeds["site-c"] == pytest.approx(speeds["site-b"]) and speeds["site-b"] > 0.99
    assert p.predicted_gain_s_per_step > blind.proposal.predicted_gain_s_per_step
    slow = scaled_cluster(three, speeds, p.details["link_scale"])
    best = plan_job(slow, resolve_model("gpt-mini"), plan.job, fixed=True).plan
    assert p.details["proposed_s"] == pytest.approx(best.prediction.iteration_time_s)
    # the policy without busy: no streaks, no hint
    off = tick(snap(97.0), LoopConfig(Policy(confirm_ticks=1)), LoopState(), modules)
    assert off.state.busy == {} and off.decisions[0].proposal.details["busy"] == {}
