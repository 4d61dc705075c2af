"""Schedulers of the simulator: where a job's stages run and how its transfers are provisioned.

One interface: :meth:`Scheduler.admit` places a new job (GPUs and lightpaths) or blocks it, and
:meth:`Scheduler.update` runs after every event (an arrival or a departure: between events the
network does not change, so this is the per-iteration update of a policy).

- ``baseline`` (communication-unaware): each stage in the datacenter with the most free GPUs,
  every cross-DC boundary a fixed number of slots, k-shortest-path first-fit; never adjusted.
- ``cba``: the CBA policy of 004_899cf4a7bfe92fb3.txt as far as it is described. Placement and
  first provisioning as the baseline (assumption: the paper is about the network side). After
  every event, boundaries are labelled communication-bound (CB) from the current schedule (the
  transfer is slower than the slowest stage, so the next stage waits: a DCI-induced bubble); CB
  transfers are re-provisioned first, most severe first, with the slots that remove the bubble
  (at most ``max_slots``); non-CB transfers holding more than they need give the surplus back
  (assumption: "more slots for CB transfers" taken from those that do not need them).
- ``joint`` (ours): placement, routes and slot counts chosen together by the planner's optimiser
  on the current free GPUs and spectrum (the exact CP-SAT model when the instance is small
  enough, else tabu search), each boundary offered only the slot counts that remove its bubble;
  then the same per-event re-provisioning as ``cba`` (re-planning the network when jobs leave).

Every scheduler places a chain of units (:attr:`JobProfile.units`): a pipeline's stages, or the
islands of a job that synchronises once per round of local steps (``IslandProfile``: a round's
exchange takes the place of a boundary's activations, and islands come in any order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from dmsc.planner.placement.baselines import solve_greedy
from dmsc.planner.placement.milp import solve_milp
from dmsc.planner.placement.problem import (
    Infeasible,
    LinkState,
    PathOption,
    PlacementProblem,
    PlacementResult,
)
from dmsc.planner.placement.tabu import solve_tabu
from dmsc.sim.network import OpticalNetwork, Route
from dmsc.sim.profile import JobProfile
from dmsc.sim.scenario import ScenarioSpec
from dmsc.sim.spectrum import Lightpath


@dataclass
class Transfer:
    """One stage boundary of a running job."""

    boundary: int
    src: int
    dst: int
    route: Route | None = None  # None inside one datacenter
    lightpath: Lightpath | None = None

    def gbit_s(self, profile: JobProfile) -> float:
        if self.route is None or self.lightpath is None:
            return profile.intra_dc_gbit_s
        return self.lightpath.slots * self.route.gbit_s_per_slot

    def propagation_s(self) -> float:
        return self.route.propagation_s if self.route is not None else 0.0


@dataclass
class RunningJob:
    """A job holding GPUs and lightpaths."""

    id: int
    profile: JobProfile
    dcs: list[int]
    transfers: list[Transfer] = field(default_factory=list)

    def transfer_s(self) -> list[float]:
        return [self.profile.transfer_s(t.gbit_s(self.profile)) for t in self.transfers]

    def iteration_s(self) -> float:
        return self.profile.iteration_s(
            self.transfer_s(), [t.propagation_s() for t in self.transfers]
        )

    def compute_only_s(self) -> float:
        p = self.profile
        return (p.microbatches - 1) * max(p.compute_s) + sum(p.compute_s)

    def cb_labels(self) -> list[bool]:
        """Which boundaries are communication-bound in the current schedule."""
        return [x > self.profile.bottleneck_s for x in self.transfer_s()]


@dataclass
class Admission:
    """What an admission attempt did."""

    job: RunningJob | None
    requests: int  # lightpath set-ups asked for
    blocked_requests: int
    reason: str = ""  # "gpu" or "spectrum" when blocked


class Scheduler(Protocol):
    """The interface every scheduler implements."""

    name: ClassVar[str]

    def admit(self, net: OpticalNetwork, profile: JobProfile, job_id: int) -> Admission: ...

    def update(self, net: OpticalNetwork, running: list[RunningJob]) -> None: ...


def release(net: OpticalNetwork, job: RunningJob) -> None:
    """Give back the job's GPUs and lightpaths."""
    for d in job.dcs:
        net.gpus_free[d] += job.profile.unit_gpus
    for t in job.transfers:
        if t.lightpath is not None:
            net.grid.release(t.lightpath.id)
            t.lightpath = None


def _unusable(free: int, n_slots: int, guard: int) -> list[int]:
    """The slots where a lightpath's own slots may not lie, given a link's free-slot mask and
    the guard band: the taken slots, the ``guard`` slots below each taken one (the guard band
    above a lightpath there would land on it) and the top ``guard`` slots. A placement model
    that keeps a lightpath's own slots off these keeps its guard band free too."""
    taken = [u for u in range(n_slots) if not (free >> u) & 1]
    out = {u - j for u in taken for j in range(guard + 1) if u - j >= 0}
    return sorted(out | set(range(max(0, n_slots - guard), n_slots)))


