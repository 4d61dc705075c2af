"""A round mode's replicas placed as islands: whole pipelines, spread over datacenters only when
they must be or when it pays, the exchange costed once per round; the choice of datacenters
checked against brute force over every assignment of whole islands."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest

from dmsc.netmodel import (
    DEFAULT_CALIBRATION,
    CommModel,
    Topology,
    build_layer_costs,
    estimate_iteration,
)
from dmsc.netmodel.sync import exposed_s
from dmsc.planner.island_exchange import exchange_cost, exchange_payloads
from dmsc.planner.islands import island_job, place_islands
from dmsc.planner.placement.from_specs import build_problem
from dmsc.planner.placement.problem import Infeasible, Placement, PlacementResult, evaluate
from dmsc.planner.plan import Plan, placed_pipeline
from dmsc.planner.solve import plan_job, run_solver
from dmsc.spec import ClusterSpec, JobSpec, resolve_model

GPT = resolve_model("gpt-mini")


def _job(**kw: Any) -> JobSpec:
    return JobSpec(**{"global_batch": 16, "micro_batch": 4, "pp": 1, "dp": 2, **kw})


def _island_dcs(plan: Plan) -> list[set[str]]:
    """The datacenters of each replica's pipeline (one per island when islands are whole)."""
    return [{st.replicas[r].datacenter for st in plan.stages} for r in range(plan.job.dp)]


def _check_devices(plan: Plan) -> None:
    devices = [d for st in plan.stages for rep in st.replicas for d in rep.devices]
    assert len(devices) == len(set(devices)) == plan.job.devices


def _variant(base: ClusterSpec, **changes: Any) -> ClusterSpec:
    d = base.model_dump()
    for key, value in changes.items():
        d[key] = value(d[key]) if callable(value) else value
    return ClusterSpec.model_validate(d)


def test_local_cpu_puts_two_diloco_replicas_in_two_datacenters(local_cpu: ClusterSpec) -> None:
    with pytest.raises(Infeasible, match="needs 2 devices in one datacenter"):
        plan_job(local_cpu, GPT, _job(), fixed=True)  # every-step: a stage's replicas together
    plan = plan_job(local_cpu, GPT, _job(sync="diloco:10"), fixed=True).plan
    (stage,) = plan.stages
    dcs = [rep.datacenter for rep in stage.replicas]
    assert len(set(dcs)) == 2 and [rep.dp_rank for rep in stage.replicas] == [0, 1]
    _check_devices(plan)
    # The exchange's reservation: after the last stage, on one link (neighbouring DCs), a small
    # share of it (a round's bytes over ten iterations).
    (path,) = plan.paths
    assert path.after_stage == 0 and {path.source, path.target} == set(dcs)
    assert len(path.links) == 1 and 0 < path.units < 64
    assert plan.job.sync.mode == "diloco" and plan.prediction.traffic_bytes["dp"] > 0
    assert plan.search.solver == "islands"
    # no part of the iteration is negative (stage times in whole microseconds once rounded a
    # transfer-free stage below its compute and showed "pp_comm -0.7 us")
    b = plan.prediction.breakdown_s
    assert all(v >= 0 for v in b.values()), b
    assert sum(b.values()) == pytest.approx(plan.prediction.iteration_time_s, rel=1e-9)


def test_rounds_hide_the_exchange_of_the_same_islands(local_cpu: ClusterSpec) -> None:
    times, dcs = {}, {}
    for h in (1, 50):
        plan = plan_job(
            local_cpu, GPT, _job(sync=f"diloco:{h}", overlap_dp_comm=False), fixed=True
        ).plan
        times[h] = plan.prediction
        dcs[h] = [rep.datacenter for rep in plan.stages[0].replicas]
    assert dcs[1] == dcs[50] and len(set(dcs[1])) == 2  # the same islands, across the DCI
    assert times[50].iteration_time_s < times[1].iteration_time_s
    # Without overlap the exposed exchange is a round's over its iterations.
    assert times[50].breakdown_s["dp_comm"] == pytest.approx(times[1].breakdown_s["dp_comm"] / 50)
    assert times[50].traffic_bytes["dp"] == pytest.approx(times[1].traffic_bytes["dp"] / 50)


