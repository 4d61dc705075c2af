"""Recalibration: the cluster spec a plan was made on, refitted to what a run of the plan measured.

A run measures, for the plan's placement (:class:`RunFigures`):

- each stage's compute per micro-batch (its forward and backward spans);
- each stage boundary's bytes per micro-batch and transfer time;
- the step time (the median of the task's steps, warm-up left out).

The fit (:func:`fit_run`) turns them into figures the cost model reads:

1. **per-link transfer rates**: a boundary's transfer time in the cost model is ``L + K / k``
   for its links' bandwidth times ``k`` (latency and propagation do not scale); two evaluations
   give ``L`` and ``K``, and ``k`` solves ``L + K / k = measured``. Each link of the boundary's
   path gets its bandwidth times ``k`` (the least ``k`` of the boundaries it carries).
   Boundaries inside a datacenter are reported, not fitted;
2. **per-stage compute rates**: each stage's predicted over measured micro-batch time is its
   speed; a device type's speed from the spans is the predicted over the measured compute of
   its stages together;
3. **the step**: what the spans do not show (a stage waiting for a busy core, the step's calls
   and optimizer, data loading) the cost model has no term for. The devices' speed is the span
   speed times one common factor found so that the plan's iteration, its placement kept, takes
   the measured step on the fitted spec (bisection: the iteration only grows as the devices
   slow). The factor is reported (``step_factor``): 1 when the spans explain the whole step.

A device type's peak FLOP/s and memory bandwidth are multiplied by its speed and its per-kernel
overheads divided by it (the cost model's compute time scales as 1/speed). Pure: specs and
figures in, the fitted spec and the figures it came from out.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dmsc.planner.placement.from_specs import BuiltProblem, build_problem
from dmsc.planner.placement.problem import (
    Placement,
    PlacementProblem,
    PlacementResult,
    Reservation,
    boundary_us,
    evaluate,
)
from dmsc.planner.plan import Plan, placed_pipeline, placed_pipeline_s
from dmsc.spec import ClusterSpec, LayerListSpec, TransformerSpec

SPEED_RANGE = (1e-3, 1e3)  # the common step factor is searched in here
TOLERANCE = 1e-6  # relative, on the step factor


class CannotFit(ValueError):
    """The run's figures cannot be fitted to the cluster (the reason says why)."""


@dataclass(frozen=True)
class RunFigures:
    """What a run of a plan measured (see the module docstring)."""

    stage_s: dict[int, float]  # stage -> compute seconds per micro-batch (forward + backward)
    boundaries: dict[int, tuple[float, float]]  # after stage -> (bytes, seconds) per micro-batch
    step_s: float  # median step time
    steps: int = 0  # steps measured


@dataclass(frozen=True)
class StageFit:
    stage: int
    datacenter: str
    device: str
    measured_s: float  # per micro-batch
    predicted_s: float  # per micro-batch, on the spec before the fit

    @property
    def speed(self) -> float:
        return self.predicted_s / self.measured_s


@dataclass(frozen=True)
class LinkFit:
    after_stage: int
    links: list[str]
    bytes: float  # per micro-batch
    measured_s: float
    predicted_s: float  # on the spec before the fit
    scale: float | None  # the bandwidth factor (None: not fitted, see ``why``)
    why: str = ""

    @property
    def measured_gbit_s(self) -> float:
        return self.bytes * 8 / self.measured_s / 1e9


@dataclass(frozen=True)
class Fit:
    """The fitted spec (JSON-able, as a spec file holds it) and the figures it came from."""

    cluster: dict[str, Any]
    stages: list[StageFit]
    links: list[LinkFit]
    span_speed: dict[str, float]  # device type -> speed from the spans
    step_factor: float  # the common factor that makes the step the measured one
    device_speed: dict[str, float]  # device type -> the speed written (span speed x factor)
    link_scale: dict[str, float]  # link name -> bandwidth factor written
    measured_step_s: float
    predicted_before_s: float  # the plan's iteration on the spec before the fit
    predicted_after_s: float  # ... and on the fitted spec
    steps: int = 0
    notes: list[str] = field(default_factory=list)
    pooled: list[int] = field(default_factory=list)  # earlier tasks whose figures were pooled
    # the routing's measured imbalance, which the fit priced (JobSpec.expert_imbalance), so that
    # the devices' speed does not take up the wait for the busiest expert-parallel rank
    expert_imbalance: float | None = None

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("cluster")
        for s, st in zip(out["stages"], self.stages, strict=True):
            s["speed"] = st.speed
        for link, lf in zip(out["links"], self.links, strict=True):
            link["measured_gbit_s"] = lf.measured_gbit_s
        return out


def plan_placement(built: BuiltProblem, plan: Plan) -> Placement:
    """The plan's placement in ``built`` (its job on a cluster with the plan's datacenters and
    links); CannotFit when the cluster does not have them."""
    return placement_in(built.problem, plan)


