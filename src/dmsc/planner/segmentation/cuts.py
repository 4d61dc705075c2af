"""Segmentation of a model into micro-models: by layers, by blocks, by business (task heads).

- Layer-based: contiguous layers per stage. :func:`segment_layers` is an exact dynamic program
  that minimises the slowest stage (its compute on its own device plus sending its boundary
  activation) under each stage's memory, for heterogeneous stages too.
- Block-based: a model given as a graph of blocks (not a chain) is split into groups, one per
  node, that form a chain of micro-models (every edge goes to the same or a later group: data
  never flows back), by :func:`segment_blocks_tabu` (tabu search, as 002_0021f8a50f21532c.txt
  suggests for cut points); :func:`segment_blocks_exact` enumerates every chain grouping of
  small graphs. A graph with a cycle is refused (:class:`CyclicBlockGraph` names the cycle).
- Business-based: :func:`segment_business` makes the shared backbone one micro-model and each
  task head its own.
All functions are pure: costs in, cuts out.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx


class SegmentationInfeasible(ValueError):
    """No segmentation meets the memory limits."""


@dataclass(frozen=True)
class LayerSegmentation:
    """Stage ``i`` holds layers ``ranges[i]``; ``cost`` is the slowest stage's time."""

    ranges: tuple[range, ...]
    stage_costs: tuple[float, ...]

    @property
    def cost(self) -> float:
        return max(self.stage_costs)


def _over(used: float, capacity: float) -> bool:
    """Over capacity, beyond float rounding of the sums."""
    return used > capacity + 1e-9 * max(1.0, abs(capacity))


def _stage_cost(
    compute: Sequence[float],
    send: Sequence[float],
    speed: float,
    lo: int,
    hi: int,
    prefix: Sequence[float],
    last: bool,
    offset: float = 0.0,
) -> float:
    work = (prefix[hi] - prefix[lo]) / speed
    return work + (0.0 if last else send[hi - 1]) + offset


@dataclass(frozen=True)
class _Extras:
    """Optional per-stage terms: a fixed time, and activations held ``inflight`` times."""

    offsets: Sequence[float]
    activation: Sequence[float]
    inflight: Sequence[float]

    @classmethod
    def of(
        cls,
        n: int,
        k: int,
        offsets: Sequence[float] | None,
        activation: Sequence[float] | None,
        inflight: Sequence[float] | None,
    ) -> _Extras:
        return cls(
            offsets if offsets is not None else [0.0] * k,
            activation if activation is not None else [0.0] * n,
            inflight if inflight is not None else [0.0] * k,
        )