def test_islands_stay_together_where_they_fit(local_cpu: ClusterSpec) -> None:
    # Two-device nodes: two islands of pp=1, or one of pp=2, fit in every datacenter.
    two = _variant(local_cpu, node_types=lambda nt: {"host": {**nt["host"], "devices": 2}})
    for pp in (1, 2):
        plan = plan_job(
            two,
            GPT,
            _job(pp=pp, dp=2 if pp == 1 else 3, global_batch=24, sync="fedavg:5"),
            fixed=True,
        ).plan
        islands = _island_dcs(plan)
        assert all(len(dcs) == 1 for dcs in islands)  # never split
        _check_devices(plan)
        if pp == 1:
            assert len(set.union(*islands)) == 1 and not plan.paths
        else:  # three islands of two devices: three datacenters, neighbours on the line
            assert len(set.union(*islands)) == 3
            assert all(p.after_stage == 1 for p in plan.paths)


def _heterogeneous(local_cpu: ClusterSpec, link_gbit_s: float) -> ClusterSpec:
    """dc-0: two slow devices; dc-1 and dc-2: one ten times faster device each."""

    def devices(dt: dict[str, Any]) -> dict[str, Any]:
        return {**dt, "fast": {**dt["cpu"], "peak_tflops": {"fp32": 0.5}}}

    def nodes(nt: dict[str, Any]) -> dict[str, Any]:
        return {**nt, "fasthost": {**nt["host"], "device": "fast"}}

    def dcs(dcs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        kinds = [("host", 2), ("fasthost", 1), ("fasthost", 1)]
        return [
            {**dc, "nodes": [{"type": t, "count": c}]}
            for dc, (t, c) in zip(dcs, kinds, strict=True)
        ]

    def links(links: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**link, "bandwidth_gbit_s": link_gbit_s} for link in links]

    return _variant(local_cpu, device_types=devices, node_types=nodes, datacenters=dcs, links=links)


def test_the_objective_spreads_islands_when_faster_devices_pay(local_cpu: ClusterSpec) -> None:
    cluster = _heterogeneous(local_cpu, link_gbit_s=0.05)
    where = {}
    for sync in ("diloco:1", "diloco:50"):
        job = _job(sync=sync, overlap_dp_comm=False)
        where[sync] = [
            r.datacenter for r in plan_job(cluster, GPT, job, fixed=True).plan.stages[0].replicas
        ]
    assert where["diloco:1"] == ["dc-0", "dc-0"]  # an exchange every step: stay together
    assert where["diloco:50"] == ["dc-1", "dc-2"]  # once in 50: the fast devices pay for it


def test_islands_that_fit_no_datacenter_cross_like_a_pipeline(local_cpu: ClusterSpec) -> None:
    four = _variant(
        local_cpu,
        datacenters=lambda dcs: [*dcs, {**dcs[0], "name": "dc-3"}],
        links=lambda links: [*links, {**links[0], "a": "dc-2", "b": "dc-3"}],
    )
    for solver in ("milp", "greedy", "tabu"):
        plan = plan_job(four, GPT, _job(pp=2, sync="diloco:10"), fixed=True, solver=solver).plan
        _check_devices(plan)
        assert all(len(dcs) == 2 for dcs in _island_dcs(plan))
        assert plan.search.solver == f"islands/{solver}"
        pipeline = [p for p in plan.paths if p.after_stage == 0]
        exchange = [p for p in plan.paths if p.after_stage == 1]
        assert len(pipeline) == 2 and exchange
        # No two reservations share a unit of a link.
        used: dict[str, set[int]] = {}
        for p in plan.paths:
            for link in p.links:
                units = set(range(p.first_unit, p.first_unit + p.units))
                assert not units & used.setdefault(link, set())
                used[link] |= units


