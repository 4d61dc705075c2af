"""The plan of a job placed as islands (:mod:`dmsc.planner.islands`): the same document, its
replicas of a stage each where their island runs.

What differs from an every-step plan: stage ``s`` lists one replica per data-parallel rank, each
with its own island's datacenter, nodes and devices (a stage's ``datacenter`` is its first
replica's, and its micro-batch time the slowest island's); the paths are the crossings inside
islands (when one had to cross) and, after the last stage, the exchange's amortised
reservations; the prediction is the slowest island's pipeline, the exchange's exposed share
(``dp_comm``) and the optimizer step. Its traffic is the cost model's, as every plan's: the
``dp`` bytes of a round spread over its iterations, compressed.
"""

from __future__ import annotations

from dmsc.netmodel import Estimate
from dmsc.planner.islands import IslandPlacement
from dmsc.planner.plan import (
    Plan,
    StageRecord,
    make_sid,
    path_record,
    plan_record,
    replica_record,
    stage_chunks,
)
from dmsc.planner.strategy import StrategySearch
from dmsc.spec import ClusterSpec, JobSpec, LayerListSpec, TransformerSpec


def assemble_island_plan(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    placed: IslandPlacement,
    estimate: Estimate,
    strategy: StrategySearch | None,
) -> Plan:
    """The plan of ``job`` placed as ``placed`` says, with its prediction and search record."""
    crit = placed.critical
    topo, names = crit.built.topology, crit.built.problem.dc_names
    breakdown = placed.breakdown_s
    traffic = dict(estimate.traffic_bytes)  # the cost model's, as every plan's
    traffic["pp"] = sum(
        sum(i.built.problem.boundary_bytes) * i.built.problem.microbatches * 2
        for i in placed.islands
    )
    replicas = placed.replicas
    stages: list[StageRecord] = []
    for s, (layer_names, chunks) in enumerate(stage_chunks(model, job)):
        records = [
            replica_record(topo, r, names[topo.devices[rep[s][0]].dc], list(rep[s]))
            for r, rep in enumerate(replicas)
        ]
        stages.append(
            StageRecord(
                index=s,
                sid=make_sid(model.name, s, layer_names[0], layer_names[-1]),
                chunks=chunks,
                layers=len(layer_names),
                datacenter=records[0].datacenter,
                microbatch_s=max(i.pipeline.stage_us[s] for i in placed.islands) * 1e-6,
                replicas=records,
            )
        )
    paths = []
    for island in placed.islands:
        dcs = island.result.placement.dcs
        for b, route in enumerate(island.result.placement.routes):
            if route is not None:
                paths.append(path_record(island.built, b, dcs[b], dcs[b + 1], route))
    for ex in placed.routes:
        paths.append(path_record(crit.built, job.pp - 1, ex.a, ex.z, ex.route))
    return plan_record(
        cluster, model, job, estimate, stages, paths, breakdown, traffic, placed.result, strategy
    )
