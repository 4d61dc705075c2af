"""One snapshot of what the control plane measured, for one tick of the loop.

Where each measurement is kept, and what :func:`take` reads of it:

- the run's training metrics, step traces (with each worker's CPU % and memory over its steps:
  :mod:`dmsc.runtime.compute.telemetry`), tasks and faults: the database, read once through
  :func:`~dmsc.runtime.control.advisors.read_measurements` on the deployment's current plan;
- the queue depth: the run's queued training tasks in the same read;
- inference requests in flight, the latencies of those answered within the policy's window
  (whichever door they came through: the gateway's requests are no task rows) and the elastic
  serving replicas: the control plane's router (``cp.inference``), read under its own short
  lock;
- the rate across each stage boundary: the traced bytes per step over the measured step time,
  and the capacity of the plan's reserved path there (:mod:`dmsc.planner.plan`);
- the devices online by datacenter (the launcher's ``capacity()`` where it has one: the Ray
  cluster's ``dc:NAME`` resources of its alive nodes; else the cluster spec's devices) against
  the replicas' (:class:`~.resizing.DeviceView`), and why no resize can be made now, if none
  can (task heads, elastic serving replicas, the running task's sync mode, no deployment left
  by a failed shrink);
- when the deployment last moved (the newest ``move`` among the run's scale events: the loop's
  or ``dmsc replan``'s), read when the modules are due: a task that started before it ran on
  the old placement (:mod:`.hysteresis`).

Nothing here waits on a worker or on the plane's task lock: a tick never probes the workers
(their health comes from the watchdog, their use of the machine from the step traces).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Protocol

from sqlalchemy import select

from dmsc.data.db import Database, RunRecord, ScaleEventRecord
from dmsc.data.traces import step_traces
from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors.base import Measurements, read_measurements, unix_s
from dmsc.runtime.control.advisors.prediction import Prediction, task_prediction, traced_routing
from dmsc.runtime.control.advisors.traffic import boundary_bytes
from dmsc.runtime.control.loop.busy import numbered_on
from dmsc.runtime.control.loop.resizing import NO_DEPLOYMENT, DeviceView, device_view
from dmsc.runtime.control.loop.tick import Snapshot, modules_due
from dmsc.spec import ClusterSpec, LayerListSpec, TransformerSpec

TRACED_STEPS = 50  # the step traces a snapshot reads (the modules' window)
RATE_STEPS = 5  # the last steps a boundary's rate is the mean of


class Observed(Protocol):
    """What a snapshot reads of the control plane (:class:`~..plane.ControlPlane`)."""

    db: Database
    run: RunRecord
    plan: Plan
    cluster: ClusterSpec | None
    model: TransformerSpec
    inference: Any  # .in_flight(), .pool, .heads, .answered_since() where it keeps latencies


class Predictions:
    """The prediction for the job a training task ran, kept per (task, plan): it re-plans once."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int, float | None], Prediction] = {}

    def get(
        self,
        plan: Plan,
        cluster: ClusterSpec | None,
        model: TransformerSpec | LayerListSpec,
        m: Measurements,
    ) -> Prediction:
        # a mixture's routing as the task's traces measured it (advisors.prediction.routed)
        routing = traced_routing(plan, m.traces)
        key = (m.task_id or 0, id(plan), routing)
        if key not in self._kept:
            params = next((t.params for t in m.tasks if t.id == m.task_id), None)
            # the newest only
            self._kept = {key: task_prediction(plan, cluster, model, params, routing)}
        return self._kept[key]


def link_rates(m: Measurements) -> dict[int, float]:
    """Bytes/s across each stage boundary over the last ``RATE_STEPS`` traced steps."""
    steps = {p.step: p.step_s for p in m.metrics}
    traced = sorted({t.step for t in m.traces})[-RATE_STEPS:]
    times = [steps[s] for s in traced if s in steps]
    if not times or statistics.mean(times) <= 0:
        return {}
    recent = [t for t in m.traces if t.step in set(traced)]
    return {
        b: statistics.mean(series) / statistics.mean(times)
        for b, series in boundary_bytes(recent).items()
        if series
    }


def telemetry(m: Measurements) -> dict[str, dict[str, float | None]]:
    """Each worker's mean CPU %, largest memory and its node's mean CPU % (all cores) over its
    last ``RATE_STEPS`` traced steps."""
    traced = set(sorted({t.step for t in m.traces})[-RATE_STEPS:])
    out: dict[str, dict[str, float | None]] = {}
    by: dict[str, list[Any]] = {}
    for t in m.traces:
        if t.step in traced:
            by.setdefault(f"{t.stage}/{t.replica}", []).append(t)
    for name, rows in sorted(by.items()):
        cpu = [t.cpu_percent for t in rows if t.cpu_percent is not None]
        rss = [t.rss_bytes for t in rows if t.rss_bytes is not None]
        node = [t.node_cpu_percent for t in rows if t.node_cpu_percent is not None]
        out[name] = {
            "cpu_percent": statistics.mean(cpu) if cpu else None,
            "rss_bytes": float(max(rss)) if rss else None,
            "node_cpu_percent": statistics.mean(node) if node else None,
        }
    return out


