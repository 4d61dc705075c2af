"""What differential-privacy noise will do to a training task, said before it starts.

DP-FedAvg (:mod:`dmsc.runtime.compute.privacy`) clips each replica's update of a stage to L2
norm ``C`` (``--privacy-clip``), adds Gaussian noise of standard deviation ``sigma * C`` to
every coordinate of the sum of the ``n`` replicas' updates (``--privacy-noise`` is ``sigma``), then
divides by ``n``. On the mean update of a stage of ``d`` parameters the noise has L2 norm about
``sigma * C * sqrt(d) / n``, while the mean of the clipped updates has norm at most ``C``: where
``sigma * sqrt(d) / n`` is above 1 the noise outweighs the update it is added to, and training
goes nowhere or backwards (``--privacy-noise 0.8`` over 2 replicas of gpt-mini took the validation
loss from 2.98 to 31.39). ``dmsc train`` says so, with the figures, before it sends the task.
"""

from __future__ import annotations

import json
import math
from typing import Any

from dmsc.cli.app import err_console


def noise_to_update(noise: float, replicas: int, params: float) -> float:
    """The L2 norm of the noise on a round's mean update, in units of the clipping norm (the
    largest the mean update itself can be), for a stage of ``params`` parameters."""
    return noise * math.sqrt(params) / replicas


def noise_warning(noise: float, clip: float, replicas: int, params: float) -> str | None:
    """A warning where the noise outweighs the update (``None`` where it does not)."""
    ratio = noise_to_update(noise, replicas, params)
    if ratio <= 1:
        return None
    return (
        f"--privacy-noise {noise:g} over {replicas} replicas adds noise of L2 norm about "
        f"{ratio:,.1f} x --privacy-clip ({ratio * clip:,.3g}) to each round's mean update of a "
        f"stage of {params:,.0f} parameters, whose own norm is at most --privacy-clip ({clip:g}): "
        "the noise outweighs the update, so expect the loss to stay or rise rather than fall. "
        "Noise no larger than the update needs --privacy-noise at most "
        f"{replicas / math.sqrt(params):.2g} "
        "here, or more replicas (the noise on the mean falls as 1 / replicas)."
    )


def stage_params(plan: Any) -> float:
    """Parameters of the plan's smallest stage, in proportion to its layers (each stage syncs
    its own parameters; the smallest has the least noise)."""
    layers = [int(s.layers) for s in plan.stages]
    return float(plan.params) * min(layers) / sum(layers)


def running_plan() -> Any:
    """The plan of the run the control plane on this home serves (None when it cannot say)."""
    from dmsc.cli.database import open_database
    from dmsc.data.db import control_file
    from dmsc.data.records import RunRecord
    from dmsc.planner.plan import Plan

    try:
        run_id = int(json.loads(control_file().read_text())["run"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    with open_database().sessions() as s:
        run = s.get(RunRecord, run_id)
        return Plan.model_validate_json(run.plan_json) if run is not None else None


def warn_about_noise(settings: Any, dp: int | None) -> None:
    """Print the warning of :func:`noise_warning` on standard error for a task's sync
    ``settings`` (at ``dp`` replicas, the plan's when None), where it applies."""
    if settings is None or settings.privacy_noise <= 0 or settings.privacy_clip is None:
        return
    plan = running_plan()
    if plan is None:
        return
    replicas = dp if dp is not None else plan.job.dp
    line = noise_warning(
        settings.privacy_noise, settings.privacy_clip, replicas, stage_params(plan)
    )
    if line is not None:
        err_console.print(f"warning: {line}", highlight=False)
