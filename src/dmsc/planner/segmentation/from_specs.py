"""Segmentation of a model on a cluster: costs from the cost model, cuts from :mod:`.cuts`.

- ``layer``: contiguous stages of a transformer or layer list; stage ``i`` runs on the devices of
  datacenter ``i mod D`` (a pipeline laid across the datacenters in order), so heterogeneous
  clusters get uneven cuts.
- ``block``: a block graph grouped onto ``k`` nodes of the first datacenter, the groups a chain
  of micro-models (data never flows back to an earlier group).
- ``business``: a block graph's backbone (blocks without a task) and one micro-model per task.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from dmsc.netmodel import (
    DEFAULT_CALIBRATION,
    DTYPE_BYTES,
    Calibration,
    LayerCost,
    build_layer_costs,
)
from dmsc.netmodel.compute import layer_time, peak_flops
from dmsc.netmodel.fabrics import dc_uplink
from dmsc.netmodel.memory import inflight_microbatches, stage_memory
from dmsc.planner.segmentation.cuts import (
    MicroModel,
    block_order,
    group_inputs,
    segment_blocks_exact,
    segment_blocks_tabu,
    segment_business,
    segment_layers,
)
from dmsc.spec import (
    BlockGraphSpec,
    ClusterSpec,
    DeviceTypeSpec,
    JobSpec,
    LayerListSpec,
    TransformerSpec,
)

# Block groupings (groups ** blocks) up to which the exact search runs: it only visits chain
# groupings, far fewer (the example's 9 blocks in 3 groups: 19,683 groupings, 57 chains).
EXACT_LIMIT = 50_000


@dataclass(frozen=True)
class Segment:
    """One micro-model of a segmentation: its layers or blocks, where it runs, its cost."""

    name: str
    members: tuple[str, ...]
    device_type: str
    time_s: float
    memory_gib: float
    reads_from: str | None = None


def _dc_device(cluster: ClusterSpec, dc: int) -> tuple[str, DeviceTypeSpec]:
    name = cluster.node_types[cluster.datacenters[dc].nodes[0].type].device
    return name, cluster.device_types[name]


@dataclass(frozen=True)
class LayerDPInputs:
    """Per-layer figures the layer DP needs: time on a reference device, bytes that stay
    (weights, gradients, optimizer states), activation bytes per micro-batch in flight, and the
    micro-batches each stage keeps in flight."""

    layers: list[LayerCost]
    compute: list[float]
    static: list[float]
    activation: list[float]
    inflight: list[float]


def layer_dp_inputs(
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    device: DeviceTypeSpec,
    calib: Calibration = DEFAULT_CALIBRATION,
) -> LayerDPInputs:
    layers = build_layer_costs(model, job)
    train = job.mode == "train"
    compute = []
    for lc in layers:
        policy = job.recompute if lc.kind in ("block", "moe_block", "layer") else "none"
        lt = layer_time(lc, device, model.dtype, policy, calib)
        compute.append(lt.forward + (lt.backward + lt.recompute if train else 0.0))
    static = [
        stage_memory(
            job,
            model.dtype,
            0,
            lc.params_per_device - lc.expert_params_per_device,
            lc.expert_params_per_device,
            0.0,
        ).total
        for lc in layers
    ]
    return LayerDPInputs(
        layers,
        compute,
        static,
        [lc.activation_bytes for lc in layers],
        [inflight_microbatches(job, s) for s in range(job.pp)],
    )


def segment_by_layers(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    calib: Calibration = DEFAULT_CALIBRATION,
) -> list[Segment]:
    """``job.pp`` contiguous stages minimising the slowest (exact DP), memory respected."""
    n_dc = len(cluster.datacenters)
    devices = [_dc_device(cluster, s % n_dc) for s in range(job.pp)]
    ref = devices[0][1]
    d = layer_dp_inputs(model, job, ref, calib)
    layers, compute, static, activation, inflight = (
        d.layers,
        d.compute,
        d.static,
        d.activation,
        d.inflight,
    )
    speeds = [peak_flops(dev, model.dtype) / peak_flops(ref, model.dtype) for _, dev in devices]
    # what the framework holds outside tensors (CUDA context, workspaces) is not the layers'
    caps = [dev.memory_gib * 1024**3 - calib.for_device(dev).framework_bytes for _, dev in devices]
    seg = segment_layers(
        compute, static, [0.0] * len(layers), speeds, caps, None, activation, inflight
    )
    out = []
    for s, r in enumerate(seg.ranges):
        mem = sum(static[i] + inflight[s] * activation[i] for i in r)
        out.append(
            Segment(
                f"stage {s}",
                tuple(layers[i].name for i in r),
                devices[s][0],
                seg.stage_costs[s],
                mem / 1024**3,
            )
        )
    return out


def block_graph(
    model: BlockGraphSpec,
    device: DeviceTypeSpec,
    batch: int,
    calib: Calibration = DEFAULT_CALIBRATION,
) -> nx.DiGraph:
    """The model's blocks with compute seconds, memory bytes and edge bytes for ``batch``."""
    rate = peak_flops(device, model.dtype) * calib.for_device(device).gemm_efficiency
    B = DTYPE_BYTES[model.dtype]
    # Weights and gradients in the model's dtype, fp32 Adam moments (and master weights when
    # training in 16 bits): 2+2+12 or 4+4+8 bytes per parameter, 16 either way.
    opt = 2 * B + (12 if B < 4 else 8)
    g = nx.DiGraph()
    for blk in model.blocks:
        g.add_node(
            blk.name,
            compute=3 * blk.forward_gflop * 1e9 * batch / rate,  # forward and backward
            memory=blk.params * opt + blk.activation_bytes * batch,
            task=blk.task,
        )
    out_bytes = {blk.name: blk.output_bytes * batch for blk in model.blocks}
    for a, b in model.edges:
        g.add_edge(a, b, bytes=out_bytes[a])
    return g