def needed_slots(route: Route, profile: JobProfile, cap: int) -> int:
    return min(cap, route.slots_for(profile.needed_gbit_s()))


def _setup(net: OpticalNetwork, t: Transfer, slots: int, fit: str) -> bool:
    """Set up ``t`` with ``slots`` on the first of the k shortest routes that has room."""
    for route in net.dc_routes(t.src, t.dst):
        lp = net.grid.setup(route.links, slots, fit)  # type: ignore[arg-type]
        if lp is not None:
            t.route, t.lightpath = route, lp
            return True
    return False


def _place_most_free(net: OpticalNetwork, profile: JobProfile) -> list[int] | None:
    dcs: list[int] = []
    for _ in range(profile.units):
        d = max(range(len(net.gpus_free)), key=lambda i: (net.gpus_free[i], -i))
        if net.gpus_free[d] < profile.unit_gpus:
            for back in dcs:
                net.gpus_free[back] += profile.unit_gpus
            return None
        net.gpus_free[d] -= profile.unit_gpus
        dcs.append(d)
    if profile.interchangeable:  # islands: those in one datacenter side by side in the chain
        dcs.sort()
    return dcs


def _provision_fixed(net: OpticalNetwork, job: RunningJob, slots: int, fit: str) -> tuple[int, int]:
    requests = blocked = 0
    for b in range(job.profile.units - 1):
        t = Transfer(b, job.dcs[b], job.dcs[b + 1])
        job.transfers.append(t)
        if t.src == t.dst:
            continue
        requests += 1
        if not _setup(net, t, slots, fit):
            blocked += 1
            break
    return requests, blocked


class BaselineScheduler:
    """Communication-unaware: most-free placement, fixed slots, k-shortest-path first-fit."""

    name: ClassVar[str] = "baseline"

    def __init__(self, scenario: ScenarioSpec) -> None:
        self.scenario = scenario

    def admit(self, net: OpticalNetwork, profile: JobProfile, job_id: int) -> Admission:
        dcs = _place_most_free(net, profile)
        if dcs is None:
            return Admission(None, 0, 0, "gpu")
        job = RunningJob(job_id, profile, dcs)
        requests, blocked = _provision_fixed(
            net, job, self.scenario.baseline_slots, self.scenario.fit
        )
        if blocked:
            release(net, job)
            return Admission(None, requests, blocked, "spectrum")
        return Admission(job, requests, 0)

    def update(self, net: OpticalNetwork, running: list[RunningJob]) -> None:
        return None


class CBAScheduler(BaselineScheduler):
    """Communication-bound-aware re-provisioning after every event (see the module docstring)."""

    name: ClassVar[str] = "cba"

    def update(self, net: OpticalNetwork, running: list[RunningJob]) -> None:
        reprovision(net, running, self.scenario.max_slots, self.scenario.fit)


def reprovision(net: OpticalNetwork, running: list[RunningJob], cap: int, fit: str) -> None:
    """Trim non-CB transfers to what they need, then grow CB ones, most severe first."""
    cb: list[tuple[float, RunningJob, Transfer]] = []
    for job in running:
        labels = job.cb_labels()
        for t, is_cb in zip(job.transfers, labels, strict=True):
            if t.route is None or t.lightpath is None:
                continue
            want = needed_slots(t.route, job.profile, cap)
            if is_cb:
                severity = job.profile.transfer_s(t.gbit_s(job.profile)) / job.profile.bottleneck_s
                cb.append((severity, job, t))
            elif t.lightpath.slots > want:
                _resize(net, t, want, fit)
    cb.sort(key=lambda item: (-item[0], item[1].id, item[2].boundary))
    for _, job, t in cb:
        assert t.route is not None and t.lightpath is not None
        want = needed_slots(t.route, job.profile, cap)
        if want > t.lightpath.slots:
            _resize(net, t, want, fit)


def _resize(net: OpticalNetwork, t: Transfer, slots: int, fit: str) -> None:
    """Move ``t`` to ``slots`` if any route has room (the old range counts as free), else to the
    most it can get above its current size, else leave it."""
    assert t.lightpath is not None and t.route is not None
    old_route, old = t.route, t.lightpath
    net.grid.release(old.id)
    target = slots
    while target > 0:
        for route in net.dc_routes(t.src, t.dst):
            lp = net.grid.setup(route.links, target, fit)  # type: ignore[arg-type]
            if lp is not None:
                t.route, t.lightpath = route, lp
                return
        if target <= old.slots:
            break
        target -= 1
    t.route, t.lightpath = old_route, net.grid.allocate(old.links, old.start, old.slots)


