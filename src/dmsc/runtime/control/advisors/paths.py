"""Path optimisation: the planner's placement and path choice re-run on measured rather than
nominal bandwidth and compute, and a move proposed when it beats the current placement.

From the step traces (:func:`measure_boundaries`, :func:`measure_stages`):

- each stage boundary's effective bandwidth: the bytes it carried per micro-batch (all replicas
  together, as the planner counts them) over the transfer gap, the time from the end of stage
  ``s``'s op on a micro-batch to the start of stage ``s+1``'s on the same one (forward; backward
  the other way). A gap holds the transfer and any wait for a busy receiver, so the smallest gap
  of a step is taken (the first micro-batch finds its receiver idle), then the median over the
  steps and replicas. Spans are wall-clock times: across machines the gap holds their clock skew;
- each stage's compute per micro-batch (its forward and backward spans, median over the steps and
  replicas).

Measured over nominal (the planner's own figures for the plan's placement) gives a speed for each
datacenter's devices (geometric mean over its stages) and a factor for each inter-datacenter link
(the least over the boundaries that cross it). A link's factor is taken on the boundary's
*forecast* rate, not the median: each step's rate (its bytes over its gap) is a point of a
series that Holt's linear smoothing (:mod:`dmsc.data.forecast`) forecasts one step ahead, so a
link whose load keeps growing (its rate falling step after step) is re-planned on the rate the
next steps will see rather than on what it carried half a window ago; with fewer than
:data:`~dmsc.data.forecast.MIN_POINTS` steps the median stands.

:func:`scaled_cluster` writes them into the cluster spec (peak FLOP/s, memory bandwidth and
per-op overhead of a datacenter's own copy of its device type; a link's Gbit/s or Gbit/s per
slot): the cost model's compute time scales as 1/speed to within its fixed per-op costs (under
1% on the example clusters). A datacenter whose node the control loop found busy keeps its own
measured speed but lends it to no other (:func:`device_speeds`): an idle one may then win.
Boundaries inside a datacenter are measured and reported, not scaled. Plans of islands (round
modes) are not re-planned here.

Then ``plan_job(..., fixed=True)`` re-plans the plan's strategy on the measured cluster, and the
current placement is scored on the same measured problem: a move is proposed when the planner's
placement differs and is predicted faster; its gain per step is the difference. Its cost is a
stated estimate (:func:`~.move_cost.move_cost_s`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dmsc.data.forecast import MIN_POINTS, forecast_ahead
from dmsc.data.traces import StepTrace
from dmsc.planner.placement.from_specs import BuiltProblem, build_problem
from dmsc.planner.placement.problem import (
    Infeasible,
    Placement,
    PlacementProblem,
    PlacementResult,
    boundary_us,
    evaluate,
)
from dmsc.planner.plan import Plan, placed_pipeline_s, stage_chunks
from dmsc.planner.recalibrate import CannotFit, placement_in
from dmsc.runtime.control.advisors.base import Measurements, Proposal, ProposalKind
from dmsc.runtime.control.advisors.move_cost import move_cost_s
from dmsc.spec import ClusterSpec, LayerListSpec, TransformerSpec, resolve_model


@dataclass(frozen=True)
class BoundaryMeasure:
    """A stage boundary as measured: bytes per micro-batch (all replicas), transfer gap (the
    median over the steps), and its rate forecast for the next step (None: too few steps)."""

    bytes_per_microbatch: float
    gap_s: float
    forecast_gbit_s: float | None = None

    @property
    def gbit_s(self) -> float:
        return self.bytes_per_microbatch * 8 / self.gap_s / 1e9

    @property
    def expected_gbit_s(self) -> float:
        """What the next steps will see: the forecast where there is one, else the median."""
        return self.forecast_gbit_s if self.forecast_gbit_s is not None else self.gbit_s


def forecast_gbit_s(rates: list[float]) -> float | None:
    """The next step's rate of a boundary from its per-step rates (in step order): Holt's
    forecast (:mod:`dmsc.data.forecast`); None with fewer than :data:`MIN_POINTS` steps; the
    last step's rate when the trend runs the forecast to zero or below (a link whose rate
    falls that fast is taken at its latest measure, not extrapolated past it)."""
    if len(rates) < MIN_POINTS:
        return None
    ahead = forecast_ahead(rates, 1)
    return ahead if ahead > 0 else rates[-1]


def _spans_by_op(trace: StepTrace) -> dict[tuple[str, int], tuple[float, float]]:
    return {(op, mb): (a, b) for op, mb, a, b in trace.spans}


def measure_boundaries(
    traces: Sequence[StepTrace], microbatches: int
) -> dict[int, BoundaryMeasure]:
    """Each boundary's bytes per micro-batch and transfer gap (see the module docstring), and
    its rate forecast from the per-step rates (each step's gap: the median over replicas)."""
    by_key = {(t.step, t.stage, t.replica): t for t in traces}
    gaps: dict[int, list[float]] = {}
    by_step: dict[int, dict[int, list[float]]] = {}  # boundary -> step -> gaps (replicas)
    sent: dict[int, dict[int, float]] = {}  # boundary -> step -> bytes forward
    for (step, stage, replica), t in by_key.items():
        nxt = by_key.get((step, stage + 1, replica))
        n = t.sent.get((stage + 1, replica), 0)
        if n:
            per_step = sent.setdefault(stage, {})
            per_step[step] = per_step.get(step, 0.0) + n
        if nxt is None:
            continue
        mine, theirs = _spans_by_op(t), _spans_by_op(nxt)
        step_gaps = [
            theirs[("F", mb)][0] - mine[("F", mb)][1]
            for mb in range(microbatches)
            if ("F", mb) in mine and ("F", mb) in theirs
        ] + [
            mine[("B", mb)][0] - theirs[("B", mb)][1]
            for mb in range(microbatches)
            if ("B", mb) in mine and ("B", mb) in theirs
        ]
        positive = [g for g in step_gaps if g > 0]
        if positive:
            gaps.setdefault(stage, []).append(min(positive))
            by_step.setdefault(stage, {}).setdefault(step, []).append(min(positive))
    out = {}
    for b, samples in gaps.items():
        steps = sent.get(b, {})
        if not steps:
            continue
        per_mb = statistics.median(steps.values()) / microbatches
        rates = [
            steps[step] / microbatches * 8 / statistics.median(g) / 1e9
            for step, g in sorted(by_step[b].items())
            if step in steps
        ]
        out[b] = BoundaryMeasure(per_mb, statistics.median(samples), forecast_gbit_s(rates))
    return out


def measure_stages(traces: Sequence[StepTrace], microbatches: int) -> dict[int, float]:
    """Each stage's compute seconds per micro-batch (forward and backward spans; the worker's
    ``compute_s`` when it reported no spans), median over steps and replicas."""
    samples: dict[int, list[float]] = {}
    for t in traces:
        busy = sum(b - a for _, _, a, b in t.spans) if t.spans else t.compute_s
        if busy > 0:
            samples.setdefault(t.stage, []).append(busy / microbatches)
    return {s: statistics.median(v) for s, v in samples.items()}


def current_placement(problem: PlacementProblem, plan: Plan) -> Placement | None:
    """The plan's placement in ``problem`` (a problem of the plan's job on some cluster); None
    when one of its datacenters or paths is not among the problem's."""
    try:
        return placement_in(problem, plan)
    except CannotFit:
        return None


def _geomean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def device_speeds(
    cluster: ClusterSpec, ratios: dict[str, list[float]], busy: Collection[str] = ()
) -> dict[str, float]:
    """Each datacenter's device speed, measured over nominal: the geometric mean of its stages'
    ``ratios``; a datacenter that ran no stage takes the mean of the measured datacenters with
    its device type (a cost model off for a device type is off wherever it runs: left nominal,
    such a datacenter would look faster than the measured ones for no measured reason), those
    on ``busy`` nodes left out while one of that type is not (their slowness is the load)."""
    speed = {dc: _geomean(r) for dc, r in ratios.items() if r}

    def device(dc_name: str) -> str:
        dc = next(d for d in cluster.datacenters if d.name == dc_name)
        return cluster.node_types[dc.nodes[0].type].device

    by_type: dict[str, list[float]] = {}
    idle: dict[str, list[float]] = {}
    for dc, f in speed.items():
        by_type.setdefault(device(dc), []).append(f)
        if dc not in busy:
            idle.setdefault(device(dc), []).append(f)
    for spec in cluster.datacenters:
        same = idle.get(device(spec.name)) or by_type.get(device(spec.name))
        if spec.name not in speed and same:
            speed[spec.name] = _geomean(same)
    return speed


def cluster_mismatch(plan: Plan, cluster: ClusterSpec) -> str | None:
    """Why ``cluster`` is not the one ``plan`` was made on (None when it can be)."""
    names = {dc.name for dc in cluster.datacenters}
    missing = sorted({st.datacenter for st in plan.stages} - names)
    if missing:
        return f"cluster {cluster.name!r} has no datacenter {', '.join(missing)} of the plan"
    links = {f"{link.a}-{link.b}" for link in cluster.links}
    gone = sorted({name for p in plan.paths for name in p.links} - links)
    if gone:
        return f"cluster {cluster.name!r} has no link {', '.join(gone)} of the plan"
    return None


def scaled_cluster(
    cluster: ClusterSpec,
    speed: dict[str, float],
    link_scale: dict[str, float],
    slot_rate: dict[str, float] | None = None,
) -> ClusterSpec:
    """``cluster`` with each datacenter's devices ``speed[dc]`` times as fast (its own copy of
    its device and node types) and each link ``link_scale[name]`` times its bandwidth (a slot
    link: times ``slot_rate[name]``, the Gbit/s a slot carried in the plan)."""
    data = cluster.model_dump()
    data["topology"] = None  # its fibers are in ``links`` already
    for dc in data["datacenters"]:
        f = speed.get(dc["name"], 1.0)
        if f == 1.0:
            continue
        nodes = []
        for group in dc["nodes"]:
            ntype = dict(data["node_types"][group["type"]])
            dev = dict(data["device_types"][ntype["device"]])
            dev["preset"] = None
            dev["peak_tflops"] = {k: v * f for k, v in dev["peak_tflops"].items()}
            dev["memory_bw_gbyte_s"] *= f
            for key in ("op_overhead_us", "host_op_us"):
                if dev.get(key):
                    dev[key] /= f
            dev_name, node_name = f"{ntype['device']}@{dc['name']}", f"{group['type']}@{dc['name']}"
            data["device_types"][dev_name] = dev
            data["node_types"][node_name] = {**ntype, "device": dev_name}
            nodes.append({**group, "type": node_name})
        dc["nodes"] = nodes
    for link in data["links"]:
        f = link_scale.get(f"{link['a']}-{link['b']}", 1.0)
        if f == 1.0:
            continue
        if link.get("bandwidth_gbit_s") is not None:
            link["bandwidth_gbit_s"] *= f
        elif slot_rate and f"{link['a']}-{link['b']}" in slot_rate:
            link["gbit_s_per_slot"] = slot_rate[f"{link['a']}-{link['b']}"] * f
    return ClusterSpec.model_validate(data)


@dataclass(frozen=True)
class Replanned:
    """The current placement and the planner's, both scored on the measured figures."""

    current_s: float
    new_plan: Plan
    speed: dict[str, float]
    link_scale: dict[str, float]
    boundaries: dict[int, BoundaryMeasure]
    stage_compute_s: dict[int, float]
    nominal_compute_s: dict[int, float]

    @property
    def new_s(self) -> float:
        return self.new_plan.prediction.iteration_time_s


def _iteration_s(
    built: BuiltProblem,
    placement: Placement,
    plan: Plan,
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
) -> float | None:
    """The iteration of ``plan``'s job placed as ``placement`` in ``built`` (its cluster)."""
    from dmsc.netmodel import estimate_iteration

    # as it runs: a residency rule added since it was planned does not stop it being measured
    objective = evaluate(replace(built.problem, resident_dcs=None), placement)
    if objective is None:
        return None
    result = PlacementResult(placement, objective, "current", 0.0)
    pipeline = placed_pipeline_s(built.problem, result, plan.job)
    breakdown = estimate_iteration(cluster, model, plan.job).breakdown_s
    return pipeline + breakdown["dp_comm"] + breakdown["optimizer"]


def measured_scales(
    plan: Plan,
    cluster: ClusterSpec,
    nominal: BuiltProblem,
    place: Placement,
    stages: dict[int, float],
    boundaries: dict[int, BoundaryMeasure],
    busy: Collection[str] = (),
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Measured over nominal: each datacenter's device speed, each inter-datacenter link's
    bandwidth factor (on the boundary's forecast rate, :attr:`BoundaryMeasure.expected_gbit_s`),
    and the Gbit/s per unit of the slot links among them (what :func:`scaled_cluster` takes)."""
    ratios: dict[str, list[float]] = {}
    for s, measured in stages.items():
        nominal_s = (nominal.problem.compute_us[s][place.dcs[s]] or 0) * 1e-6
        if s < len(plan.stages) and nominal_s > 0 and measured > 0:
            ratios.setdefault(plan.stages[s].datacenter, []).append(nominal_s / measured)
    transfer_us = boundary_us(nominal.problem, place.dcs, place.routes)
    link_scale: dict[str, float] = {}
    slot_rate: dict[str, float] = {}
    for p in plan.paths:
        b = p.after_stage
        if b not in boundaries or b >= len(transfer_us):
            continue
        nominal_gbit_s = nominal.problem.boundary_bytes[b] * 8 / (transfer_us[b] * 1e-6) / 1e9
        factor = boundaries[b].expected_gbit_s / nominal_gbit_s
        for name in p.links:
            link_scale[name] = min(factor, link_scale.get(name, math.inf))
            if p.slot_ghz is not None:
                slot_rate[name] = p.gbit_s / p.units
    return device_speeds(cluster, ratios, busy), link_scale, slot_rate


def replan(
    plan: Plan, cluster: ClusterSpec, traces: Sequence[StepTrace], busy: Collection[str] = ()
) -> Replanned | str:
    """Measure, scale the cluster, re-plan and score the current placement; or why not
    (``busy``: datacenters whose nodes the loop found busy, :func:`device_speeds`)."""
    from dmsc.planner.solve import SOLVERS, plan_job

    model: TransformerSpec | LayerListSpec = plan.model_spec or resolve_model(plan.model)
    m = plan.job.microbatches
    nominal = build_problem(cluster, model, plan.job)
    place = current_placement(nominal.problem, plan)
    if place is None:
        return "the plan's paths are not among the planner's path options on this cluster"
    stages, boundaries = measure_stages(traces, m), measure_boundaries(traces, m)
    if not stages:
        return "no step traces with compute times yet"
    speed, link_scale, slot_rate = measured_scales(
        plan, cluster, nominal, place, stages, boundaries, busy
    )
    measured_cluster = scaled_cluster(cluster, speed, link_scale, slot_rate)
    built = build_problem(measured_cluster, model, plan.job)
    current_s = _iteration_s(built, place, plan, measured_cluster, model)
    if current_s is None:
        return "the current placement breaks a constraint of the measured cluster"
    solver = plan.search.solver if plan.search.solver in SOLVERS else "milp"
    try:  # a residency rule may leave the job nowhere to go on the measured cluster
        new_plan = plan_job(measured_cluster, model, plan.job, solver=solver, fixed=True).plan
    except Infeasible as exc:
        return f"no placement on the measured cluster: {exc}"
    nominal_compute = {
        s: (nominal.problem.compute_us[s][d] or 0) * 1e-6 for s, d in enumerate(place.dcs)
    }
    return Replanned(current_s, new_plan, speed, link_scale, boundaries, stages, nominal_compute)


def layer_datacenters(plan: Plan, model: TransformerSpec | LayerListSpec) -> dict[str, str]:
    """Where each layer of ``plan`` runs: its datacenter, by layer name."""
    return {
        name: plan.stages[s].datacenter
        for s, (names, _) in enumerate(stage_chunks(model, plan.job))
        for name in names
    }


def _describe(old: Plan, new: Plan) -> tuple[ProposalKind, str, dict[str, Any]]:
    """What changes from ``old`` to ``new``: the kind of move, its target and the details."""
    old_dcs = [st.datacenter for st in old.stages]
    new_dcs = [st.datacenter for st in new.stages]
    old_layers = [st.layers for st in old.stages]
    new_layers = [st.layers for st in new.stages]

    def routes(plan: Plan) -> list[dict[str, Any]]:
        return [
            {"after_stage": p.after_stage, "links": p.links, "units": p.units} for p in plan.paths
        ]

    details: dict[str, Any] = {
        "datacenters": {"current": old_dcs, "proposed": new_dcs},
        "layers_per_stage": {"current": old_layers, "proposed": new_layers},
        "paths": {"current": routes(old), "proposed": routes(new)},
    }
    if old_dcs != new_dcs:
        pairs = enumerate(zip(old_dcs, new_dcs, strict=True))
        moves = [f"stage {s}: {a} -> {b}" for s, (a, b) in pairs if a != b]
        if old_layers != new_layers:
            moves.append(f"layers per stage {old_layers} -> {new_layers}")
        return "move-stage", "; ".join(moves), details
    if old_layers != new_layers:
        return "recut", f"layers per stage {old_layers} -> {new_layers}", details
    if routes(old) != routes(new):
        now = routes(old)
        changed = [
            f"boundary {r['after_stage']}->{r['after_stage'] + 1} via {', '.join(r['links'])} "
            f"({r['units']} units)"
            for r in routes(new)
            if r not in now
        ]
        return "reroute", "; ".join(changed) or "paths", details
    return "keep", "placement", details


class PathOptimisation:
    """Re-runs the planner on measured bandwidth and compute; proposes a faster placement."""

    name = "paths"
    description = (
        "re-plans the run's strategy (placement, paths, layer cut) on the measured bandwidth "
        "of each boundary and compute of each stage; proposes a move with its predicted gain"
    )
    reads = "the plan, step traces (op spans and bytes), the cluster spec, worker recoveries"
    proposes = "move-stage, reroute, recut (or keep, with the reason)"

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster

    def _keep(self, reason: str, **details: Any) -> list[Proposal]:
        return [Proposal(self.name, "keep", "placement", reason, details=details)]

    def propose(self, measurements: Measurements) -> list[Proposal]:
        plan = measurements.plan
        if plan.job.sync.local_steps and plan.job.dp > plan.job.ep:
            return self._keep("plans of islands (round modes) are not re-planned yet")
        why = cluster_mismatch(plan, self.cluster)
        if why is not None:
            return self._keep(why)
        if not measurements.traces:
            return self._keep("no step traces yet: nothing measured to re-plan on")
        found = replan(plan, self.cluster, measurements.traces, measurements.busy)
        if isinstance(found, str):
            return self._keep(found)
        measured = {
            "speed_by_datacenter": found.speed,
            "link_scale": found.link_scale,
            "boundary_gbit_s": {b: m.gbit_s for b, m in found.boundaries.items()},
            "boundary_forecast_gbit_s": {b: m.forecast_gbit_s for b, m in found.boundaries.items()},
            "boundary_gap_s": {b: m.gap_s for b, m in found.boundaries.items()},
            "stage_compute_s": found.stage_compute_s,
            "nominal_compute_s": found.nominal_compute_s,
            "current_s": found.current_s,
            "proposed_s": found.new_s,
            "busy": dict(measurements.busy),  # a move re-plans with them (loop.moves)
        }
        kind, target, details = _describe(plan, found.new_plan)
        gain = found.current_s - found.new_s
        if kind == "keep" or gain <= 0:
            return self._keep(
                f"on the measured figures the planner keeps the placement (predicted "
                f"{found.current_s:.3f} s/step, best found {found.new_s:.3f} s/step)",
                **measured,
            )
        model = plan.model_spec or resolve_model(plan.model)
        before, after = layer_datacenters(plan, model), layer_datacenters(found.new_plan, model)
        moved = sum(1 for name, dc in after.items() if before.get(name) != dc)
        crossing = [m.bytes_per_microbatch / m.gap_s for b, m in found.boundaries.items()
                    if any(p.after_stage == b for p in plan.paths)]  # fmt: skip
        cost, parts = move_cost_s(
            plan, moved, min(crossing, default=None), measurements.faults,
            measurements.worker_start_s,
        )  # fmt: skip
        busy = ", ".join(f"{dc} ({cpu:.0f}%)" for dc, cpu in sorted(measurements.busy.items()))
        return [
            Proposal(
                module=self.name,
                kind=kind,
                target=target,
                reason=(f"busy node CPU in {busy}: " if busy else "")
                + f"predicted {found.new_s:.3f} s/step on the measured figures against "
                f"{found.current_s:.3f} s/step now; the move costs {cost:.1f} s (checkpoint, "
                f"{moved} layers to move, restart)",
                predicted_gain_s_per_step=gain,
                current_s_per_step=found.current_s,
                cost_s=cost,
                details={**details, **measured, "cost_parts_s": parts, "moved_layers": moved},
            )
        ]
