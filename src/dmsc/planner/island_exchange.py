"""The exchange between islands (:mod:`dmsc.planner.islands`): what a round costs and what it
reserves.

- **Its time is the cost model's** (:mod:`dmsc.netmodel.sync`): the collective over the
  replicas' own devices (a ring in data-parallel rank order, islands by datacenter), every stage
  at once, its payload compressed as the job says, with the compute on its path (the codec's
  passes, the leader's rule: ``work_s``), once per round, less what the inner steps hide
  (``exposed_s``): what ``estimate_iteration`` costs on its own rank layout, on the placed one.
- **Its reservation is amortised per round.** Between each pair of datacenters its rings
  join, the fewest units (a level of the problem) whose rate carries what the ring's hops
  between them send in a round within the round (``H`` iterations: the plan's iteration times
  ``H``), at most an even share of each link among the pairs whose route crosses it, first-fit
  on the first route (by length) with room. Its time stays the cost model's, at the links'
  rates: the burst at the end of a round rides on what no reservation holds, and the
  reservation is the share of the link the job keeps in steady state (the simulator's island
  jobs also hold only the rate that moves a payload per round). Reserving the burst's rate
  instead would hold a link's capacity for a transfer made once in ``H`` iterations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dmsc.netmodel import DTYPE_BYTES, CommCost, CommModel, build_layer_costs
from dmsc.netmodel.comm import Group
from dmsc.netmodel.iteration import assign_stage_layers
from dmsc.netmodel.sync import (
    bucketed,
    exchange,
    host_side,
    stage_payload,
    vocab_matrix,
    work_s,
)
from dmsc.planner.placement.problem import (
    Infeasible,
    PathOption,
    PlacementProblem,
    Reservation,
    first_fit,
    reserve,
)
from dmsc.spec import JobSpec, LayerListSpec, TransformerSpec

Replica = tuple[tuple[int, ...], ...]  # [stage] -> its tensor-parallel devices


@dataclass(frozen=True)
class ExchangeRoute:
    """A reservation for the exchange between datacenters ``a`` and ``z`` (``a < z``)."""

    a: int
    z: int
    route: Reservation


def ring(items: Sequence[int]) -> list[tuple[int, int]]:
    """The hops of a ring through ``items`` in order, as the cost model's ring takes them (both
    ways between two items)."""
    n = len(items)
    return [(items[i], items[(i + 1) % n]) for i in range(n)] if n > 1 else []


@dataclass(frozen=True)
class Payloads:
    """What one device puts into a round's exchange, its stage's, the largest: bytes on the
    wire and fp32 elements of its update (what the codec and the leader work on), each for the
    dense parameters and the experts'."""

    dense: float
    expert: float
    dense_elements: float = 0.0
    expert_elements: float = 0.0


def exchange_payloads(model: TransformerSpec | LayerListSpec, job: JobSpec) -> Payloads:
    """What one device puts into a round's exchange (:class:`Payloads`)."""
    layers = build_layer_costs(model, job)
    vocab = vocab_matrix(layers)
    stages = assign_stage_layers(layers, job)
    per = [
        stage_payload(ms, DTYPE_BYTES[model.dtype], job.sync.compression, vocab) for ms in stages
    ]
    experts = [sum(lc.expert_params_per_device for lc in ms) for ms in stages]
    dense = [sum(lc.params_per_device for lc in ms) for ms in stages]
    dense = [whole - expert for whole, expert in zip(dense, experts, strict=True)]
    return Payloads(max(d for d, _ in per), max(e for _, e in per), max(dense), max(experts))


def _groups(
    replicas: Sequence[Replica], job: JobSpec, payloads: Payloads
) -> list[tuple[list[Group], float, float]]:
    """The exchange's groups and what each rank puts in (bytes, elements): every stage's
    tensor-parallel ranks over all replicas (dense), and the replicas of the same experts (one
    per island)."""
    dense = [tuple(rep[s][t] for rep in replicas) for s in range(job.pp) for t in range(job.tp)]
    out = [(dense, payloads.dense, payloads.dense_elements)]
    if payloads.expert and job.dp // job.ep > 1:
        expert = [
            tuple(rep[s][t] for rep in replicas[i :: job.ep])
            for s in range(job.pp)
            for t in range(job.tp)
            for i in range(job.ep)
        ]
        out.append((expert, payloads.expert, payloads.expert_elements))
    return out


