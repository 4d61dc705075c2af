"""The placement problem: pipeline stages onto datacenters, stage boundaries onto network paths.

A pure description, in integer microseconds so that every solver (the exact model, brute force,
the heuristics) scores a solution identically. Stage ``s`` needs ``devices[s]`` devices of one
datacenter and runs a micro-batch in ``compute_us[s][d]`` there (``None``: it cannot). When
stages ``s`` and ``s + 1`` sit in different datacenters, their boundary needs a path between them
with ``n`` capacity units (frequency slots, or shares of a Gbit/s link) reserved on every link of
the path, the same contiguous range on each (spectrum continuity and contiguity).

A residency rule of the cluster (:mod:`dmsc.spec.residency`) keeps the model's stages, which
hold its weights, in ``resident_dcs`` (None: anywhere); ``residency_rules`` name the rules that
narrowed it, for the message when no placement remains.

Score of a solution (micro-batch time of stage ``s`` is ``t_s = compute + 2 max(c_in, c_out)``,
one blocking exchange per direction, each as slow as the slower neighbouring boundary):
``m * max_s t_s + (p - 1) / v * mean_s t_s``, held as the integer ``v p m max t + (p - 1) sum t``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PathOption:
    """One candidate route between two datacenters."""

    links: tuple[int, ...]  # indexes into PlacementProblem.links
    km: float
    latency_us: int
    gbit_s_per_unit: float  # line rate one capacity unit carries on this path


@dataclass(frozen=True)
class LinkState:
    """A link's capacity units and those already taken (by other jobs)."""

    name: str
    units: int
    busy: frozenset[int] = frozenset()

    @property
    def busy_mask(self) -> int:
        """The busy units as the bits of one integer (cached)."""
        cached = self.__dict__.get("_busy_mask")
        if cached is None:
            cached = sum(1 << u for u in self.busy)
            object.__setattr__(self, "_busy_mask", cached)
        return cached


@dataclass(frozen=True)
class PlacementProblem:
    """Everything a placement solver needs; see the module docstring."""

    dc_names: tuple[str, ...]
    free_devices: tuple[int, ...]
    devices: tuple[int, ...]  # per stage
    compute_us: tuple[tuple[int | None, ...], ...]  # [stage][dc]
    boundary_bytes: tuple[float, ...]  # per boundary (stage s -> s+1), per micro-batch
    local_us: tuple[tuple[int, ...], ...]  # [boundary][dc]: transfer time inside one DC
    links: tuple[LinkState, ...]
    paths: dict[tuple[int, int], tuple[PathOption, ...]]  # (dc a, dc b) -> options
    levels: tuple[int, ...]  # capacity units a boundary may reserve
    microbatches: int = 8
    chunks: int = 1
    link_efficiency: float = 0.95
    resident_dcs: frozenset[int] | None = None
    residency_rules: tuple[str, ...] = ()
    cross_us_cache: dict[tuple[int, int, int, int, int], int] = field(
        default_factory=dict, compare=False, repr=False
    )
    # What the routing step derives from the problem alone (see dmsc.planner.placement.routing).
    routing_cache: dict[tuple[object, ...], object] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    @property
    def n_stages(self) -> int:
        return len(self.devices)

    @property
    def n_dcs(self) -> int:
        return len(self.dc_names)

    def may_hold(self, d: int) -> bool:
        """Whether datacenter ``d`` may hold the model's weights (residency)."""
        return self.resident_dcs is None or d in self.resident_dcs

    def cross_us(self, b: int, a: int, z: int, k: int, n: int) -> int:
        """Micro-batch transfer time of boundary ``b`` from DC ``a`` to ``z`` on path ``k``."""
        key = (b, a, z, k, n)
        if key not in self.cross_us_cache:
            path = self.paths[(a, z)][k]
            rate = n * path.gbit_s_per_unit * 1e9 / 8 * self.link_efficiency
            self.cross_us_cache[key] = path.latency_us + round(self.boundary_bytes[b] / rate * 1e6)
        return self.cross_us_cache[key]


@dataclass(frozen=True)
class Reservation:
    """A cross-datacenter boundary's reservation: path option, units and first unit."""

    path: int
    units: int
    start: int


@dataclass(frozen=True)
class Placement:
    """A solution: the datacenter of each stage and the route of each crossing boundary."""

    dcs: tuple[int, ...]
    routes: tuple[Reservation | None, ...]  # per boundary; None when both stages share a DC


