"""A training deployment started again at the largest data-parallel degree that starts.

After a lost node the shrink (:mod:`.shrink`) re-plans at a smaller dp on the devices online
(:func:`~.online.plan_online`); the new layout may still fail to start (a worker that does not
come up, another node lost meanwhile, a placement group that waits past its bound).
:func:`start_first` then tries the next smaller dp, down to the floor (the policy's
``elastic.dp_min``, or 1), each planned and started in turn. When none starts,
:class:`NoDeployment` names every attempt and why it failed: the control plane is then left
without workers, says so in ``dmsc status`` (``undeployed``: the cause and the checkpoint kept),
and its next training task redeploys first (:meth:`.shrink.Shrink.redeploy`: the run's newest
checkpoint that verifies, at the largest dp the devices online then hold).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dmsc.planner.plan import Plan
from dmsc.runtime.control.launch.deployment import Deployment
from dmsc.runtime.control.launch.fallback import Restored


@dataclass(frozen=True)
class Started:
    """The layout that started: its plan, the deployment, what it loaded, and why each larger
    dp tried before it did not start."""

    plan: Plan
    deployment: Deployment
    restored: Restored
    tried: tuple[str, ...] = ()


class NoDeployment(RuntimeError):
    """No layout started: every dp tried, and why it did not start."""

    def __init__(self, tried: Iterable[str], what: str = "no layout started") -> None:
        self.tried = list(tried)
        super().__init__(f"{what} ({'; '.join(self.tried) or 'no dp to try'})")


def start_first(
    dps: Iterable[int],
    plan_at: Callable[[int], Plan],
    start_at: Callable[[Plan], tuple[Deployment, Restored]],
) -> Started:
    """The first of ``dps`` (largest first) whose plan (``plan_at``: ValueError when there is
    none) starts (``start_at``: the started deployment and the checkpoint it loaded, or an
    error); :class:`NoDeployment` when none does."""
    tried: list[str] = []
    for dp in dps:
        try:
            plan = plan_at(dp)
        except ValueError as exc:
            tried.append(f"dp {dp} not planned: {exc}")
            continue
        try:
            dep, restored = start_at(plan)
        except Exception as exc:  # the launcher's, a worker's, a restore's: the next dp
            tried.append(f"dp {dp} did not start: {type(exc).__name__}: {exc}")
            continue
        return Started(plan, dep, restored, tuple(tried))
    raise NoDeployment(tried)
