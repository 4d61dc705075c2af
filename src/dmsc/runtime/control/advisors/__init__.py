"""The functional modules of the orchestrator: loosely coupled modules behind one small
interface (:class:`FunctionalModule`), each reading a snapshot of the run's measurements
(:class:`Measurements`) and proposing actions (:class:`Proposal`) that the orchestrator decides
on (:mod:`.orchestrator`).

- :mod:`.traffic`: traffic prediction, per stage boundary and data-parallel exchange, and the
  step time (Holt's linear smoothing, its held-out error beside the naive forecaster's);
- :mod:`.paths`: path optimisation, the planner re-run on measured bandwidth and compute;
  :mod:`.move_cost`: the one-off cost of a move it (and the busy node's move) proposes;
- :mod:`.policy`: policy analysis, the service-level objectives, breaches raised into the
  exception queue.

The modules never act and never read the database themselves: :func:`read_measurements` takes
the snapshot, :func:`orchestrate` decides, :func:`apply` acts. They advise, hence the package's
name (``dmsc modules`` lists them).

- :mod:`.base`: the one interface, :class:`Measurements` in and :class:`Proposal` out;
- :mod:`.orchestrator`: collect the proposals, decide on each (:class:`DecisionRule`), apply;
- :mod:`.prediction`: the prediction a measured step is compared with (the job that ran).

Imports run one way: ``orchestrator -> policy, paths, traffic -> move_cost -> base ->
prediction`` (and this package's ``__init__`` gathers them). Below it: :mod:`..tasks`, the
exception queue :mod:`.policy` raises breaches into.
"""

from __future__ import annotations

from dmsc.runtime.control.advisors.base import (
    MOVE_KINDS,
    FunctionalModule,
    Measurements,
    MetricPoint,
    Proposal,
    ProposalKind,
    TaskTimes,
    newest_run,
    read_measurements,
)
from dmsc.runtime.control.advisors.orchestrator import (
    Decision,
    DecisionRule,
    NoDeployment,
    apply,
    collect,
    decide,
    orchestrate,
)
from dmsc.runtime.control.advisors.paths import PathOptimisation
from dmsc.runtime.control.advisors.policy import PolicyAnalysis, SLOs
from dmsc.runtime.control.advisors.traffic import TrafficPrediction
from dmsc.spec import ClusterSpec

# Every module, in the order they run (``dmsc modules list``).
MODULE_TYPES = (TrafficPrediction, PathOptimisation, PolicyAnalysis)


def default_modules(
    cluster: ClusterSpec | None, slos: SLOs | None = None
) -> list[FunctionalModule]:
    """The modules with their settings; path optimisation only with the run's ``cluster``."""
    modules: list[FunctionalModule] = [TrafficPrediction()]
    if cluster is not None:
        modules.append(PathOptimisation(cluster))
    modules.append(PolicyAnalysis(slos))
    return modules


__all__ = [
    "MODULE_TYPES",
    "MOVE_KINDS",
    "Decision",
    "DecisionRule",
    "FunctionalModule",
    "Measurements",
    "MetricPoint",
    "NoDeployment",
    "PathOptimisation",
    "PolicyAnalysis",
    "Proposal",
    "ProposalKind",
    "SLOs",
    "TaskTimes",
    "TrafficPrediction",
    "apply",
    "collect",
    "decide",
    "default_modules",
    "newest_run",
    "orchestrate",
    "read_measurements",
]
