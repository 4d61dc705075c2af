"""Discrete-event simulation of training jobs over a multi-datacenter optical network, and of
lightpath requests alone.

The names below load on first use (PEP 562): ``dmsc topology`` or a lightpath run does not pay
for the schedulers' solver (OR-Tools) and scipy's statistics (2.4 s of a command's start)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dmsc._lazy import lazy_getattr

if TYPE_CHECKING:
    from dmsc.sim.engine import RunResult, run
    from dmsc.sim.metrics import mean_ci, relative_change, summarize
    from dmsc.sim.network import OpticalNetwork, Route
    from dmsc.sim.profile import JobProfile, build_profiles
    from dmsc.sim.scenario import JobTypeSpec, ScenarioSpec, load_scenario
    from dmsc.sim.schedulers import SCHEDULERS, Admission, RunningJob, Scheduler, Transfer
    from dmsc.sim.spectrum import Lightpath, SpectrumGrid

_WHERE = {
    "RunResult": "dmsc.sim.engine",
    "run": "dmsc.sim.engine",
    "mean_ci": "dmsc.sim.metrics",
    "relative_change": "dmsc.sim.metrics",
    "summarize": "dmsc.sim.metrics",
    "OpticalNetwork": "dmsc.sim.network",
    "Route": "dmsc.sim.network",
    "JobProfile": "dmsc.sim.profile",
    "build_profiles": "dmsc.sim.profile",
    "JobTypeSpec": "dmsc.sim.scenario",
    "ScenarioSpec": "dmsc.sim.scenario",
    "load_scenario": "dmsc.sim.scenario",
    "SCHEDULERS": "dmsc.sim.schedulers",
    "Admission": "dmsc.sim.schedulers",
    "RunningJob": "dmsc.sim.schedulers",
    "Scheduler": "dmsc.sim.schedulers",
    "Transfer": "dmsc.sim.schedulers",
    "Lightpath": "dmsc.sim.spectrum",
    "SpectrumGrid": "dmsc.sim.spectrum",
}
__getattr__ = lazy_getattr(_WHERE, globals())

__all__ = [
    "SCHEDULERS",
    "Admission",
    "JobProfile",
    "JobTypeSpec",
    "Lightpath",
    "OpticalNetwork",
    "Route",
    "RunResult",
    "RunningJob",
    "ScenarioSpec",
    "Scheduler",
    "SpectrumGrid",
    "Transfer",
    "build_profiles",
    "load_scenario",
    "mean_ci",
    "relative_change",
    "run",
    "summarize",
]
