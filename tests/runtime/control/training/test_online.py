"""The cluster spec cut down to the devices online (:mod:`dmsc.runtime.control.training.online`),
and the shrink's re-plan on it: a lost device is never placed on."""

from __future__ import annotations

import pytest
from modules_helpers import make_plan, two_sites

from dmsc.runtime.control.training.online import online_cluster, plan_online
from dmsc.runtime.control.training.resize import check_online, resized_plan
from dmsc.spec import ClusterSpec, resolve_model

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
