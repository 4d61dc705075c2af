"""The plan: the contract between planning and running (``dmsc.plan/1``).

A plan names the strategy, every stage (its layers, its SID, its replicas with datacenter, nodes
and devices), every reserved inter-datacenter path (links, capacity units or slot range), the
predicted iteration with its breakdown, memory and traffic, and how it was found. A job that
synchronises once per round (diloco, fedavg, fedprox) is placed as islands
(:mod:`dmsc.planner.island_plan`): its replicas of a stage may then sit in different datacenters.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dmsc.netmodel import DEFAULT_CALIBRATION, Calibration, CommModel, Estimate, build_layer_costs
from dmsc.netmodel.iteration import assign_stage_layers
from dmsc.netmodel.topology import Topology
from dmsc.planner.gantt import replay_placement, span
from dmsc.planner.placement.from_specs import BuiltProblem
from dmsc.planner.placement.problem import (
    PlacementProblem,
    PlacementResult,
    Reservation,
    boundary_us,
    stage_us,
)
from dmsc.planner.strategy import StrategySearch
from dmsc.spec import ClusterSpec, JobSpec, LayerListSpec, TransformerSpec

PLAN_VERSION: Literal["dmsc.plan/1"] = "dmsc.plan/1"
_SID_NAMESPACE = uuid.UUID("6f1c2d9e-4b8a-4c3e-9a57-d0e5c1b2a3f4")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplicaRecord(_Record):
    """One data-parallel replica of a stage: where its tensor-parallel ranks run."""

    dp_rank: int
    datacenter: str
    nodes: list[int]
    devices: list[int]
    device: str = Field(
        default="cpu",
        description="Where the runtime runs it: cuda:N (N: its first device's GPU index on its "
        "node) or cpu.",
    )


class StageRecord(_Record):
    """One pipeline stage (micro-model) and its replicas."""

    index: int
    sid: str = Field(description="Service ID of the micro-model.")
    chunks: list[tuple[str, str]] = Field(description="First and last layer of each chunk.")
    layers: int
    datacenter: str
    microbatch_s: float
    replicas: list[ReplicaRecord]
    allreduce: Literal["ring", "tree", "hierarchical"] | None = Field(
        default=None,
        description="The all-reduce its replicas average their gradients with: the job's "
        "allreduce, auto resolved to the one the cost model prices fastest for this stage's "
        "gradient over its replicas' devices (none: one replica, or a plan of before).",
    )


class PathRecord(_Record):
    """A reserved route for the boundary after stage ``after_stage``; after the last stage, for
    the exchange between data-parallel islands of a round mode (:mod:`dmsc.planner.islands`)."""

    after_stage: int
    source: str
    target: str
    links: list[str]
    km: float
    units: int
    first_unit: int
    slot_ghz: float | None = Field(description="Slot width when the units are frequency slots.")
    gbit_s: float


class PredictionRecord(_Record):
    iteration_time_s: float
    breakdown_s: dict[str, float]
    memory_gib_per_device: float
    traffic_bytes: dict[str, float]
    tflops_per_gpu: float


class AlternativeRecord(_Record):
    """A runner-up strategy, as the search costed it: not placed."""

    strategy: dict[str, int | str | bool]
    iteration_time_s: float = Field(description="Its iteration as estimated before placement.")
    why_lost: str = Field(
        description="Against the chosen strategy's estimate (search.estimate_s): the extra "
        "seconds and the term that grew most, or 'equal'."
    )


class SearchRecord(_Record):
    solver: str
    candidates: int
    search_seconds: float
    placement_seconds: float
    optimal: bool
    gap_pct: float | None
    strategies_considered: int
    strategies_pruned: dict[str, int]
    alternatives: list[AlternativeRecord]
    estimate_s: float | None = Field(
        default=None,
        description="The chosen strategy's iteration as estimated before placement, what its "
        "runners-up are measured against (none when the strategy was given).",
    )


def _runtime_device(topo: Topology, index: int) -> str:
    """The runtime's name of global device ``index``: ``cuda:N`` for a GPU, else ``cpu``."""
    dev = topo.devices[index]
    kind = topo.cluster.device_types[dev.type_name].runtime_device
    return f"cuda:{dev.local}" if kind == "cuda" else "cpu"


class Plan(_Record):
    """A deployable plan."""

    schema_version: Literal["dmsc.plan/1"] = PLAN_VERSION
    cluster: str
    model: str
    # The whole model, so that any model the planner accepted deploys (a file's or a
    # checkpoint's, not only a preset's); plans written before it resolve ``model`` by name.
    model_spec: TransformerSpec | LayerListSpec | None = None
    params: float
    job: JobSpec
    stages: list[StageRecord]
    paths: list[PathRecord]
    prediction: PredictionRecord
    search: SearchRecord


STRATEGY_KEYS = (
    "tp",
    "pp",
    "dp",
    "ep",
    "micro_batch",
    "schedule",
    "interleave",
    "recompute",
    "sequence_parallel",
    "zero",
)


