"""The control plane: a deployed plan, its run in the database, and the ``dmsc.Control`` service.

:class:`ControlPlane` deploys a plan (stage workers through the local launcher, the registry in
this process), records runs, tasks, services, metrics and model versions in the database, and
serves ``dmsc.Control``: Status, Train, Infer and Down, each taking its typed message
(:mod:`dmsc.runtime.transport.messages`; a bad field is refused with INVALID_ARGUMENT naming
it). The process around it (settings, threads, the gateway, ``control.json``) is
:mod:`dmsc.runtime.control.daemon`; replica routing and versions are :mod:`.inference`, the
repair of failed workers between tasks :mod:`.watchdog`.

Recovery. Training tasks checkpoint every ``checkpoint_every`` steps (default 50) and survive a
failed worker (see :mod:`dmsc.runtime.control.training`). After a crash of the control plane,
the same plan resumes its run (:meth:`dmsc.data.db.Database.resume_or_new_run`): workers load
the run's last checkpoint, queued tasks stay queued, and a task that was running resumes from its
own last checkpoint.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.data.db import CheckpointRecord, Database, ModelVersionRecord, data_dir
from dmsc.planner.plan import Plan
from dmsc.runtime.control import status
from dmsc.runtime.control.deployment import Checkpoint, Deployment
from dmsc.runtime.control.inference import NoReplica, Replicas
from dmsc.runtime.control.task_queue import TaskQueue
from dmsc.runtime.control.training import Recovering, TrainReport, layout_from_plan, train
from dmsc.runtime.transport.messages import (
    DownRequest,
    InferRequest,
    LatePolicy,
    Schedule,
    StatusRequest,
    TrainRequest,
)
from dmsc.runtime.transport.observe import json_logger
from dmsc.runtime.transport.rpc import BadRequest, message_handler, parse
from dmsc.spec import TransformerSpec, resolve_model


@dataclass(frozen=True)
class TrainParams:
    """A training task's parameters, checked against the plan (stored with the task)."""

    steps: int
    batch: int
    microbatches: int
    checkpoint_every: int
    late_policy: LatePolicy
    grad_wait_s: float
    first_step: int | None = None  # set once the task has started: a rerun resumes

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


