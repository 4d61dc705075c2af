"""The control plane as a process: ``dmsc up`` starts it, the other commands talk to it.

It deploys a plan (stage workers through the local launcher, the registry in this process),
serves ``dmsc.Control`` (Status, Train, Infer, Down) on 127.0.0.1, records runs, tasks, services,
metrics and model versions in the database, and writes ``control.json`` (address, pid) under the
data directory so that later commands can find it.

Recovery. Training tasks checkpoint every ``checkpoint_every`` steps (default 50) and survive a
failed worker (see :mod:`dmsc.runtime.control.training`). A watchdog checks the workers every second
while no task runs and replaces a failed one (loading the last checkpoint into its pipeline); a
replica whose pipeline failed leaves inference routing until it is healed. Every fault and what
was done about it goes to the ``faults`` table, shown by ``dmsc status``. After a crash of the
control plane, the same plan resumes its run: workers load the run's last checkpoint, queued tasks
stay queued, and a task that was running resumes from its own last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy import select

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.data.db import (
    CheckpointRecord,
    Database,
    FaultRecord,
    ModelVersionRecord,
    RunRecord,
    ServiceRecord,
    TaskRecord,
    data_dir,
)
from dmsc.planner.plan import Plan
from dmsc.runtime.control.deployment import Checkpoint, Deployment, WorkerFailure
from dmsc.runtime.control.model_store import versions
from dmsc.runtime.control.task_queue import TaskQueue
from dmsc.runtime.control.training import (
    Recovering,
    TrainReport,
    fault_record,
    layout_from_plan,
    train,
)
from dmsc.runtime.transport.messages import CONTROL_SERVICE, LATE_POLICIES
from dmsc.runtime.transport.observe import json_logger, metrics_server
from dmsc.runtime.transport.rpc import BadRequest, json_handler, serve
from dmsc.spec import TransformerSpec, resolve_model

CHECKPOINT_EVERY = 50  # steps, unless a task asks otherwise


def control_file() -> Path:
    return data_dir() / "control.json"


class ControlPlane:
    """A deployment plus the database and the Control service methods."""

    def __init__(
        self, plan: Plan, db: Database, registry_ttl_s: float = 10.0, spares: int = 0
    ) -> None:
        model = resolve_model(plan.model)
        if not isinstance(model, TransformerSpec):
            raise ValueError("the runtime serves transformer models")
        self.plan, self.model, self.db = plan, model, db
        self.deployment = Deployment(
            layout_from_plan(plan, model),
            workdir=data_dir() / "workers",
            registry_ttl_s=registry_ttl_s,
            spares=spares,
            # a step that takes 50 times its predicted time has a stuck worker in it
            step_deadline_s=max(30.0, 50 * plan.prediction.iteration_time_s),
        )
        self.run = self._resume_or_new_run(plan)
        train_text, valid_text = stdlib_text()
        self.corpus = Corpus(train_text, model.seq, seed=0)
        self.valid = Corpus(valid_text, model.seq, seed=1)
        self.steps_done = 0
        self.lock = threading.Lock()
        self.replica_locks = [threading.Lock() for _ in range(plan.job.dp)]
        self.served: dict[int, int] = {}  # replica -> model version it serves
        self.replicas_down: set[int] = set()  # replicas out of inference routing until healed
        self._version_signature: list[tuple[int, str]] = []
        self.metrics = CollectorRegistry()
        self.m_tasks = Counter(
            "dmsc_control_tasks_total", "Tasks finished", ["kind", "state"], registry=self.metrics
        )
        self.m_queue = Gauge("dmsc_control_queue_depth", "Queued tasks", registry=self.metrics)
        self.m_step = Histogram(
            "dmsc_control_train_step_seconds", "Training step time", registry=self.metrics
        )
        self.log = json_logger("dmsc.planner")
        self._infer_calls = 0
        self.stopped = threading.Event()

    def _resume_or_new_run(self, plan: Plan) -> RunRecord:
        """After a crash, the same plan resumes its run: queued tasks stay queued and tasks that
        were running when the control plane died go back to the queue."""
        plan_json = json.dumps(json.loads(plan.model_dump_json()))
        with self.db.sessions() as s, s.begin():
            run = s.scalars(
                select(RunRecord)
                .where(RunRecord.status == "running", RunRecord.plan_json == plan_json)
                .order_by(RunRecord.id.desc())
            ).first()
            if run is not None:
                interrupted = list(
                    s.scalars(
                        select(TaskRecord).where(
                            TaskRecord.run_id == run.id, TaskRecord.state == "running"
                        )
                    )
                )
                for task in interrupted:
                    task.state = "queued"
                s.add(
                    FaultRecord(
                        run_id=run.id,
                        kind="control-plane",
                        reason="the control plane restarted; running tasks requeued: "
                        + (", ".join(str(t.id) for t in interrupted) or "none"),
                        detected_at=time.time(),
                    )
                )
                return run
        return self.db.new_run(plan.model, plan.cluster, json.loads(plan.model_dump_json()))

    def end_run(self) -> None:
        with self.db.sessions() as s, s.begin():
            run = s.get(RunRecord, self.run.id)
            if run is not None:
                run.status = "stopped"

    def start(self) -> None:
        self.deployment.start()
        last = self.last_checkpoint()
        if last is not None:  # a resumed run: the workers continue from where it stopped
            self.deployment.restore(last)
            self.steps_done = last.step
            self.log.info("resumed from the checkpoint of step %d", last.step)
        self._record_services()
        with self.db.sessions() as s, s.begin():
            for fault in s.scalars(
                select(FaultRecord).where(
                    FaultRecord.run_id == self.run.id,
                    FaultRecord.kind == "control-plane",
                    FaultRecord.recovered_at.is_(None),
                )
            ):
                fault.recovered_at = time.time()
                fault.checkpoint_step = last.step if last is not None else None

    def _record_services(self, sids: list[str] | None = None) -> None:
        """Record the services (only ``sids``, the replacements, after a heal)."""
        for h in self.deployment.handles:
            if sids is not None and h.config.sid not in sids:
                continue
            self.db.add(
                ServiceRecord(
                    run_id=self.run.id,
                    sid=h.config.sid,
                    stage=h.config.stage,
                    replica=h.config.replica,
                    address=h.address,
                )
            )

    def last_checkpoint(self, task_id: int | None = None) -> Checkpoint | None:
        rec = self.db.last_checkpoint(self.run.id, task_id)
        if rec is None:
            return None
        files = {int(k): (v[0], v[1]) for k, v in json.loads(rec.files_json).items()}
        return Checkpoint(rec.step, files)

    def status(self, req: dict[str, Any]) -> dict[str, Any]:
        # The faults first, the services after: a heal replaces the handles before it records
        # its fault, so a fault shown as recovered is never shown beside the worker it replaced.
        faults = [
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
            for f in self.db.faults(self.run.id)
        ]
        replicas_down = sorted(self.replicas_down)
        dep = self.deployment
        handles = list(dep.handles)
        silent = dep.probe(3.0)  # every worker asked at once: a dead one costs one timeout
        services: list[dict[str, Any]] = [
            {
                "sid": h.config.sid,
                "stage": h.config.stage,
                "replica": h.config.replica,
                "address": h.address,
                "health": "unreachable" if (h.config.stage, h.config.replica) in silent else "ok",
                "pid": h.process.pid,
            }
            for h in handles
        ]
        seen = {s.sid: s for s in dep.registry.lookup()}
        for s in services:
            s["registered"] = s["sid"] in seen
            s["heartbeat_age_s"] = dep.registry.heartbeat_age(s["sid"])
        tasks = [{"id": t.id, "kind": t.kind, "state": t.state} for t in self.db.tasks(self.run.id)]
        return {
            "run": self.run.id,
            "model": self.plan.model,
            "steps": self.steps_done,
            "epoch": self.deployment.epoch,
            "services": services,
            "tasks": tasks,
            "faults": faults,
            "replicas_down": replicas_down,
            "spares": [
                {"sid": h.config.sid, "address": h.address, "pid": h.process.pid}
                for h in self.deployment.spares
            ],
        }

    def train_params(self, req: dict[str, Any]) -> dict[str, Any]:
        """A training task's parameters, checked (BadRequest says which one is wrong)."""
        try:
            steps = int(req.get("steps", 100))
            batch = int(req.get("batch", self.plan.job.global_batch))
            micro = int(req.get("microbatches", self.plan.job.microbatches))
            every = int(req.get("checkpoint_every", CHECKPOINT_EVERY))
            policy = str(req.get("late_policy", "wait"))
            grad_wait_s = float(req.get("grad_wait_s", 5.0))
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"bad train request: {exc}") from None
        params: dict[str, Any] = {
            "steps": steps,
            "batch": batch,
            "microbatches": micro,
            "checkpoint_every": every,
            "late_policy": policy,
            "grad_wait_s": grad_wait_s,
        }
        if steps <= 0 or batch <= 0 or micro <= 0 or batch % (micro * self.plan.job.dp):
            raise BadRequest("steps, batch and microbatches must be positive, batch divisible")
        if params["checkpoint_every"] < 0:
            raise BadRequest("checkpoint_every must be 0 (only at the start) or positive")
        if params["late_policy"] not in LATE_POLICIES or not params["grad_wait_s"] > 0:
            raise BadRequest(f"late_policy must be one of {LATE_POLICIES}, grad_wait_s positive")
        if "first_step" in req:
            params["first_step"] = int(req["first_step"])
        return params

    def run_task(self, task_id: int, params: dict[str, Any]) -> TrainReport:
        """Run a training task (holding the lock). A task that was running when the control
        plane died resumes from its last checkpoint."""
        schedule = "gpipe" if self.plan.job.schedule == "gpipe" else "1f1b"
        start = None
        if "first_step" in params:  # it ran before: resume
            start = self.last_checkpoint(task_id)
        else:
            params = {**params, "first_step": self.steps_done}
            self.db.set_task_params(task_id, params)
        first = int(params["first_step"])
        folder = data_dir() / "checkpoints" / f"run{self.run.id}" / f"task{task_id}"
        report = train(
            self.deployment,
            self.corpus,
            self.valid,
            int(params["steps"]),
            int(params["batch"]),
            int(params["microbatches"]),
            schedule,
            self.db,
            task_id,
            first_step=first,
            recovering=Recovering(
                checkpoint_every=int(params["checkpoint_every"]),
                checkpoint_dir=folder,
                late_policy=str(params["late_policy"]),
                grad_wait_s=float(params["grad_wait_s"]),
                start=start,
            ),
            run_id=self.run.id,
        )
        self.steps_done = first + int(params["steps"])
        for r in report.recoveries:
            self.log.warning("recovered from a failure: %s", r.reason, extra={"task_id": task_id})
        return report

    def train(self, req: dict[str, Any]) -> dict[str, Any]:
        params = self.train_params(req)
        params.pop("first_step", None)
        with self.lock:
            task = self.db.new_task(self.run.id, "train", params)
            try:
                report = self.run_task(task.id, params)
            except Exception as exc:
                self.db.set_task_state(task.id, "failed", str(exc))
                raise
            version = self._checkpoint()
        steps = params["steps"]
        for s in report.step_s:
            self.m_step.observe(s)
        self.m_tasks.labels("train", "done").inc()
        self.log.info("train task done", extra={"task_id": task.id, "run": self.run.id})
        return {
            "task": task.id,
            "steps": steps,
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

    def _checkpoint(self) -> int:
        """Save the model as a new version (and as the run's latest checkpoint)."""
        folder = data_dir() / "checkpoints" / f"run{self.run.id}" / f"step{self.steps_done}"
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

    def infer(self, req: dict[str, Any]) -> dict[str, Any]:
        prompt = str(req.get("prompt", ""))
        try:
            tokens = int(req.get("tokens", 40))
        except (TypeError, ValueError):
            raise BadRequest("tokens must be an integer") from None
        if not prompt or not 0 < tokens <= 4096:
            raise BadRequest("a prompt and 1..4096 tokens are needed")
        task = self.db.new_task(self.run.id, "infer", {"tokens": tokens})
        self.db.set_task_state(task.id, "running")
        errors = []
        for replica in self.replicas():  # a failed replica: the request goes to the next one
            try:
                text = self.infer_on(replica, prompt, tokens)
            except WorkerFailure as exc:
                errors.append(f"{replica}: {exc}")
                continue
            self.db.set_task_state(task.id, "done")
            return {"task": task.id, "text": text, "replica": replica}
        self.db.set_task_state(task.id, "failed", "; ".join(errors))
        raise BadRequest(f"no replica could serve the request: {'; '.join(errors) or 'none up'}")

    def down(self, req: dict[str, Any]) -> dict[str, Any]:
        self.stopped.set()
        return {"ok": True}

    # -- queued work and the gateway's backend -----------------------------------------------
    def work_queue(self, queue: TaskQueue) -> None:
        """Run queued training tasks (the asynchronous lane) until the plane stops."""
        while not self.stopped.is_set():
            self.m_queue.set(queue.depth())
            try:
                self.sync_versions()
            except Exception as exc:  # a bad checkpoint must not stop the queue
                self.log.warning("version sync failed: %s", exc)
            task = queue.claim("priority", lane="async") or queue.claim("priority", lane="sync")
            if task is None:
                self.stopped.wait(0.5)
                continue
            try:
                params = self.train_params(json.loads(task.params_json))
                with self.lock:
                    self.run_task(task.id, params)
                queue.complete(task.id)
                self.m_tasks.labels("train", "done").inc()
                self.log.info("task done", extra={"task_id": task.id, "run": self.run.id})
            except Exception as exc:  # isolate it in the exception queue (or retry)
                state = queue.fail(task.id, exc)
                self.m_tasks.labels("train", state).inc()
                self.log.warning("task failed: %s", exc, extra={"task_id": task.id})

    def replicas(self) -> list[str]:
        """The replicas in inference routing (a failed one leaves until it is healed)."""
        return [f"replica-{r}" for r in range(self.plan.job.dp) if r not in self.replicas_down]

    def sync_versions(self) -> None:
        """Load the production version into the replicas and, during a gray release, the
        canary into the last replica (with two or more replicas)."""
        all_versions = versions(self.db)
        signature = [(v.id, v.status) for v in all_versions]
        if signature == self._version_signature:
            return
        self._version_signature = signature
        production = next((v for v in all_versions if v.status == "production"), None)
        canary_v = next((v for v in all_versions if v.status == "canary"), None)
        R = self.plan.job.dp
        for r in range(R):
            want = canary_v if (canary_v is not None and R > 1 and r == R - 1) else production
            if want is None or self.served.get(r) == want.id:
                continue
            digests = json.loads(want.metrics_json or "{}")
            with self.lock:
                for s in range(self.deployment.stages):
                    path = str(Path(want.path) / f"stage{s}.pt")
                    self.deployment.clients[(s, r)].call(
                        "Load", {"path": path, "sha256": digests.get(path, "")}
                    )
            self.served[r] = want.id
            self.log.info("replica %d serves version %d", r, want.id, extra={"run": self.run.id})

    def replicas_for_version(self, version_id: int | None) -> list[str]:
        serving = [
            f"replica-{r}"
            for r, v in self.served.items()
            if v == version_id and r not in self.replicas_down
        ]
        return serving or self.replicas()

    def infer_on(
        self, replica: str, prompt: str, tokens: int, cancel: threading.Event | None = None
    ) -> str:
        """Generate on one replica. A failure names the stage and takes the replica out of
        routing (the watchdog heals it); ``cancel`` stops it between tokens."""
        r = int(replica.rsplit("-", 1)[1])
        with self.replica_locks[r]:
            self._infer_calls += 1
            base = 10_000_000 + self._infer_calls * 10_000
            try:
                out = self.deployment.generate(
                    prompt.encode(), tokens, step_base=base, replica=r, cancel=cancel
                )
            except WorkerFailure as exc:
                self.replicas_down.add(r)
                self.log.warning("%s failed: %s", replica, exc, extra={"run": self.run.id})
                raise
        return out.decode("utf-8", errors="replace")

    # -- the watchdog -------------------------------------------------------------------------
    def watch_workers(self, interval_s: float = 1.0) -> None:
        """Replace failed workers while no task runs (a task recovers its own failures), and
        bring healed replicas back into routing."""
        while not self.stopped.wait(interval_s):
            if not self.lock.acquire(blocking=False):
                continue
            try:
                self.heal_once()
            except Exception as exc:  # keep watching; the next round tries again
                self.log.warning("healing failed: %s", exc, extra={"run": self.run.id})
            finally:
                self.lock.release()

    def heal_once(self) -> None:
        dep = self.deployment
        found = dep.suspects()
        # Alive and heartbeating is not enough: a worker must answer within the failure timeout.
        found.update({k: v for k, v in dep.probe(dep.registry.ttl_s).items() if k not in found})
        sids = {(h.config.stage, h.config.replica): h.config.sid for h in dep.handles}
        replicas = sorted({k[1] for k in found} | set(self.replicas_down))
        for r in replicas:
            mine = {k: v for k, v in found.items() if k[1] == r}
            if not mine:  # marked down by a failed request, but every worker is alive
                try:
                    for s in range(dep.stages):
                        dep.clients[(s, r)].call("Health", timeout_s=3)
                except Exception:
                    continue
                self.replicas_down.discard(r)
                continue
            self.replicas_down.add(r)
            failure = WorkerFailure(mine, sids)
            with self.replica_locks[r]:
                rec = dep.heal(failure, r, self.last_checkpoint())
            self.db.add(fault_record(rec, self.run.id))
            self._record_services(rec.failed)
            self.served.pop(r, None)  # load the served version again
            self._version_signature = []
            self.replicas_down.discard(r)
            self.log.info("replica %d healed", r, extra={"run": self.run.id})

    def services(self) -> list[dict[str, Any]]:
        services: list[dict[str, Any]] = self.status({})["services"]
        return services

    def methods(self) -> dict[str, Any]:
        return {
            "Status": json_handler(self.status),
            "Train": json_handler(self.train),
            "Infer": json_handler(self.infer),
            "Down": json_handler(self.down),
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="dmsc control plane")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--gateway", default=None, help="HOST:PORT for the HTTP gateway")
    parser.add_argument("--router", default="least_outstanding", help="replica routing policy")
    parser.add_argument(
        "--failure-timeout",
        type=float,
        default=10.0,
        help="seconds without a heartbeat before a worker is declared failed",
    )
    parser.add_argument("--spares", type=int, default=0, help="warm spare worker processes")
    args = parser.parse_args(argv)
    plan = Plan.model_validate_json(Path(args.plan).read_text())
    db = Database()
    cp = ControlPlane(plan, db, registry_ttl_s=args.failure_timeout, spares=args.spares)
    cp.start()
    queue = TaskQueue(db, cp.run.id)
    threading.Thread(target=cp.work_queue, args=(queue,), daemon=True).start()
    threading.Thread(target=cp.watch_workers, daemon=True).start()
    gateway = None
    if args.gateway:
        import uvicorn

        from dmsc.runtime.business.gateway import create_app

        host, _, gport = args.gateway.rpartition(":")
        app = create_app(cp, db, queue, router=args.router)
        gateway = uvicorn.Server(
            uvicorn.Config(app, host=host or "127.0.0.1", port=int(gport), log_level="warning")
        )
        threading.Thread(target=gateway.run, daemon=True).start()
    server, port = serve(CONTROL_SERVICE, cp.methods())
    control_file().write_text(
        json.dumps(
            {
                "address": f"127.0.0.1:{port}",
                "pid": os.getpid(),
                "run": cp.run.id,
                "metrics": metrics_server(cp.metrics),
            }
        )
    )
    print(f"READY 127.0.0.1:{port}", flush=True)
    cp.stopped.wait()
    cp.end_run()  # a clean stop ends the run; a crash leaves it to be resumed
    if gateway is not None:
        gateway.should_exit = True
    cp.deployment.shutdown()
    server.stop(grace=1)
    control_file().unlink(missing_ok=True)


if __name__ == "__main__":
    main()
