"""What ``dmsc status`` shows: the services, their health and use, nodes, tasks, faults, spares.

The section per parallel mode compares the plan's predicted communication with the one measured
in the last steps of the run's newest traced training task (:mod:`dmsc.data.comm_modes`).

Health is asked of every worker at once (:func:`dmsc.runtime.control.launch.failures.health`), so
a dead worker costs one timeout, not one per worker. Each answer carries the worker's telemetry
(:mod:`dmsc.runtime.compute.telemetry`): its process's CPU % over the last second, resident memory
and GPU memory, and its node's CPU, memory and network use, from which come the node totals.

The faults are read before the services: a heal replaces the handles before it records its
fault, so a fault shown as recovered is never shown beside the worker it replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Protocol

from dmsc.data.comm_modes import compare_modes, expert_imbalance
from dmsc.data.db import Database, TaskRecord
from dmsc.data.traces import step_traces, traced_tasks
from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors.prediction import PLANS, Prediction, predict_segments
from dmsc.runtime.control.launch import failures
from dmsc.runtime.control.launch.deployment import Deployment
from dmsc.runtime.control.launch.failures import key_of
from dmsc.runtime.control.training.params import TrainParams
from dmsc.runtime.control.training.report import TrainReport
from dmsc.spec import ClusterSpec, TransformerSpec

HEALTH_TIMEOUT_S = 3.0
MODE_STEPS = 20  # the last steps of a task whose communication is compared per mode


def services(dep: Deployment) -> list[dict[str, Any]]:
    """Every serving worker: address, pid, whether it answers, registered, last heartbeat, and
    what its process uses (None where it did not say)."""
    return survey(dep)[0]


def survey(dep: Deployment) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The services (:func:`services`) and the nodes they run on (:func:`node_totals`). A
    replica's tensor-parallel ranks past the first answer their own health probe, with what
    their own processes use."""
    ranks = dep.tp.handles  # a replica's tensor-parallel ranks past the first
    handles = sorted([*dep.handles, *ranks], key=lambda h: (key_of(h), h.config.tp_rank))
    answers, silent = failures.health(dep, HEALTH_TIMEOUT_S)
    rank_answers, silent_ranks = dep.tp.probe(HEALTH_TIMEOUT_S) if ranks else ({}, set())
    out: list[dict[str, Any]] = []
    machines: dict[str, dict[str, Any]] = {}
    for h in handles:
        first = not h.config.tp_rank
        said = answers.get(key_of(h)) if first else rank_answers.get(h.config.sid)
        use = _obj(_obj(said).get("telemetry"))
        node = getattr(h.process, "ip", "local")
        if _obj(use.get("node")):
            machines.setdefault(node, use["node"])
        gone = key_of(h) in silent if first else h.config.sid in silent_ranks
        out.append(
            {
                "sid": h.config.sid,
                "stage": h.config.stage,
                "replica": h.config.replica,
                "tp_rank": h.config.tp_rank,
                "address": h.address,
                "health": "unreachable" if gone else "ok",
                "pid": h.process.pid,
                "node": node,
                **worker_use(use),
            }
        )
    seen_sids = {s.sid for s in dep.registry.lookup()}
    for s in out:
        s["registered"] = s["sid"] in seen_sids
        s["heartbeat_age_s"] = dep.registry.heartbeat_age(s["sid"])
    return out, node_totals(out, machines)


def _obj(x: Any) -> dict[str, Any]:
    """``x`` if it is a JSON object, else an empty one (a worker's answer is read, not trusted)."""
    return x if isinstance(x, dict) else {}


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def worker_use(telemetry: dict[str, Any]) -> dict[str, Any]:
    """A worker's Health telemetry as the services table shows it: its process's CPU % (over
    the last second) and RSS, the GPU memory its allocator holds and its GPUs' mean utilisation
    (None where unknown; GPU fields None without CUDA)."""
    p, node = _obj(telemetry.get("process")), _obj(telemetry.get("node"))
    gpus = [_obj(g) for g in telemetry.get("gpus") or [] if _obj(g)]
    held = [_number(g.get("memory_reserved_bytes")) for g in gpus]
    util = [u for u in (_number(g.get("utilization_percent")) for g in gpus) if u is not None]
    rss = _number(p.get("rss_bytes"))
    return {
        "host": node.get("host") if isinstance(node.get("host"), str) else None,
        "cpu_percent": _number(p.get("cpu_percent")),
        "rss_bytes": None if rss is None else int(rss),
        "gpu_memory_bytes": int(sum(h for h in held if h is not None)) if gpus else None,
        "gpu_utilization_percent": sum(util) / len(util) if util else None,
    }


