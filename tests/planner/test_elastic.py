"""Placing one more serving replica on the free devices of a plan's cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import three_cpu_hosts

from dmsc.planner.elastic import (
    IDLE_BAND,
    devices_in_use,
    move_replica,
    node_load,
    place_grown,
    place_replica,
    renumber_load,
)
from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[2]
MODEL = resolve_model("gpt-mini")


def _cluster(devices: dict[str, int], links: list[tuple[str, str, float]]) -> ClusterSpec:
    """Datacenters of one node each, with ``devices[name]`` CPU devices."""
    types = {
        f"n{k}": {"device": "cpu", "devices": k, "link": {"bandwidth_gbit_s": 40}}
        for k in set(devices.values())
    }
    return ClusterSpec.model_validate(
        {
            "name": "test",
            "device_types": {
                "cpu": {"peak_tflops": {"fp32": 0.05}, "memory_gib": 4, "memory_bw_gbyte_s": 10}
            },
            "node_types": types,
            "datacenters": [
                {
                    "name": n,
                    "nodes": [{"type": f"n{k}", "count": 1}],
                    "network": {"gbit_s_per_node": 10},
                }
                for n, k in devices.items()
            ],
            "links": [{"a": a, "b": b, "km": km, "bandwidth_gbit_s": 1} for a, b, km in links],
        }
    )


def test_replicas_fill_the_free_devices_and_then_there_is_no_room() -> None:
    cluster = load_spec(ClusterSpec, ROOT / "examples/clusters/two-sites-cpu.yaml")
    plan = plan_job(cluster, MODEL, JobSpec(global_batch=8, micro_batch=2, pp=2), fixed=True).plan
    taken = devices_in_use(plan)
    assert len(taken) == 2
    extra = place_replica(plan, cluster, taken, dp_rank=1)
    assert extra is not None and [r.dp_rank for r in extra] == [1, 1]
    # the plan put both stages on site-a's two devices: the new pipeline goes whole to site-b
    assert [st.datacenter for st in plan.stages] == ["site-a", "site-a"]
    assert [r.datacenter for r in extra] == ["site-b", "site-b"]
    used = [d for r in extra for d in r.devices]
    assert len(set(used)) == 2 and not set(used) & taken
    assert place_replica(plan, cluster, taken | set(used), dp_rank=2) is None  # 4 devices in all


def _forced(cluster: ClusterSpec, dcs: list[str]):  # type: ignore[no-untyped-def]
    """A two-stage plan of ``cluster`` with its stages moved to ``dcs`` (all the placement reads
    of the plan is each stage's datacenter and tp)."""
    plan = plan_job(cluster, MODEL, JobSpec(global_batch=8, micro_batch=2, pp=2), fixed=True).plan
    stages = [
        st.model_copy(update={"datacenter": dc}) for st, dc in zip(plan.stages, dcs, strict=True)
    ]
    return plan.model_copy(update={"stages": stages})


def test_a_full_datacenter_sends_the_stage_to_its_neighbour_then_the_nearest() -> None:
    # a chain a - b - c - d; devices are numbered by datacenter: a 0, b 1-2, c 3, d 4-5
    cluster = _cluster(
        {"a": 1, "b": 2, "c": 1, "d": 2}, [("a", "b", 10), ("b", "c", 10), ("c", "d", 100)]
    )
    plan = _forced(cluster, ["a", "c"])

    def dcs(taken: set[int]) -> list[str] | None:
        placed = place_replica(plan, cluster, taken, dp_rank=1)
        return None if placed is None else [r.datacenter for r in placed]

    assert dcs(set()) == ["a", "c"]  # where the plan put each stage
    assert dcs({0}) == ["b", "c"]  # a is full: the nearest to a
    assert dcs({0, 3}) == ["b", "b"]  # c is full: stage 1 follows stage 0 into b
    assert dcs({0, 3, 1}) == ["b", "d"]  # b's last device to stage 0; then the nearest free
    assert dcs({0, 1, 2, 3, 4, 5}) is None


def test_a_tensor_parallel_group_stays_on_one_node() -> None:
    cluster = _cluster({"a": 4}, [])
    plan = plan_job(cluster, MODEL, JobSpec(global_batch=8, micro_batch=2, tp=2), fixed=True).plan
    assert devices_in_use(plan) == {0, 1}
    (extra,) = place_replica(plan, cluster, devices_in_use(plan), dp_rank=1) or []
    assert extra.devices == [2, 3] and extra.nodes == [0]
    assert place_replica(plan, cluster, {0, 1, 2}, dp_rank=1) is None  # 1 free device, tp = 2


def test_a_serving_replica_stays_out_of_a_datacenter_a_residency_rule_forbids() -> None:
    cluster = _cluster({"a": 1, "b": 2, "c": 2}, [("a", "b", 10), ("b", "c", 10)])
    plan = _forced(cluster, ["a", "a"])
    assert [r.datacenter for r in place_replica(plan, cluster, {0}, 1) or []] == ["b", "b"]
    data = cluster.model_dump(mode="json", exclude_none=True)
    data["residency"] = {
        "rules": [{"name": "not-b", "models": [plan.model], "datacenters": ["a", "c"]}]
    }
    ruled = ClusterSpec.model_validate(data)
    assert [r.datacenter for r in place_replica(plan, ruled, {0}, 1) or []] == ["c", "c"]
    assert place_replica(plan, ruled, {0, 3, 4}, 1) is None  # b alone has room: no replica


def test_a_new_replica_goes_to_the_idlest_node_packing_among_equally_idle_ones() -> None:
    """Fake telemetry: the plan's one worker holds a device of node 0. Packing alone, or with
    node 0 nearly idle (within one band), fills node 0's free device; with its worker busy the
    replica goes to an idle node."""
    cluster = three_cpu_hosts()
    plan = plan_job(cluster, MODEL, JobSpec(global_batch=8, micro_batch=2, pp=1), fixed=True).plan
    taken = devices_in_use(plan)
    assert taken == {0}  # node 0's first device
    assert node_load(plan, cluster, {(0, 0): 95.0}) == {0: 95.0}
    assert node_load(plan, cluster, {(0, 1): 50.0}) == {}  # no such worker: nothing measured

    def node_of(load: dict[int, float] | None) -> int:
        (rec,) = place_replica(plan, cluster, taken, 1, load) or []
        return rec.devices[0] // 2  # two devices a node

    assert node_of(None) == 0
    assert node_of(node_load(plan, cluster, {(0, 0): IDLE_BAND / 2})) == 0
    assert node_of(node_load(plan, cluster, {(0, 0): 95.0})) == 1
    assert node_of({0: 95.0, 1: 60.0}) == 2  # node 2 measured nothing: the idlest


def test_a_grown_dp_puts_its_new_replicas_on_the_idlest_nodes() -> None:
    """The solver hands out a datacenter's devices in order: grown from dp 1 to 3, replica 1
    shares node 0 with replica 0, whose worker is busy. Told the load, the new replicas go to
    the idle nodes 1 and 2, one each, each where place_replica puts one more serving replica
    on that load (the node given a replica one band busier), and replica 0 stays."""
    cluster = three_cpu_hosts()
    plan = plan_job(cluster, MODEL, JobSpec(global_batch=12, micro_batch=2, pp=1), fixed=True).plan
    assert [r.nodes for r in plan.stages[0].replicas] == [[0]]
    job3 = JobSpec(global_batch=12, micro_batch=2, pp=1, dp=3)
    blind = plan_job(cluster, MODEL, job3, fixed=True).plan
    assert [r.nodes for r in blind.stages[0].replicas] == [[0], [0], [1]]
    load = node_load(plan, cluster, {(0, 0): 300.0})
    assert load == {0: 300.0}
    grown = place_grown(plan, blind, cluster, load)
    reps = grown.stages[0].replicas
    assert [r.nodes for r in reps] == [[0], [1], [2]] and [r.dp_rank for r in reps] == [0, 1, 2]
    assert reps[0] == plan.stages[0].replicas[0]
    assert grown.job.dp == 3 and grown.prediction == blind.prediction
    assert grown.paths == blind.paths
    taken, seen = {0}, dict(load)
    for r in (1, 2):
        want = place_replica(blind, cluster, taken, r, seen)
        assert want == [reps[r]]
        taken |= set(reps[r].devices)
        seen[reps[r].nodes[0]] = seen.get(reps[r].nodes[0], 0.0) + IDLE_BAND


def test_a_grow_with_no_measured_load_is_the_solvers() -> None:
    cluster = three_cpu_hosts()
    plan = plan_job(cluster, MODEL, JobSpec(global_batch=12, micro_batch=2, pp=1), fixed=True).plan
    job3 = JobSpec(global_batch=12, micro_batch=2, pp=1, dp=3)
    blind = plan_job(cluster, MODEL, job3, fixed=True).plan
    assert place_grown(plan, blind, cluster, {}) is blind
    assert place_grown(blind, plan, cluster, {0: 99.0}) is plan  # a shrink: nothing to place


def test_a_load_is_carried_to_the_same_node_of_another_spec_of_the_cluster() -> None:
    """Datacenters a (one node), b (one node) and c (one node); cut down, a goes and b's node
    is node 0: its load is node 1's on the whole spec, and back again. A node the other spec
    lacks (a's) is left out."""
    whole = _cluster({"a": 2, "b": 2, "c": 2}, [("a", "b", 10.0), ("b", "c", 10.0)])
    data = whole.model_dump(exclude_none=True)
    data["datacenters"] = data["datacenters"][1:]
    data["links"] = data["links"][1:]
    cut = ClusterSpec.model_validate(data)
    assert renumber_load({0: 80.0, 1: 30.0}, cut, whole) == {1: 80.0, 2: 30.0}
    assert renumber_load({0: 5.0, 1: 80.0, 2: 30.0}, whole, cut) == {0: 80.0, 1: 30.0}
    assert renumber_load({1: 80.0}, whole, whole) == {1: 80.0}


def test_a_replica_moves_to_free_devices_of_a_node_of_its_datacenter_or_says_why_not() -> None:
    cluster = three_cpu_hosts()
    plan = plan_job(cluster, MODEL, JobSpec(global_batch=12, micro_batch=2, pp=1), fixed=True).plan
    moved = move_replica(plan, cluster, 0, 0, 2)
    assert moved.stages[0].replicas[0].devices == [4] and moved.stages[0].replicas[0].nodes == [2]
    assert moved.prediction == plan.prediction and moved.paths == plan.paths
    two = _cluster({"a": 2, "b": 2}, [("a", "b", 10.0)])
    there = plan_job(two, MODEL, JobSpec(global_batch=12, micro_batch=2, pp=1), fixed=True).plan
    other = 1 - two.datacenters.index(
        next(dc for dc in two.datacenters if dc.name == there.stages[0].datacenter)
    )
    with pytest.raises(ValueError, match=f"node {other} is in"):
        move_replica(there, two, 0, 0, other)
    dp3 = plan_job(cluster, MODEL, JobSpec(global_batch=12, micro_batch=2, pp=1, dp=3), fixed=True)
    full = dp3.plan  # replicas on devices 0, 1 and 2: node 0 has no free device
    with pytest.raises(ValueError, match="node 0 has 0 free devices"):
        move_replica(full, cluster, 0, 2, 0)
    with pytest.raises(ValueError, match="stage 0 replica 5: not in the plan"):
        move_replica(full, cluster, 0, 5, 2)