def boundary_us(
    problem: PlacementProblem, dcs: Sequence[int], routes: Sequence[Reservation | None]
) -> list[int]:
    out = []
    for b in range(problem.n_stages - 1):
        a, z = dcs[b], dcs[b + 1]
        r = routes[b]
        if a == z:
            out.append(problem.local_us[b][a])
        else:
            assert r is not None
            out.append(problem.cross_us(b, a, z, r.path, r.units))
    return out


def stage_us(problem: PlacementProblem, dcs: Sequence[int], comm: Sequence[int]) -> list[int]:
    n = len(problem.devices)
    compute = problem.compute_us
    times = []
    for s in range(n):
        c = compute[s][dcs[s]]
        assert c is not None
        before = comm[s - 1] if s > 0 else 0
        after = comm[s] if s < n - 1 else 0
        times.append(c + 2 * (before if before > after else after))
    return times


def score(problem: PlacementProblem, stage_times: Sequence[int]) -> int:
    """The integer objective ``v p m max t + (p - 1) sum t`` (see the module docstring)."""
    p, m, v = problem.n_stages, problem.microbatches, problem.chunks
    return v * p * m * max(stage_times) + (p - 1) * sum(stage_times)


def score_to_seconds(problem: PlacementProblem, value: int) -> float:
    """The objective as seconds of pipeline time per iteration."""
    return value / (problem.chunks * problem.n_stages) * 1e-6


def capacity_ok(problem: PlacementProblem, dcs: Sequence[int]) -> bool:
    used = [0] * len(problem.dc_names)
    devices, compute = problem.devices, problem.compute_us
    for s, d in enumerate(dcs):
        used[d] += devices[s]
        if compute[s][d] is None or not problem.may_hold(d):
            return False
    return all(u <= f for u, f in zip(used, problem.free_devices, strict=True))


def spectrum_ok(
    problem: PlacementProblem, dcs: Sequence[int], routes: Sequence[Reservation | None]
) -> bool:
    """Every reserved range inside its links, clear of busy units and of the other ranges."""
    taken: dict[int, set[int]] = {}
    for b, r in enumerate(routes):
        if r is None:
            continue
        path = problem.paths[(dcs[b], dcs[b + 1])][r.path]
        want = set(range(r.start, r.start + r.units))
        for lid in path.links:
            link = problem.links[lid]
            if r.start < 0 or r.start + r.units > link.units or want & link.busy:
                return False
            have = taken.setdefault(lid, set())
            if want & have:
                return False
            have |= want
    return True


def evaluate(problem: PlacementProblem, placement: Placement) -> int | None:
    """The objective of a placement, or None when it breaks a constraint."""
    dcs, routes = placement.dcs, placement.routes
    if len(dcs) != problem.n_stages or not capacity_ok(problem, dcs):
        return None
    for b in range(problem.n_stages - 1):
        if (dcs[b] != dcs[b + 1]) != (routes[b] is not None):
            return None
    if not spectrum_ok(problem, dcs, routes):
        return None
    return score(problem, stage_us(problem, dcs, boundary_us(problem, dcs, routes)))


def first_fit(
    problem: PlacementProblem, path: PathOption, units: int, taken: dict[int, int]
) -> int | None:
    """Lowest start of ``units`` contiguous units free on every link of ``path``.

    Units are bits of Python integers (bit ``u`` set: unit ``u`` in use); ``taken`` maps a link to
    the units reserved so far by this solution. A run of ``units`` free bits starting at ``s`` is
    a set bit ``s`` of ``free & free >> 1 & ... & free >> (units - 1)`` (measured ~10x faster
    than set operations in the tabu search's inner loop).
    """
    limit = min(problem.links[lid].units for lid in path.links)
    if units > limit:
        return None
    blocked = 0
    for lid in path.links:
        blocked |= problem.links[lid].busy_mask | taken.get(lid, 0)
    free = ~blocked & ((1 << limit) - 1)
    run = free
    for shift in range(1, units):
        run &= free >> shift
        if not run:
            return None
    if not run:
        return None
    return (run & -run).bit_length() - 1


def reserve(path: PathOption, start: int, units: int, taken: dict[int, int]) -> None:
    bits = ((1 << units) - 1) << start
    for lid in path.links:
        taken[lid] = taken.get(lid, 0) | bits


@dataclass(frozen=True)
class PlacementResult:
    """A solver's answer with its search record."""

    placement: Placement
    objective: int
    solver: str
    seconds: float
    optimal: bool = False
    gap_pct: float | None = None
    candidates: int = 0
    notes: tuple[str, ...] = ()


class Infeasible(ValueError):
    """No placement satisfies the constraints; the message names the binding one."""
