"""What the simulator needs to know of a job, from the cost model, and its iteration time.

Iteration time of a pipeline whose boundaries overlap transfers with compute (the next
micro-batch computes while the last one's activations travel): one micro-batch fills and drains
the pipeline (every stage's compute, every boundary's transfer and propagation, forward and
backward), the other ``m - 1`` pass at the pace of the slowest element, a stage or a transfer:

    T = (m - 1) x max(max_s c_s, max_b x_b) + sum_s c_s + 2 sum_b (x_b + d_b)

``c_s`` compute of stage ``s`` per micro-batch, ``x_b`` serialisation of one micro-batch's
activations on boundary ``b`` at its reserved rate, ``d_b`` propagation. A boundary is
communication-bound (CB) when ``x_b > max_s c_s``: then the stage after it cannot start right
after its predecessor (a DCI-induced bubble, 004_899cf4a7bfe92fb3.txt) and more slots shorten
the iteration; otherwise more slots change only the fill term.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dmsc.netmodel import DEFAULT_CALIBRATION, build_layer_costs
from dmsc.netmodel.fabrics import dc_uplink
from dmsc.netmodel.iteration import assign_stage_layers
from dmsc.planner.placement.from_specs import stage_times_on
from dmsc.sim.scenario import JobTypeSpec
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


@dataclass(frozen=True)
class JobProfile:
    """A job type as the simulator sees it."""

    index: int
    name: str
    pp: int
    stage_gpus: int
    microbatches: int
    iterations: int
    compute_s: tuple[float, ...]  # per stage, per micro-batch (forward + backward + TP)
    boundary_bytes: float  # per micro-batch, all replicas of a stage together
    intra_dc_gbit_s: float  # rate of a boundary inside one datacenter

    @property
    def bottleneck_s(self) -> float:
        return max(self.compute_s)

    def needed_gbit_s(self) -> float:
        """Rate at which a boundary stops being communication-bound."""
        return self.boundary_bytes * 8 / self.bottleneck_s / 1e9

    def transfer_s(self, gbit_s: float) -> float:
        return self.boundary_bytes * 8 / (gbit_s * 1e9)

    def iteration_s(self, transfer_s: Sequence[float], propagation_s: Sequence[float]) -> float:
        pace = max(self.bottleneck_s, max(transfer_s, default=0.0))
        fill = sum(self.compute_s) + 2 * sum(
            x + d for x, d in zip(transfer_s, propagation_s, strict=True)
        )
        return (self.microbatches - 1) * pace + fill

    @property
    def nominal_s(self) -> float:
        """Iteration time with every boundary inside one datacenter."""
        x = self.transfer_s(self.intra_dc_gbit_s)
        return self.iteration_s([x] * (self.pp - 1), [0.0] * (self.pp - 1))


def build_profiles(cluster: ClusterSpec, jobs: Sequence[JobTypeSpec]) -> list[JobProfile]:
    """Cost every job type of the mix on the first datacenter's devices."""
    node_type = cluster.datacenters[0].nodes[0].type
    per_node = cluster.node_types[node_type].devices
    dc = cluster.datacenters[0]
    out = []
    for i, jt in enumerate(jobs):
        model = resolve_model(jt.model)
        job = JobSpec(
            global_batch=jt.global_batch,
            micro_batch=jt.micro_batch,
            tp=jt.tp,
            pp=jt.pp,
            dp=jt.dp,
            recompute=jt.recompute,
            attention=jt.attention,
            precision=jt.precision,
            sequence_parallel=jt.tp > 1,
        )
        parts = stage_times_on(cluster, model, job, node_type, DEFAULT_CALIBRATION)
        if parts is None:
            raise ValueError(f"jobs[{i}]: {jt.model} with pp={jt.pp} does not fit the devices")
        layers = build_layer_costs(model, job)
        last = assign_stage_layers(layers, job)[0][-1]
        nodes = max(1, math.ceil(jt.stage_gpus / per_node))
        out.append(
            JobProfile(
                index=i,
                name=f"{jt.model}/pp{jt.pp}",
                pp=jt.pp,
                stage_gpus=jt.stage_gpus,
                microbatches=job.microbatches,
                iterations=jt.iterations,
                compute_s=tuple(c + t + e for c, t, e in parts),
                boundary_bytes=last.output_bytes * jt.tp * jt.dp,
                intra_dc_gbit_s=dc_uplink(dc.network)[0] * nodes,
            )
        )
    return out