class JointScheduler:
    """Placement, routes and slots chosen together by the planner's optimiser."""

    name: ClassVar[str] = "joint"

    def __init__(
        self, scenario: ScenarioSpec, exact_max_stages: int = 4, time_limit_s: float = 0.2
    ):
        self.scenario = scenario
        self.exact_max_stages = exact_max_stages
        self.time_limit_s = time_limit_s

    def _problem(self, net: OpticalNetwork, profile: JobProfile) -> PlacementProblem:
        D = len(net.dc_names)
        comp = tuple(round(c * 1e6) for c in profile.unit_compute_s)
        intra = round(profile.transfer_s(profile.intra_dc_gbit_s) * 1e6)
        links = tuple(
            LinkState(
                f"{a}-{b}",
                net.n_slots,
                frozenset(_unusable(net.grid.free[i], net.n_slots, net.guard_band)),
            )
            for i, (a, b) in enumerate(net.link_ends)
        )
        paths: dict[tuple[int, int], tuple[PathOption, ...]] = {}
        levels: set[int] = set()
        for a in range(D):
            for z in range(D):
                if a == z:
                    continue
                opts = []
                for r in net.dc_routes(a, z):
                    opts.append(
                        PathOption(r.links, r.km, round(r.propagation_s * 1e6), r.gbit_s_per_slot)
                    )
                    levels.add(needed_slots(r, profile, self.scenario.max_slots))
                paths[(a, z)] = tuple(opts)
        return PlacementProblem(
            dc_names=tuple(net.dc_names),
            free_devices=tuple(net.gpus_free),
            devices=tuple([profile.unit_gpus] * profile.units),
            compute_us=tuple(tuple([c] * D) for c in comp),
            boundary_bytes=tuple([profile.boundary_bytes] * (profile.units - 1)),
            local_us=tuple(tuple([intra] * D) for _ in range(profile.units - 1)),
            links=links,
            paths=paths,
            levels=tuple(sorted(levels)),
            microbatches=profile.placement_microbatches,
            link_efficiency=1.0,
        )

    def admit(self, net: OpticalNetwork, profile: JobProfile, job_id: int) -> Admission:
        need = profile.unit_gpus * profile.units
        if max(net.gpus_free) < profile.unit_gpus or sum(net.gpus_free) < need:
            return Admission(None, 0, 0, "gpu")
        # A job that fits in one datacenter has no cross-DC boundary: that is the optimum of the
        # placement model (equal devices everywhere), so skip the solver and take the datacenter
        # it fills best (keeping large holes for large jobs).
        fits = [d for d, free in enumerate(net.gpus_free) if free >= need]
        if fits:
            d = min(fits, key=lambda i: (net.gpus_free[i], i))
            net.gpus_free[d] -= need
            job = RunningJob(job_id, profile, [d] * profile.units)
            job.transfers = [Transfer(b, d, d) for b in range(profile.units - 1)]
            return Admission(job, 0, 0)
        problem = self._problem(net, profile)
        crossing_requests = 0
        # The greedy placement, and the exact model (small instances, within a short time limit)
        # or a short tabu search; the best of them. Under a short limit CP-SAT may return less
        # than the greedy start it was hinted with (measured), hence the comparison.
        found: list[PlacementResult] = []
        last_error: Infeasible | None = None
        for solve in (
            solve_greedy,
            (lambda p: solve_milp(p, time_limit_s=self.time_limit_s, workers=1))
            if profile.units <= self.exact_max_stages
            else (lambda p: solve_tabu(p, restarts=1, iterations=15, patience=5)),
        ):
            try:
                found.append(solve(problem))
            except Infeasible as exc:
                last_error = exc
        if not found:
            reason = "gpu" if "devices" in str(last_error) else "spectrum"
            blocked = 1 if reason == "spectrum" else 0
            return Admission(None, blocked, blocked, reason)
        result = min(found, key=lambda r: r.objective)
        dcs = list(result.placement.dcs)
        for d in dcs:
            net.gpus_free[d] -= profile.unit_gpus
        job = RunningJob(job_id, profile, dcs)
        for b, route in enumerate(result.placement.routes):
            t = Transfer(b, dcs[b], dcs[b + 1])
            job.transfers.append(t)
            if route is None:
                continue
            crossing_requests += 1
            sim_route = net.dc_routes(t.src, t.dst)[route.path]
            t.route = sim_route
            try:
                t.lightpath = net.grid.allocate(sim_route.links, route.start, route.units)
            except ValueError:
                # Two of the job's lightpaths side by side on a shared fiber: the model keeps
                # guard bands from the lightpaths already there, not between its own.
                t.lightpath = net.grid.setup(sim_route.links, route.units, self.scenario.fit)
            if t.lightpath is None:
                release(net, job)
                return Admission(None, crossing_requests, crossing_requests, "spectrum")
        return Admission(job, crossing_requests, 0)

    def update(self, net: OpticalNetwork, running: list[RunningJob]) -> None:
        reprovision(net, running, self.scenario.max_slots, self.scenario.fit)


SCHEDULERS: dict[str, type[BaselineScheduler] | type[JointScheduler]] = {
    "baseline": BaselineScheduler,
    "cba": CBAScheduler,
    "joint": JointScheduler,
}