def node_totals(
    services: list[dict[str, Any]], machines: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each node the services run on: its own CPU % (all cores, over the last second), memory
    and network rates as one of its workers read them, and the sums of its workers' CPU %, RSS
    and GPU memory."""
    out = []
    for node in sorted({s["node"] for s in services}):
        mine = [s for s in services if s["node"] == node]
        m = machines.get(node, {})

        def total(key: str, rows: list[dict[str, Any]] = mine) -> float | None:
            known = [r[key] for r in rows if r[key] is not None]
            return sum(known) if known else None

        out.append(
            {
                "node": node,
                "host": m.get("host") if isinstance(m.get("host"), str) else None,
                "cpus": _number(m.get("cpus")),
                "cpu_percent": _number(m.get("cpu_percent")),
                "memory_used_bytes": _number(m.get("memory_used_bytes")),
                "memory_total_bytes": _number(m.get("memory_total_bytes")),
                "net_sent_bytes_s": _number(m.get("net_sent_bytes_s")),
                "net_recv_bytes_s": _number(m.get("net_recv_bytes_s")),
                "workers": len(mine),
                "workers_cpu_percent": total("cpu_percent"),
                "workers_rss_bytes": total("rss_bytes"),
                "workers_gpu_memory_bytes": total("gpu_memory_bytes"),
            }
        )
    return out


def faults(db: Database, run_id: int) -> list[dict[str, Any]]:
    """The run's faults and what was done about each."""
    return [
        {
            "id": f.id,
            "kind": f.kind,
            "task": f.task_id,
            "services": f.services,
            "reason": f.reason,
            "detected_at": f.detected_at,
            "recovered_at": f.recovered_at,
            "checkpoint_step": f.checkpoint_step,
            "steps_lost": f.steps_lost,
            "epoch": f.epoch,
        }
        for f in db.faults(run_id)
    ]


def report(
    dep: Deployment,
    db: Database,
    run_id: int,
    plan: Plan,
    steps: int,
    replicas_down: Collection[int],
    predict: Callable[[TaskRecord], Prediction] | None = None,
) -> dict[str, Any]:
    """The reply of ``Status``; ``predict`` gives the prediction a training task's step is
    compared with (None: the plan's, :func:`modes`)."""
    faults_now = faults(db, run_id)  # before the services (see the module docstring)
    down = sorted(replicas_down)
    serving, nodes = survey(dep)
    traced = traced_tasks(db, run_id)
    task = traced[-1] if traced else None
    record = next((t for t in db.tasks(run_id) if t.id == task), None)
    prediction = predict(record) if record is not None and predict is not None else None
    return {
        "run": run_id,
        "model": plan.model,
        "modes_task": task,
        "modes": modes(db, plan, task, prediction),
        "modes_prediction": None if prediction is None else shown_basis(prediction),
        "expert_imbalance": routing(db, task),
        "planned_expert_imbalance": plan.job.expert_imbalance,
        "steps": steps,
        "epoch": dep.epoch,
        "services": serving,
        "nodes": nodes,
        "tasks": [{"id": t.id, "kind": t.kind, "state": t.state} for t in db.tasks(run_id)],
        "faults": faults_now,
        "replicas_down": down,
        "spares": [
            {"sid": h.config.sid, "address": h.address, "pid": h.process.pid}
            for h in dep.spares.handles
        ],
    }


def modes(
    db: Database, plan: Plan, task_id: int | None, prediction: Prediction | None = None
) -> list[dict[str, Any]]:
    """Each parallel mode's communication per step over the task's last steps, predicted
    against the traces' measurement (:func:`dmsc.data.comm_modes.compare_modes`). Predicted by
    ``prediction``, the one the task's step is compared with
    (:class:`~dmsc.runtime.control.advisors.prediction.Prediction`; None: the plan's): the
    plan's figures where the task ran the plan's job, re-estimated for the batch, dp or sync it
    ran, none where it is not comparable (its dp changed) or its parts were not kept."""
    if task_id is None:
        return []
    traces = step_traces(db, task_id, last=MODE_STEPS)
    predicted = plan.prediction.breakdown_s if prediction is None else prediction.breakdown_s
    return [r.as_json() for r in compare_modes(predicted, traces)]


def routing(db: Database, task_id: int | None, plan: Plan | None = None) -> float | None:
    """The routing's imbalance over the task's last steps (the busiest expert-parallel rank's
    tokens over an even share, :func:`dmsc.data.comm_modes.expert_imbalance`; the plan
    priced ``JobSpec.expert_imbalance``); None without expert parallelism (and without
    reading the traces where ``plan`` has none)."""
    if task_id is None or (plan is not None and plan.job.ep < 2):
        return None
    return expert_imbalance(step_traces(db, task_id, last=MODE_STEPS))


class _Report(Protocol):
    def as_json(self) -> dict[str, Any]: ...


def result_of(
    report: _Report, db: Database, plan: Plan, task_id: int, prediction: Prediction | None = None
) -> dict[str, Any]:
    """A training task's result (its report's: the sync mode, the privacy spent, the prediction
    its step compares with), with its communication per mode against ``prediction`` (the one
    its step compares with; None: the plan's)."""
    out = {**report.as_json(), "modes": modes(db, plan, task_id, prediction)}
    measured = routing(db, task_id)
    if measured is not None:  # the next plan may price it (dmsc plan --expert-imbalance)
        out["expert_imbalance"] = {"measured": measured, "planned": plan.job.expert_imbalance}
    return out


class _Plane(Protocol):  # what a control plane holds of its run (.plane.ControlPlane)
    db: Database
    plan: Plan
    cluster: ClusterSpec | None
    model: TransformerSpec


def finished(
    plane: _Plane, report: TrainReport, params: TrainParams, task_id: int
) -> dict[str, Any]:
    """Training task ``task_id``'s result as it ended (:func:`result_of`): its segments and
    its whole step compared with the predictions for the job it ran on ``plane``'s plan, its
    mixtures' routing as measured
    (:func:`dmsc.runtime.control.advisors.prediction.predict_segments`)."""
    db, plan = plane.db, plane.plan
    measured = routing(db, task_id, plan)
    whole = predict_segments(report, plan, plane.cluster, plane.model, params, measured)
    return result_of(report, db, plan, task_id, whole)


def shown_basis(prediction: Prediction) -> str | None:
    """What the per-mode table says of its predicted column: nothing where it is the plan's."""
    return None if prediction.basis == PLANS else prediction.basis
