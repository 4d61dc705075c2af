"""Where one more serving replica of a plan's pipeline goes: free devices of the plan's cluster.

The plan placed ``dp`` replicas of every stage; an elastic deployment adds whole pipelines to
serve inference and removes them again. One more pipeline needs, for every stage, ``tp``
devices of one node (its tensor-parallel group, as the plan places them) that no replica uses.
The rule, stage by stage:

1. the datacenter the plan put that stage in (its layers' neighbours, and the paths the plan
   reserved for them, are there);
2. else the datacenter of this replica's previous stage (the boundary stays inside a fabric);
3. else any other datacenter, the nearest to the previous stage first (the propagation delay of
   the cluster's inter-datacenter links, fewest hops).

Within a datacenter, the idlest node that still fits is taken: its load is the CPU % its
workers measured (:func:`node_load`, from the training steps' telemetry), counted in bands of
``IDLE_BAND`` percent so that measurement noise does not decide; among nodes of one band, the one
with the fewest free devices (packing: the emptiest nodes stay whole for later, larger groups).
Without a load, packing alone. A datacenter that a residency rule of
the cluster keeps the model out of (:mod:`dmsc.spec.residency`) is never taken. None when some
stage finds no room: the deployment is at its cluster's capacity.

A training task's dp grown (:func:`place_grown`) places its new replicas by the same rule: the
solver re-plans the strategy at the larger dp without seeing the nodes' load, and each replica
it added is placed again on the idlest nodes, in the datacenter and on the device type the
solver chose for each of its stages, so the plan's paths and its prediction (priced per
datacenter) stand; each stage keeps the all-reduce the solver chose (any one is correct). A node
given a new worker counts ``IDLE_BAND`` busier for the next replica, so that they spread. The
workers' load is counted on the nodes of the spec their plan was placed on; a grow placed on
another spec of the cluster (all its devices back after a shrink numbered on the devices that
were online, or the reverse) reads it through :func:`renumber_load`, so that the load lands on
the same nodes and not on the ones that now carry their numbers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import networkx as nx

from dmsc.netmodel.topology import Topology
from dmsc.planner.plan import Plan, ReplicaRecord, replica_record
from dmsc.spec import ClusterSpec
from dmsc.spec.residency import allowed_datacenters

# CPU % (100 a core): nodes whose loads fall in one band of this width rank as equally idle
IDLE_BAND = 25.0


def node_load(
    plan: Plan, cluster: ClusterSpec, worker_cpu: Mapping[tuple[int, int], float]
) -> dict[int, float]:
    """Each node's load: the CPU % of ``plan``'s workers on it (``worker_cpu`` by (stage,
    replica), as the steps' telemetry measured them), summed; a worker counts on the node of
    its first device. Nodes with no measured worker are not in it (idle)."""
    topo = Topology(cluster)
    out: dict[int, float] = {}
    for st in plan.stages:
        for r, rep in enumerate(st.replicas):
            cpu = worker_cpu.get((st.index, r))
            if cpu is not None and rep.devices:
                node = topo.devices[rep.devices[0]].node
                out[node] = out.get(node, 0.0) + cpu
    return out


def renumber_load(
    load: Mapping[int, float], numbered_on: ClusterSpec, onto: ClusterSpec
) -> dict[int, float]:
    """``load`` (by the nodes of ``numbered_on``) by the nodes of ``onto``, another spec of the
    same cluster: a node is the one of the same datacenter at the same position among that
    datacenter's nodes. That is how a spec cut down to the devices online keeps its nodes (each
    datacenter's first ones, in order: :func:`dmsc.runtime.control.training.online.online_cluster`),
    while its global numbering shifts when an earlier datacenter lost nodes or went. A node
    with no counterpart in ``onto`` is left out."""
    if numbered_on is onto:
        return dict(load)

    def positions(cluster: ClusterSpec) -> list[tuple[str, int]]:
        topo = Topology(cluster)
        first: dict[int, int] = {}
        out = []
        for node in topo.nodes:
            first.setdefault(node.dc, node.index)
            out.append((topo.dc_names[node.dc], node.index - first[node.dc]))
        return out

    target = {where: n for n, where in enumerate(positions(onto))}
    source = positions(numbered_on)
    out: dict[int, float] = {}
    for node, cpu in load.items():
        to = target.get(source[node]) if 0 <= node < len(source) else None
        if to is not None:
            out[to] = out.get(to, 0.0) + cpu
    return out


def devices_in_use(plan: Plan) -> set[int]:
    """The global device indices the plan's replicas occupy."""
    return {d for st in plan.stages for rep in st.replicas for d in rep.devices}


def _dc_order(cluster: ClusterSpec, first: list[str]) -> list[str]:
    """Datacenters: ``first`` (in order, without repeats), then the rest by distance from the
    last of ``first`` over the inter-datacenter links (km), ties by name."""
    names = [dc.name for dc in cluster.datacenters]
    graph = nx.Graph()
    graph.add_nodes_from(names)
    for link in cluster.links:
        graph.add_edge(link.a, link.b, km=link.km)
    seen: list[str] = []
    for name in first:
        if name in names and name not in seen:
            seen.append(name)
    origin = seen[-1] if seen else names[0]
    far = nx.single_source_dijkstra_path_length(graph, origin, weight="km")
    rest = sorted((n for n in names if n not in seen), key=lambda n: (far.get(n, float("inf")), n))
    return seen + rest


def place_replica(
    plan: Plan,
    cluster: ClusterSpec,
    taken: Collection[int],
    dp_rank: int,
    load: Mapping[int, float] | None = None,
) -> list[ReplicaRecord] | None:
    """The devices of one more pipeline replica (one record per stage, rank ``dp_rank``), none
    of them in ``taken``, on the idlest nodes by ``load`` (:func:`node_load`); None when the
    cluster has no room for it (module docstring)."""
    busy_of = load or {}
    topo = Topology(cluster)
    tp = plan.job.tp
    busy = set(taken)
    picks: list[ReplicaRecord] = []
    allowed, _ = allowed_datacenters(cluster.residency, plan.model, topo.dc_names)
    for st in plan.stages:
        prefer = [st.datacenter] + ([picks[-1].datacenter] if picks else [])
        placed = None
        for dc_name in (n for n in _dc_order(cluster, prefer) if n in allowed):
            d = topo.dc_names.index(dc_name)
            free_by_node: dict[int, list[int]] = {}
            for dev in topo.devices:
                if dev.dc == d and dev.index not in busy:
                    free_by_node.setdefault(dev.node, []).append(dev.index)
            fits = [
                (int(busy_of.get(n, 0.0) // IDLE_BAND), len(v), n)
                for n, v in free_by_node.items()
                if len(v) >= tp
            ]
            if not fits:
                continue
            _, _, node = min(fits)
            devs = sorted(free_by_node[node])[:tp]
            placed = replica_record(topo, dp_rank, dc_name, devs)
            break
        if placed is None:
            return None
        busy.update(placed.devices)
        picks.append(placed)
    return picks


def place_grown(old: Plan, new: Plan, cluster: ClusterSpec, load: Mapping[int, float]) -> Plan:
    """``new``, ``old``'s strategy re-planned at a larger dp, with the replicas it added (ranks
    ``old.job.dp`` on) placed on the idlest nodes by ``load`` (module docstring); ``new`` as
    the solver placed it when a replica finds no such room, or nothing grew."""
    keep = old.job.dp
    if new.job.dp <= keep or not load:
        return new
    topo = Topology(cluster)
    busy_of = dict(load)
    taken = {d for st in new.stages for rep in st.replicas[:keep] for d in rep.devices}
    placed: dict[int, list[ReplicaRecord]] = {}
    for r in range(keep, new.job.dp):
        solver = [st.replicas[r] for st in new.stages]
        # the solver's datacenter of each of this replica's stages is the one tried first
        first = [st.model_copy(update={"datacenter": rec.datacenter})
                 for st, rec in zip(new.stages, solver, strict=True)]  # fmt: skip
        picks = place_replica(new.model_copy(update={"stages": first}), cluster, taken, r, busy_of)
        if picks is None or any(
            p.datacenter != rec.datacenter
            or topo.devices[p.devices[0]].type_name != topo.devices[rec.devices[0]].type_name
            for p, rec in zip(picks, solver, strict=True)
        ):
            return new
        for p in picks:
            taken.update(p.devices)
            node = topo.devices[p.devices[0]].node
            busy_of[node] = busy_of.get(node, 0.0) + IDLE_BAND
        placed[r] = picks
    grown = range(keep, new.job.dp)
    stages = [
        st.model_copy(update={"replicas": [*st.replicas[:keep], *(placed[r][s] for r in grown)]})
        for s, st in enumerate(new.stages)
    ]
    return new.model_copy(update={"stages": stages})


def move_replica(plan: Plan, cluster: ClusterSpec, stage: int, replica: int, node: int) -> Plan:
    """``plan`` with replica ``replica`` of stage ``stage`` on free devices of ``node``, a node
    of its datacenter with its device type (a busy node's stage moved to an idle node: the
    control loop's ``move-node``). The plan's prediction and paths stand: they are priced per
    datacenter and device type. ValueError names why it cannot be made."""
    topo = Topology(cluster)
    if not 0 <= stage < len(plan.stages) or not 0 <= replica < len(plan.stages[stage].replicas):
        raise ValueError(f"stage {stage} replica {replica}: not in the plan")
    st = plan.stages[stage]
    rep = st.replicas[replica]
    if not 0 <= node < len(topo.nodes) or max(rep.devices) >= len(topo.devices):
        raise ValueError(f"node {node}: not a node of cluster {cluster.name!r} as the plan has it")
    was = topo.devices[rep.devices[0]]
    target = topo.nodes[node]
    if topo.dc_names[target.dc] != rep.datacenter:
        raise ValueError(f"node {node} is in {topo.dc_names[target.dc]}, not {rep.datacenter}")
    if cluster.node_types[target.type_name].device != was.type_name:
        raise ValueError(f"node {node} has no {was.type_name} devices")
    taken = devices_in_use(plan)
    span = range(target.first_device, target.first_device + target.devices)
    free = [d for d in span if d not in taken]
    if len(free) < len(rep.devices):
        raise ValueError(
            f"node {node} has {len(free)} free devices, stage {stage} replica {replica} needs "
            f"{len(rep.devices)}"
        )
    moved = replica_record(topo, rep.dp_rank, rep.datacenter, free[: len(rep.devices)])
    replicas = [moved if r == replica else x for r, x in enumerate(st.replicas)]
    stages = [
        s.model_copy(update={"replicas": replicas}) if s.index == stage else s for s in plan.stages
    ]
    return plan.model_copy(update={"stages": stages})
