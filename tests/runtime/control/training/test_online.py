"""The cluster spec cut down to the devices online (:mod:`dmsc.runtime.control.training.online`),
and the re-plans on it (the shrink's, and the loop's resize between steps): a lost device is
never placed on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import pytest
from modules_helpers import make_plan, two_sites

from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.training.online import ResizedPlans, online_cluster, plan_online
from dmsc.runtime.control.training.resize import Asked, Between, check_online, resized_plan
from dmsc.spec import ClusterSpec, JobSpec, resolve_model

MODEL = resolve_model("gpt-mini")
PLAN = make_plan(two_sites())  # dp 2 x pp 2: stage 0's replicas at site-a, stage 1's at site-b


def _devices(cluster: ClusterSpec) -> dict[str, int]:
    return {
        dc.name: sum(g.count * cluster.node_types[g.type].devices for g in dc.nodes)
        for dc in cluster.datacenters
    }


def test_each_datacenter_keeps_the_devices_online_and_no_more() -> None:
    spec = two_sites()  # one node of two devices per site
    assert online_cluster(spec, None) is spec  # the launcher cannot say: the spec as it is
    assert _devices(online_cluster(spec, {"site-a": 2, "site-b": 2})) == {"site-a": 2, "site-b": 2}
    assert _devices(online_cluster(spec, {"site-a": 5, "site-b": 2})) == {"site-a": 2, "site-b": 2}
    cut = online_cluster(spec, {"site-a": 1, "site-b": 2})  # a Ray node of one unit lost
    assert _devices(cut) == {"site-a": 1, "site-b": 2}
    part = cut.node_types["host-1of2"]  # the server's device and link, one device of it
    assert (part.device, part.devices, part.link) == ("cpu", 1, spec.node_types["host"].link)
    gone = online_cluster(spec, {"site-b": 2})  # none of site-a online: it goes
    assert [dc.name for dc in gone.datacenters] == ["site-b"]
    with pytest.raises(ValueError, match="no device of cluster 'two-sites-cpu' is online"):
        online_cluster(spec, {"elsewhere": 4})


def test_the_shrinks_re_plan_places_only_on_devices_online() -> None:
    """A site-a device lost, dp 2 -> 1: on the whole spec the planner keeps both stages at
    site-a (the link between the sites is thin), where one device is left, and the layout
    could not start; on the devices online it places where there is room."""
    online = {"site-a": 1, "site-b": 2}
    spec = two_sites()
    blind = resized_plan(PLAN, MODEL, spec, 1)
    with pytest.raises(ValueError, match="2 devices in site-a, which has 1 online"):
        check_online(blind, online)
    plan = plan_online(PLAN, MODEL, spec, 1, online)
    check_online(plan, online)
    assert plan.job.dp == 1 and plan.cluster == PLAN.cluster
    used = [r.datacenter for st in plan.stages for r in st.replicas]
    assert used.count("site-a") <= 1 and len(used) == 2
    alone = plan_online(PLAN, MODEL, spec, 1, {"site-b": 2})  # site-a gone: site-b alone
    assert {r.datacenter for st in alone.stages for r in st.replicas} == {"site-b"}
    with pytest.raises(ValueError, match="do not fit"):  # no room anywhere: said, not placed
        plan_online(PLAN, MODEL, spec, 2, online)


class Plane:
    """What a resize between steps reads and changes of the control plane: its re-plan is the
    control plane's own (:class:`ResizedPlans` on the two-site spec), the rest recorded."""

    def __init__(self) -> None:
        self.plan, self.deployment, self.calls = PLAN, "old layout", list[object]()
        self.inference, self.plans = self, ResizedPlans()

    @contextlib.contextmanager
    def paused(self, why: str, timeout_s: float) -> Iterator[int]:
        yield 0  # no inference request in flight

    def resized(self, dp: int, online: Mapping[str, int] | None = None) -> Plan:
        return self.plans.get(self.plan, MODEL, two_sites(), dp, online)

    def relayout(self, plan: Plan, action: str, why: str, step: int | None = None) -> None:
        self.calls.append(plan)
        self.deployment = "new layout"