def segment_layers(
    compute: Sequence[float],
    memory: Sequence[float],
    send: Sequence[float],
    speeds: Sequence[float],
    capacities: Sequence[float],
    offsets: Sequence[float] | None = None,
    activation: Sequence[float] | None = None,
    inflight: Sequence[float] | None = None,
) -> LayerSegmentation:
    """Cut ``len(compute)`` layers into ``len(speeds)`` contiguous non-empty stages.

    ``compute[l]``: time of layer ``l`` on a unit-speed device; ``memory[l]``: its bytes;
    ``send[l]``: time to send layer ``l``'s output to the next stage; stage ``i`` runs at
    ``speeds[i]`` with ``capacities[i]`` bytes, plus ``offsets[i]`` of fixed time (its boundary
    transfers, when they do not depend on the cut) and ``inflight[i]`` copies of the layers'
    ``activation`` bytes (micro-batches in flight). Minimises the slowest stage exactly, in
    O(stages x layers^2).
    """
    n, k = len(compute), len(speeds)
    ex = _Extras.of(n, k, offsets, activation, inflight)
    act_prefix = [0.0]
    for a in ex.activation:
        act_prefix.append(act_prefix[-1] + a)
    if not (len(memory) == len(send) == n and len(capacities) == k):
        raise ValueError("compute, memory and send need one entry per layer; capacities per stage")
    if k > n:
        raise SegmentationInfeasible(f"{k} stages need at least {k} layers, there are {n}")
    prefix = [0.0]
    mem_prefix = [0.0]
    for c, mb in zip(compute, memory, strict=True):
        prefix.append(prefix[-1] + c)
        mem_prefix.append(mem_prefix[-1] + mb)
    INF = math.inf
    # best[i][j]: the slowest of stages 0..i-1 holding layers 0..j-1; arg for the cut.
    best = [[INF] * (n + 1) for _ in range(k + 1)]
    cut = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for i in range(1, k + 1):
        last = i == k
        for j in range(i, n - (k - i) + 1):
            for lo in range(i - 1, j):
                if best[i - 1][lo] == INF:
                    continue
                used = mem_prefix[j] - mem_prefix[lo]
                used += ex.inflight[i - 1] * (act_prefix[j] - act_prefix[lo])
                if _over(used, capacities[i - 1]):
                    continue
                stage = _stage_cost(
                    compute, send, speeds[i - 1], lo, j, prefix, last, ex.offsets[i - 1]
                )
                c = max(best[i - 1][lo], stage)
                if c < best[i][j]:
                    best[i][j] = c
                    cut[i][j] = lo
    if best[k][n] == INF:
        raise SegmentationInfeasible("no cut of the layers fits every stage's memory")
    ranges: list[range] = []
    j = n
    for i in range(k, 0, -1):
        lo = cut[i][j]
        ranges.append(range(lo, j))
        j = lo
    ranges.reverse()
    costs = tuple(
        _stage_cost(compute, send, speeds[i], r.start, r.stop, prefix, i == k - 1, ex.offsets[i])
        for i, r in enumerate(ranges)
    )
    return LayerSegmentation(tuple(ranges), costs)


def segment_layers_bruteforce(
    compute: Sequence[float],
    memory: Sequence[float],
    send: Sequence[float],
    speeds: Sequence[float],
    capacities: Sequence[float],
    offsets: Sequence[float] | None = None,
    activation: Sequence[float] | None = None,
    inflight: Sequence[float] | None = None,
) -> LayerSegmentation:
    """Every placement of the cuts (the reference for :func:`segment_layers`)."""
    n, k = len(compute), len(speeds)
    ex = _Extras.of(n, k, offsets, activation, inflight)
    prefix = [0.0]
    for c in compute:
        prefix.append(prefix[-1] + c)
    best: LayerSegmentation | None = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        ranges = tuple(range(bounds[i], bounds[i + 1]) for i in range(k))
        if any(
            _over(
                sum(memory[r.start : r.stop])
                + ex.inflight[i] * sum(ex.activation[r.start : r.stop]),
                capacities[i],
            )
            for i, r in enumerate(ranges)
        ):
            continue
        costs = tuple(
            _stage_cost(
                compute, send, speeds[i], r.start, r.stop, prefix, i == k - 1, ex.offsets[i]
            )
            for i, r in enumerate(ranges)
        )
        if best is None or max(costs) < best.cost:
            best = LayerSegmentation(ranges, costs)
    if best is None:
        raise SegmentationInfeasible("no cut of the layers fits every stage's memory")
    return best


class CyclicBlockGraph(ValueError):
    """The blocks' edges form a cycle: no chain of micro-models can hold them."""

    def __init__(self, cycle: Sequence[str]) -> None:
        self.cycle = tuple(cycle)
        super().__init__("the blocks form a cycle: " + " -> ".join([*cycle, cycle[0]]))


def block_order(graph: nx.DiGraph) -> list[str]:
    """The blocks in topological order (ties by name); a graph with a cycle has none and raises
    :class:`CyclicBlockGraph` naming one of its cycles."""
    try:
        return list(nx.lexicographical_topological_sort(graph))
    except nx.NetworkXUnfeasible:
        raise CyclicBlockGraph([u for u, _ in nx.find_cycle(graph)]) from None


@dataclass(frozen=True)
class BlockSegmentation:
    """Group of each block, and the objective: slowest group plus the heaviest cut traffic.

    Groups form a chain: every edge goes from a group to the same or a later one, so group
    ``k`` only reads what groups ``0..k-1`` produced and data never flows back."""

    groups: dict[str, int]
    cost: float