def placement_in(problem: PlacementProblem, plan: Plan) -> Placement:
    """The plan's placement in ``problem`` (a problem of the plan's job on some cluster): its
    stages' datacenters and its reserved paths as the problem's route options; CannotFit when a
    datacenter or a path of the plan is not the problem's (the control loop's path module asks
    the same of the cluster it re-plans on)."""
    index = {name: d for d, name in enumerate(problem.dc_names)}
    missing = sorted({st.datacenter for st in plan.stages} - set(index))
    if missing:
        raise CannotFit(f"the cluster has no datacenter {', '.join(missing)} of the plan")
    dcs = tuple(index[st.datacenter] for st in plan.stages)
    names = [link.name for link in problem.links]
    paths = {p.after_stage: p for p in plan.paths}
    routes: list[Reservation | None] = []
    for b in range(len(dcs) - 1):
        if dcs[b] == dcs[b + 1]:
            routes.append(None)
            continue
        record = paths.get(b)
        options = problem.paths.get((dcs[b], dcs[b + 1]), ())
        k = next(
            (
                k
                for k, o in enumerate(options)
                if record is not None and [names[i] for i in o.links] == record.links
            ),
            None,
        )
        if record is None or k is None:
            raise CannotFit(f"the plan's path after stage {b} is not a route of the cluster")
        routes.append(Reservation(k, record.units, record.first_unit))
    return Placement(dcs, tuple(routes))


def _stage_device(cluster: ClusterSpec, datacenter: str) -> str:
    dc = next(d for d in cluster.datacenters if d.name == datacenter)
    return cluster.node_types[dc.nodes[0].type].device


def scaled(
    cluster: ClusterSpec, speed: dict[str, float], link_scale: dict[str, float]
) -> ClusterSpec:
    """``cluster`` with each device type ``speed[type]`` times as fast and each link's
    bandwidth (or Gbit/s per slot) times ``link_scale[name]``."""
    from dmsc.netmodel import DEFAULT_CALIBRATION

    data = cluster.model_dump(mode="json", exclude_none=True)
    for name, f in speed.items():
        dev = data["device_types"][name]
        # the per-kernel costs the cost model would take from its constants, written out so
        # that they scale with the rest
        dc = DEFAULT_CALIBRATION.for_device(cluster.device_types[name])
        dev.setdefault("op_overhead_us", dc.kernel_overhead_s * 1e6)
        if dc.host_op_s > 0:
            dev.setdefault("host_op_us", dc.host_op_s * 1e6)
        dev.pop("preset", None)
        dev["peak_tflops"] = {k: v * f for k, v in dev["peak_tflops"].items()}
        dev["memory_bw_gbyte_s"] *= f
        for key in ("op_overhead_us", "host_op_us"):
            if dev.get(key):
                dev[key] /= f
    for link in data.get("links", []):
        f = link_scale.get(f"{link['a']}-{link['b']}", 1.0)
        if link.get("bandwidth_gbit_s") is not None:
            link["bandwidth_gbit_s"] *= f
        elif link.get("gbit_s_per_slot") is not None:
            link["gbit_s_per_slot"] *= f
    return ClusterSpec.model_validate(data)


def iteration_s(
    plan: Plan,
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    placement: Placement | None = None,
) -> float:
    """The plan's iteration on ``cluster`` with the plan's placement kept (pipeline replayed,
    plus data-parallel exchange and optimizer), as the planner predicts a placed plan."""
    from dmsc.netmodel import estimate_iteration

    built, result = _placed(plan, cluster, model, placement)
    pipeline = placed_pipeline_s(built.problem, result, plan.job)
    rest = estimate_iteration(cluster, model, plan.job).breakdown_s
    return pipeline + rest["dp_comm"] + rest["optimizer"]


def placed_breakdown_s(
    plan: Plan, cluster: ClusterSpec, model: TransformerSpec | LayerListSpec
) -> dict[str, float]:
    """:func:`iteration_s` by part, as a plan's prediction breaks its iteration down: the placed
    pipeline's compute, tensor- and expert-parallel, pipeline and bubble seconds, and the
    data-parallel exchange and optimizer."""
    from dmsc.netmodel import estimate_iteration

    built, result = _placed(plan, cluster, model, None)
    rest = estimate_iteration(cluster, model, plan.job).breakdown_s
    pipe = placed_pipeline(built, result, plan.job).breakdown_s
    return {**pipe, "dp_comm": rest["dp_comm"], "optimizer": rest["optimizer"]}


def _placed(
    plan: Plan,
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    placement: Placement | None,
) -> tuple[BuiltProblem, PlacementResult]:
    """The problem of ``plan``'s job on ``cluster`` and the plan's placement in it (or
    ``placement``); :class:`CannotFit` where it breaks a constraint there."""
    built = build_problem(cluster, model, plan.job)
    place = placement or plan_placement(built, plan)
    objective = evaluate(built.problem, place)
    if objective is None:
        raise CannotFit("the plan's placement breaks a constraint of the cluster")
    return built, PlacementResult(place, objective, "plan", 0.0)


