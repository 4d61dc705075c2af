"""A busy node (.busy): the datacenters' node CPU from made-up snapshots, the streak over ticks,
and the tick that hands the busy datacenters to the real path optimisation, which then moves a
stage to the idle site (checked against the planner run directly on that measured cluster); and
the loop's own move of a stage replica to an idle node of its datacenter, proposed, decided and
applied to the plan."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from modules_helpers import ROOT, fill_run, make_plan

from dmsc.data.db import Database
from dmsc.data.traces import StepTrace
from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.advisors import Measurements, MetricPoint, TaskTimes, read_measurements
from dmsc.runtime.control.advisors.paths import PathOptimisation, device_speeds, scaled_cluster
from dmsc.runtime.control.loop.busy import datacenter_cpu, node_moves, numbered_on, watch
from dmsc.runtime.control.loop.hysteresis import parts
from dmsc.runtime.control.loop.moves import apply_move
from dmsc.runtime.control.loop.objectives import BusyNode, Policy
from dmsc.runtime.control.loop.tick import LoopConfig, LoopState, Snapshot, tick
from dmsc.runtime.control.training.online import ResizedPlans
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model


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


# -- a move to an idle node of the same datacenter (.busy.node_moves), on made-up snapshots


def one_site(nodes: int) -> ClusterSpec:
    """One datacenter of ``nodes`` nodes of one CPU device each."""
    cpu = {"peak_tflops": {"fp32": 0.05}, "memory_gib": 4, "memory_bw_gbyte_s": 10}
    return ClusterSpec.model_validate(
        {
            "name": "one-site",
            "device_types": {"cpu": cpu},
            "node_types": {
                "host": {"device": "cpu", "devices": 1, "link": {"bandwidth_gbit_s": 40}}
            },
            "datacenters": [
                {"name": "dc", "nodes": [{"type": "host", "count": nodes}],
                 "network": {"gbit_s_per_node": 10}}
            ],
        }
    )  # fmt: skip


def _measured(
    plan: Plan, compute: dict[tuple[int, int], float], node_cpu: float | None = None
) -> Measurements:
    """A running task's 6 steps, each replica computing ``compute[(stage, replica)]`` seconds a
    step (no spans), the step as long as the slowest pipeline takes; each step's trace with its
    node at ``node_cpu`` % (None: not measured)."""
    m = plan.job.microbatches
    slowest = max(compute.values())
    traces = tuple(
        StepTrace(step, s, r, c, [], {}, node_cpu_percent=node_cpu)
        for step in range(6)
        for (s, r), c in compute.items()
    )
    metrics = tuple(MetricPoint(step, 1.0, slowest * (m + 1) / m, 1.0) for step in range(6))
    task = TaskTimes(1, "train", "running", "t", "sync", 0.0, 1.0, None)
    return Measurements(1, plan, 100.0, 1, metrics, traces, (task,), remaining_steps=1000)


def test_a_busy_node_moves_its_stage_to_an_idle_node_of_the_same_datacenter() -> None:
    """dp 2 x pp 2 on nodes 0-3 of one datacenter, node 4 free. Node 0 (stage 0 replica 0) is
    busy at 97% and computes three times what replica 1 of its stage does on idle node 1: the
    tick proposes moving it to node 4 (no other datacenter: path optimisation has nowhere to
    go), the rule applies it, and applied the plan puts that replica, and only it, there."""
    cluster = one_site(5)
    plan = make_plan(cluster)
    assert [r.nodes for st in plan.stages for r in st.replicas] == [[0], [1], [2], [3]]
    m, t = plan.job.microbatches, 0.05
    measured = _measured(plan, {(0, 0): 3 * m * t, (0, 1): m * t, (1, 0): m * t, (1, 1): m * t})
    use = {"0/0": _use(97.0), "0/1": _use(30.0), "1/0": _use(20.0), "1/1": _use(25.0)}
    config = LoopConfig(Policy.model_validate({"confirm_ticks": 1, "busy": {"ticks": 1}}))
    snap = Snapshot(measured, telemetry=use, cluster=cluster)
    res = tick(snap, config, LoopState(), [])
    (d,) = res.recorded
    p = d.proposal
    assert (p.module, p.kind, d.verdict) == ("busy-node", "move-node", "apply"), d.reason
    assert p.target == "stage 0 replica 0: node 0 -> node 4 in dc"
    assert p.reason.startswith("node 0 of dc is busy (97% CPU, over 90%): stage 0 replica 0 ")
    assert "150.0 ms a micro-batch there against 50.0 ms on an idle node" in p.reason
    assert "node 4 of dc is idle (none of the run's workers)" in p.reason
    assert p.predicted_gain_s_per_step == pytest.approx(m * 2 * t)  # the slowest falls to t
    assert parts(p) == {"stage 0 replica 0": ("node 0", "node 4")}
    # without the busy node's telemetry over the threshold: nothing proposed
    calm = Snapshot(measured, telemetry={**use, "0/0": _use(50.0)}, cluster=cluster)
    assert tick(calm, config, LoopState(), []).decisions == ()
    # applied: replica 0 of stage 0 on node 4's device, the rest and the prediction as they were
    moved: list[Plan] = []
    cp = SimpleNamespace(plan=plan, cluster=cluster, inference=_Gates(),
                         relayout=lambda new, action, why: moved.append(new))  # fmt: skip
    done = apply_move(cp, (), p)
    assert done["target"] == p.target
    (new,) = moved
    assert [r.devices for st in new.stages for r in st.replicas] == [[4], [1], [2], [3]]
    assert new.stages[0].replicas[0].nodes == [4] and new.prediction == plan.prediction
    cp.plan = new  # the replica left node 0: the same move is no longer proposed
    with pytest.raises(BadRequest, match="no longer proposed"):
        apply_move(cp, (), p)


def test_with_no_idle_replica_of_the_stage_the_plans_figure_is_scaled_as_the_idle_stages_ran() -> (
    None
):
    """pp 2, dp 1 on nodes 0-1, node 2 free: stage 0's node is busy, and no replica of stage 0
    runs on an idle node. Stage 1 on idle node 1 measured 1.5 times the plan's figure: stage 0
    on an idle node would take the plan's figure for it times 1.5."""
    cluster = one_site(3)
    plan = make_plan(cluster, JobSpec(global_batch=8, micro_batch=2, pp=2))
    s0, s1 = (st.microbatch_s for st in plan.stages)
    m = plan.job.microbatches
    measured = _measured(plan, {(0, 0): 4 * m * s0, (1, 0): 1.5 * m * s1})
    use = {"0/0": _use(99.0), "1/0": _use(20.0)}
    policy = BusyNode(cpu_percent=90)
    (p,) = node_moves(plan, cluster, use, {"dc": 99.0}, policy, measured.traces, 1.0)
    assert p.target == "stage 0 replica 0: node 0 -> node 2 in dc"
    assert p.details["compute_s"]["idle"] == pytest.approx(1.5 * s0)
    assert "as the stages on idle nodes measured against the plan" in p.reason
    gain = m * (4 * s0 - max(1.5 * s0, 1.5 * s1))
    assert p.predicted_gain_s_per_step == pytest.approx(gain)
    # both nodes busy: nothing measured says what an idle node would do, and nothing moves
    both = {**use, "1/0": _use(95.0)}
    keeps = node_moves(plan, cluster, both, {"dc": 99.0}, policy, measured.traces, 1.0)
    assert [(k.kind, k.target) for k in keeps] == [
        ("keep", "stage 0 replica 0: node 0 -> node 2 in dc"),
        ("keep", "stage 1 replica 0: node 1 -> node 2 in dc"),
    ]
    assert all("no idle node measured a stage to compare with" in k.reason for k in keeps)


