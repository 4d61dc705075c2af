"""The cluster spec cut down to the devices online, so that a re-plan places only on them.

The cluster spec says which devices a datacenter has; after a Ray node is lost, the launcher's
``capacity`` (the ``dc:NAME`` units of the nodes alive) says how many are still up there. A
re-plan on the whole spec may put a replica on the lost devices, which no node offers any more.
:func:`online_cluster` keeps, in each datacenter, only as many devices as are online: whole
nodes of its node groups in order, then, when the devices left do not make a whole node, one
node of a node type of that many devices (the same device and link: a Ray node may offer fewer
units than the spec's server holds); a datacenter with none online goes, and so do the
residency rules' mentions of it. The planner then places on what is left
(:func:`plan_online`), as ``dmsc plan`` would on a spec of those devices.
"""

from __future__ import annotations

from collections.abc import Mapping

from dmsc.planner.plan import Plan
from dmsc.runtime.control.training.resize import resized_plan
from dmsc.spec import ClusterSpec, TransformerSpec


def _kept_nodes(
    cluster: ClusterSpec, groups: list[dict[str, object]], up: int, types: dict[str, object]
) -> list[dict[str, object]]:
    """The node groups of one datacenter that hold ``up`` devices (``types`` gains the node
    types of partial nodes)."""
    kept: list[dict[str, object]] = []
    for g in groups:
        name, count = str(g["type"]), int(str(g["count"]))
        per = cluster.node_types[name].devices
        whole = min(count, up // per)
        if whole:
            kept.append({"type": name, "count": whole})
            up -= whole * per
        if whole < count and 0 < up < per:  # a node with fewer units than the spec's server
            part = f"{name}-{up}of{per}"
            types[part] = cluster.node_types[name].model_copy(update={"devices": up}).model_dump()
            kept.append({"type": part, "count": 1})
            up = 0
    return kept


def online_cluster(cluster: ClusterSpec, online: Mapping[str, int] | None) -> ClusterSpec:
    """``cluster`` with, in each datacenter, no more devices than ``online`` says are up there
    (module docstring; None: the launcher cannot say, the spec as it is). ValueError when no
    device is online, or the spec cut down is not valid (the reason named)."""
    if online is None:
        return cluster
    doc = cluster.model_dump(exclude_none=True)
    types: dict[str, object] = dict(doc["node_types"])
    dcs = []
    for dc in doc["datacenters"]:
        up = max(0, int(online.get(dc["name"], 0)))
        nodes = _kept_nodes(cluster, dc["nodes"], up, types)
        if nodes:
            dcs.append({**dc, "nodes": nodes})
    if not dcs:
        raise ValueError(f"no device of cluster {cluster.name!r} is online ({dict(online)})")
    kept = {dc["name"] for dc in dcs}
    if "residency" in doc:
        res = doc["residency"]
        if res.get("home") is not None and res["home"] not in kept:
            res = {**res, "home": None}
        rules = [
            {**r, "datacenters": [d for d in r["datacenters"] if d in kept]}
            for r in res.get("rules", [])
        ]
        doc["residency"] = {**res, "rules": rules}
    try:
        return ClusterSpec.model_validate({**doc, "node_types": types, "datacenters": dcs})
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"cluster {cluster.name!r} on the devices online: {exc}") from None


def plan_online(
    plan: Plan,
    model: TransformerSpec,
    cluster: ClusterSpec | None,
    dp: int,
    online: Mapping[str, int] | None,
    *,
    heads: bool = False,
    serving: bool = False,
) -> Plan:
    """``plan``'s strategy at ``dp`` replicas placed on the devices ``online`` only
    (:func:`~.resize.resized_plan` on :func:`online_cluster`); ValueError says why there is
    none."""
    on = online_cluster(cluster, online) if cluster is not None else None
    return resized_plan(plan, model, on, dp, heads=heads, serving=serving)