def segment_by_blocks(
    cluster: ClusterSpec,
    model: BlockGraphSpec,
    groups: int,
    batch: int = 1,
    seed: int = 0,
    calib: Calibration = DEFAULT_CALIBRATION,
) -> tuple[list[Segment], str]:
    """Blocks grouped onto ``groups`` nodes of the first datacenter as a chain of micro-models
    (group ``k`` reads only from earlier groups); exact when small enough. A block graph with a
    cycle raises :class:`~dmsc.planner.segmentation.cuts.CyclicBlockGraph`."""
    dev_name, dev = _dc_device(cluster, 0)
    g = block_graph(model, dev, batch, calib)
    order = block_order(g)
    bandwidth = dc_uplink(cluster.datacenters[0].network)[0] * 1e9 / 8
    capacity = dev.memory_gib * 1024**3
    if groups ** len(model.blocks) <= EXACT_LIMIT:
        seg = segment_blocks_exact(g, groups, bandwidth, capacity)
        method = "exact"
    else:
        seg = segment_blocks_tabu(g, groups, bandwidth, capacity, seed=seed)
        method = "tabu"
    reads = group_inputs(g, seg.groups, groups)
    out = []
    for k in range(groups):
        members = tuple(n for n in order if seg.groups[n] == k)
        load = sum(g.nodes[n]["compute"] for n in members)
        mem = sum(g.nodes[n]["memory"] for n in members)
        source = ", ".join(f"group {r}" for r in reads[k]) or None
        out.append(Segment(f"group {k}", members, dev_name, load, mem / 1024**3, source))
    return out, method


def segment_by_business(
    cluster: ClusterSpec,
    model: BlockGraphSpec,
    batch: int = 1,
    calib: Calibration = DEFAULT_CALIBRATION,
) -> list[Segment]:
    """The shared backbone and one micro-model per task head."""
    dev_name, dev = _dc_device(cluster, 0)
    g = block_graph(model, dev, batch, calib)
    order = block_order(g)
    backbone = [n for n in order if g.nodes[n]["task"] is None]
    heads: dict[str, list[str]] = {}
    for n in order:
        task = g.nodes[n]["task"]
        if task is not None:
            heads.setdefault(task, []).append(n)
    micro: list[MicroModel] = segment_business(backbone, heads)
    return [
        Segment(
            m.name,
            m.layers,
            dev_name,
            sum(g.nodes[n]["compute"] for n in m.layers),
            sum(g.nodes[n]["memory"] for n in m.layers) / 1024**3,
            m.reads_from,
        )
        for m in micro
    ]
