"""What the operator's dashboard shows, as one JSON document built from the control plane.

The gateway serves the pages (:mod:`dmsc.runtime.business.dashboard`); this module gathers what
they draw, every field from a real source:

- ``topology``: the plan's datacenters with the stages placed in each, and its reserved paths
  (the stage boundary, the links, the reserved units or bandwidth);
- ``services``: every worker (SID, stage, replica, datacenter, device, health, heartbeat age,
  its epoch, its process's CPU % and memory) as ``dmsc status`` probes them, and ``nodes``: the
  machines they run on (CPU, memory and network use, and the sums over their workers);
- ``tasks`` (the newest), the queue depths by lane and the exception queue, the model versions
  with their canary share, and the run's faults;
- ``training``: the newest training task's step times beside the prediction for the job it ran,
  loss and throughput per step (the ``metrics`` table), and each parallel mode's communication
  per step, the plan's prediction against the last steps' traces (``modes``, as ``dmsc status``
  shows it). A task whose dp changed while it ran (a resize between steps, a shrink after a
  lost node) has ``segments``: each dp it ran at, from which step to which, its steps, their
  median and the prediction for that dp on the plan it ran on, as ``dmsc train`` and the task's
  result say (:mod:`.training.report`); while it runs, the segments so far, from its session's
  report (``live``: :meth:`~.advisors.prediction.TaskPredictions.segments`). Its task-wide
  prediction is then none, with the reason (its steps mix jobs);
- ``links``: the bytes per step each worker sent to each peer, averaged over the last steps of
  that task, and the rate that makes over the measured step time (the ``step_traces`` table);
- ``gantt``: the forward and backward ops of the last steps, every stage and replica, on the
  workers' wall clock, relative to the first op shown;
- ``serving`` and ``scale_events``: the elastic serving replicas (where each runs, its requests
  in flight, whether it is being drained) and the replicas added and removed, with the reason.

A tenant's document (``tenant`` given: a key without the admin scope) holds only its own rows,
as ``GET /v1/tasks`` does (:func:`tenant_rows`): its tasks and queue depths, its newest training
task's metrics, traffic and Gantt, and the task of a model version or a fault only when that
task is its own. The deployment's own state (topology, services, serving replicas, scale
events) is the same for every reader.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable
from typing import Any

from dmsc.data.db import Database, TaskRecord
from dmsc.data.traces import link_bytes, step_traces
from dmsc.planner.plan import Plan
from dmsc.runtime.control import status
from dmsc.runtime.control.advisors.prediction import PLANS, Prediction, mixed
from dmsc.runtime.control.launch.deployment import Deployment

TASKS_SHOWN = 40
FAULTS_SHOWN = 20
TRAFFIC_STEPS = 20  # steps averaged into the per-link traffic
GANTT_STEPS = 2  # the last steps drawn as a Gantt chart
SCALE_EVENTS_SHOWN = 30


def _iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.isoformat()


def _task(t: TaskRecord) -> dict[str, Any]:
    wait = None
    if t.started_at is not None:
        wait = max(0.0, (t.started_at - t.created_at).total_seconds())
    return {
        "id": t.id,
        "kind": t.kind,
        "state": t.state,
        "lane": t.lane,
        "priority": t.priority,
        "tenant": t.tenant,
        "attempts": t.attempts,
        "exception_type": t.exception_type,
        "error": t.error,
        "created_at": _iso(t.created_at),
        "queue_wait_s": wait,
    }


def topology(plan: Plan) -> dict[str, Any]:
    """The plan's datacenters, the stages placed in each, and its reserved paths."""
    dcs: dict[str, list[dict[str, Any]]] = {}
    for st in plan.stages:
        for rep in st.replicas:
            dcs.setdefault(rep.datacenter, []).append(
                {
                    "stage": st.index,
                    "replica": rep.dp_rank,
                    "sid": st.sid,
                    "layers": f"{st.chunks[0][0]} .. {st.chunks[-1][1]}",
                    "devices": rep.devices,
                    "device": rep.device,
                }
            )
    paths = [
        {
            "after_stage": p.after_stage,
            "source": p.source,
            "target": p.target,
            "links": p.links,
            "km": p.km,
            "reserved": (
                f"{p.units} slots from {p.first_unit}"
                if p.slot_ghz
                else f"units {p.first_unit}-{p.first_unit + p.units - 1}"
            ),
            "gbit_s": p.gbit_s,
        }
        for p in plan.paths
    ]
    return {
        "cluster": plan.cluster,
        "datacenters": [{"name": n, "placed": v} for n, v in sorted(dcs.items())],
        "paths": paths,
    }


