"""Segmentation of a model into micro-models: by layers, by blocks, by business (task heads).

- Layer-based: contiguous layers per stage. :func:`segment_layers` is an exact dynamic program
  that minimises the slowest stage (its compute on its own device plus sending its boundary
  activation) under each stage's memory, for heterogeneous stages too.
- Block-based: a model given as a graph of blocks (not a chain) is split into groups, one per
  node, by :func:`segment_blocks_tabu` (tabu search, as 002_0021f8a50f21532c.txt suggests for cut
  points); :func:`segment_blocks_exact` enumerates every grouping of small graphs.
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


@dataclass(frozen=True)
class BlockSegmentation:
    """Group of each block, and the objective: slowest group plus the heaviest cut traffic."""

    groups: dict[str, int]
    cost: float


def block_cost(graph: nx.DiGraph, groups: dict[str, int], n_groups: int, bandwidth: float) -> float:
    """Slowest group's compute plus the time of the largest inter-group transfer it waits on.

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


def _valid(graph: nx.DiGraph, groups: dict[str, int], n_groups: int, memory: float) -> bool:
    used = [0.0] * n_groups
    for node, data in graph.nodes(data=True):
        used[groups[node]] += data.get("memory", 0.0)
    return all(u <= memory for u in used) and len(set(groups.values())) == n_groups


def segment_blocks_exact(
    graph: nx.DiGraph, n_groups: int, bandwidth: float, memory: float = math.inf
) -> BlockSegmentation:
    """Every assignment of blocks to groups (n_groups ** blocks): small graphs only."""
    nodes = sorted(graph.nodes)
    best: BlockSegmentation | None = None
    for combo in itertools.product(range(n_groups), repeat=len(nodes)):
        if combo[0] != 0:  # groups are interchangeable: fix the first block's group
            continue
        groups = dict(zip(nodes, combo, strict=True))
        if not _valid(graph, groups, n_groups, memory):
            continue
        c = block_cost(graph, groups, n_groups, bandwidth)
        if best is None or c < best.cost:
            best = BlockSegmentation(groups, c)
    if best is None:
        raise SegmentationInfeasible("no grouping of the blocks fits the memory")
    return best


def segment_blocks_tabu(
    graph: nx.DiGraph,
    n_groups: int,
    bandwidth: float,
    memory: float = math.inf,
    seed: int = 0,
    iterations: int = 500,
    tenure: int = 7,
) -> BlockSegmentation:
    """Tabu search over block-to-group assignments (moves: one block to another group)."""
    rng = random.Random(seed)
    nodes = sorted(graph.nodes)
    if len(nodes) < n_groups:
        raise SegmentationInfeasible(f"{n_groups} groups need at least {n_groups} blocks")
    # Start: topological order cut into equal-compute runs.
    order = list(nx.topological_sort(graph)) if nx.is_directed_acyclic_graph(graph) else nodes
    total = sum(graph.nodes[n]["compute"] for n in order)
    groups: dict[str, int] = {}
    acc = 0.0
    for n in order:
        groups[n] = min(n_groups - 1, int(acc / total * n_groups)) if total else 0
        acc += graph.nodes[n]["compute"]
    for g in range(n_groups):  # every group non-empty
        if g not in groups.values():
            groups[rng.choice(nodes)] = g

    def value(gs: dict[str, int]) -> float:
        if not _valid(graph, gs, n_groups, memory):
            return math.inf
        return block_cost(graph, gs, n_groups, bandwidth)

    current = dict(groups)
    best = BlockSegmentation(dict(current), value(current))
    tabu: dict[tuple[str, int], int] = {}
    for it in range(iterations):
        candidates = []
        for n in nodes:
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
        if v < best.cost:
            best = BlockSegmentation(dict(trial), v)
    if best.cost == math.inf:
        raise SegmentationInfeasible("tabu search found no grouping that fits the memory")
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