def test_a_lone_replica_is_compared_with_what_it_measured_while_its_node_was_idle() -> None:
    """One stage (pp 1, dp 1) on node 0, node 1 free: no other replica runs anywhere to compare
    with, so before, the busy node kept it ("no idle node measured a stage"). The tick keeps
    what the replica computed while its node was under the threshold, and once the node is busy
    (its compute 3 times that) proposes the move with that figure as the idle node's."""
    cluster = one_site(2)
    plan = make_plan(cluster, JobSpec(global_batch=8, micro_batch=2, pp=1))
    m, t = plan.job.microbatches, 0.05
    config = LoopConfig(Policy.model_validate({"confirm_ticks": 1, "busy": {"ticks": 1}}))
    calm = Snapshot(_measured(plan, {(0, 0): m * t}, 40.0), telemetry={"0/0": _use(40.0)},
                    cluster=cluster)  # fmt: skip
    state = tick(calm, config, LoopState(), []).state
    assert list(state.idle_compute.values()) == [pytest.approx(t)]
    hot = Snapshot(_measured(plan, {(0, 0): 3 * m * t}, 98.0), telemetry={"0/0": _use(98.0)},
                   cluster=cluster)  # fmt: skip
    (d,) = tick(hot, config, state, []).recorded
    p = d.proposal
    assert (p.kind, d.verdict, p.target) == (
        "move-node",
        "apply",
        "stage 0 replica 0: node 0 -> node 1 in dc",
    )
    assert "150.0 ms a micro-batch there against 50.0 ms on an idle node (its own steps" in p.reason
    assert p.predicted_gain_s_per_step == pytest.approx(m * 2 * t)
    # a tick that never saw the node idle has nothing to compare with: kept, as before
    (k,) = tick(hot, config, LoopState(), []).recorded
    assert k.proposal.kind == "keep" and "no idle node measured a stage" in k.proposal.reason
    # steps of a busy node are never an idle figure, whatever the telemetry's window said
    lagging = Snapshot(_measured(plan, {(0, 0): 3 * m * t}, 98.0), telemetry={"0/0": _use(40.0)},
                       cluster=cluster)  # fmt: skip
    assert tick(lagging, config, LoopState(), []).state.idle_compute == {}


