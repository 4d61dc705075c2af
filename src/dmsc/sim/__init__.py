"""Discrete-event simulation of training jobs over a multi-datacenter optical network."""

from dmsc.sim.engine import RunResult, run
from dmsc.sim.metrics import mean_ci, relative_change, summarize
from dmsc.sim.network import OpticalNetwork, Route
from dmsc.sim.profile import JobProfile, build_profiles
from dmsc.sim.scenario import JobTypeSpec, ScenarioSpec, load_scenario
from dmsc.sim.schedulers import SCHEDULERS, Admission, RunningJob, Scheduler, Transfer
from dmsc.sim.spectrum import Lightpath, SpectrumGrid

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