def block_cost(graph: nx.DiGraph, groups: dict[str, int], n_groups: int, bandwidth: float) -> float:
    """Slowest group's compute plus the time of the inter-group transfers it waits on.

    Node attribute ``compute`` (s), edge attribute ``bytes``; ``bandwidth`` in bytes/s.
    """
    load = [0.0] * n_groups
    for node, data in graph.nodes(data=True):
        load[groups[node]] += data["compute"]
    incoming = [0.0] * n_groups
    for u, v, data in graph.edges(data=True):
        if groups[u] != groups[v]:
            incoming[groups[v]] += data["bytes"] / bandwidth
    return max(load[g] + incoming[g] for g in range(n_groups))


def is_chain(graph: nx.DiGraph, groups: Mapping[str, int]) -> bool:
    """Every edge stays in its group or goes to a later one (no data flows back)."""
    return all(groups[u] <= groups[v] for u, v in graph.edges)


def group_inputs(graph: nx.DiGraph, groups: Mapping[str, int], n_groups: int) -> list[list[int]]:
    """For each group, the (earlier) groups it reads from, in order."""
    reads: list[set[int]] = [set() for _ in range(n_groups)]
    for u, v in graph.edges:
        if groups[u] != groups[v]:
            reads[groups[v]].add(groups[u])
    return [sorted(r) for r in reads]


def _valid(graph: nx.DiGraph, groups: dict[str, int], n_groups: int, memory: float) -> bool:
    used = [0.0] * n_groups
    for node, data in graph.nodes(data=True):
        used[groups[node]] += data.get("memory", 0.0)
    return (
        all(not _over(u, memory) for u in used)
        and len(set(groups.values())) == n_groups
        and is_chain(graph, groups)
    )


def _check_groups(graph: nx.DiGraph, n_groups: int) -> list[str]:
    order = block_order(graph)
    if n_groups <= 0:
        raise ValueError("the number of groups must be positive")
    if len(order) < n_groups:
        raise SegmentationInfeasible(f"{n_groups} groups need at least {n_groups} blocks")
    return order


def segment_blocks_exact(
    graph: nx.DiGraph, n_groups: int, bandwidth: float, memory: float = math.inf
) -> BlockSegmentation:
    """Every chain grouping of the blocks (depth-first along a topological order, a block's
    group at least its inputs' groups): small graphs only."""
    order = _check_groups(graph, n_groups)
    preds = {n: list(graph.predecessors(n)) for n in order}
    mem = {n: graph.nodes[n].get("memory", 0.0) for n in order}
    groups: dict[str, int] = {}
    used = [0.0] * n_groups
    count = [0] * n_groups  # blocks per group so far
    best: BlockSegmentation | None = None

    def visit(i: int, empty: int) -> None:
        nonlocal best
        if i == len(order):
            c = block_cost(graph, groups, n_groups, bandwidth)
            if best is None or c < best.cost:
                best = BlockSegmentation(dict(groups), c)
            return
        n = order[i]
        left = len(order) - i - 1  # blocks still to place after this one
        for g in range(max((groups[p] for p in preds[n]), default=0), n_groups):
            now_empty = empty - (count[g] == 0)
            if now_empty > left or _over(used[g] + mem[n], memory):
                continue  # the blocks left cannot fill every group, or over memory
            groups[n] = g
            used[g] += mem[n]
            count[g] += 1
            visit(i + 1, now_empty)
            used[g] -= mem[n]
            count[g] -= 1
        groups.pop(n, None)

    visit(0, n_groups)
    if best is None:
        raise SegmentationInfeasible("no chain grouping of the blocks fits the memory")
    return best