def _fit_links(
    plan: Plan,
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    place: Placement,
    measured: dict[int, tuple[float, float]],
) -> list[LinkFit]:
    """Each measured boundary's transfer, predicted and fitted (module docstring, 1)."""
    paths = {p.after_stage: p for p in plan.paths}
    base = build_problem(cluster, model, plan.job).problem
    t1 = boundary_us(base, place.dcs, place.routes)
    out = []
    for b, (nbytes, seconds) in sorted(measured.items()):
        if b >= len(t1):
            continue
        pred = t1[b] * 1e-6
        path = paths.get(b)
        if path is None:
            out.append(LinkFit(b, [], nbytes, seconds, pred, None, "inside a datacenter"))
            continue
        doubled = scaled(cluster, {}, {name: 2.0 for name in path.links})
        t2 = boundary_us(build_problem(doubled, model, plan.job).problem, place.dcs, place.routes)
        k_part = 2 * (t1[b] - t2[b]) * 1e-6  # K: the part that scales with 1/bandwidth
        fixed = pred - k_part
        if k_part <= 0 or seconds <= fixed:
            why = (
                "the measured transfer is within the link's latency"
                if k_part > 0
                else ("the transfer does not depend on the link's bandwidth")
            )
            out.append(LinkFit(b, list(path.links), nbytes, seconds, pred, None, why))
            continue
        scale = k_part / (seconds - fixed)
        out.append(LinkFit(b, list(path.links), nbytes, seconds, pred, scale))
    return out


def _step_factor(
    plan: Plan,
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    place: Placement,
    span_speed: dict[str, float],
    link_scale: dict[str, float],
    step_s: float,
) -> tuple[float, list[str]]:
    """The common factor on ``span_speed`` at which the iteration takes ``step_s``."""

    def at(f: float) -> float:
        speed = {k: v * f for k, v in span_speed.items()}
        return iteration_s(plan, scaled(cluster, speed, link_scale), model, place)

    lo, hi = SPEED_RANGE
    if at(hi) > step_s:
        return hi, [f"the step is shorter than the fitted links alone allow ({at(hi):.4f} s)"]
    if at(lo) < step_s:
        return lo, [f"the step is longer than devices {1 / lo:.0f} times slower explain"]
    a, b = math.log(lo), math.log(hi)
    while b - a > TOLERANCE:
        mid = (a + b) / 2
        if at(math.exp(mid)) > step_s:  # too slow: speed up
            a = mid
        else:
            b = mid
    return math.exp((a + b) / 2), []


def fit_run(
    plan: Plan,
    cluster: ClusterSpec,
    figures: RunFigures,
    model: TransformerSpec | LayerListSpec | None = None,
    source: str | None = None,
) -> Fit:
    """``cluster`` (the one ``plan`` was made on) fitted to ``figures`` (a run of ``plan``);
    CannotFit says why not (no stage measured, another cluster, a step of no time). ``source``
    becomes the fitted device types' ``measured.source`` (where the figures came from)."""
    from dmsc.spec import resolve_model

    model = model or plan.model_spec or resolve_model(plan.model)
    if not figures.stage_s:
        raise CannotFit("no stage's compute was measured (no step traces with spans)")
    if not figures.step_s > 0:
        raise CannotFit("no step time was measured")
    built = build_problem(cluster, model, plan.job)
    place = plan_placement(built, plan)
    stages = []
    for s, measured in sorted(figures.stage_s.items()):
        if s >= len(plan.stages) or measured <= 0:
            continue
        dc = plan.stages[s].datacenter
        predicted = (built.problem.compute_us[s][place.dcs[s]] or 0) * 1e-6
        if predicted > 0:
            stages.append(StageFit(s, dc, _stage_device(cluster, dc), measured, predicted))
    if not stages:
        raise CannotFit("no measured stage is one of the plan's")
    span_speed = {
        dev: sum(st.predicted_s for st in stages if st.device == dev)
        / sum(st.measured_s for st in stages if st.device == dev)
        for dev in sorted({st.device for st in stages})
    }
    links = _fit_links(plan, cluster, model, place, figures.boundaries)
    link_scale: dict[str, float] = {}
    for lf in links:
        for name in lf.links if lf.scale is not None else ():
            link_scale[name] = min(lf.scale or 1.0, link_scale.get(name, math.inf))
    before = iteration_s(plan, cluster, model, place)
    factor, notes = _step_factor(
        plan, cluster, model, place, span_speed, link_scale, figures.step_s
    )
    device_speed = {k: v * factor for k, v in span_speed.items()}
    fitted = scaled(cluster, device_speed, link_scale)
    after = iteration_s(plan, fitted, model, place)
    data = fitted.model_dump(mode="json", exclude_none=True)
    for name in device_speed if source else ():
        data["device_types"][name]["measured"] = {"source": source}
    return Fit(
        cluster=ClusterSpec.model_validate(data).model_dump(mode="json", exclude_none=True),
        stages=stages,
        links=links,
        span_speed=span_speed,
        step_factor=factor,
        device_speed=device_speed,
        link_scale=link_scale,
        measured_step_s=figures.step_s,
        predicted_before_s=before,
        predicted_after_s=after,
        steps=figures.steps,
        notes=notes,
    )
