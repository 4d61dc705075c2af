"""Data-parallel replicas as islands: where the replicas of a job that averages once per round go.

A job whose replicas synchronise once per round of ``H`` inner steps (``diloco:H``, ``fedavg:H``,
``fedprox:H``) exchanges nothing between replicas inside a round, so its replicas need not share
a datacenter. It is placed as islands: an island is one replica's whole pipeline (with experts,
the ``ep`` replicas of one expert-parallel group, which exchange tokens every micro-batch), its
pipeline edges inside it; the islands may sit in different datacenters and exchange the model
once per round across them (as the simulator's ``IslandProfile`` places such jobs).

The choices, and why:

- **An island is a pipeline of the existing placement problem.** ``build_problem`` of the
  island's job (``dp = ep``, the same micro-batches) scores an island in each datacenter with
  the shared integer model (:func:`~dmsc.planner.placement.problem.evaluate`, all stages there)
  and feeds the solvers when an island must cross datacenters. Building one problem with ``dp``
  units per stage instead would need a graph of pipelines, not a chain: every solver assumes
  one chain of stages.
- **Whole islands when the datacenters hold them** (each island inside one datacenter). The
  datacenters are chosen by search over the sets that hold the islands and need each of their
  members (a larger set adds crossings and cannot shorten the slowest pipeline), at most
  :data:`MAX_DATACENTERS` fastest datacenters: a set costs its slowest island's pipeline, plus
  the exchange's exposed share and the optimizer step. Sets are tried fastest pipeline, fewest
  datacenters and shortest ring first and stop at a lower bound, so islands stay together when
  one datacenter holds them and spread when none does or when faster devices elsewhere pay for
  the exchange. In a set, the datacenters with most room fill first.
- **Otherwise, one island at a time** with the requested solver on what the islands before it
  left (devices, reserved units): an island may then cross datacenters as an every-step pipeline
  does. Greedy: an island's place does not weigh the exchange.
- **The exchange** between islands, once per round, is costed by the cost model on the
  replicas' devices and reserves its rate amortised over the round
  (:mod:`dmsc.planner.island_exchange`). When islands had to cross datacenters and their
  pipelines left no room for it, the islands are placed once more with the exchange's units
  held back on every link it needs.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from dmsc.netmodel import DEFAULT_CALIBRATION, Calibration, CommModel
from dmsc.netmodel.core_share import on_cores
from dmsc.netmodel.sync import exposed_s
from dmsc.netmodel.topology import Topology
from dmsc.planner.island_exchange import (
    ExchangeRoute,
    Payloads,
    Replica,
    exchange_cost,
    exchange_payloads,
    exchange_rates,
    headroom,
    reserve_exchange,
    ring,
)
from dmsc.planner.placement.from_specs import BuiltProblem, build_problem
from dmsc.planner.placement.problem import (
    Infeasible,
    Placement,
    PlacementProblem,
    PlacementResult,
    evaluate,
    reserve,
)
from dmsc.planner.plan import PlacedPipeline, placed_pipeline
from dmsc.spec import ClusterSpec, JobSpec, LayerListSpec, TransformerSpec

MAX_DATACENTERS = 12  # datacenters the set search considers (2^12 sets at most)
MAX_FILLS = 16  # splits of the islands over a set costed one by one (beyond: two of them)
MAX_COSTED = 128  # placements costed before the search stops (then not exhaustive)

Solve = Callable[[PlacementProblem], PlacementResult]


@dataclass(frozen=True)
class Island:
    """One island: its pipeline's placement and the devices of each of its replicas."""

    built: BuiltProblem
    result: PlacementResult
    pipeline: PlacedPipeline
    replicas: tuple[Replica, ...]  # ep of them