def exchange_cost(
    comm: CommModel, job: JobSpec, replicas: Sequence[Replica], payloads: Payloads
) -> CommCost:
    """One round's exchange between ``replicas`` (in data-parallel rank order): its time with
    the compute on its path (the codec's passes, the leader's rule: :func:`work_s`, at the
    first device's host side: :func:`host_side`), as ``estimate_iteration`` prices it."""
    codec = job.sync.compression
    time_s, sent, links = 0.0, 0.0, dict[int, float]()
    for groups, payload, elements in _groups(replicas, job, payloads):
        cost = exchange(comm, groups, payload, codec, job.allreduce, job.sync.via)
        device = comm.topo.device_type(groups[0][0])
        host = host_side(device, comm.calib)
        work = work_s(job.sync, max(len(g) for g in groups), elements, host, job.tp)
        if not bucketed(job.sync, job.overlap_dp_comm):  # the quorum before a whole exchange
            work += comm.quorum_s(groups)
        time_s, sent = time_s + cost.time_s + work, sent + cost.bytes_sent
        for lid, nbytes in cost.link_bytes.items():
            links[lid] = links.get(lid, 0.0) + nbytes
    return CommCost(time_s, sent, links)


def exchange_rates(
    comm: CommModel,
    job: JobSpec,
    replicas: Sequence[Replica],
    payloads: Payloads,
    round_s: float,
) -> dict[tuple[int, int], float]:
    """Bytes per second that the exchange needs between each pair of datacenters its rings
    join (the busier way): what its hops between them send in a round, spread over ``round_s``.
    A hop sends what its rank sends (the cost model's bytes over the ranks)."""
    topo, codec = comm.topo, job.sync.compression
    sent: dict[tuple[int, int], float] = {}
    for groups, payload, _ in _groups(replicas, job, payloads):
        cost = exchange(comm, groups, payload, codec, job.allreduce, job.sync.via)
        per_hop = cost.bytes_sent / sum(len(g) for g in groups)
        for group in groups:
            for u, v in ring(group):
                a, z = topo.devices[u].dc, topo.devices[v].dc
                if a != z:
                    sent[(a, z)] = sent.get((a, z), 0.0) + per_hop
    pairs = sorted({(min(a, z), max(a, z)) for a, z in sent})
    return {(a, z): max(sent.get((a, z), 0.0), sent.get((z, a), 0.0)) / round_s for a, z in pairs}


def _shares(problem: PlacementProblem, rates: dict[tuple[int, int], float]) -> dict[int, int]:
    """Units each pair may take of a link: an even share among the pairs whose first route
    crosses it (so that every pair finds room on links nothing else holds)."""
    crossing: dict[int, int] = {}
    for a, z in rates:
        for lid in problem.paths[(a, z)][0].links:
            crossing[lid] = crossing.get(lid, 0) + 1
    return {lid: problem.links[lid].units // n for lid, n in crossing.items()}


def _levels(
    problem: PlacementProblem, option: PathOption, rate_Bps: float, share: dict[int, int]
) -> list[int]:
    """The levels to try for ``rate_Bps`` on ``option``: the fewest units that carry it, or,
    past the pair's share of a link (``share``), the largest level within it; then smaller."""
    unit_Bps = option.gbit_s_per_unit * 1e9 / 8 * problem.link_efficiency
    need = max(1, math.ceil(rate_Bps / unit_Bps))
    cap = min((share.get(lid, problem.links[lid].units) for lid in option.links), default=0)
    allowed = [u for u in problem.levels if u <= cap] or [problem.levels[0]]
    first = next((u for u in allowed if u >= need), allowed[-1])
    return [first, *(u for u in reversed(allowed) if u < first)]


def reserve_exchange(
    problem: PlacementProblem, rates: dict[tuple[int, int], float], taken: dict[int, int]
) -> tuple[ExchangeRoute, ...]:
    """The amortised reservations for ``rates`` (see the module docstring), first-fit around
    ``taken`` (problem link -> units held, as bits), which they join."""
    out = []
    share = _shares(problem, rates)
    for (a, z), rate in rates.items():
        chosen: ExchangeRoute | None = None
        for k, option in enumerate(problem.paths[(a, z)]):
            for units in _levels(problem, option, rate, share):
                start = first_fit(problem, option, units, taken)
                if start is not None:
                    reserve(option, start, units, taken)
                    chosen = ExchangeRoute(a, z, Reservation(k, units, start))
                    break
            if chosen is not None:
                break
        if chosen is None:
            raise Infeasible(
                f"no free capacity between {problem.dc_names[a]} and {problem.dc_names[z]} "
                "for the data-parallel exchange"
            )
        out.append(chosen)
    return tuple(out)


def headroom(problem: PlacementProblem, rates: dict[tuple[int, int], float]) -> dict[int, int]:
    """Units to hold back on each link (the top ones, as bits) so that ``rates`` fit on their
    shortest routes once the pipelines have their share."""
    count: dict[int, int] = {}
    share = _shares(problem, rates)
    for (a, z), rate in rates.items():
        option = problem.paths[(a, z)][0]
        units = _levels(problem, option, rate, share)[0]
        for lid in option.links:
            count[lid] = count.get(lid, 0) + units
    held = {}
    for lid, n in count.items():
        size = problem.links[lid].units
        n = min(n, size)
        held[lid] = ((1 << n) - 1) << (size - n)
    return held