def test_a_node_that_stays_busy_confirms_its_move_on_the_next_tick() -> None:
    """The modules ran when the node became busy, then waited for the re-plan's cadence (30 s
    in benchmarks/control_loop.py): the move held on 1 of 2 ticks waited 12 s to confirm while
    the stage ran 3.5 times slower. While a datacenter stays busy they run every tick."""
    cluster = one_site(2)
    plan = make_plan(cluster, JobSpec(global_batch=8, micro_batch=2, pp=1))
    m, t = plan.job.microbatches, 0.05
    policy = {"confirm_ticks": 2, "replan_interval_s": 3600, "busy": {"ticks": 1}}
    config = LoopConfig(Policy.model_validate(policy))
    calm = Snapshot(_measured(plan, {(0, 0): m * t}, 40.0), telemetry={"0/0": _use(40.0)},
                    cluster=cluster)  # fmt: skip
    hot = Snapshot(_measured(plan, {(0, 0): 3 * m * t}, 98.0), telemetry={"0/0": _use(98.0)},
                   cluster=cluster)  # fmt: skip
    state = tick(calm, config, LoopState(), []).state
    first = tick(hot, config, state, [])
    (held,) = first.recorded
    assert (held.proposal.kind, held.verdict) == ("move-node", "refuse")
    assert "held: the same move on 1 of 2 consecutive ticks" in held.reason
    second = tick(hot, config, first.state, [])  # the same steps, long before the cadence
    assert second.modules_ran
    (applied,) = second.recorded
    assert (applied.proposal.kind, applied.verdict) == ("move-node", "apply")