def _brute_force(cluster: ClusterSpec, job: JobSpec) -> float:
    """The best iteration over every assignment of whole islands to datacenters (islands in
    datacenter order, each datacenter's devices handed out in order), costed from the parts."""
    ij = island_job(job)
    built = build_problem(cluster, GPT, ij)
    problem, topo = built.problem, built.topology
    optimizer = estimate_iteration(cluster, GPT, job).breakdown_s["optimizer"]
    comm = CommModel(topo, DEFAULT_CALIBRATION)
    payloads = exchange_payloads(GPT, job)
    by_dc = {d: [dev.index for dev in topo.devices if dev.dc == d] for d in range(problem.n_dcs)}
    best = math.inf
    for dcs in itertools.combinations_with_replacement(range(problem.n_dcs), job.dp):
        pipes, replicas, cursor = [], [], dict.fromkeys(by_dc, 0)
        for d in dcs:
            placement = Placement((d,) * ij.pp, (None,) * (ij.pp - 1))
            value = evaluate(problem, placement)
            if value is None or cursor[d] + ij.devices > len(by_dc[d]):
                break
            pipes.append(placed_pipeline(built, PlacementResult(placement, value, "-", 0.0), ij))
            devs = by_dc[d][cursor[d] : cursor[d] + ij.devices]
            cursor[d] += ij.devices
            replicas.append(tuple((devs[s],) for s in range(ij.pp)))
        else:
            crit = max(pipes, key=lambda p: p.seconds)
            round_s = exchange_cost(comm, job, replicas, payloads).time_s
            window = crit.critical_compute_s * 2 / 3
            dp = exposed_s(round_s, job.sync, job.overlap_dp_comm, window)
            best = min(best, crit.seconds + dp + optimizer)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_choice_of_datacenters_equals_brute_force(local_cpu: ClusterSpec, seed: int) -> None:
    rng = random.Random(seed)

    def dcs(dcs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {
                **dc,
                "nodes": [{"type": rng.choice(["host", "fasthost"]), "count": rng.randint(1, 3)}],
            }
            for dc in dcs
        ]

    reference = math.inf
    while reference == math.inf:  # draw until the cluster holds the job's whole islands
        base = _heterogeneous(local_cpu, link_gbit_s=rng.choice([0.02, 0.2, 1.0]))
        cluster = _variant(base, datacenters=dcs)
        dp = rng.choice([2, 3, 4])
        job = _job(
            dp=dp,
            pp=rng.choice([1, 1, 2]),
            global_batch=4 * dp,
            sync=rng.choice(["diloco:1", "diloco:8", "fedavg:3"]),
            overlap_dp_comm=rng.random() < 0.5,
        )
        if cluster.device_count >= job.devices:
            reference = _brute_force(cluster, job)
    optimizer = estimate_iteration(cluster, GPT, job).breakdown_s["optimizer"]
    placed = place_islands(cluster, GPT, job, lambda p: run_solver("milp", p), "milp", optimizer)
    assert placed.result.optimal
    assert placed.iteration_s == pytest.approx(reference, rel=1e-9)


def test_the_islands_exchange_prices_the_codecs_passes_as_the_estimate_does(
    local_cpu: ClusterSpec,
) -> None:
    """A round's exchange between islands carries the codec's passes over each replica's fp32
    update (and, through the leader, its rule's), as ``estimate_iteration`` prices them: the
    island plan's int8 exchange is the wire's time plus ``sync.work_s`` of the stage's
    parameters (before, the islands priced the wire alone)."""
    from dmsc.netmodel.sync import HostSide, exchange, work_s

    job = _job(sync={"mode": "diloco", "inner_steps": 10, "compress": "int8"})
    payloads = exchange_payloads(GPT, job)
    params = sum(lc.params_per_device for lc in build_layer_costs(GPT, job))
    assert payloads.dense_elements == params
    topo = Topology(local_cpu)
    comm = CommModel(topo, DEFAULT_CALIBRATION)
    replicas = [((0,),), ((1,),)]  # one device of each of two datacenters
    cost = exchange_cost(comm, job, replicas, payloads)
    int8 = job.sync.compression
    wire = exchange(comm, [(0, 1)], payloads.dense, int8, job.allreduce, "collective").time_s
    device = topo.device_type(0)
    memory = device.memory_bw_gbyte_s * 1e9
    memory *= DEFAULT_CALIBRATION.for_device(device).memory_efficiency
    work = work_s(job.sync, 2, payloads.dense_elements, HostSide(memory))  # a CPU: no copy
    assert work > 0 and cost.time_s == pytest.approx(wire + work, rel=1e-12)