def last_move_s(db: Database, run_id: int) -> float | None:
    """When run ``run_id``'s deployment last moved (unix seconds; None: never)."""
    with db.sessions() as s:
        at = s.scalar(
            select(ScaleEventRecord.at)
            .where(ScaleEventRecord.run_id == run_id, ScaleEventRecord.action == "move")
            .order_by(ScaleEventRecord.id.desc())
            .limit(1)
        )
    return unix_s(at)


def capacity(cp: Any, cluster: ClusterSpec) -> tuple[dict[str, int], str]:
    """The devices online by datacenter, and where that was read: the cluster spec's, as
    many as the launcher's ``capacity()`` says are up where it says (Ray's nodes alive; a
    private Ray cluster offers more units than the spec has devices, and the re-plan places on
    the spec)."""
    out = {
        dc.name: sum(g.count * cluster.node_types[g.type].devices for g in dc.nodes)
        for dc in cluster.datacenters
    }
    launcher = getattr(getattr(cp, "deployment", None), "launcher", None)
    read = getattr(launcher, "capacity", None)
    if read is None:
        return out, "the cluster spec"
    up = read()
    return {dc: min(n, up.get(dc, 0)) for dc, n in out.items()}, "the Ray cluster's nodes"


def _blocked(cp: Any, m: Measurements) -> str | None:
    """Why the deployment cannot be resized now (training.resize's refusals), or None."""
    if undeployed := getattr(cp, "undeployed", None):  # a failed shrink stopped every worker
        return f"{NO_DEPLOYMENT} ({undeployed})"
    if getattr(cp.inference, "heads", False):
        return "the replicas hold task heads of their own"
    if getattr(cp.inference, "pool", None) is not None:
        return "elastic serving replicas hold devices (dmsc up --autoscale)"
    running = [t for t in m.tasks if t.kind == "train" and t.state == "running"]
    for t in running:
        sync = t.params.get("sync") or {}
        mode = sync.get("mode", "every-step")
        if mode != "every-step" or sync.get("local_data") or sync.get("task_heads"):
            return f"training task {t.id}'s replicas differ between steps (sync {mode})"
    return None


def devices(cp: Any, plan: Plan, base_dp: int, m: Measurements) -> DeviceView | None:
    """The replicas of ``plan`` against the devices online (None without a cluster spec:
    nothing to re-plan on)."""
    if cp.cluster is None:
        return None
    online, source = capacity(cp, cp.cluster)
    return device_view(plan, base_dp, online, source, _blocked(cp, m))


def take(
    cp: Observed,
    now_s: float,
    predictions: Predictions,
    last_key: tuple[Any, ...] | None = None,
    window_s: float = 300.0,
    last_ran_s: float | None = None,
    interval_s: float = 0.0,
    asked: bool = False,
) -> Snapshot:
    """The snapshot of ``cp``'s run at ``now_s`` (module docstring). The last ``RATE_STEPS``
    step traces are read for the objectives; ``TRACED_STEPS`` only when the modules are due
    (:func:`.tick.modules_due` of ``last_key``, the key they last ran on at ``last_ran_s``, and
    the re-plan's ``interval_s``; a tick that an event makes run them has the last
    ``RATE_STEPS``; ``asked``: the tick will run them, a node having been over the busy
    threshold at the last one); the inference latencies of the last ``window_s``."""
    plan = cp.plan  # read once: a move may replace it meanwhile
    measured = read_measurements(cp.db, cp.run.id, now_s, last_steps=RATE_STEPS)
    base_dp = measured.plan.job.dp  # the run's own plan: what devices coming back restore
    started = getattr(getattr(cp, "deployment", None), "start_s", None)  # a move's restart
    measured = dataclasses.replace(measured, plan=plan, worker_start_s=started)
    moved_s = None
    key = Snapshot(measured).key()
    due = modules_due(key, last_key, now_s, last_ran_s, interval_s, asked)
    if measured.task_id is not None and due:
        traces = tuple(step_traces(cp.db, measured.task_id, last=TRACED_STEPS))
        measured = dataclasses.replace(measured, traces=traces)
        moved_s = last_move_s(cp.db, cp.run.id)
    if measured.task_id is not None:
        predicted = predictions.get(plan, cp.cluster, cp.model, measured)
        measured = dataclasses.replace(measured, predicted=predicted)
    pool = getattr(cp.inference, "pool", None)
    answered = getattr(cp.inference, "answered_since", None)  # None: a router that keeps none
    return Snapshot(
        measured=measured,
        queue_depth=sum(t.kind == "train" and t.state == "queued" for t in measured.tasks),
        in_flight=int(cp.inference.in_flight()),
        serving_replicas=pool.count() if pool is not None else 0,
        link_rates=link_rates(measured),
        link_capacity={p.after_stage: p.gbit_s * 1e9 / 8 for p in plan.paths if p.gbit_s > 0},
        telemetry=telemetry(measured),
        moved_s=moved_s,
        devices=devices(cp, plan, base_dp, measured),
        served=None if answered is None else tuple(answered(now_s - window_s)),
        cluster=numbered_on(cp),  # the spec the plan's devices are numbered on (.busy)
    )
