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

A job whose replicas synchronise once per round of local steps (``sync: diloco:H``,
``fedavg:H``, ``fedprox:H``) is placed otherwise: as :class:`IslandProfile` says, its only
traffic between datacenters is then the exchange of each round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from dmsc.netmodel import DEFAULT_CALIBRATION, DTYPE_BYTES, build_layer_costs
from dmsc.netmodel.fabrics import dc_uplink
from dmsc.netmodel.iteration import assign_stage_layers
from dmsc.netmodel.sync import host_side, model_payload, work_s
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
    boundary_bytes: float  # per micro-batch, all replicas of a stage together (islands: a round)
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
        return self.iteration_s([x] * (self.units - 1), [0.0] * (self.units - 1))

    # What the schedulers place: a chain of ``units`` groups of ``unit_gpus`` GPUs, each in one
    # datacenter, consecutive units joined by a transfer (here: the pipeline's stages).
    @property
    def units(self) -> int:
        return self.pp

    @property
    def unit_gpus(self) -> int:
        return self.stage_gpus

    @property
    def interchangeable(self) -> bool:
        """Whether the units may be put in any order (not a pipeline's stages)."""
        return False

    @property
    def unit_compute_s(self) -> tuple[float, ...]:
        """Each unit's time as the placement model (micro-batches of a pipeline) scores it."""
        return self.compute_s

    @property
    def placement_microbatches(self) -> int:
        return self.microbatches


@dataclass(frozen=True)
class IslandProfile(JobProfile):
    """A job whose data-parallel replicas average once per round of ``inner_steps`` iterations,
    placed as ``islands`` whole pipelines (``dp / islands`` replicas each, the same stages), each
    island inside one datacenter.

    The simulator's choices for such jobs (DiLoCo, FedAvg, FedProx):

    - islands: ``gcd(dp, pp)``, as many as the pipeline has stages where dp allows, so a job
      splits into as many pieces as its pipeline would (a job with one replica is one island);
    - the islands form a chain, those in one datacenter next to each other, and each round
      every link of the chain carries one replica's payload each way (the groups on either side
      reduce theirs first; :func:`dmsc.netmodel.sync.model_payload`, compressed as the job
      says; top-k's payloads are gathered, not summed: up to ``islands - 1`` of them);
    - the exchange of a round runs while the next round computes (streaming DiLoCo): an
      iteration takes the island's pipeline time (``step_s``, every boundary inside its
      datacenter) plus the part of the slowest crossing (and the chain's propagation there and
      back, and ``work_s``: the codec's passes over one device's update among the islands,
      :func:`dmsc.netmodel.sync.work_s`, as ``dmsc estimate`` and the planner's island plans
      price them) that ``inner_steps`` iterations do not hide, spread over them; slots are
      reserved for the wire alone (``needed_gbit_s``);
    - so a crossing is communication-bound when it is slower than ``inner_steps x step_s`` and
      needs only the rate that moves a payload in that time: a DiLoCo job crossing datacenters
      needs far fewer slots than a pipeline does;
    - the averaging inside a datacenter is left out, as the simulator leaves out every-step
      jobs' (each stage's replicas share a datacenter there).
    """

    islands: int = 1
    inner_steps: int = 1
    step_s: float = 0.0
    work_s: float = 0.0  # compute on the exchange's path: the codec's passes (module docstring)

    @property
    def bottleneck_s(self) -> float:
        return self.inner_steps * self.step_s

    def iteration_s(self, transfer_s: Sequence[float], propagation_s: Sequence[float]) -> float:
        if not transfer_s:
            return self.step_s
        exchange = max(transfer_s) + 2 * sum(propagation_s) + self.work_s
        return self.step_s + max(0.0, exchange - self.bottleneck_s) / self.inner_steps

    @property
    def units(self) -> int:
        return self.islands

    @property
    def unit_gpus(self) -> int:
        return self.stage_gpus * self.pp // self.islands

    @property
    def interchangeable(self) -> bool:
        return True

    @property
    def unit_compute_s(self) -> tuple[float, ...]:
        return (self.bottleneck_s,) * self.islands

    @property
    def placement_microbatches(self) -> int:
        return 1


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
            # the simulated jobs are Megatron-LM's, as the published sets the cost model is
            # checked against (dmsc.netmodel.tp_calls)
            sequence_parallel_edges="fused",
        )
        parts = stage_times_on(cluster, model, job, node_type, DEFAULT_CALIBRATION)
        if parts is None:
            raise ValueError(f"jobs[{i}]: {jt.model} with pp={jt.pp} does not fit the devices")
        layers = build_layer_costs(model, job)
        stages = assign_stage_layers(layers, job)
        nodes = max(1, math.ceil(jt.stage_gpus / per_node))
        pipeline = JobProfile(
            index=i,
            name=f"{jt.model}/pp{jt.pp}",
            pp=jt.pp,
            stage_gpus=jt.stage_gpus,
            microbatches=job.microbatches,
            iterations=jt.iterations,
            compute_s=tuple(c + t + e for c, t, e in parts),
            boundary_bytes=stages[0][-1].output_bytes * jt.tp * jt.dp,
            intra_dc_gbit_s=dc_uplink(dc.network)[0] * nodes,
        )
        if not jt.sync.local_steps:
            out.append(pipeline)
            continue
        codec = jt.sync.compression
        islands = math.gcd(jt.dp, jt.pp)
        payload = model_payload(stages, DTYPE_BYTES[model.dtype], codec, jt.tp)
        device = cluster.device_types[cluster.node_types[node_type].device]
        host = host_side(device, DEFAULT_CALIBRATION)
        elements = max(sum(lc.params_per_device for lc in ms) for ms in stages)
        if codec.kind == "topk":
            payload *= max(1, islands - 1)
        base = {f.name: getattr(pipeline, f.name) for f in fields(JobProfile)}
        base.update(name=f"{pipeline.name} {jt.sync.label}", boundary_bytes=payload)
        out.append(
            IslandProfile(
                **base,
                islands=islands,
                inner_steps=jt.sync.inner_steps,
                step_s=pipeline.nominal_s,
                work_s=work_s(jt.sync, islands, elements, host),
            )
        )
    return out