def _where(plan: Plan) -> dict[tuple[int, int], tuple[str, str]]:
    """(stage, replica) -> (datacenter, device) of the plan."""
    return {
        (st.index, rep.dp_rank): (rep.datacenter, rep.device)
        for st in plan.stages
        for rep in st.replicas
    }


def resized_segments(
    task: TaskRecord | None, live: Callable[[int], list[dict[str, Any]] | None] | None = None
) -> list[dict[str, Any]]:
    """The segments of one dp each of a training task, when its dp changed while it ran: a
    finished task's result's, as the report wrote them; one with no result yet, the segments so
    far of its report, from ``live`` (by task id: None when it has none); none otherwise (a
    task that ran at one dp has its task-wide prediction)."""
    if task is None:
        return []
    if task.result_json:
        segments = json.loads(task.result_json).get("segments") or []
    else:
        segments = (live(task.id) if live is not None else None) or []
    return list(segments) if len(segments) > 1 else []


def training(
    db: Database,
    task_id: int | None,
    predicted: Prediction,
    segments: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The task's step times beside the prediction for the job it ran (None: not comparable,
    ``prediction`` says why), its loss and throughput per step; ``segments``: its
    :func:`resized_segments`, each given the last step it ran (the step before the next one
    begins; the last, the task's last measured step)."""
    rows = db.metrics(task_id) if task_id is not None else []
    segs = segments or []
    ends = [s["first_step"] - 1 for s in segs[1:]]
    if segs:
        ends.append(rows[-1].step if rows else segs[-1]["first_step"] + segs[-1]["steps"] - 1)
    return {
        "task": task_id,
        "predicted_step_s": predicted.step_s,
        "prediction": predicted.basis,
        "steps": [m.step for m in rows],
        "step_s": [m.step_s for m in rows],
        "loss": [m.loss for m in rows],
        "tokens_per_s": [m.tokens_per_s for m in rows],
        "segments": [{**s, "last_step": end} for s, end in zip(segs, ends, strict=True)],
    }


def traffic(db: Database, plan: Plan, task_id: int | None) -> tuple[list[Any], list[Any]]:
    """(links, gantt): the measured traffic per directed worker pair, and the last steps' ops."""
    if task_id is None:
        return [], []
    traces = step_traces(db, task_id, last=TRAFFIC_STEPS)
    if not traces:
        return [], []
    where = _where(plan)
    steps = sorted({t.step for t in traces})
    step_s = {m.step: m.step_s for m in db.metrics(task_id) if m.step in steps}
    mean_step = sum(step_s.values()) / len(step_s) if step_s else 0.0
    links = []
    for (src, dst), nbytes in sorted(link_bytes(traces).items()):
        kind = "pipeline" if src[0] != dst[0] else "data-parallel"
        links.append(
            {
                "from": f"{src[0]}/{src[1]}",
                "to": f"{dst[0]}/{dst[1]}",
                "kind": kind,
                "from_dc": where.get(src, ("?", ""))[0],
                "to_dc": where.get(dst, ("?", ""))[0],
                "bytes_per_step": nbytes,
                "mbit_s": nbytes * 8 / mean_step / 1e6 if mean_step > 0 else None,
            }
        )
    shown = [t for t in traces if t.step in steps[-GANTT_STEPS:]]
    origin = min((a for t in shown for _, _, a, _ in t.spans), default=0.0)
    gantt = [
        {
            "step": t.step,
            "stage": t.stage,
            "replica": t.replica,
            "op": op,
            "mb": mb,
            "t0_ms": (a - origin) * 1e3,
            "t1_ms": (b - origin) * 1e3,
        }
        for t in shown
        for op, mb, a, b in t.spans
    ]
    return links, gantt


def tenant_rows(
    db: Database,
    plan: Plan,
    run_id: int,
    tenant: str | None,
    faults: list[dict[str, Any]] | None = None,
    predict: Callable[[TaskRecord], Prediction] | None = None,
    live: Callable[[int], list[dict[str, Any]] | None] | None = None,
) -> dict[str, Any]:
    """The parts of the document made of tasks: every tenant's (``tenant`` None), or only
    ``tenant``'s (its tasks, queues, newest training task; another tenant's task id is not
    shown on a model version or a fault). ``faults``: the run's, when already read;
    ``predict``: the prediction for the job a training task ran (None: the plan's); ``live``:
    the segments so far of a task still running (:func:`resized_segments`)."""
    tasks = db.tasks(run_id)
    if tenant is not None:
        tasks = [t for t in tasks if t.tenant == tenant]
    own = {t.id for t in tasks}

    def shown(task: int | None) -> int | None:
        return task if tenant is None or task in own else None

    faults = status.faults(db, run_id) if faults is None else faults
    faults = [{**f, "task": shown(f["task"])} for f in faults]
    queued = [t for t in tasks if t.state == "queued"]
    lanes = {lane: sum(t.lane == lane for t in queued) for lane in ("sync", "async")}
    exceptions = [t for t in tasks if t.state == "failed" and t.exception_type]
    trained = [t.id for t in tasks if t.kind == "train" and t.state != "queued"]
    task_id = trained[-1] if trained else None
    newest = next((t for t in tasks if t.id == task_id), None)
    predicted = Prediction(plan.prediction.iteration_time_s, PLANS, plan.prediction.breakdown_s)
    segments = resized_segments(newest, live)
    if segments and newest is not None and not newest.result_json:  # running: so far
        predicted = mixed([s["dp"] for s in segments], running=True)
    elif segments:  # the task's own words: none task-wide, each segment has its own
        result = json.loads(newest.result_json or "{}")  # type: ignore[union-attr]
        predicted = Prediction(result.get("predicted_step_s"), result.get("prediction") or "")
    elif predict is not None and newest is not None:
        predicted = predict(newest)
    links, gantt = traffic(db, plan, task_id)
    versions = [
        {
            "id": v.id,
            "run": v.run_id,
            "step": v.step,
            "status": v.status,
            "canary_percent": v.canary_percent,
            "task": shown(v.task_id),
            "created_at": _iso(v.created_at),
        }
        for v in db.model_versions()  # every run's: a version serves across runs
    ]
    return {
        "queues": {"lanes": lanes, "exceptions": len(exceptions), "queued": len(queued)},
        "tasks": [_task(t) for t in tasks[-TASKS_SHOWN:]][::-1],
        "versions": versions,
        "faults": json.loads(json.dumps(faults[-FAULTS_SHOWN:][::-1], default=str)),
        "training": {
            **training(db, task_id, predicted, segments),
            "modes": status.modes(db, plan, task_id, predicted),
            **routing_state(db, plan, task_id),
        },
        "links": links,
        "gantt": gantt,
    }


def routing_state(db: Database, plan: Plan, task_id: int | None) -> dict[str, Any]:
    """``routing``: the task's measured routing beside the plan's priced one, where the task's
    traces counted a mixture's tokens (:func:`dmsc.runtime.control.status.routing`)."""
    measured = status.routing(db, task_id)
    if measured is None:
        return {}
    return {"routing": {"measured": measured, "planned": plan.job.expert_imbalance}}


def dashboard_state(
    db: Database,
    plan: Plan,
    dep: Deployment,
    run_id: int,
    steps_done: int = 0,
    replicas_down: set[int] | None = None,
    serving: list[dict[str, Any]] | None = None,
    tenant: str | None = None,
    predict: Callable[[TaskRecord], Prediction] | None = None,
    live: Callable[[int], list[dict[str, Any]] | None] | None = None,
) -> dict[str, Any]:
    """The document the dashboard's pages draw (module docstring); ``serving``: the elastic
    serving replicas, when the deployment has them; ``tenant``: the reader's tenant, whose rows
    alone it shows (None: every tenant's, for an admin key); ``predict``: the prediction for
    the job a training task ran (None: the plan's); ``live``: the segments so far of a training
    task still running, by its id (None: none shown before its result)."""
    faults = status.faults(db, run_id)  # before the services, as dmsc status reads them
    where = _where(plan)
    services = []
    found, nodes = status.survey(dep)
    for s in found:
        key = (s["stage"], s["replica"])
        dc, device = where.get(key, ("?", "?"))
        epoch = dep.epochs.get(key, dep.epoch)
        services.append({**s, "datacenter": dc, "device": device, "epoch": epoch})
    return {
        "run": run_id,
        "model": plan.model,
        "generated_at": time.time(),
        "epoch": dep.epoch,
        "steps_done": steps_done,
        "replicas_down": sorted(replicas_down or ()),
        "topology": topology(plan),
        "services": services,
        "nodes": nodes,
        **tenant_rows(db, plan, run_id, tenant, faults, predict, live),
        "serving": serving or [],
        "scale_events": [
            {
                "at": _iso(e.at),
                "action": e.action,
                "replica": e.replica,
                "replicas_after": e.replicas_after,
                "in_flight": e.in_flight,
                "reason": e.reason,
                "placement": json.loads(e.placement_json),
            }
            for e in db.scale_events(run_id)[-SCALE_EVENTS_SHOWN:][::-1]
        ],
    }