def strategy_of(job: JobSpec) -> dict[str, int | str | bool]:
    return {k: getattr(job, k) for k in STRATEGY_KEYS}


def placed_pipeline_s(problem: PlacementProblem, result: PlacementResult, job: JobSpec) -> float:
    """Seconds of pipeline per iteration of a placement: the replay of its schedule, interleaved
    or not (:mod:`dmsc.planner.gantt`, what ``--gantt`` draws)."""
    return span(replay_placement(problem, result.placement, job.schedule))


def pipeline_seconds(plan: Plan) -> float:
    """The pipeline part of a plan's iteration (without gradient all-reduce and optimizer)."""
    b = plan.prediction.breakdown_s
    return plan.prediction.iteration_time_s - b.get("dp_comm", 0.0) - b.get("optimizer", 0.0)


def make_sid(model: str, stage: int, first: str, last: str) -> str:
    """A stable Service ID: the same model and layers always give the same SID."""
    return f"sid-{stage}-{uuid.uuid5(_SID_NAMESPACE, f'{model}/{stage}/{first}/{last}').hex[:10]}"


@dataclass(frozen=True)
class PlacedPipeline:
    """One placed pipeline as the plan reports it: each stage's micro-batch time and the
    pipeline's share of the iteration."""

    stage_us: list[int]
    breakdown_s: dict[str, float]  # compute, tp_comm, ep_comm, pp_comm, bubble
    critical_compute_s: float  # compute of one micro-batch on the slowest stage

    @property
    def seconds(self) -> float:
        return sum(self.breakdown_s.values())


def placed_pipeline(built: BuiltProblem, result: PlacementResult, job: JobSpec) -> PlacedPipeline:
    """The pipeline part of the iteration of ``job`` placed as ``result`` says."""
    problem = built.problem
    dcs, routes = result.placement.dcs, result.placement.routes
    comm = boundary_us(problem, dcs, routes)
    times = stage_us(problem, dcs, comm)
    m = problem.microbatches
    crit = max(range(problem.n_stages), key=lambda s: times[s])
    parts = built.stage_parts[dcs[crit]]
    assert parts is not None
    compute_s, tp_s, ep_s = parts[crit]
    pipeline_s = placed_pipeline_s(problem, result, job)
    # stage times are whole microseconds: a stage without transfers may round below its
    # compute, which is no negative transfer or idle time (the iteration is off by < 1 us)
    pp_s = max(0.0, m * (times[crit] * 1e-6 - compute_s - tp_s - ep_s))
    breakdown = {
        "compute": m * compute_s,
        "tp_comm": m * tp_s,
        "ep_comm": m * ep_s,
        "pp_comm": pp_s,
        "bubble": max(0.0, pipeline_s - m * (compute_s + tp_s + ep_s) - pp_s),
    }
    return PlacedPipeline(times, breakdown, compute_s)


def stage_chunks(
    model: TransformerSpec | LayerListSpec, job: JobSpec
) -> list[tuple[list[str], list[tuple[str, str]]]]:
    """Each stage's layer names and its chunks: the first and last layer of each contiguous run
    of the model's layers the stage's devices hold (:func:`assign_stage_layers`), in the order
    the schedule runs them. An interleaved stage ``s`` holds chunks ``s, s + pp, s + 2 pp, ...``
    of the model, one run each; any other stage one run."""
    layers = build_layer_costs(model, job)
    position = {lc.name: i for i, lc in enumerate(layers)}
    out = []
    for members in assign_stage_layers(layers, job):
        names = [lc.name for lc in members]
        chunks: list[tuple[str, str]] = []
        for i, name in enumerate(names):
            if i and position[name] == position[names[i - 1]] + 1:
                chunks[-1] = (chunks[-1][0], name)
            else:
                chunks.append((name, name))
        out.append((names, chunks))
    return out


def search_record(result: PlacementResult, strategy: StrategySearch | None) -> SearchRecord:
    """How a plan was found; its runners-up as the search costed them, each against the chosen
    strategy's estimate (like with like: neither placed)."""
    alternatives = [
        AlternativeRecord(strategy=strategy_of(c.job), iteration_time_s=c.time_s, why_lost=why)
        for c, why in (strategy.alternatives if strategy is not None else ())
    ]
    return SearchRecord(
        solver=result.solver,
        candidates=result.candidates,
        search_seconds=(strategy.seconds if strategy else 0.0) + result.seconds,
        placement_seconds=result.seconds,
        optimal=result.optimal,
        gap_pct=result.gap_pct,
        strategies_considered=strategy.considered if strategy else 1,
        strategies_pruned=strategy.pruned if strategy else {},
        alternatives=alternatives,
        estimate_s=strategy.best.time_s if strategy else None,
    )