def _start_groups(graph: nx.DiGraph, order: Sequence[str], n_groups: int) -> dict[str, int]:
    """The topological order cut into ``n_groups`` non-empty runs of about equal compute."""
    total = sum(graph.nodes[n]["compute"] for n in order)
    groups: dict[str, int] = {}
    acc, prev = 0.0, -1
    for i, n in enumerate(order):
        target = min(n_groups - 1, int(acc / total * n_groups)) if total else 0
        g = max(prev, min(target, prev + 1), n_groups - (len(order) - i))
        groups[n] = prev = g
        acc += graph.nodes[n]["compute"]
    return groups


def segment_blocks_tabu(
    graph: nx.DiGraph,
    n_groups: int,
    bandwidth: float,
    memory: float = math.inf,
    seed: int = 0,
    iterations: int = 500,
    tenure: int = 7,
) -> BlockSegmentation:
    """Tabu search over chain groupings (moves: one block to another group), from the
    topological order cut into runs of equal compute; groupings that are not chains or do not
    fit memory are crossed at a penalty, never returned."""
    rng = random.Random(seed)
    order = _check_groups(graph, n_groups)
    # A grouping over memory or with an edge back to an earlier group stays reachable at a
    # penalty above every valid grouping (the slowest group cannot take longer than all compute
    # and all transfers), growing with the excess and the edges back, so the search can cross
    # such groupings on its way to better ones.
    scale = float(sum(graph.nodes[n]["compute"] for n in order)) + sum(
        float(d["bytes"]) / bandwidth for _, _, d in graph.edges(data=True)
    )

    def value(gs: dict[str, int]) -> float:
        """The grouping's cost, or a penalty above all costs when it is not valid."""
        if len(set(gs.values())) != n_groups:
            return math.inf
        used = [0.0] * n_groups
        for n in order:
            used[gs[n]] += graph.nodes[n].get("memory", 0.0)
        cost = block_cost(graph, gs, n_groups, bandwidth)
        back = sum(1 for u, v in graph.edges if gs[u] > gs[v])
        if not back and not any(_over(u, memory) for u in used):
            return cost
        excess = sum(max(0.0, u - memory) for u in used) / max(memory, 1e-300)
        return cost + scale * (1.0 + excess + back)

    def fits(gs: dict[str, int]) -> bool:
        return _valid(graph, gs, n_groups, memory)

    current = _start_groups(graph, order, n_groups)
    start = value(current)
    best = BlockSegmentation(dict(current), start if fits(current) else math.inf)
    tabu: dict[tuple[str, int], int] = {}
    # A tenure as long as the neighbourhood would forbid every move: at most half of it.
    tenure = max(1, min(tenure, len(order) * (n_groups - 1) // 2))
    for it in range(iterations):
        candidates = []
        for n in order:
            for g in range(n_groups):
                if g == current[n]:
                    continue
                trial = dict(current)
                trial[n] = g
                v = value(trial)
                if tabu.get((n, g), -1) >= it and v >= best.cost:
                    continue
                candidates.append((v, rng.random(), n, g, trial))
        if not candidates:
            break
        v, _, n, g, trial = min(candidates, key=lambda c: (c[0], c[1]))
        tabu[(n, current[n])] = it + tenure
        current = trial
        if v < best.cost and fits(trial):
            best = BlockSegmentation(dict(trial), v)
    if best.cost == math.inf:
        raise SegmentationInfeasible("tabu search found no chain grouping that fits the memory")
    return best


@dataclass(frozen=True)
class MicroModel:
    """A micro-model of a business segmentation: its name, its layers and what it reads."""

    name: str
    layers: tuple[str, ...]
    reads_from: str | None


def segment_business(
    backbone: Sequence[str], heads: Mapping[str, Sequence[str]]
) -> list[MicroModel]:
    """The shared backbone as one micro-model and every task head as its own, reading the
    backbone's output."""
    if not backbone:
        raise ValueError("the backbone needs at least one layer")
    out = [MicroModel("backbone", tuple(backbone), None)]
    for name, layers in sorted(heads.items()):
        if not layers:
            raise ValueError(f"head {name!r} has no layers")
        out.append(MicroModel(f"head:{name}", tuple(layers), "backbone"))
    return out