@dataclass(frozen=True)
class IslandPlacement:
    """Where every island runs, what an iteration costs, and what the exchange reserves."""

    job: JobSpec  # one island's job
    islands: tuple[Island, ...]
    breakdown_s: dict[str, float]  # the iteration: the slowest island's pipeline, dp, optimizer
    routes: tuple[ExchangeRoute, ...]
    result: PlacementResult  # the slowest island's placement, with the search's record

    @property
    def critical(self) -> Island:
        return max(self.islands, key=lambda i: i.pipeline.seconds)

    @property
    def iteration_s(self) -> float:
        return sum(self.breakdown_s.values())

    @property
    def replicas(self) -> list[Replica]:
        """Every replica in data-parallel rank order (islands by datacenter)."""
        return [r for island in self.islands for r in island.replicas]


def island_job(job: JobSpec) -> JobSpec:
    """One island of ``job``: its ``ep`` replicas (one without experts), the same micro-batches."""
    return job.model_copy(
        update={"dp": job.ep, "global_batch": job.global_batch // (job.dp // job.ep)}
    )


@dataclass
class _Devices:
    """Each datacenter's devices, handed out in order (a stage's replicas side by side)."""

    by_dc: dict[int, list[int]]
    cursor: dict[int, int]

    @classmethod
    def of(cls, topo: Topology) -> _Devices:
        by_dc: dict[int, list[int]] = {}
        for dev in topo.devices:
            by_dc.setdefault(dev.dc, []).append(dev.index)
        return cls(by_dc, dict.fromkeys(by_dc, 0))

    def take(self, dcs: Sequence[int], job: JobSpec) -> tuple[Replica, ...]:
        """Devices for one island whose stage ``s`` runs in ``dcs[s]``: ``ep`` replicas."""
        stages = []
        for d in dcs:
            start = self.cursor[d]
            self.cursor[d] += job.tp * job.ep
            stages.append(self.by_dc[d][start : self.cursor[d]])
        return tuple(
            tuple(tuple(devs[e * job.tp : (e + 1) * job.tp]) for devs in stages)
            for e in range(job.ep)
        )


def _breakdown(
    islands: Sequence[Island],
    comm: CommModel,
    job: JobSpec,
    payloads: Payloads,
    optimizer_s: float,
) -> dict[str, float]:
    """The iteration of ``islands``: the slowest one's pipeline, the exchange's exposed share
    (see :func:`dmsc.netmodel.sync.exposed_s`), the optimizer."""
    crit = max(islands, key=lambda i: i.pipeline.seconds)
    cost = exchange_cost(comm, job, [r for i in islands for r in i.replicas], payloads)
    window = crit.pipeline.critical_compute_s * 2 / 3  # the backward of the last micro-batch
    dp_s = exposed_s(cost.time_s, job.sync, job.overlap_dp_comm, window)
    return {**crit.pipeline.breakdown_s, "dp_comm": dp_s, "optimizer": optimizer_s}


def _ring_km(problem: PlacementProblem, dcs: Sequence[int]) -> float:
    """Length of the ring through ``dcs`` in order (what the exchange's ring crosses)."""
    return sum(
        problem.paths[(a, z)][0].km if (a, z) in problem.paths else math.inf for a, z in ring(dcs)
    )


def _candidate_sets(
    problem: PlacementProblem, pipes: dict[int, PlacedPipeline], room: dict[int, int], n: int
) -> list[tuple[int, ...]]:
    """Sets of datacenters that hold ``n`` islands and need each member, best first."""
    eligible = sorted(pipes, key=lambda d: (pipes[d].seconds, -room[d], d))[:MAX_DATACENTERS]
    sets = []
    for mask in range(1, 1 << len(eligible)):
        members = tuple(sorted(d for i, d in enumerate(eligible) if mask >> i & 1))
        total = sum(room[d] for d in members)
        if len(members) > n or total < n or any(total - room[d] >= n for d in members):
            continue
        sets.append(members)
    sets.sort(key=lambda s: (max(pipes[d].seconds for d in s), len(s), _ring_km(problem, s), s))
    return sets


def _splits(members: Sequence[int], room: dict[int, int], n: int) -> Iterator[dict[int, int]]:
    """Every way to put ``n`` islands in ``members``, at least one in each, within its room."""
    if len(members) == 1:
        if 1 <= n <= room[members[0]]:
            yield {members[0]: n}
        return
    head, rest = members[0], members[1:]
    for k in range(1, min(room[head], n - len(rest)) + 1):
        for split in _splits(rest, room, n - k):
            yield {head: k, **split}


def _fills(members: Sequence[int], room: dict[int, int], n: int) -> list[dict[int, int]]:
    """The splits of ``n`` islands over ``members`` to cost: all of them when few
    (:data:`MAX_FILLS`), else the even one (where the cost model's hierarchical all-reduce
    applies) and the one that fills the datacenters with most room first."""
    every = list(itertools.islice(_splits(members, room, n), MAX_FILLS + 1))
    if len(every) <= MAX_FILLS:
        return every
    packed, left = {}, n
    for d in sorted(members, key=lambda d: (-room[d], d)):
        packed[d] = min(room[d], left)
        left -= packed[d]
    per, extra = divmod(n, len(members))
    even = {d: per for d in members}
    return [packed] + ([even] if not extra and all(per <= room[d] for d in members) else [])


def _whole_islands(
    built: BuiltProblem,
    ij: JobSpec,
    n: int,
    pipes: dict[int, PlacedPipeline],
    results: dict[int, PlacementResult],
    room: dict[int, int],
    score: Callable[[list[Island]], float],
    floor_s: float,
) -> tuple[list[Island], bool, int]:
    """The best set of datacenters and split of ``n`` whole islands over them (``score``: their
    iteration, at least the slowest pipeline and ``floor_s``); whether the search was exhaustive,
    and how many it costed."""
    best: tuple[float, list[Island]] | None = None
    costed, exhaustive = 0, True
    for members in _candidate_sets(built.problem, pipes, room, n):
        bound = max(pipes[d].seconds for d in members) + floor_s
        if best is not None and bound >= best[0]:
            break  # the sets come slowest pipeline last
        fills = _fills(members, room, n)
        exhaustive = exhaustive and len(fills) <= MAX_FILLS
        for counts in fills:
            if costed == MAX_COSTED:
                assert best is not None
                return best[1], False, costed
            devices = _Devices.of(built.topology)
            islands = [
                Island(built, results[d], pipes[d], devices.take((d,) * ij.pp, ij))
                for d in sorted(counts)
                for _ in range(counts[d])
            ]
            costed += 1
            value = score(islands)
            if best is None or value < best[0]:
                best = (value, islands)
    if best is None:
        raise Infeasible(f"no set of datacenters holds {n} islands")
    return best[1], exhaustive, costed


def _one_at_a_time(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    ij: JobSpec,
    n: int,
    first: BuiltProblem,
    solve: Solve,
    calib: Calibration,
    k_paths: int,
    held: dict[int, int],
) -> tuple[list[Island], dict[int, int], int]:
    """``n`` islands placed in turn by ``solve`` on what the ones before left and ``held``
    (problem link -> units as bits) does not; the units their crossings reserve, and the
    solvers' candidates."""
    free = list(first.problem.free_devices)
    taken = dict(held)
    devices = _Devices.of(first.topology)
    islands: list[Island] = []
    candidates = 0
    for i in range(n):
        prev = islands[-1] if islands else None
        need = [0] * len(free)
        for d in prev.result.placement.dcs if prev else ():
            need[d] += ij.tp * ij.ep
        fits = all(u <= f for u, f in zip(need, free, strict=True))
        if prev is not None and not any(prev.result.placement.routes) and fits:
            # The same place again: still free, nothing to route, and no better once others left
            # (the problem only lost capacity since).
            built, result = prev.built, prev.result
        else:
            units = {lid: first.problem.links[lid].units for lid in taken}
            busy = {
                first.link_ids[lid]: frozenset(u for u in range(units[lid]) if bits >> u & 1)
                for lid, bits in taken.items()
            }
            built = build_problem(
                cluster, model, ij, busy, k_paths, calib, free_devices=tuple(free)
            )
            try:
                result = solve(built.problem)
            except Infeasible as exc:
                raise Infeasible(f"island {i + 1} of {n}: {exc}") from None
            candidates += result.candidates
        dcs = result.placement.dcs
        for b, route in enumerate(result.placement.routes):
            if route is not None:
                path = built.problem.paths[(dcs[b], dcs[b + 1])][route.path]
                reserve(path, route.start, route.units, taken)
        for d in dcs:
            free[d] -= ij.tp * ij.ep
        pipe = placed_pipeline(built, result, ij)
        islands.append(Island(built, result, pipe, devices.take(dcs, ij)))
    return islands, {lid: bits & ~held.get(lid, 0) for lid, bits in taken.items()}, candidates


def place_islands(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    solve: Solve,
    solver: str,
    optimizer_s: float,
    calib: Calibration = DEFAULT_CALIBRATION,
    k_paths: int = 2,
) -> IslandPlacement:
    """Place the ``dp / ep`` islands of ``job`` (a round mode's) as the module docstring says.

    ``solve`` places one island's pipeline when islands cannot all be whole (``solver`` names
    it in the record); ``optimizer_s`` is the optimizer step of an iteration (the cost model's).
    Raises :class:`Infeasible` with the binding constraint.
    """
    t0 = time.perf_counter()
    # every island runs at once: devices that share a machine's cores get the whole job's
    # share of them, not one island's
    cluster = on_cores(cluster, job.devices)
    ij, n = island_job(job), job.dp // job.ep
    built = build_problem(cluster, model, ij, k_paths=k_paths, calib=calib)
    problem = built.problem
    if all(c is None for row in problem.compute_us for c in row):
        raise Infeasible("no datacenter's devices can hold a stage (memory)")
    comm = CommModel(built.topology, calib)
    payloads = exchange_payloads(model, job)
    results: dict[int, PlacementResult] = {}
    pipes: dict[int, PlacedPipeline] = {}
    room: dict[int, int] = {}
    for d in range(problem.n_dcs):
        placement = Placement((d,) * ij.pp, (None,) * (ij.pp - 1))
        value = evaluate(problem, placement)
        if value is not None:
            results[d] = PlacementResult(placement, value, "islands", 0.0, optimal=True)
            pipes[d] = placed_pipeline(built, results[d], ij)
            room[d] = problem.free_devices[d] // ij.devices

    def score(islands: list[Island]) -> float:
        return sum(_breakdown(islands, comm, job, payloads, optimizer_s).values())

    def exchange_of(islands: list[Island]) -> tuple[dict[str, float], dict[tuple[int, int], float]]:
        breakdown = _breakdown(islands, comm, job, payloads, optimizer_s)
        round_s = job.sync.inner_steps * sum(breakdown.values())
        replicas = [r for i in islands for r in i.replicas]
        return breakdown, exchange_rates(comm, job, replicas, payloads, round_s)

    if sum(room.values()) >= n:
        islands, optimal, candidates = _whole_islands(
            built, ij, n, pipes, results, room, score, optimizer_s
        )
        breakdown, rates = exchange_of(islands)
        routes = reserve_exchange(problem, rates, {})
        name = "islands"
    else:
        optimal, name = False, f"islands/{solver}"
        held: dict[int, int] = {}
        while True:
            islands, taken, candidates = _one_at_a_time(
                cluster, model, ij, n, built, solve, calib, k_paths, held
            )
            breakdown, rates = exchange_of(islands)
            try:
                routes = reserve_exchange(problem, rates, taken)
                break
            except Infeasible:
                if held:
                    raise
                held = headroom(problem, rates)  # and place the islands once more
    crit = max(islands, key=lambda i: i.pipeline.seconds)
    record = PlacementResult(
        crit.result.placement,
        crit.result.objective,
        name,
        time.perf_counter() - t0,
        optimal=optimal,
        gap_pct=0.0 if optimal else None,
        candidates=candidates,
    )
    return IslandPlacement(
        ij,
        tuple(islands),
        breakdown,
        routes,
        record,
    )