def assemble_plan(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    built: BuiltProblem,
    result: PlacementResult,
    estimate: Estimate,
    strategy: StrategySearch | None,
    calib: Calibration = DEFAULT_CALIBRATION,
) -> Plan:
    """The plan of ``job`` placed as ``result`` says, with its prediction and search record."""
    problem, topo = built.problem, built.topology
    dcs, routes = result.placement.dcs, result.placement.routes
    pipe = placed_pipeline(built, result, job)
    times = pipe.stage_us
    m = problem.microbatches
    breakdown = {
        **pipe.breakdown_s,
        "dp_comm": estimate.breakdown_s["dp_comm"],
        "optimizer": estimate.breakdown_s["optimizer"],
    }
    traffic = dict(estimate.traffic_bytes)
    traffic["pp"] = sum(problem.boundary_bytes) * m * (2 if job.mode == "train" else 1)

    comm = CommModel(topo, calib)
    # Devices: each datacenter hands out its devices in order, a stage's replicas node-aligned.
    cursor = {d: 0 for d in range(problem.n_dcs)}
    dc_devices = {
        d: [dev.index for dev in topo.devices if dev.dc == d] for d in range(problem.n_dcs)
    }
    stages: list[StageRecord] = []
    parts = stage_chunks(model, job)
    layers = sum(len(names) for names, _ in parts)
    for s, (names, chunks) in enumerate(parts):
        d = dcs[s]
        take = dc_devices[d][cursor[d] : cursor[d] + built.stage_devices]
        cursor[d] += built.stage_devices
        replicas = []
        for r in range(job.dp):
            devs = take[r * job.tp : (r + 1) * job.tp]
            replicas.append(replica_record(topo, r, problem.dc_names[d], devs))
        grad_bytes = _GRAD_BYTES * estimate.params * len(names) / layers / job.tp
        stages.append(
            StageRecord(
                index=s,
                sid=make_sid(model.name, s, names[0], names[-1]),
                chunks=chunks,
                layers=len(names),
                datacenter=problem.dc_names[d],
                microbatch_s=times[s] * 1e-6,
                replicas=replicas,
                allreduce=dp_allreduce(comm, job, replicas, grad_bytes) if job.dp > 1 else None,
            )
        )
    paths = []
    for b, route in enumerate(routes):
        if route is None:
            continue
        paths.append(path_record(built, b, dcs[b], dcs[b + 1], route))
    return plan_record(
        cluster, model, job, estimate, stages, paths, breakdown, traffic, result, strategy
    )


_GRAD_BYTES = 4  # the runtime all-reduces float32 gradients (on the host, gloo)


def dp_allreduce(
    comm: CommModel, job: JobSpec, replicas: list[ReplicaRecord], grad_bytes: float
) -> Literal["ring", "tree", "hierarchical"]:
    """The all-reduce a stage's replicas run: ``job.allreduce``, ``auto`` resolved to the one
    the cost model prices fastest for ``grad_bytes`` over the replicas' devices (one group per
    tensor-parallel rank, all at once, as :mod:`dmsc.netmodel.iteration` prices them)."""
    groups = [tuple(rep.devices[t] for rep in replicas) for t in range(job.tp)]
    choice = comm.all_reduce_choice(groups, grad_bytes, job.allreduce)
    assert choice in ("ring", "tree", "hierarchical")
    return choice  # type: ignore[return-value]


def plan_record(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    estimate: Estimate,
    stages: list[StageRecord],
    paths: list[PathRecord],
    breakdown: dict[str, float],
    traffic: dict[str, float],
    result: PlacementResult,
    strategy: StrategySearch | None,
) -> Plan:
    """The plan document of placed stages and paths: the prediction from ``breakdown`` (its
    sum is the iteration), the estimate's memory and FLOPs, and the search record."""
    total = sum(breakdown.values())
    return Plan(
        cluster=cluster.name,
        model=model.name,
        model_spec=model,
        params=estimate.params,
        job=job,
        stages=stages,
        paths=paths,
        prediction=PredictionRecord(
            iteration_time_s=total,
            breakdown_s=breakdown,
            memory_gib_per_device=estimate.memory_per_device / 1024**3,
            traffic_bytes=traffic,
            tflops_per_gpu=estimate.flops_per_iteration / total / job.devices / 1e12,
        ),
        search=search_record(result, strategy),
    )


def replica_record(topo: Topology, dp_rank: int, datacenter: str, devs: list[int]) -> ReplicaRecord:
    """A replica on the global devices ``devs`` (its tensor-parallel ranks)."""
    return ReplicaRecord(
        dp_rank=dp_rank,
        datacenter=datacenter,
        nodes=sorted({topo.devices[i].node for i in devs}),
        devices=devs,
        device=_runtime_device(topo, devs[0]),
    )


def path_record(built: BuiltProblem, after: int, a: int, z: int, route: Reservation) -> PathRecord:
    """The record of ``route`` from datacenter ``a`` to ``z``, ``after`` the stage it follows."""
    problem = built.problem
    option = problem.paths[(a, z)][route.path]
    return PathRecord(
        after_stage=after,
        source=problem.dc_names[a],
        target=problem.dc_names[z],
        links=[problem.links[i].name for i in option.links],
        km=option.km,
        units=route.units,
        first_unit=route.start,
        slot_ghz=built.slot_ghz[option.links[0]],
        gbit_s=route.units * option.gbit_s_per_unit,
    )
