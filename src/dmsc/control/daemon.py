"""The control plane as a process: ``dmsc up`` starts it, the other commands talk to it.

It deploys a plan (stage workers through the local launcher, the registry in this process),
serves ``dmsc.Control`` (Status, Train, Infer, Down) on 127.0.0.1, records runs, tasks, services,
metrics and model versions in the database, and writes ``control.json`` (address, pid) under the
data directory so that later commands can find it.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy import select

from dmsc.business.observe import json_logger, metrics_server
from dmsc.business.rpc import BadRequest, json_handler, serve
from dmsc.control.orchestrator import Deployment
from dmsc.control.plan import Plan
from dmsc.control.queue import TaskQueue
from dmsc.control.session import layout_from_plan, train
from dmsc.control.versions import versions
from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.data.db import (
    Database,
    ModelVersionRecord,
    RunRecord,
    ServiceRecord,
    TaskRecord,
    data_dir,
)
from dmsc.spec import TransformerSpec, resolve_model

CONTROL_SERVICE = "dmsc.Control"


def control_file() -> Path:
    return data_dir() / "control.json"


class ControlPlane:
    """A deployment plus the database and the Control service methods."""

    def __init__(self, plan: Plan, db: Database) -> None:
        model = resolve_model(plan.model)
        if not isinstance(model, TransformerSpec):
            raise ValueError("the runtime serves transformer models")
        self.plan, self.model, self.db = plan, model, db
        self.deployment = Deployment(layout_from_plan(plan, model), workdir=data_dir() / "workers")
        self.run = self._resume_or_new_run(plan)
        train_text, valid_text = stdlib_text()
        self.corpus = Corpus(train_text, model.seq, seed=0)
        self.valid = Corpus(valid_text, model.seq, seed=1)
        self.steps_done = 0
        self.lock = threading.Lock()
        self.replica_locks = [threading.Lock() for _ in range(plan.job.dp)]
        self.served: dict[int, int] = {}  # replica -> model version it serves
        self._version_signature: list[tuple[int, str]] = []
        self.metrics = CollectorRegistry()
        self.m_tasks = Counter(
            "dmsc_control_tasks_total", "Tasks finished", ["kind", "state"], registry=self.metrics
        )
        self.m_queue = Gauge("dmsc_control_queue_depth", "Queued tasks", registry=self.metrics)
        self.m_step = Histogram(
            "dmsc_control_train_step_seconds", "Training step time", registry=self.metrics
        )
        self.log = json_logger("dmsc.control")
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
                interrupted = s.scalars(
                    select(TaskRecord).where(
                        TaskRecord.run_id == run.id, TaskRecord.state == "running"
                    )
                )
                for task in interrupted:
                    task.state = "queued"
                return run
        return self.db.new_run(plan.model, plan.cluster, json.loads(plan.model_dump_json()))

    def end_run(self) -> None:
        with self.db.sessions() as s, s.begin():
            run = s.get(RunRecord, self.run.id)
            if run is not None:
                run.status = "stopped"

    def start(self) -> None:
        self.deployment.start()
        for h in self.deployment.handles:
            self.db.add(
                ServiceRecord(
                    run_id=self.run.id,
                    sid=h.config.sid,
                    stage=h.config.stage,
                    replica=h.config.replica,
                    address=h.address,
                )
            )

    def status(self, req: dict[str, Any]) -> dict[str, Any]:
        services = []
        for h in self.deployment.handles:
            try:
                health = self.deployment.clients[(h.config.stage, h.config.replica)].call(
                    "Health", timeout_s=3
                )["status"]
            except Exception:
                health = "unreachable"
            services.append(
                {
                    "sid": h.config.sid,
                    "stage": h.config.stage,
                    "replica": h.config.replica,
                    "address": h.address,
                    "health": health,
                    "pid": h.process.pid,
                }
            )
        seen = {s.sid: s for s in self.deployment.registry.lookup()}
        for s in services:
            s["registered"] = s["sid"] in seen
            s["heartbeat_age_s"] = self.deployment.registry.heartbeat_age(s["sid"])
        tasks = [{"id": t.id, "kind": t.kind, "state": t.state} for t in self.db.tasks(self.run.id)]
        return {
            "run": self.run.id,
            "model": self.plan.model,
            "steps": self.steps_done,
            "services": services,
            "tasks": tasks,
        }

    def train(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            steps = int(req.get("steps", 100))
            batch = int(req.get("batch", self.plan.job.global_batch))
            micro = int(req.get("microbatches", self.plan.job.microbatches))
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"bad train request: {exc}") from None
        if steps <= 0 or batch <= 0 or micro <= 0 or batch % (micro * self.plan.job.dp):
            raise BadRequest("steps, batch and microbatches must be positive, batch divisible")
        schedule = "gpipe" if self.plan.job.schedule == "gpipe" else "1f1b"
        with self.lock:
            task = self.db.new_task(self.run.id, "train", {"steps": steps, "batch": batch})
            try:
                report = train(
                    self.deployment,
                    self.corpus,
                    self.valid,
                    steps,
                    batch,
                    micro,
                    schedule,
                    self.db,
                    task.id,
                    first_step=self.steps_done,
                )
            except Exception as exc:
                self.db.set_task_state(task.id, "failed", str(exc))
                raise
            self.steps_done += steps
            version = self._checkpoint()
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
        }

    def _checkpoint(self) -> int:
        folder = data_dir() / "checkpoints" / f"run{self.run.id}" / f"step{self.steps_done}"
        digests = {}
        for (stage, replica), client in self.deployment.clients.items():
            if replica == 0:
                out = client.call("Save", {"path": str(folder / f"stage{stage}.pt")})
                digests[out["path"]] = out["sha256"]
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
        with self.lock:
            task = self.db.new_task(self.run.id, "infer", {"tokens": tokens})
            self.db.set_task_state(task.id, "running")
            text = self.deployment.generate(prompt.encode(), tokens)
            self.db.set_task_state(task.id, "done")
        return {"task": task.id, "text": text.decode("utf-8", errors="replace")}

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
                steps = int(json.loads(task.params_json).get("steps", 1))
                with self.lock:
                    train(
                        self.deployment,
                        self.corpus,
                        self.valid,
                        steps,
                        self.plan.job.global_batch,
                        self.plan.job.microbatches,
                        "1f1b",
                        self.db,
                        None,
                        first_step=self.steps_done,
                    )
                    self.steps_done += steps
                queue.complete(task.id)
                self.m_tasks.labels("train", "done").inc()
                self.log.info("task done", extra={"task_id": task.id, "run": self.run.id})
            except Exception as exc:  # isolate it in the exception queue (or retry)
                state = queue.fail(task.id, exc)
                self.m_tasks.labels("train", state).inc()
                self.log.warning("task failed: %s", exc, extra={"task_id": task.id})

    def replicas(self) -> list[str]:
        return [f"replica-{r}" for r in range(self.plan.job.dp)]

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
        serving = [f"replica-{r}" for r, v in self.served.items() if v == version_id]
        return serving or self.replicas()

    def infer_on(self, replica: str, prompt: str, tokens: int) -> str:
        r = int(replica.rsplit("-", 1)[1])
        with self.replica_locks[r]:
            self._infer_calls += 1
            base = 10_000_000 + self._infer_calls * 10_000
            out = self.deployment.generate(prompt.encode(), tokens, step_base=base, replica=r)
        return out.decode("utf-8", errors="replace")

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
    args = parser.parse_args(argv)
    plan = Plan.model_validate_json(Path(args.plan).read_text())
    db = Database()
    cp = ControlPlane(plan, db)
    cp.start()
    queue = TaskQueue(db, cp.run.id)
    threading.Thread(target=cp.work_queue, args=(queue,), daemon=True).start()
    gateway = None
    if args.gateway:
        import uvicorn

        from dmsc.business.gateway import create_app

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
