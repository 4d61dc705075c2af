"""Re-cut the layers once the stages have a place: the exact layer DP on the placed pipeline.

The first placement uses stages of (nearly) equal layer counts. Once each stage has a datacenter,
its devices' speed and memory and the time of its boundary transfers are known, and the dynamic
program of :mod:`.segmentation.cuts` finds the cut that minimises the slowest stage (the head
and embedding make the end stages heavier; slower devices or slower links should hold fewer
layers). The planner then places the re-cut pipeline again and keeps whichever is faster.
"""

from __future__ import annotations

from dmsc.netmodel import DEFAULT_CALIBRATION, Calibration
from dmsc.planner.placement.from_specs import BuiltProblem
from dmsc.planner.placement.problem import PlacementResult, boundary_us
from dmsc.planner.segmentation.cuts import SegmentationInfeasible, segment_layers
from dmsc.planner.segmentation.from_specs import layer_dp_inputs
from dmsc.spec import ClusterSpec, JobSpec, LayerListSpec, TransformerSpec

_BLOCK_KINDS = ("block", "moe_block", "layer")


def rebalanced_job(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    built: BuiltProblem,
    result: PlacementResult,
    calib: Calibration = DEFAULT_CALIBRATION,
) -> JobSpec | None:
    """``job`` with ``stage_layers`` from the DP for this placement; None when nothing changes
    or the DP cannot apply (interleaved schedule, one stage, a stage left without a block)."""
    if job.pp < 2 or job.chunks > 1:
        return None
    problem = built.problem
    dcs = result.placement.dcs
    ref_parts = built.stage_parts[dcs[0]]  # the first stage's devices are the reference
    if ref_parts is None:
        return None
    node_type = cluster.node_types[built.dc_node_type[dcs[0]]]
    dp_in = layer_dp_inputs(model, job, cluster.device_types[node_type.device], calib)
    layers, compute = dp_in.layers, dp_in.compute
    # Tensor/expert-parallel time per block, from the costed stages on the reference devices.
    per_stage_blocks = job.stage_layers or _even_counts(
        sum(1 for lc in layers if lc.kind in _BLOCK_KINDS), job.pp
    )
    comm_per_block = sum(p[1] + p[2] for p in ref_parts) / max(1, sum(per_stage_blocks))
    compute = [
        c + (comm_per_block if lc.kind in _BLOCK_KINDS else 0.0)
        for c, lc in zip(compute, layers, strict=True)
    ]
    speeds = []
    for s, d in enumerate(dcs):
        parts = built.stage_parts[d]
        if parts is None:
            return None
        speeds.append(sum(ref_parts[s]) / sum(parts[s]))
    comm = boundary_us(problem, dcs, result.placement.routes)
    offsets = [
        2e-6 * max(comm[s - 1] if s > 0 else 0, comm[s] if s < job.pp - 1 else 0)
        for s in range(job.pp)
    ]
    capacities = [
        cluster.device_types[cluster.node_types[built.dc_node_type[d]].device].memory_gib * 1024**3
        for d in dcs
    ]
    try:
        seg = segment_layers(
            compute,
            dp_in.static,
            [0.0] * len(layers),
            speeds,
            capacities,
            offsets,
            dp_in.activation,
            dp_in.inflight,
        )
    except SegmentationInfeasible:
        return None
    counts = [sum(1 for i in r if layers[i].kind in _BLOCK_KINDS) for r in seg.ranges]
    if min(counts) < 1 or counts == per_stage_blocks:
        return None
    return JobSpec.model_validate({**job.model_dump(), "stage_layers": counts})


def _even_counts(n: int, k: int) -> list[int]:
    base, extra = divmod(n, k)
    return [base + (1 if i < extra else 0) for i in range(k)]