class ControlPlane:
    """A deployment plus the database and the Control service methods."""

    def __init__(
        self,
        plan: Plan,
        db: Database,
        registry_ttl_s: float = 10.0,
        spares: int = 0,
        home: Path | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        model = resolve_model(plan.model)
        if not isinstance(model, TransformerSpec):
            raise ValueError("the runtime serves transformer models")
        self.plan, self.model, self.db = plan, model, db
        self.home = home if home is not None else data_dir()
        self.deployment = Deployment(
            layout_from_plan(plan, model),
            workdir=self.home / "workers",
            registry_ttl_s=registry_ttl_s,
            spares=spares,
            # a step that takes 50 times its predicted time has a stuck worker in it
            step_deadline_s=max(30.0, 50 * plan.prediction.iteration_time_s),
            home=self.home,
        )
        plan_dict = json.loads(plan.model_dump_json())
        self.run = db.resume_or_new_run(plan.model, plan.cluster, plan_dict)
        train_text, valid_text = stdlib_text()
        self.corpus = Corpus(train_text, model.seq, seed=0)
        self.valid = Corpus(valid_text, model.seq, seed=1)
        self.steps_done = 0
        self.lock = threading.Lock()  # one task at a time touches the weights
        self.log = log or json_logger("dmsc.control")
        self.inference = Replicas(
            self.deployment,
            db,
            self.lock,
            self.log,
            self.run.id,
            token_timeout_s=self.deployment.registry.ttl_s,  # the failure timeout
        )
        self.metrics = CollectorRegistry()
        self.m_tasks = Counter(
            "dmsc_control_tasks_total", "Tasks finished", ["kind", "state"], registry=self.metrics
        )
        self.m_queue = Gauge("dmsc_control_queue_depth", "Queued tasks", registry=self.metrics)
        self.m_step = Histogram(
            "dmsc_control_train_step_seconds", "Training step time", registry=self.metrics
        )
        self.stopped = threading.Event()

    def start(self) -> None:
        self.deployment.start()
        last = self.last_checkpoint()
        if last is not None:  # a resumed run: the workers continue from where it stopped
            self.deployment.restore(last)
            self.steps_done = last.step
            self.log.info("resumed from the checkpoint of step %d", last.step)
        self.record_services()
        self.db.close_control_plane_faults(self.run.id, last.step if last is not None else None)

    def end_run(self) -> None:
        self.db.end_run(self.run.id)

    def record_services(self, sids: list[str] | None = None) -> None:
        """Record the services (only ``sids``, the replacements, after a heal)."""
        for h in self.deployment.handles:
            if sids is None or h.config.sid in sids:
                c = h.config
                self.db.add_service(self.run.id, c.sid, c.stage, c.replica, h.address)

    def last_checkpoint(self, task_id: int | None = None) -> Checkpoint | None:
        rec = self.db.last_checkpoint(self.run.id, task_id)
        if rec is None:
            return None
        files = {int(k): (v[0], v[1]) for k, v in json.loads(rec.files_json).items()}
        return Checkpoint(rec.step, files)

    # -- dmsc.Control -------------------------------------------------------------------------
    def status(self, req: StatusRequest) -> dict[str, Any]:
        dep, down = self.deployment, self.inference.down
        return status.report(dep, self.db, self.run.id, self.plan.model, self.steps_done, down)

    def train_params(self, req: TrainRequest) -> TrainParams:
        """A training request completed from the plan (batch and micro-batches default to its)
        and checked against it (BadRequest says what is wrong)."""
        batch = req.batch if req.batch is not None else self.plan.job.global_batch
        micro = req.microbatches if req.microbatches is not None else self.plan.job.microbatches
        dp = self.plan.job.dp
        if batch % (micro * dp):
            raise BadRequest(
                f"batch ({batch}) must be divisible by microbatches x dp ({micro} x {dp})"
            )
        return TrainParams(
            steps=req.steps,
            batch=batch,
            microbatches=micro,
            checkpoint_every=req.checkpoint_every,
            late_policy=req.late_policy,
            grad_wait_s=req.grad_wait_s,
            first_step=req.first_step,
        )

    def run_task(self, task_id: int, params: TrainParams) -> TrainReport:
        """Run a training task (holding the lock). A task that was running when the control
        plane died resumes from its last checkpoint."""
        schedule: Schedule = "gpipe" if self.plan.job.schedule == "gpipe" else "1f1b"
        start = None
        if params.first_step is not None:  # it ran before: resume
            start = self.last_checkpoint(task_id)
            first = params.first_step
        else:
            first = self.steps_done
            self.db.set_task_params(task_id, {**params.as_json(), "first_step": first})
        folder = self.home / "checkpoints" / f"run{self.run.id}" / f"task{task_id}"
        report = train(
            self.deployment,
            self.corpus,
            self.valid,
            params.steps,
            params.batch,
            params.microbatches,
            schedule,
            self.db,
            task_id,
            first_step=first,
            recovering=Recovering(
                checkpoint_every=params.checkpoint_every,
                checkpoint_dir=folder,
                late_policy=params.late_policy,
                grad_wait_s=params.grad_wait_s,
                start=start,
            ),
            run_id=self.run.id,
        )
        self.steps_done = first + params.steps
        for r in report.recoveries:
            self.log.warning("recovered from a failure: %s", r.reason, extra={"task_id": task_id})
        return report

    def train(self, req: TrainRequest) -> dict[str, Any]:
        params = self.train_params(req.model_copy(update={"first_step": None}))
        with self.lock:
            task = self.db.new_task(self.run.id, "train", params.as_json(), state="running")
            try:
                report = self.run_task(task.id, params)
            except Exception as exc:
                self.db.set_task_state(task.id, "failed", str(exc))
                raise
            version = self._save_version()
            self.db.set_task_state(task.id, "done")
        for s in report.step_s:
            self.m_step.observe(s)
        self.m_tasks.labels("train", "done").inc()
        self.log.info("train task done", extra={"task_id": task.id, "run": self.run.id})
        return {
            "task": task.id,
            "steps": params.steps,
            "loss_first": report.losses[0],
            "loss_last": report.losses[-1],
            "val_start": report.val_start,
            "val_end": report.val_end,
            "median_step_s": report.median_step_s,
            "predicted_step_s": self.plan.prediction.iteration_time_s,
            "tokens_per_s": report.tokens_per_step / report.median_step_s,
            "model_version": version,
            "recoveries": [
                {
                    "services": r.failed,
                    "reason": r.reason,
                    "detected_at": r.detected_at,
                    "recovered_after_s": r.recovered_at - r.detected_at,
                    "checkpoint_step": r.checkpoint_step,
                }
                for r in report.recoveries
            ],
            "steps_lost": report.steps_lost,
            "restarts": report.restarts,
            "skipped": report.skipped,
        }

    def _save_version(self) -> int:
        """Save the model as a new version (and as the run's latest checkpoint)."""
        folder = self.home / "checkpoints" / f"run{self.run.id}" / f"step{self.steps_done}"
        ckpt = self.deployment.checkpoint(self.steps_done, folder)
        digests = {path: sha for path, sha in ckpt.files.values()}
        files = {str(k): list(v) for k, v in ckpt.files.items()}
        self.db.add(
            CheckpointRecord(run_id=self.run.id, step=ckpt.step, files_json=json.dumps(files))
        )
        record = self.db.add(
            ModelVersionRecord(
                run_id=self.run.id,
                step=self.steps_done,
                path=str(folder),
                sha256=next(iter(digests.values())),
                metrics_json=json.dumps(digests),
            )
        )
        return record.id

    def infer(self, req: InferRequest) -> dict[str, Any]:
        task = self.db.new_task(self.run.id, "infer", {"tokens": req.tokens}, state="running")
        try:
            replica, text = self.inference.generate(req.prompt, req.tokens)
        except NoReplica as exc:
            self.db.set_task_state(task.id, "failed", str(exc))
            raise BadRequest(str(exc)) from None
        self.db.set_task_state(task.id, "done")
        return {"task": task.id, "text": text, "replica": replica}

    def down(self, req: DownRequest) -> dict[str, Any]:
        self.stopped.set()
        return {"ok": True}

    def methods(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "Status": message_handler(StatusRequest, self.status),
            "Train": message_handler(TrainRequest, self.train),
            "Infer": message_handler(InferRequest, self.infer),
            "Down": message_handler(DownRequest, self.down),
        }

    # -- the gateway's backend (dmsc.runtime.business.gateway.Backend) -----------------------
    def replicas(self) -> list[str]:
        return self.inference.names()

    def replicas_for_version(self, version_id: int | None) -> list[str]:
        return self.inference.for_version(version_id)

    def infer_on(
        self,
        replica: str,
        prompt: str,
        tokens: int,
        cancel: threading.Event | None = None,
        tenant: str = "default",
        deadline: float | None = None,
    ) -> str:
        return self.inference.infer_on(replica, prompt, tokens, cancel, tenant, deadline)

    def stage_count(self) -> int:
        """Stages of a replica's pipeline: a request's cost is its tokens times this."""
        return self.deployment.stages

    def services(self) -> list[dict[str, Any]]:
        return status.services(self.deployment)

    # -- queued work ------------------------------------------------------------------------
    def work_queue(self, queue: TaskQueue) -> None:
        """Run queued training tasks (the asynchronous lane first) until the plane stops;
        between tasks, load the model versions the replicas should serve."""
        while not self.stopped.is_set():
            self.m_queue.set(queue.depth())
            try:
                self.inference.sync_versions()
            except Exception as exc:  # a bad checkpoint must not stop the queue
                self.log.warning("version sync failed: %s", exc)
            task = queue.claim("priority", lane="async") or queue.claim("priority", lane="sync")
            if task is None:
                self.stopped.wait(0.5)
                continue
            try:
                params = self.train_params(parse(TrainRequest, json.loads(task.params_json)))
                with self.lock:
                    self.run_task(task.id, params)
                queue.complete(task.id)
                self.m_tasks.labels("train", "done").inc()
                self.log.info("task done", extra={"task_id": task.id, "run": self.run.id})
            except Exception as exc:  # isolate it in the exception queue (or retry)
                state = queue.fail(task.id, exc)
                self.m_tasks.labels("train", state).inc()
                self.log.warning("task failed: %s", exc, extra={"task_id": task.id})
