"""Schedulers x loads x seeds: the simulation experiment ``dmsc simulate`` and the benchmarks run.

:func:`sweep` runs every scheduler at every offered load over consecutive seeds (the scenario's
seed first), each run on a fresh network, and keeps every run; :class:`Sweep` summarises them
(means with 95% confidence intervals over the seeds) and compares each scheduler with the
``baseline`` one. Rendering (tables, CSV, plots) is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dmsc.sim.engine import RunResult, run
from dmsc.sim.metrics import relative_change, summarize
from dmsc.sim.network import OpticalNetwork
from dmsc.sim.profile import build_profiles
from dmsc.sim.scenario import ScenarioSpec
from dmsc.sim.schedulers import SCHEDULERS
from dmsc.spec import ClusterSpec

# (description of the run starting now, or "" within a run; arrivals simulated so far in all)
Progress = Callable[[str, int], None]


class ScenarioInvalid(ValueError):
    """The scenario's network or job profiles cannot be built ("field: reason")."""


@dataclass(frozen=True)
class Sweep:
    """Every run of a sweep, by (scheduler, load), and their summaries."""

    scenario: ScenarioSpec
    schedulers: tuple[str, ...]
    loads: tuple[float, ...]
    seeds: int
    arrivals: int
    slots_per_fiber: int
    runs: dict[tuple[str, float], list[RunResult]]
    summaries: dict[tuple[str, float], dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        summaries = {key: summarize(value) for key, value in self.runs.items()}
        object.__setattr__(self, "summaries", summaries)

    def relative(self, scheduler: str, load: float) -> dict[str, float]:
        """Percent change of ``scheduler``'s summary against the baseline's at ``load``."""
        return relative_change(
            self.summaries[(scheduler, load)], self.summaries[("baseline", load)]
        )

    def to_dict(self) -> dict[str, Any]:
        """The figures as ``dmsc simulate --json`` prints them (without the job list): per
        scheduler its summary, or per load when there are several loads; the change against
        ``baseline`` when it ran beside others."""
        single = len(self.loads) == 1
        s = self.scenario
        out: dict[str, Any] = {
            "scenario": s.name,
            "seeds": self.seeds,
            "arrivals": self.arrivals,
            "loads": list(self.loads),
            "k_paths": s.k_paths,
            "fit": s.fit,
            "guard_band": s.guard_band,
            "modulations": s.modulations,
            "slots": self.slots_per_fiber,
            "schedulers": {},
        }
        for name in self.schedulers:
            per_load = {f"{load:g}": self.summaries[(name, load)] for load in self.loads}
            out["schedulers"][name] = self.summaries[(name, self.loads[0])] if single else per_load
        if "baseline" in self.schedulers and len(self.schedulers) > 1:
            rel: dict[str, Any] = {}
            for name in self.schedulers:
                if name == "baseline":
                    continue
                per = {f"{load:g}": self.relative(name, load) for load in self.loads}
                rel[name] = per[f"{self.loads[0]:g}"] if single else per
            out["relative_to_baseline_pct"] = rel
        return out


def sweep(
    scenario: ScenarioSpec,
    cluster: ClusterSpec,
    schedulers: Sequence[str],
    loads: Sequence[float] | None = None,
    seeds: int = 1,
    arrivals: int | None = None,
    slots: int | None = None,
    progress: Progress | None = None,
) -> Sweep:
    """Run every scheduler at every load (default: the scenario's) over ``seeds`` seeds of
    ``arrivals`` jobs each (default: the scenario's), on networks of ``slots`` slots per fiber
    (default: the scenario's). Raises ``ValueError`` for an unknown scheduler or a count that is
    not positive, :class:`ScenarioInvalid` when the scenario's network or profiles cannot be
    built."""
    unknown = [n for n in schedulers if n not in SCHEDULERS]
    if unknown:
        raise ValueError(f"unknown scheduler {unknown[0]!r} (known: {', '.join(SCHEDULERS)})")
    if seeds <= 0 or (arrivals is not None and arrivals <= 0):
        raise ValueError("seeds and arrivals must be positive")
    if loads is not None and any(x <= 0 for x in loads):
        raise ValueError("loads must be positive")

    def network() -> OpticalNetwork:
        return OpticalNetwork.for_scenario(scenario, cluster, slots)

    try:
        slots_per_fiber = network().n_slots
        profiles = build_profiles(cluster, scenario.jobs)
    except ValueError as exc:
        raise ScenarioInvalid(str(exc)) from None
    load_list = tuple(loads or [scenario.load_erlang])
    n = arrivals or scenario.arrivals
    runs: dict[tuple[str, float], list[RunResult]] = {}
    done = 0
    for name in schedulers:
        for load in load_list:
            for k in range(seeds):
                if progress is not None:
                    progress(f"{name} at {load:g} Erlang, seed {k}", done)

                def tick(i: int, base: int = done) -> None:
                    if progress is not None:
                        progress("", base + i)

                result = run(scenario, profiles, network, name, load, scenario.seed + k, n, tick)
                done += n
                runs.setdefault((name, load), []).append(result)
    return Sweep(scenario, tuple(schedulers), load_list, seeds, n, slots_per_fiber, runs)
