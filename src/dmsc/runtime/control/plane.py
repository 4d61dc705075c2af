"""The control plane: a deployed plan, its run in the database, and the ``dmsc.Control`` service.

:class:`ControlPlane` deploys a plan (stage workers through the local launcher, the registry in
this process), records runs, tasks, services, metrics and model versions in the database, and
serves ``dmsc.Control``: Status, Train, Infer (InferStream: token by token) and Down, each
taking its typed message (:mod:`dmsc.runtime.transport.messages`; a bad field is refused with
INVALID_ARGUMENT naming it). The process around it (settings, threads, the gateway,
``control.json``) is :mod:`dmsc.runtime.control.daemon`; replica routing and versions are
:mod:`.serving.inference`, the repair of failed workers between tasks :mod:`.watchdog`.

Recovery. Training tasks checkpoint every ``checkpoint_every`` steps (default 50) and survive a
failed worker (see :mod:`.training.session`). After a crash of the control plane, the same plan
resumes its run (:meth:`dmsc.data.db.Database.resume_or_new_run`): workers load the run's last
checkpoint, queued tasks stay queued, and a task that was running resumes from its own last
checkpoint (the steps it had done since count as lost in the restart's fault). Every recovery loads
the newest checkpoint that verifies (:mod:`.launch.fallback`): a missing or corrupt one is a
``checkpoint`` fault, and with none that verifies the control plane does not start (or, once
running, refuses training: :attr:`ControlPlane.weights_lost`) rather than serve fresh weights. Tasks
that an earlier, stopped run left queued move into this run when it starts
(:meth:`.tasks.task_queue.TaskQueue.adopt_orphans`). A training task that ends records its version.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dmsc.data.corpus import Corpus, stdlib_text, task_corpora
from dmsc.data.db import Database, TaskRecord, data_dir
from dmsc.data.tokenizer import tokenizer_for
from dmsc.data.traces import latest_worker_cpu
from dmsc.planner.plan import Plan
from dmsc.runtime.control import dashboard_state, status
from dmsc.runtime.control.advisors.prediction import Prediction, TaskPredictions
from dmsc.runtime.control.launch import fallback, signals
from dmsc.runtime.control.launch.deployment import Checkpoint, Deployment
from dmsc.runtime.control.launch.fallback import NoGoodCheckpoint, Restored
from dmsc.runtime.control.launch.launchers import Launcher, runs_here
from dmsc.runtime.control.service import control_methods
from dmsc.runtime.control.serving.head_inference import Heads
from dmsc.runtime.control.serving.infer_calls import InferCalls
from dmsc.runtime.control.serving.inference import Replicas
from dmsc.runtime.control.serving.model_store import save_version
from dmsc.runtime.control.tasks import infer_batch, lanes, task_queue, work_loop
from dmsc.runtime.control.tasks.door import Door
from dmsc.runtime.control.training.corpora import TaskTexts, inside_roots
from dmsc.runtime.control.training.local_data import load_task_shards
from dmsc.runtime.control.training.online import ResizedPlans, numbered_spec
from dmsc.runtime.control.training.params import TrainParams, task_params
from dmsc.runtime.control.training.report import TrainReport
from dmsc.runtime.control.training.residency import check_task
from dmsc.runtime.control.training.resize import Between, record_resize, resize
from dmsc.runtime.control.training.retention import Retention
from dmsc.runtime.control.training.session import Recovering, layout_from_plan, train_task
from dmsc.runtime.control.training.shrink import Shrink
from dmsc.runtime.transport.messages import (
    DownRequest,
    InferRequest,
    InjectRequest,
    Sampling,
    Schedule,
    StatusRequest,
    TrainRequest,
)
from dmsc.runtime.transport.observe import json_logger
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.spec import ClusterSpec, TransformerSpec, resolve_model


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
        device: str = "plan",
        launcher: Launcher | None = None,
        cluster: ClusterSpec | None = None,
        retention: Retention | None = None,
        queue: task_queue.Policy = "priority",
        data_roots: Sequence[Path] | None = None,
    ) -> None:
        # the plan's cluster spec, when known: training tasks may then change dp (.resize)
        self.cluster, self.device = cluster, device
        self.queue_policy = queue  # the order the task queue's consumers claim in
        # where a task's data may lie (dmsc up --data-root; the data directory when none given)
        model = plan.model_spec if plan.model_spec is not None else resolve_model(plan.model)
        if not isinstance(model, TransformerSpec):
            raise ValueError("the runtime serves transformer models")
        self.plan, self.model, self.db = plan, model, db
        self.home = home if home is not None else data_dir()
        self.data_roots = [Path(r) for r in data_roots] if data_roots else [self.home]
        self.tokenizer = tokenizer_for(model)
        self.encode = getattr(self.tokenizer, "encode_corpus", None)  # None: bytes as they are
        # the default (training, validation) text, tokenized once, before the plane serves
        texts = stdlib_text()
        self.texts = (
            texts if self.encode is None else (self.encode(texts[0]), self.encode(texts[1]))
        )
        self.deployment = Deployment(
            layout_from_plan(plan, model, device=device, spec=cluster, pack=runs_here(launcher)),
            launcher=launcher,
            workdir=self.home / "workers",
            registry_ttl_s=registry_ttl_s,
            spares=spares,
            # a step that takes 50 times its predicted time has a stuck worker in it
            step_deadline_s=max(30.0, 50 * plan.prediction.iteration_time_s),
            home=self.home,
        )
        plan_dict = json.loads(plan.model_dump_json())
        self.run = db.resume_or_new_run(plan.model, plan.cluster, plan_dict)
        # this run's checkpoints (never another database's run of the same number: .run_key)
        self.run_dir = self.home / "checkpoints" / db.run_key(self.run.id)
        self.retention = retention or Retention()  # which of a task's checkpoints stay
        self.queue = task_queue.TaskQueue(db, self.run.id)
        self.door = Door(self.queue, self.train_params)  # both doors' one way in (.tasks.door)
        self.consumers = work_loop.Consumers(self, queue)  # started once (.work_queue)
        self.corpus, self.valid = task_corpora(None, model.seq, 0, self.texts, self.encode)
        self.task_texts = TaskTexts(
            lambda data, seed: task_corpora(data, model.seq, seed, self.texts, self.encode)
        )
        self.resized_plans = ResizedPlans()  # the plans at other dps (.training.online)
        self.between, self.shrink = Between(self), Shrink(self)  # resizes during a task
        self._predictions, self.steps_done = TaskPredictions(partial(status.routing, db)), 0
        self.lock = threading.Lock()  # one task at a time touches the weights
        self.handoff = lanes.Handoff(self.lock)  # taken by tasks, lent between lanes (.tasks)
        self.log = log or json_logger("dmsc.control")
        ttl, tok = self.deployment.registry.ttl_s, self.tokenizer  # ttl: the failure timeout
        self.inference = Replicas(self.deployment, db, self.lock, self.log, self.run.id, ttl, tok)
        # the held-out text of the last task that trained task heads (None: no heads yet)
        self.heads_valid: Corpus | None = None
        self.heads = Heads(
            self.inference,
            lambda: self.heads_valid or self.valid,
            lambda: (self.steps_done, tuple(sorted(self.inference.served.items()))),
        )
        self.calls = InferCalls(db, self.run.id, self.inference, self.heads)
        self.metrics = CollectorRegistry()
        self.m_tasks = Counter(
            "dmsc_control_tasks_total", "Tasks finished", ["kind", "state"], registry=self.metrics
        )
        self.m_queue = Gauge("dmsc_control_queue_depth", "Queued tasks", registry=self.metrics)
        self.m_step = Histogram(
            "dmsc_control_train_step_seconds", "Training step time", registry=self.metrics
        )
        self.stopped = threading.Event()
        self.batches = infer_batch.Batches(self.door, self.calls, self.consumers, self.stopped)
        # Set when no checkpoint could restore the workers: training is refused (see start).
        self.weights_lost: str | None = None
        self.undeployed: str | None = None  # no workers after a failed shrink (.training.shrink)
        self.unrestored: set[int] = set()  # replicas kept out of routing for that reason
        self.interrupted: set[int] = set()  # tasks a crash cut short, to resume

    def start(self) -> None:
        """Start the workers; a resumed run's go back to its newest checkpoint that verifies
        (NoGoodCheckpoint, after recording the fault, when it has some but none does)."""
        self.deployment.start()
        self.interrupted = {
            t.id
            for t in self.db.tasks(self.run.id)
            if t.state == "queued" and "first_step" in json.loads(t.params_json)
        }
        last = self.restore_run("resuming the run")
        if last is not None:  # a resumed run: the workers continue from where it stopped
            self.steps_done = last.step
            trained = [t for t in self.db.tasks(self.run.id) if t.kind == "train"]
            if trained and json.loads(trained[-1].params_json).get("sync", {}).get("task_heads"):
                self.inference.heads = True  # the replicas went back to their own heads
            self.log.info("resumed from the checkpoint of step %d", last.step)
        self.record_services()
        self.db.close_control_plane_faults(self.run.id, last.step if last is not None else None)
        orphans = task_queue.TaskQueue(self.db, self.run.id).adopt_orphans(self.plan.model)
        for outcome, ids in orphans.items():
            if ids:
                self.log.warning(
                    "tasks left by an earlier run %s: %s", outcome, ids, extra={"run": self.run.id}
                )

    def restore_run(self, what: str) -> Checkpoint | None:
        """Load the run's newest checkpoint that verifies into every worker; None when the run
        has none, NoGoodCheckpoint (recorded) when it has some but none verifies."""
        restored = fallback.restore_newest(self.deployment, self.checkpoints())
        self.record_refused(restored)
        if restored.lost:
            raise restored.error(f"{what}, run {self.run.id}")
        return restored.checkpoint

    def record_refused(self, restored: Restored, task_id: int | None = None) -> None:
        """Record and log the checkpoints a recovery skipped (they are not tried again)."""
        fallback.record_refused(restored, self.deployment, self.db, self.run.id, self.log, task_id)

    def end_run(self) -> None:
        self.db.end_run(self.run.id)

    def record_services(self, sids: list[str] | None = None) -> None:
        """Record the services (only ``sids``, the replacements, after a heal)."""
        for h in self.deployment.handles:
            if sids is None or h.config.sid in sids:
                c = h.config
                self.db.add_service(self.run.id, c.sid, c.stage, c.replica, h.address)

    def checkpoints(self, task_id: int | None = None) -> list[Checkpoint]:
        """The run's checkpoints (of one task, when given) not refused yet, newest first."""
        return [
            Checkpoint.from_json(rec.step, rec.files_json, rec.id)
            for rec in self.db.checkpoints(self.run.id, task_id)
        ]

    # -- dmsc.Control -------------------------------------------------------------------------
    def status(self, req: StatusRequest) -> dict[str, Any]:
        dep, down, predict = self.deployment, self.inference.down, self._task_prediction
        out = status.report(dep, self.db, self.run.id, self.plan, self.steps_done, down, predict)
        out["queue"] = self.queue_policy
        lost = {"weights_lost": self.weights_lost, "undeployed": self.undeployed}
        out.update({k: v for k, v in lost.items() if v})  # each only when so
        return out

    def train_params(self, req: TrainRequest) -> TrainParams:
        """A training request completed from the plan and checked against it, its data
        included (BadRequest says what is wrong): the parameters its task stores and runs
        from. The corpus read and the resized plan are kept for the run (.training.corpora)."""
        try:
            if req.data is not None:  # inside a data root: the task keeps the resolved path
                req = req.model_copy(update={"data": inside_roots(req.data, self.data_roots)})
            params, runs_on = task_params(req, self.plan), self.plan
            if req.dp is not None and req.dp != self.plan.job.dp:
                runs_on = self.resized(req.dp)  # before it queues: the cluster has room for it
            check_task(self.cluster, runs_on, req.data, "the task")  # residency rules
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if req.data is not None:
            self.corpora(req.data, req.seed)  # readable, and long enough: before it queues
        return params

    def resized(self, dp: int, online: Mapping[str, int] | None = None) -> Plan:
        """The plan at ``dp`` replicas on the devices ``online`` (None: the spec's), kept once
        planned (ValueError says why there is none; .training.online)."""
        heads, serving = self.inference.heads, self.inference.pool is not None
        cpu = partial(latest_worker_cpu, self.db, self.run.id)  # read when a re-plan runs
        return self.resized_plans.get(self.plan, self.model, self.cluster, dp, online, heads=heads,
                                      serving=serving, worker_cpu=cpu)  # fmt: skip

    def relayout(self, plan: Plan, action: str, why: str, step: int | None = None) -> None:
        """Move the deployment to ``plan`` from a checkpoint at ``step`` (default: the step
        the weights are at between tasks): a new dp, a move (.resize)."""
        step = self.steps_done if step is None else step
        folder, spec = self.run_dir / f"{action}{step}", numbered_spec(self, plan)  # cpusets
        self.deployment, err = resize(self.deployment, plan, self.model, step, folder,
                                      self.device, spec)  # fmt: skip
        self.inference.rebind(self.deployment)
        self.record_services()
        if err is not None:
            raise err
        self.plan = plan
        record_resize(self.db, self.run.id, action, why, plan)

    def corpora(self, data: str | None, seed: int) -> tuple[Corpus, Corpus]:
        """The (training, validation) text of a task; BadRequest names the data."""
        try:
            return self.task_texts.get(data, seed)
        except ValueError as exc:
            raise BadRequest(f"data: {exc}") from None

    def run_task(
        self, task_id: int, params: TrainParams, lend: Callable[[], bool] | None = None
    ) -> tuple[TrainReport, int]:
        """Run a training task (holding the lock) and save the model version it produced;
        returns the report and the version, told to a caller that waits (.tasks.door). A task
        that was running when the control plane died resumes from its newest checkpoint that
        verifies; the steps it had done after its newest checkpoint count as lost in the
        restart's fault. A cancel request stops it between two steps (``report.cancelled``);
        ``lend`` lets waiting tasks train in between (:mod:`.tasks.lanes`)."""
        try:
            ran = self._run_task(task_id, params, lend)
        except BaseException as exc:
            self.door.ran(task_id, exc)
            raise
        self.door.ran(task_id, ran)
        return ran

    def _run_task(
        self, task_id: int, params: TrainParams, lend: Callable[[], bool] | None
    ) -> tuple[TrainReport, int]:
        if self.weights_lost:
            raise RuntimeError(
                f"training refused: {self.weights_lost} (`dmsc down` and `dmsc up` start a new "
                "run with fresh weights)"
            )
        if self.undeployed:  # a failed shrink left no workers: a deployment first
            self.shrink.redeploy()
        schedule: Schedule = "gpipe" if self.plan.job.schedule == "gpipe" else "1f1b"
        start, older = self.inference.lineage(self.checkpoints(), self.steps_done), []
        if params.first_step is not None:  # it ran before: resume
            first = params.first_step
            saved = self.db.checkpoints(self.run.id, task_id, refused=True)
            if saved and task_id in self.interrupted:  # what ran after its newest checkpoint
                self.interrupted.discard(task_id)
                redone = [m for m in self.db.metrics(task_id) if m.step >= saved[0].step]
                self.db.add_restart_steps_lost(self.run.id, len(redone))
            usable = self.checkpoints(task_id)
            if saved and not usable:
                raise NoGoodCheckpoint([], f"none of task {task_id}'s checkpoints is usable")
            start, older = (
                (usable[0], [c for c in usable[1:] if c.step >= first]) if usable else (None, [])
            )
        else:
            first = self.steps_done
            self.db.set_task_params(task_id, {**params.as_json(), "first_step": first})
        folder = self.run_dir / f"task{task_id}"
        if params.dp is not None and params.dp != self.plan.job.dp:
            why = f"training task {task_id}: dp {self.plan.job.dp} -> {params.dp}"
            self.relayout(self.resized(params.dp), "train-dp", why)
        try:
            pause = None if lend is None else lanes.Pausing(self, lend, task_id, params, first)
            report = self._train(task_id, params, first, schedule, folder, start, older, pause)
        except NoGoodCheckpoint:  # the workers are not at one step: back to the run's newest
            self._restore_after_loss()
            raise
        self.steps_done = report.end_step
        result = status.finished(self, report, params, task_id)
        self.db.set_task_result(task_id, result)
        for r in report.recoveries:
            self.log.warning("recovered from a failure: %s", r.reason, extra={"task_id": task_id})
        return report, self._save_version(task_id)

    def _restore_after_loss(self) -> None:
        """After a task found no checkpoint of its own that verifies: every worker goes back to
        the run's newest that does, or training is refused from now on."""
        try:
            last = self.restore_run("after a task lost its checkpoints")
        except NoGoodCheckpoint as exc:
            last, why = None, str(exc)
        else:
            why = "no checkpoint of the run is left to go back to"
        if last is None:  # the survivors trained, a replacement did not: not one model
            self.weights_lost = why
            self.log.error("the weights cannot be restored: %s", why, extra={"run": self.run.id})
            return
        self.steps_done = last.step

    def _train(
        self,
        task_id: int,
        params: TrainParams,
        first: int,
        schedule: Schedule,
        folder: Path,
        start: Checkpoint | None,
        older: list[Checkpoint],
        pause: lanes.Pausing | None = None,
    ) -> TrainReport:
        corpus, valid = self.corpora(params.data, params.seed)
        if params.sync.local_data:  # each datacenter's replicas read their own files
            load_task_shards(self.deployment, params)
        if params.sync.task_heads:  # from its first step the replicas' heads differ
            self.heads_valid, self.inference.heads = valid, True
        with self.between.running(task_id):  # the loop's resizes, before a step (.resize)
            return train_task(
                self.deployment,
                params,
                (corpus, valid),
                schedule,
                self.db,
                task_id,
                first,
                Recovering(
                    checkpoint_every=params.checkpoint_every,
                    checkpoint_dir=folder,
                    late_policy=params.late_policy,
                    grad_wait_s=params.grad_wait_s,
                    start=start,
                    older=older,
                    retention=self.retention,
                ),
                run_id=self.run.id,
                stop=lambda: task_queue.cancel_requested(self.db, task_id),
                turn=self.inference.training_turn,
                pause=pause,
                swap=self.between,
                shrink=self.shrink,  # replicas a lost node took, dropped (.training.shrink)
                plan_now=lambda: self.plan,  # the plan each segment of steps ran on
                live=partial(self._predictions.begin, task_id, params),  # the dashboard's
            )

    def train(self, req: TrainRequest, gone: threading.Event | None = None) -> dict[str, Any]:
        """The Train call: the task queued as the gateway's are (.tasks.door), then waited for
        until it ends; ``gone`` set (the caller went away) cancels it. It has one attempt: the
        caller sees a failure, as the task does."""
        task, _ = self.door.submit(req, max_attempts=1, wait=True)
        ended = partial(self.door.ended, task.id)  # no consumer runs: this thread works
        self.consumers.drive(self.queue, req.lane, ended)
        report, version, state = self.door.wait(task.id, gone)
        for s in report.step_s:
            self.m_step.observe(s)
        out = {"task": task.id, "state": state, "model_version": version}
        return {**out, **report.as_json()}  # with the predictions of the job that ran (_run_task)

    def submit_task(self, req: TrainRequest, tenant: str) -> TaskRecord:
        """The gateway's ``POST /v1/tasks``: the task resolved and queued (BadRequest says what
        is wrong, QuotaExceeded which quota it would pass)."""
        task, _ = self.door.submit(req, tenant=tenant)
        return task

    def _save_version(self, task_id: int | None = None) -> int:
        """Save the model as a new version of ``task_id`` (and the run's latest checkpoint)."""
        folder, every = self.run_dir / f"step{self.steps_done}", self.inference.heads
        args = (self.deployment, self.db, self.run.id, folder, self.steps_done, every, task_id)
        version, first = save_version(*args)
        if first:  # the first model serves without a promote
            self.log.info("version %d in production (the first)", version)
        return version

    def infer(self, req: InferRequest) -> dict[str, Any]:
        return self.calls.infer(req)

    def infer_stream(self, req: InferRequest, gone: threading.Event) -> Iterator[dict[str, Any]]:
        return self.calls.infer_stream(req, gone)

    def answer(self, req: InferRequest, cancel: threading.Event | None = None) -> dict[str, Any]:
        return self.calls.answer(req, cancel)  # the gateway's aggregate request (no task)

    def down(self, req: DownRequest) -> dict[str, Any]:
        self.stopped.set()
        return {"ok": True}

    def inject(self, req: InjectRequest) -> dict[str, Any]:
        """``dmsc chaos``: the fault, sent through the launcher to wherever the worker runs."""
        return signals.signal_worker(self.deployment, req.sid, req.fault)

    def methods(self) -> dict[str, grpc.RpcMethodHandler]:
        """The ``dmsc.Control`` handlers, typed both ways (:mod:`.service`)."""
        return control_methods(self)

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
        sampling: Sampling | None = None,
    ) -> str:
        return self.inference.infer_on(
            replica, prompt, tokens, cancel, tenant, deadline, sampling=sampling
        )

    def stage_count(self) -> int:
        """Stages of a replica's pipeline: a request's cost is its tokens times this."""
        return self.deployment.stages

    def services(self) -> list[dict[str, Any]]:
        return status.services(self.deployment)

    def dashboard(self, tenant: str | None = None) -> dict[str, Any]:
        """What the operator's pages draw (:mod:`.dashboard_state`): ``tenant``'s rows alone, or
        every tenant's (None)."""
        return dashboard_state.dashboard_state(
            self.db,
            self.plan,
            self.deployment,
            self.run.id,
            self.steps_done,
            set(self.inference.down),
            self.inference.pool.status() if self.inference.pool is not None else None,
            tenant=tenant,
            predict=self._task_prediction,
            live=lambda t: self._predictions.segments(t, self.plan, self.cluster, self.model),
        )

    def _task_prediction(self, task: TaskRecord) -> Prediction:
        """The prediction for the job training task ``task`` ran (kept: it re-plans once)."""
        return self._predictions.get(task, self.plan, self.cluster, self.model)

    # -- queued work ------------------------------------------------------------------------
    def work_queue(self, queue: task_queue.TaskQueue | None = None) -> None:
        """Run queued training tasks until the plane stops (:mod:`.tasks.work_loop`: a consumer
        per lane, claiming in :attr:`queue_policy`; every task reaches an end; once)."""
        self.consumers.run(queue or self.queue)
