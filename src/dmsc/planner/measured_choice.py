"""Planning on a recalibrated cluster: keep the placement the fit measured unless another is
clearly faster.

A fit (:mod:`dmsc.planner.recalibrate`) reproduces the run it came from: on the fitted spec the
measured plan's iteration is the measured step. It says less about any other placement. Its
figures fold what the cost model has no term for (a core shared by several stages, the step's
calls) into the devices' speed and into the links the run's boundaries crossed, and a boundary
inside a datacenter is not fitted at all. So the search on the fitted spec can find a placement
it predicts a little faster only because it moved a boundary off a fitted link onto an unfitted
one. Measured on the CPU demo (``benchmarks/recalibration.py``, 5 runs of 60 steps): in the 3
runs where the planner moved the stages on the fit, each for a predicted 7% gain, the new
placement measured 10-19% over its prediction and no faster than the one measured before; in
the 2 where it kept it, the prediction was within 2%.

So the measured plan, re-costed on the fitted spec with its placement kept, is kept unless the
search's plan is predicted faster by more than :data:`MARGIN`. Pure: plans and specs in, the
chosen plan and the words that say why out.
"""

from __future__ import annotations

from dmsc.netmodel import estimate_iteration
from dmsc.planner.placement.from_specs import build_problem
from dmsc.planner.placement.problem import PlacementResult, evaluate
from dmsc.planner.plan import Plan, assemble_plan, strategy_of
from dmsc.planner.recalibrate import CannotFit, plan_placement
from dmsc.planner.solve import PlanOutcome
from dmsc.spec import ClusterSpec, LayerListSpec, TransformerSpec

# How much faster the search's placement must be predicted, on the fit, to replace the one
# the fit measured: more than this machine's run-to-run spread of the same plan (2-10%) and
# than the gain the unfitted placements were predicted (7%) in the runs above.
MARGIN = 0.10


def _placed(plan: Plan) -> list[tuple[list[tuple[str, str]], list[tuple[str, list[int]]]]]:
    """A plan's stages as deployed: each one's layers and its replicas' devices."""
    return [(st.chunks, [(r.datacenter, r.devices) for r in st.replicas]) for st in plan.stages]


def same_job(a: Plan, b: Plan) -> bool:
    """Whether two plans are of one job: model, batch, strategy and mode."""
    return (
        a.model == b.model
        and a.job.global_batch == b.job.global_batch
        and a.job.mode == b.job.mode
        and strategy_of(a.job) == strategy_of(b.job)
    )


def measured_outcome(
    measured: Plan, cluster: ClusterSpec, model: TransformerSpec | LayerListSpec
) -> PlanOutcome:
    """``measured`` re-costed on ``cluster`` with its placement kept (its prediction, stage
    times and paths as the planner gives them there); CannotFit when the cluster lacks a
    datacenter or a path of it."""
    built = build_problem(cluster, model, measured.job)
    place = plan_placement(built, measured)
    objective = evaluate(built.problem, place)
    if objective is None:
        raise CannotFit("the measured plan's placement breaks a constraint of the cluster")
    result = PlacementResult(place, objective, "measured", 0.0)
    estimate = estimate_iteration(cluster, model, measured.job)
    plan = assemble_plan(cluster, model, measured.job, built, result, estimate, None)
    return PlanOutcome(plan, built, result, None)


def prefer_measured(
    found: PlanOutcome,
    measured: Plan,
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    margin: float = MARGIN,
) -> tuple[PlanOutcome, str | None]:
    """``found`` (the search's plan on the fitted ``cluster``) or ``measured`` (the plan of the
    run the fit came from) re-costed there, whichever the module docstring says; with the words
    that say so when it is not simply ``found`` (None: another job, or the same placement)."""
    if not same_job(found.plan, measured) or _placed(found.plan) == _placed(measured):
        return found, None
    try:
        kept = measured_outcome(measured, cluster, model)
    except CannotFit as exc:
        return found, f"the measured plan's placement cannot be kept ({exc}): the search's plan"
    new_s = found.plan.prediction.iteration_time_s
    kept_s = kept.plan.prediction.iteration_time_s
    gain = 1 - new_s / kept_s
    if gain > margin:
        return found, (
            f"placed otherwise than the measured plan: predicted {gain:.1%} faster on the fit "
            f"({new_s * 1e3:.1f} against {kept_s * 1e3:.1f} ms), over the {margin:.0%} margin"
        )
    return kept, (
        f"kept the measured plan's placement ({kept_s * 1e3:.1f} ms on the fit): the search's "
        f"({new_s * 1e3:.1f} ms) is predicted {gain:.1%} faster, within the {margin:.0%} margin "
        "(a fit is exact for the placement it measured only)"
    )