def test_a_replica_s_time_on_its_busy_node_is_that_of_the_steps_it_was_busy() -> None:
    """The node turned busy two steps ago: the window's 4 earlier steps (idle, 50 ms a
    micro-batch) had made the median, and the move looked worth 3 ms a micro-batch, refused
    for a payback beyond the task (control_loop.py: 38.4 against 35.1 ms, until the task
    ended). Its busy steps' 150 ms are the figure."""
    cluster = one_site(2)
    plan = make_plan(cluster, JobSpec(global_batch=8, micro_batch=2, pp=1))
    m, t = plan.job.microbatches, 0.05
    traces = tuple(
        StepTrace(step, 0, 0, (3 if step >= 4 else 1) * m * t, [], {},
                  node_cpu_percent=98.0 if step >= 4 else 40.0)
        for step in range(6)
    )  # fmt: skip
    baseline = {(0, 0, json.dumps(plan.stages[0].chunks)): t}
    use = {"0/0": _use(98.0)}
    policy = BusyNode(cpu_percent=90)
    (p,) = node_moves(plan, cluster, use, {"dc": 98.0}, policy, traces, 0.6, (), baseline)
    assert p.details["compute_s"]["now"] == pytest.approx(3 * t)
    assert p.predicted_gain_s_per_step == pytest.approx(m * 2 * t)


def test_after_a_shrink_the_nodes_are_those_of_the_spec_cut_to_the_devices_online() -> None:
    """Datacenter a (nodes 0-1) runs both stages; a node of it is lost and the re-plan on the
    devices online puts them in b, on what the cut spec numbers nodes 1 and 2 (2 and 3 of the
    whole spec, where device 1 is a's). Read on the whole spec the plan's devices are not its
    own (nothing proposed); on the cut spec the control plane keeps for it, the busy stage 0
    moves to b's free node 3 of that numbering, and the plan moved is kept on it too."""
    cpu = {"peak_tflops": {"fp32": 0.05}, "memory_gib": 4, "memory_bw_gbyte_s": 10}
    host = {"device": "cpu", "devices": 1, "link": {"bandwidth_gbit_s": 40}}
    whole = ClusterSpec.model_validate(
        {
            "name": "two",
            "device_types": {"cpu": cpu},
            "node_types": {"host": host},
            "datacenters": [
                {"name": n, "nodes": [{"type": "host", "count": k}],
                 "network": {"gbit_s_per_node": 10}}
                for n, k in (("a", 2), ("b", 4))
            ],
            "links": [{"a": "a", "b": "b", "km": 2000, "bandwidth_gbit_s": 0.1}],
        }
    )  # fmt: skip
    model = resolve_model("gpt-mini")
    plan = make_plan(whole, JobSpec(global_batch=8, micro_batch=2, pp=2))
    plans = ResizedPlans()
    shrunk = plans.get(plan, model, whole, 1, {"a": 1, "b": 4})
    assert [(st.datacenter, st.replicas[0].nodes) for st in shrunk.stages] == [
        ("b", [1]), ("b", [2])]  # fmt: skip
    moved: list[Plan] = []
    cp = SimpleNamespace(plan=shrunk, cluster=whole, resized_plans=plans, inference=_Gates(),
                         relayout=lambda new, action, why: moved.append(new))  # fmt: skip
    cut = numbered_on(cp)
    assert (
        cut is not None and cut is not whole and [dc.name for dc in cut.datacenters] == ["a", "b"]
    )
    m = shrunk.job.microbatches
    compute = {
        (0, 0): 3 * m * shrunk.stages[0].microbatch_s,
        (1, 0): m * shrunk.stages[1].microbatch_s,
    }
    traces = _measured(shrunk, compute).traces
    use, busy = {"0/0": _use(97.0), "1/0": _use(20.0)}, {"b": 97.0}
    assert node_moves(shrunk, whole, use, busy, BusyNode(), traces, 1.0) == []
    (p,) = node_moves(shrunk, cut, use, busy, BusyNode(), traces, 1.0)
    assert p.target == "stage 0 replica 0: node 1 -> node 3 in b"
    apply_move(cp, (), p)
    (new,) = moved
    assert [st.replicas[0].devices for st in new.stages] == [[3], [2]]
    assert plans.numbered_on(new) is cut


class _Gates:
    """No inference request in flight: a move's drain ends at once."""

    @contextlib.contextmanager
    def paused(self, why: str, timeout_s: float) -> Iterator[int]:
        yield 0