def test_the_loops_resize_between_steps_re_plans_on_the_devices_online() -> None:
    """The loop saw a site-a device lost and hands the running task a shrink to dp 1: the
    re-plan on the whole spec puts both stages at site-a (refused before: "2 devices in
    site-a, which has 1 online"); on the devices online it places where there is room."""
    cp, told = Plane(), list[str]()
    between = Between(cp)
    with between.running(3):
        between.ask(Asked(1, "devices lost", told.append, {"site-a": 1, "site-b": 2}))
        assert between(5) == "new layout"
    assert len(told) == 1 and told[0].startswith("applied before step 5"), told
    [plan] = cp.calls
    check_online(plan, {"site-a": 1, "site-b": 2})
    assert plan.job.dp == 1


def test_resized_plans_are_kept_by_dp_and_devices_online() -> None:
    plans, reads = ResizedPlans(), list[int]()

    def cpu() -> None:
        reads.append(1)  # the workers' load is read only when a re-plan runs

    online = {"site-a": 1, "site-b": 2}
    cut = plans.get(PLAN, MODEL, two_sites(), 1, online, worker_cpu=cpu)
    assert plans.get(PLAN, MODEL, two_sites(), 1, dict(online), worker_cpu=cpu) is cut
    whole = plans.get(PLAN, MODEL, two_sites(), 1, None, worker_cpu=cpu)
    assert whole is not cut and len(reads) == 2
    with pytest.raises(ValueError, match="2 devices in site-a, which has 1 online"):
        check_online(whole, online)
    # nothing cut (every device online): the spec itself, its devices numbered as before
    spec = two_sites()
    assert online_cluster(spec, {"site-a": 2, "site-b": 3}) is spec


def _edge_and_dc() -> ClusterSpec:
    """A small datacenter of slower devices first (its one node is node 0), then one of three
    nodes of two CPU devices (nodes 1-3), far apart: the planner places a one-stage job in the
    second."""
    device = {"memory_gib": 4, "memory_bw_gbyte_s": 10}
    return ClusterSpec.model_validate(
        {
            "name": "edge-and-dc",
            "device_types": {
                "cpu": {"peak_tflops": {"fp32": 0.05}, **device},
                "slow": {"peak_tflops": {"fp32": 0.01}, **device},
            },
            "node_types": {
                "host": {"device": "cpu", "devices": 2, "link": {"bandwidth_gbit_s": 40}},
                "small": {"device": "slow", "devices": 2, "link": {"bandwidth_gbit_s": 40}},
            },
            "datacenters": [
                {"name": n, "nodes": [{"type": t, "count": k}], "network": {"gbit_s_per_node": 10}}
                for n, t, k in (("edge", "small", 1), ("dc", "host", 3))
            ],
            "links": [{"a": "edge", "b": "dc", "km": 500, "bandwidth_gbit_s": 1}],
        }
    )


def test_a_grow_after_a_shrink_reads_the_load_on_the_nodes_the_workers_ran_on() -> None:
    """The edge datacenter went: the re-plan on the devices online numbers dc's nodes 0-2, and
    the one worker runs on its node 0, which is node 1 of the whole spec. Its load is busy; the
    edge is back and dp grows to 3: the new replicas go to dc's idle nodes 2 and 3. Before, the
    load was read on the whole spec's numbering and landed on the edge's node 0: node 1 looked
    idle and took replica 1 next to the busy worker (packing)."""
    spec = _edge_and_dc()
    plan = plan_job(spec, MODEL, JobSpec(global_batch=12, micro_batch=2, pp=1), fixed=True).plan
    plans = ResizedPlans()
    shrunk = plans.get(plan, MODEL, spec, 1, {"dc": 6})  # the edge is offline
    cut = online_cluster(spec, {"dc": 6})
    assert plans.numbered_on(shrunk) is not None and plans.numbered_on(plan) is None
    [rep] = shrunk.stages[0].replicas
    assert (rep.datacenter, rep.nodes) == ("dc", [0])  # dc's first node: node 1 of the spec
    assert cut.datacenters[0].name == "dc" and spec.datacenters[1].name == "dc"
    grown = plans.get(shrunk, MODEL, spec, 3, None, worker_cpu=lambda: {(0, 0): 300.0})
    assert [r.nodes for r in grown.stages[0].replicas] == [[1], [2], [3]]
    # the other way: a plan of the whole spec grown while the edge is offline
    busy = plans.get(plan, MODEL, spec, 3, {"dc": 6}, worker_cpu=lambda: {(0, 0): 300.0})
    assert [r.nodes for r in busy.stages[0].replicas] == [[0], [1], [2]]
