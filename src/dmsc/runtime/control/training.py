"""A training session on a deployed plan: steps, validation, checkpoints, recovery, metrics.

The session takes a checkpoint before its first step and every ``checkpoint_every`` steps. When a
worker fails, the deployment replaces it and every worker goes back to the last checkpoint; the
steps since then run again on the same data (batches are a function of the step), so the run goes
on as the same run without the failure would have from that checkpoint. Metrics of the lost steps
are dropped and written again. A step that a stage leader dropped (late gradients, policy
``restart``) was applied nowhere and simply runs again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmsc.data.corpus import Corpus
from dmsc.data.db import CheckpointRecord, Database, FaultRecord
from dmsc.planner.plan import Plan
from dmsc.runtime.control import recovery
from dmsc.runtime.control.deployment import Checkpoint, Deployment, StageLayout
from dmsc.runtime.control.failures import StepRestartNeeded, WorkerFailure
from dmsc.runtime.control.recovery import Recovery
from dmsc.runtime.transport.messages import DEFAULT_GRAD_WAIT_S, LatePolicy, Schedule
from dmsc.spec import TransformerSpec


def layout_from_plan(
    plan: Plan, model: TransformerSpec, seed: int = 0, lr: float = 1e-3
) -> StageLayout:
    """The stage layer ranges, replicas and SIDs a plan deploys."""
    return StageLayout(
        model=model,
        ranges=[(st.chunks[0][0], st.chunks[-1][1]) for st in plan.stages],
        replicas=plan.job.dp,
        seed=seed,
        lr=lr,
        sids=[st.sid for st in plan.stages],
    )


@dataclass
class TrainReport:
    steps: int
    losses: list[float] = field(default_factory=list)  # by step, as finally applied
    step_s: list[float] = field(default_factory=list)
    val_start: float | None = None
    val_end: float | None = None
    tokens_per_step: int = 0
    first_step: int = 0
    recoveries: list[Recovery] = field(default_factory=list)
    steps_lost: int = 0  # steps run again after recoveries
    restarts: int = 0  # steps dropped by a stage leader and run again
    skipped: list[tuple[int, int, int]] = field(default_factory=list)  # step, stage, replica
    checkpoint: Checkpoint | None = None  # the last one taken

    @property
    def median_step_s(self) -> float:
        s = sorted(self.step_s[len(self.step_s) // 5 :] or self.step_s)  # skip warm-up steps
        return s[len(s) // 2]


def validation_loss(
    dep: Deployment,
    corpus: Corpus,
    batch: int,
    microbatches: int,
    batches: int = 4,
    step_base: int = 2_000_000,
) -> float:
    losses = []
    for k in range(batches):
        x, y = corpus.batch(10_000 + k, batch)
        losses.append(dep.eval_step(step_base + k, x, y, microbatches))
    return sum(losses) / len(losses)


def fault_record(
    rec: Recovery, run_id: int, task_id: int | None = None, steps_lost: int = 0
) -> FaultRecord:
    """The database row of a recovery from failed workers."""
    return FaultRecord(
        run_id=run_id,
        task_id=task_id,
        kind="worker",
        services=",".join(rec.failed),
        reason=rec.reason[:2000],
        detected_at=rec.detected_at,
        recovered_at=rec.recovered_at,
        checkpoint_step=rec.checkpoint_step,
        steps_lost=steps_lost,
        epoch=rec.epoch,
    )


@dataclass
class Recovering:
    """How a session survives failures."""

    checkpoint_every: int = 0  # steps between checkpoints (0: only the one before step 1)
    checkpoint_dir: Path | None = None
    late_policy: LatePolicy = "wait"  # see dmsc.runtime.compute.worker
    grad_wait_s: float = (
        DEFAULT_GRAD_WAIT_S  # the bound on waiting for a replica's gradient (skip, restart)
    )
    max_recoveries: int = 5
    max_restarts: int = 20
    start: Checkpoint | None = None  # resume from this checkpoint instead of taking one


def train(
    dep: Deployment,
    corpus: Corpus,
    valid: Corpus,
    steps: int,
    batch: int,
    microbatches: int,
    schedule: Schedule = "1f1b",
    db: Database | None = None,
    task_id: int | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    first_step: int = 0,
    recovering: Recovering | None = None,
    run_id: int | None = None,
    validate: bool = True,
) -> TrainReport:
    """Run steps ``first_step`` .. ``first_step + steps - 1``; validation loss before and after.
    With ``recovering.start``, the session resumes from that checkpoint (its step must lie in
    the range) and the steps before it are taken as done."""
    rec = recovering or Recovering()
    end = first_step + steps
    report = TrainReport(steps, tokens_per_step=batch * dep.layout.model.seq, first_step=first_step)
    logged = db is not None and task_id is not None

    def folder(step: int) -> Path | None:
        return rec.checkpoint_dir / f"step{step}" if rec.checkpoint_dir else None

    def save(step: int) -> Checkpoint:
        ckpt = dep.checkpoint(step, folder(step))
        if db is not None and run_id is not None:
            files = {str(k): list(v) for k, v in ckpt.files.items()}
            db.add(
                CheckpointRecord(
                    run_id=run_id, task_id=task_id, step=step, files_json=json.dumps(files)
                )
            )
        report.checkpoint = ckpt
        return ckpt

    def bring_back(failure: WorkerFailure, ckpt: Checkpoint, at_step: int) -> None:
        if len(report.recoveries) >= rec.max_recoveries:
            raise failure
        r = recovery.recover(dep, failure, ckpt)
        report.recoveries.append(r)
        report.steps_lost += at_step - ckpt.step
        if logged:
            assert db is not None and task_id is not None
            db.drop_metrics_from(task_id, ckpt.step)
        if db is not None and run_id is not None:
            db.add(fault_record(r, run_id, task_id, steps_lost=at_step - ckpt.step))

    if rec.start is not None:
        if not first_step <= rec.start.step <= end:
            raise ValueError(f"checkpoint of step {rec.start.step} is outside {first_step}..{end}")
        dep.restore(rec.start)
        ckpt = report.checkpoint = rec.start
        if logged:  # steps after the checkpoint run again: their old metrics go
            assert db is not None and task_id is not None
            db.drop_metrics_from(task_id, ckpt.step)
    else:
        ckpt = save(first_step)
    if validate:
        try:
            report.val_start = validation_loss(dep, valid, batch, microbatches)
        except WorkerFailure as failure:
            bring_back(failure, ckpt, ckpt.step)
            report.val_start = validation_loss(dep, valid, batch, microbatches)
    if logged:
        assert db is not None and task_id is not None
        db.set_task_state(task_id, "running")
    losses: dict[int, float] = {}
    step = ckpt.step

    def roll_back(failure: WorkerFailure, at_step: int) -> int:
        bring_back(failure, ckpt, at_step)
        for s in range(ckpt.step, at_step):
            losses.pop(s, None)
        return ckpt.step

    while True:
        t0: float | None = None  # the step's first attempt (a restarted step counts whole)
        while step < end:
            x, y = corpus.batch(step, batch)
            t0 = t0 if t0 is not None else time.perf_counter()
            try:
                out = dep.train_step(
                    step, x, y, microbatches, schedule, rec.late_policy, rec.grad_wait_s
                )
            except StepRestartNeeded:
                report.restarts += 1
                if report.restarts > rec.max_restarts:
                    raise
                continue
            except WorkerFailure as failure:
                step, t0 = roll_back(failure, step), None
                continue
            dt, t0 = time.perf_counter() - t0, None
            losses[step] = out["loss"]
            report.step_s.append(dt)
            report.skipped += [(step, st, r) for st, r in out.get("skipped", [])]
            if logged:
                assert db is not None and task_id is not None
                db.add_metric(task_id, step, out["loss"], dt, report.tokens_per_step / dt)
            if on_step is not None:
                on_step(step, {**out, "step_s": dt, "tokens_per_s": report.tokens_per_step / dt})
            step += 1
            if rec.checkpoint_every and (step - first_step) % rec.checkpoint_every == 0:
                try:
                    ckpt = save(step)
                except WorkerFailure as failure:
                    step = roll_back(failure, step)
        if not validate:
            break
        try:
            report.val_end = validation_loss(dep, valid, batch, microbatches)
            break
        except WorkerFailure as failure:  # the weights go back to the checkpoint: run again
            step = roll_back(failure, step)
    report.losses = [losses[s] for s in sorted(losses)]
    if logged:
        assert db is not None and task_id is not None
        db.set_task_state(task_id, "done")
    return report
