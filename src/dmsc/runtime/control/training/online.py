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

The control plane's re-plans at another dp (a task's ``--dp``, the loop's resizes between
tasks and between steps, :mod:`.resize`; the shrink's, :mod:`.shrink`) go through
:class:`ResizedPlans`: each re-plans on the devices online the loop saw, once per deployed plan,
dp, devices online and serving state. A grow's new replicas go to the idlest nodes
(:func:`dmsc.planner.elastic.place_grown`). A cut spec numbers its devices and nodes anew (a
datacenter that lost a node shifts the numbers of every one after it), so :class:`ResizedPlans`
keeps the spec each plan it made is numbered on: the workers' measured load, counted on the
nodes of the deployed plan's spec, is carried over to the nodes of the spec the grow places on
(:func:`dmsc.planner.elastic.renumber_load`: the same datacenter, the same position in it).
Before, a grow after a shrink read the shrunk plan's devices on the whole spec, and the load of
a busy worker landed on another node, which then took the new replicas as if it were idle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dmsc.planner.plan import Plan
from dmsc.runtime.control.training.resize import resized_plan
from dmsc.spec import ClusterSpec, TransformerSpec

NUMBERED = 16  # the plans made on a cut spec whose numbering is kept (one is deployed at a time)


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
        pinned = {"cpus": g["cpus"]} if g.get("cpus") else {}  # the nodes keep their cores
        if whole:
            kept.append({"type": name, "count": whole, **pinned})
            up -= whole * per
        if whole < count and 0 < up < per:  # a node with fewer units than the spec's server
            part = f"{name}-{up}of{per}"
            types[part] = cluster.node_types[name].model_copy(update={"devices": up}).model_dump()
            kept.append({"type": part, "count": 1, **pinned})
            up = 0
    return kept


def _devices(cluster: ClusterSpec) -> dict[str, int]:
    return {
        dc.name: sum(g.count * cluster.node_types[g.type].devices for g in dc.nodes)
        for dc in cluster.datacenters
    }


def online_cluster(cluster: ClusterSpec, online: Mapping[str, int] | None) -> ClusterSpec:
    """``cluster`` with, in each datacenter, no more devices than ``online`` says are up there
    (module docstring; None: the launcher cannot say, the spec as it is). ValueError when no
    device is online, or the spec cut down is not valid (the reason named)."""
    if online is None or all(online.get(dc, 0) >= n for dc, n in _devices(cluster).items()):
        return cluster  # nothing cut: the same spec, its devices numbered as before
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
    worker_cpu: Mapping[tuple[int, int], float] | None = None,
    numbered_on: ClusterSpec | None = None,
) -> Plan:
    """``plan``'s strategy at ``dp`` replicas placed on the devices ``online`` only
    (:func:`~.resize.resized_plan` on :func:`online_cluster`); ValueError says why there is
    none. ``worker_cpu``: ``plan``'s workers' CPU %, on the nodes of ``numbered_on``, the spec
    ``plan`` is numbered on (None: ``cluster``; module docstring)."""
    on = online_cluster(cluster, online) if cluster is not None else None
    return resized_plan(plan, model, on, dp, heads=heads, serving=serving, worker_cpu=worker_cpu,
                        numbered_on=numbered_on or cluster)  # fmt: skip


class ResizedPlans:
    """The control plane's plans at other dps, each re-planned once per deployed plan, dp,
    devices online and serving state (module docstring)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[object, ...], tuple[Plan, Plan]] = {}
        # the plans made on a cut spec, by id, with that spec: the newest NUMBERED of them
        self._numbered: dict[int, tuple[Plan, ClusterSpec]] = {}

    def numbered_on(self, plan: Plan) -> ClusterSpec | None:
        """The cut spec ``plan`` is numbered on, when this made it on one (None: the whole
        spec's numbering, or not made here)."""
        kept = self._numbered.get(id(plan))
        return kept[1] if kept is not None and kept[0] is plan else None

    def note(self, plan: Plan, spec: ClusterSpec) -> None:
        """``plan`` is numbered on ``spec``, a spec cut to the devices online (made here, or
        moved within it: :mod:`dmsc.runtime.control.loop.moves`)."""
        self._numbered[id(plan)] = (plan, spec)
        for old in list(self._numbered)[:-NUMBERED]:
            del self._numbered[old]

    def get(
        self,
        plan: Plan,
        model: TransformerSpec,
        cluster: ClusterSpec | None,
        dp: int,
        online: Mapping[str, int] | None = None,
        *,
        heads: bool = False,
        serving: bool = False,
        worker_cpu: Callable[[], Mapping[tuple[int, int], float] | None] | None = None,
    ) -> Plan:
        """``plan`` at ``dp`` replicas on the devices ``online`` (None: the spec's): ValueError
        says why there is none. ``worker_cpu`` reads the workers' CPU % when a re-plan runs."""
        up = None if online is None else tuple(sorted(online.items()))
        key = (dp, up, heads, serving)
        kept = self._kept.get(key)
        if kept is None or kept[0] is not plan:
            cpu = worker_cpu() if worker_cpu is not None else None
            to = plan_online(plan, model, cluster, dp, online, heads=heads, serving=serving,
                             worker_cpu=cpu, numbered_on=self.numbered_on(plan))  # fmt: skip
            on = online_cluster(cluster, online) if cluster is not None else None
            if on is not None and on is not cluster:
                self.note(to, on)
            kept = self._kept[key] = (plan, to)
        return kept[1]


def numbered_spec(cp: Any, plan: Plan) -> ClusterSpec | None:
    """The cluster spec ``plan``'s devices and nodes are numbered on, for control plane ``cp``:
    the spec cut to the devices online when a shrink or a resize planned it there (``cp``'s
    :class:`ResizedPlans`), else ``cp``'s cluster spec (None: not known)."""
    plans = getattr(cp, "resized_plans", None)
    cut: ClusterSpec | None = plans.numbered_on(plan) if plans is not None else None
    whole: ClusterSpec | None = getattr(cp, "cluster", None)
    return cut or whole
