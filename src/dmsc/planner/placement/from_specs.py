"""From specs to a :class:`PlacementProblem`: stage times per datacenter, boundary sizes, paths.

Stage times come from the cost model: for each kind of node a datacenter holds, the job is costed
on a one-datacenter cluster of such nodes (so tensor- and expert-parallel traffic stay where the
stage runs); a datacenter whose devices cannot hold a stage gets ``None`` for it. Candidate routes
are the ``k`` shortest simple paths between datacenter sites by length (networkx); a path's line
rate per unit follows the modulation its length allows, or a share of a Gbit/s link. The
cluster's residency rules for the model's name become the problem's resident datacenters.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import networkx as nx

from dmsc.netmodel import (
    DEFAULT_CALIBRATION,
    Calibration,
    DoesNotFit,
    Topology,
    build_layer_costs,
    choose_modulation,
    estimate_iteration,
)
from dmsc.netmodel.core_share import on_cores
from dmsc.netmodel.fabrics import dc_uplink
from dmsc.netmodel.iteration import assign_stage_layers
from dmsc.planner.placement.problem import LinkState, PathOption, PlacementProblem
from dmsc.spec import ClusterSpec, JobSpec, LayerListSpec, NodeGroupSpec, TransformerSpec
from dmsc.spec.residency import allowed_datacenters

BANDWIDTH_UNITS = 64  # a Gbit/s link is reserved in 1/64 shares
LEVELS = (2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class BuiltProblem:
    """The placement problem and what maps it back to the cluster."""

    problem: PlacementProblem
    topology: Topology
    link_ids: tuple[int, ...]  # problem link index -> topology link id
    slot_ghz: tuple[float | None, ...]  # per problem link; None for Gbit/s links
    stage_devices: int
    dc_node_type: tuple[str, ...]
    stage_parts: tuple[list[tuple[float, float, float]] | None, ...]  # [dc][stage] seconds


def _dc_node_type(cluster: ClusterSpec, dc_index: int) -> str:
    return cluster.datacenters[dc_index].nodes[0].type


def stage_times_on(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    node_type: str,
    calib: Calibration,
) -> list[tuple[float, float, float]] | None:
    """Per-stage micro-batch (compute, tensor-parallel, expert-parallel) seconds on nodes of
    ``node_type``; None when the stages do not fit those devices."""
    ntype = cluster.node_types[node_type]
    nodes = math.ceil(job.devices / ntype.devices)
    src = next(dc for dc in cluster.datacenters if any(g.type == node_type for g in dc.nodes))
    sub = ClusterSpec(
        name=f"{cluster.name}/{node_type}",
        device_types={ntype.device: cluster.device_types[ntype.device]},
        node_types={node_type: ntype},
        datacenters=[
            src.model_copy(
                update={"nodes": [NodeGroupSpec(type=node_type, count=nodes)], "site": None}
            )
        ],
    )
    try:
        est = estimate_iteration(sub, model, job.model_copy(update={"first_device": 0}), calib)
    except DoesNotFit:
        return None
    return [(st.compute_s, st.tp_comm_s, st.ep_comm_s) for st in est.stages]


def build_problem(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    busy: dict[int, frozenset[int]] | None = None,
    k_paths: int = 2,
    calib: Calibration = DEFAULT_CALIBRATION,
    free_devices: tuple[int, ...] | None = None,
) -> BuiltProblem:
    """The placement problem of ``job``'s pipeline stages over ``cluster``'s datacenters.

    ``busy`` maps a topology link id to the capacity units other jobs hold on it. Devices that
    share a machine's cores compute at the job's share of them (:func:`on_cores`).
    """
    cluster = on_cores(cluster, job.devices)
    topo = Topology(cluster)
    n_dc = len(cluster.datacenters)
    stage_devices = job.tp * job.dp
    node_types = tuple(_dc_node_type(cluster, d) for d in range(n_dc))
    times_by_type = {nt: stage_times_on(cluster, model, job, nt, calib) for nt in set(node_types)}
    parts = tuple(times_by_type[node_types[d]] for d in range(n_dc))
    compute = tuple(
        tuple(
            None if (part := parts[d]) is None else round(sum(part[s]) * 1e6) for d in range(n_dc)
        )
        for s in range(job.pp)
    )
    if free_devices is None:
        free_devices = tuple(
            sum(g.count * cluster.node_types[g.type].devices for g in dc.nodes)
            for dc in cluster.datacenters
        )
    layers = build_layer_costs(model, job)
    per_stage = assign_stage_layers(layers, job)
    boundary = tuple(per_stage[s][-1].output_bytes * job.tp * job.dp for s in range(job.pp - 1))
    local = []
    for b in range(job.pp - 1):
        row = []
        for d, dc in enumerate(cluster.datacenters):
            per_node = cluster.node_types[node_types[d]].devices
            nodes = max(1, math.ceil(stage_devices / per_node))
            gbit_s, latency_us = dc_uplink(dc.network)
            bw = gbit_s * 1e9 / 8 * calib.network_link_efficiency * nodes
            row.append(round((boundary[b] / bw + 2 * latency_us * 1e-6) * 1e6))
        local.append(tuple(row))

    inter = [link for link in topo.links if link.kind == "interdc"]
    link_index = {link.id: i for i, link in enumerate(inter)}
    states: list[LinkState] = []
    slot_ghz: list[float | None] = []
    unit_rate: list[float | None] = []  # Gbit/s per unit for bandwidth links
    for link, spec in zip(inter, cluster.links, strict=True):
        taken = (busy or {}).get(link.id, frozenset())
        if spec.slots is not None:
            states.append(LinkState(f"{spec.a}-{spec.b}", spec.slots, taken))
            slot_ghz.append(spec.slot_ghz)
            unit_rate.append(spec.gbit_s_per_slot)
        else:
            states.append(LinkState(f"{spec.a}-{spec.b}", BANDWIDTH_UNITS, taken))
            slot_ghz.append(None)
            unit_rate.append(link.bandwidth_Bps * 8 / 1e9 / BANDWIDTH_UNITS)
    paths: dict[tuple[int, int], tuple[PathOption, ...]] = {}
    g = topo.site_graph
    for a, z in itertools.permutations(range(n_dc), 2):
        options = []
        routes = nx.shortest_simple_paths(g, topo.dc_sites[a], topo.dc_sites[z], weight="km")
        for route in itertools.islice(routes, k_paths):
            ids = [g.edges[u, v]["link"] for u, v in itertools.pairwise(route)]
            idx = tuple(link_index[i] for i in ids)
            km = sum(topo.links[i].km for i in ids)
            rates = []
            for i in idx:
                if slot_ghz[i] is None or unit_rate[i] is not None:
                    rates.append(unit_rate[i])
                else:
                    rates.append(choose_modulation(km).gbit_s_per_12g5_slot * slot_ghz[i] / 12.5)  # type: ignore[operator]
            latency = round(km * cluster.propagation_us_per_km)
            options.append(PathOption(idx, km, latency, min(r for r in rates if r is not None)))
        paths[(a, z)] = tuple(options)
    max_units = max((s.units for s in states), default=0)
    levels = tuple(
        sorted({u for u in LEVELS if u <= max_units} | ({max_units} if max_units else set()))
    )
    names = tuple(dc.name for dc in cluster.datacenters)
    allowed, rules = allowed_datacenters(cluster.residency, model.name, names)
    problem = PlacementProblem(
        dc_names=names,
        free_devices=free_devices,
        devices=tuple([stage_devices] * job.pp),
        compute_us=compute,
        boundary_bytes=boundary,
        local_us=tuple(local),
        links=tuple(states),
        paths=paths,
        levels=levels or (1,),
        microbatches=job.microbatches,
        chunks=job.chunks,
        link_efficiency=calib.inter_dc_link_efficiency,
        resident_dcs=frozenset(d for d, n in enumerate(names) if n in allowed) if rules else None,
        residency_rules=rules,
    )
    return BuiltProblem(
        problem,
        topo,
        tuple(link.id for link in inter),
        tuple(slot_ghz),
        stage_devices,
        node_types,
        parts,
    )
