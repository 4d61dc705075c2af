"""A training session on a deployed plan: steps, validation, checkpoints, recovery, metrics.

The session takes a checkpoint before its first step and every ``checkpoint_every`` steps. When a
worker fails, the deployment replaces it and every worker goes back to the last checkpoint; the
steps since then run again on the same data (batches are a function of the step), so the run goes
on as the same run without the failure would have from that checkpoint. Metrics of the lost steps
are dropped and written again (when no replacement can start, a lost Ray node's, the failed
replicas may be dropped instead: :mod:`.shrink`). A step that a stage leader dropped (late
gradients, policy ``restart``) was applied nowhere and simply runs again.

A checkpoint whose files are missing or corrupt when a rollback (or a resume) needs it is skipped
for the session's next older one (:mod:`dmsc.runtime.control.launch.fallback`): a ``checkpoint``
fault is recorded, the checkpoint is marked refused in the database, and more steps run again. With
none left that verifies the session stops with
:class:`~dmsc.runtime.control.launch.fallback.NoGoodCheckpoint`.

Cancelling: ``stop`` is asked before every step; once it says so, the session checkpoints the
step it reached and ends (``report.cancelled``; the weights stay at ``report.end_step``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmsc.data.corpus import Corpus
from dmsc.data.db import CheckpointRecord, Database, FaultRecord
from dmsc.data.traces import record_step
from dmsc.planner.plan import Plan
from dmsc.runtime.control.launch import recovery
from dmsc.runtime.control.launch.deployment import Checkpoint, Deployment, StageLayout
from dmsc.runtime.control.launch.failures import StepRestartNeeded, WorkerFailure
from dmsc.runtime.control.launch.fallback import Restored, checkpoint_faults, restore_newest
from dmsc.runtime.control.launch.launchers import WorkerStartError
from dmsc.runtime.control.launch.recovery import Recovery
from dmsc.runtime.control.training.lr_schedule import lr_at
from dmsc.runtime.control.training.params import TrainParams
from dmsc.runtime.control.training.placement import plan_cpus, plan_devices
from dmsc.runtime.control.training.report import TrainReport
from dmsc.runtime.control.training.retention import Retention, check_quota, prune
from dmsc.runtime.transport.messages import (
    DEFAULT_GRAD_WAIT_S,
    LatePolicy,
    Schedule,
    SyncSettings,
    TrainSettings,
)
from dmsc.spec import ClusterSpec, TransformerSpec

log = logging.getLogger("dmsc.control.training")  # the control plane's log, where it has one
# :class:`.shrink.Shrink`: (deployment, failure, error, checkpoints, replicas differ) -> go on with
ShrinkHook = Callable[
    [Deployment, WorkerFailure, Exception, list[Checkpoint], bool], tuple[Deployment, Recovery]
]


def layout_from_plan(
    plan: Plan,
    model: TransformerSpec,
    seed: int = 0,
    lr: float = 1e-3,
    device: str = "plan",
    spec: ClusterSpec | None = None,
    pack: bool = False,
) -> StageLayout:
    """The stage layer ranges (each stage's chunks, interleaved), replicas, SIDs and devices a
    plan deploys; with ``spec`` (the cluster spec its nodes are numbered on), the cores of the
    nodes that have a cpuset, or with ``pack`` (its workers run on this machine) the cores the
    workers are packed onto where the spec's devices share them
    (:func:`~.placement.plan_cpus`)."""
    return StageLayout(
        devices=plan_devices(plan, device),
        cpus=plan_cpus(plan, spec, pack),
        pack_cores=pack,
        datacenters={
            (st.index, r): rep.datacenter for st in plan.stages for r, rep in enumerate(st.replicas)
        },
        model=model,
        ranges=[st.chunks[0] for st in plan.stages],
        chunks=[list(st.chunks) for st in plan.stages] if plan.job.chunks > 1 else [],
        replicas=plan.job.dp,
        tp=plan.job.tp,
        ep=plan.job.ep,
        sequence_parallel=plan.job.sequence_parallel and plan.job.tp > 1,
        allreduce={st.index: st.allreduce for st in plan.stages if st.allreduce},
        seed=seed,
        lr=lr,
        sids=[st.sid for st in plan.stages],
    )


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
    """The database row of a recovery from failed workers (left open when no checkpoint could
    be loaded: the workers are back, their weights are not)."""
    lost = " (no checkpoint verifies: the weights are not restored)" if rec.lost else ""
    return FaultRecord(
        run_id=run_id,
        task_id=task_id,
        kind="worker",
        services=",".join(rec.failed),
        reason=(rec.reason + lost)[:2000],
        detected_at=rec.detected_at,
        recovered_at=None if rec.lost else rec.recovered_at,
        checkpoint_step=None if rec.lost else rec.checkpoint_step,
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
    # which of the session's checkpoints stay on disk, and the tenant's quota (None: all stay)
    retention: Retention | None = None
    older: list[Checkpoint] = field(default_factory=list)  # start's fallbacks, newest first


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
    stop: Callable[[], bool] | None = None,
    turn: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    lr: Callable[[int], float] | None = None,
    sync: SyncSettings | None = None,
    pause: Callable[[int], tuple[int, dict[str, Any] | None]] | None = None,
    swap: Callable[[int], Deployment | None] | None = None,
    shrink: ShrinkHook | None = None,
    plan_now: Callable[[], Plan] | None = None,
    live: Callable[[TrainReport], None] | None = None,
) -> TrainReport:
    """Run steps ``first_step`` .. ``first_step + steps - 1``; validation loss before and after.
    ``turn()`` is held around each step and validation (the replicas' fair locks: inference
    requests take their tokens between two steps, never inside one).
    With ``recovering.start``, the session resumes from that checkpoint (or, when it does not
    verify, the newest of ``recovering.older`` that does; each must lie in the range) and the
    steps before it are taken as done. ``stop`` (asked before each step) cancels the session.
    ``lr(i)`` is the learning rate of the session's ``i``-th step (the workers' own when None).
    ``sync`` says how the data-parallel replicas agree (every step by default; a round of
    ``sync.inner_steps`` otherwise, the session's last step ending one too) and whether each
    draws its batches from its own shard (``sync.local_data``: loaded by the caller,
    :mod:`dmsc.runtime.control.training.local_data`; ``corpus`` then serves nothing but its size).
    The task's state is the caller's to set (running, then done or cancelled once it has
    recorded what the session produced).
    ``pause(step)``, asked before each step (each round's first with ``sync.outer``), may let
    other tasks train the same weights (:mod:`dmsc.runtime.control.tasks.lanes`): it returns
    the step they left them at, and the task's parameters to store with the moved first step
    (None when none ran); the session's remaining steps then follow from there, after a
    checkpoint recorded in one transaction with those parameters (a rollback never undoes
    their steps, and a resume after a crash finds its first step and its checkpoints agree).
    ``swap(step)``, asked before each step after ``pause``, may resize the deployment there
    (:class:`~.resize.Between`): it returns the deployment the weights now are on, and the
    session goes on there after a checkpoint.
    ``shrink``, called when a recovery cannot start a replacement (no room: a lost Ray node),
    drops the failed replicas and returns the deployment to go on with (or raises).
    ``plan_now()``, asked where the steps begin and after each resize or shrink, names the plan
    in force: each layout's steps are a segment of the report (:mod:`.report`); ``live`` is
    handed the report as it is made, to read its segments while the steps run."""
    rec = recovering or Recovering()
    end = first_step + steps
    report = TrainReport(steps, tokens_per_step=batch * dep.layout.model.seq, first_step=first_step)
    if live is not None:
        live(report)

    def segment(at: int) -> None:  # the steps from ``at`` run on ``dep``'s layout
        report.segment(at, dep.layout.replicas, plan_now() if plan_now is not None else None)

    report.sync = sync
    rounds_of = sync.inner_steps if sync is not None and sync.outer else 1
    local = sync is not None and sync.local_data
    logged = db is not None and task_id is not None
    recorded = db is not None and run_id is not None
    # The session's checkpoints, oldest first; the last is the one a rollback goes back to.
    history: list[Checkpoint] = []
    # those a rollback no longer goes back to (from before a loan or a resize), oldest first:
    # still counted by the retention rule, which prunes them as newer ones come
    behind: list[Checkpoint] = []

    in_rounds = sync is not None and sync.outer
    # mid-round the replicas differ (weights, inner optimizers), and task heads always do
    every = sync is not None and (sync.outer or sync.task_heads)

    def folder(step: int) -> Path | None:
        return rec.checkpoint_dir / f"step{step}" if rec.checkpoint_dir else None

    def save(step: int, task_params: dict[str, Any] | None = None) -> Checkpoint:
        """A checkpoint at ``step``, recorded (with ``task_params``, the task's parameters
        stored in the same transaction)."""
        ckpt = dep.checkpoint(step, folder(step), every=every)
        if recorded:
            assert db is not None and run_id is not None
            row = db.add(
                CheckpointRecord(
                    run_id=run_id, task_id=task_id, step=step, files_json=ckpt.files_json()
                ),
                None if task_params is None or task_id is None else (task_id, task_params),
            )
            ckpt.id = row.id
        history.append(ckpt)
        report.checkpoint = ckpt
        if rec.retention is not None:  # the older ones go; a tenant past its quota stops here
            for gone in prune([*behind, *history], rec.retention, db if recorded else None):
                held = behind if any(c is gone for c in behind) else history
                held[:] = [c for c in held if c is not gone]
            if recorded and task_id is not None:
                assert db is not None
                check_quota(db, task_id, rec.retention)
        return ckpt

    def settle(restored: Restored, what: str) -> Checkpoint:
        """Record the checkpoints ``restored`` skipped; the one it loaded (else raise)."""
        for ckpt, exc in restored.refused:
            if ckpt in history:
                history.remove(ckpt)
            if db is not None and ckpt.id is not None:
                db.refuse_checkpoint(ckpt.id, str(exc))
        if recorded:
            assert db is not None and run_id is not None
            sids = {k: dep.sid(*k) for k in dep.clients}
            for row in checkpoint_faults(restored, run_id, sids, task_id, dep.epoch):
                db.add(row)
        for _, exc in restored.refused:
            log.warning("checkpoint skipped while %s: %s", what, exc, extra={"task_id": task_id})
        if restored.checkpoint is None:
            raise restored.error(what)
        report.checkpoint = restored.checkpoint
        return restored.checkpoint

    def bring_back(failure: WorkerFailure, at_step: int) -> Checkpoint:
        nonlocal dep
        if len(report.recoveries) >= rec.max_recoveries:
            raise failure
        try:
            r = recovery.recover(dep, failure, history[::-1])
        except WorkerStartError as exc:  # no room for a replacement
            if shrink is None:
                raise
            dep, r = shrink(dep, failure, exc, history[::-1], every)
            segment(r.checkpoint_step)
        report.recoveries.append(r)
        lost = at_step - r.checkpoint.step if r.checkpoint is not None else 0
        if recorded:
            assert db is not None and run_id is not None
            db.add(fault_record(r, run_id, task_id, steps_lost=lost))
        ckpt = settle(r.restored, f"rolling back from step {at_step}")
        report.steps_lost += lost
        if logged:
            assert db is not None and task_id is not None
            db.drop_metrics_from(task_id, ckpt.step)
        return ckpt

    if rec.start is not None:
        for c in (rec.start, *rec.older):
            if not first_step <= c.step <= end:
                raise ValueError(f"checkpoint of step {c.step} is outside {first_step}..{end}")
        history.extend([*rec.older[::-1], rec.start])
        ckpt = settle(restore_newest(dep, history[::-1]), "resuming")
        if logged:  # steps after the checkpoint run again: their old metrics go
            assert db is not None and task_id is not None
            db.drop_metrics_from(task_id, ckpt.step)
    else:
        ckpt = save(first_step)
    hold = turn or contextlib.nullcontext
    if validate:
        try:
            with hold():
                report.val_start = validation_loss(dep, valid, batch, microbatches)
        except WorkerFailure as failure:
            bring_back(failure, ckpt.step)
            with hold():
                report.val_start = validation_loss(dep, valid, batch, microbatches)
    losses: dict[int, float] = {}
    step = history[-1].step
    segment(step)  # where the steps begin (a resumed task: at the checkpoint it went back to)

    def roll_back(failure: WorkerFailure, at_step: int) -> int:
        back = bring_back(failure, at_step).step
        for s in range(back, at_step):
            losses.pop(s, None)
        return back

    while True:
        t0: float | None = None  # the step's first attempt (a restarted step counts whole)
        while step < end:
            if stop is not None and stop():
                report.cancelled = True
                break
            if pause is not None and (not in_rounds or (step - first_step) % rounds_of == 0):
                at, stored = pause(step)
                if moved := at - step:  # others trained meanwhile: go on from where they left
                    first_step, end, step = first_step + moved, end + moved, step + moved
                    report.first_step = first_step
                    save(step, stored)  # the moved first step with the checkpoint, or neither
                    behind.extend(history[:-1])
                    del history[:-1]
            if swap is not None and (resized := swap(step)) is not None:
                dep = resized  # the same weights at this step, on another layout
                segment(step)
                save(step)
                behind.extend(history[:-1])  # a rollback never goes back to the old layout's
                del history[:-1]
            x, y = (None, None) if local else corpus.batch(step, batch)
            outer = in_rounds and ((step - first_step + 1) % rounds_of == 0 or step == end - 1)
            try:
                with hold():
                    t0 = t0 if t0 is not None else time.perf_counter()
                    out = dep.train_step(
                        step,
                        x,
                        y,
                        microbatches,
                        schedule,
                        rec.late_policy,
                        rec.grad_wait_s,
                        lr(step - first_step) if lr is not None else None,
                        sync,
                        outer,
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
            report.dp_bytes += out.get("dp_bytes", 0)
            report.rounds += 1 if outer or not in_rounds else 0
            report.timed(dt)
            report.skipped += [(step, st, r) for st, r in out.get("skipped", [])]
            if logged:
                assert db is not None and task_id is not None
                db.add_metric(task_id, step, out["loss"], dt, report.tokens_per_step / dt)
                record_step(db, task_id, step, out)
            if on_step is not None:
                on_step(step, {**out, "step_s": dt, "tokens_per_s": report.tokens_per_step / dt})
            step += 1
            if rec.checkpoint_every and (step - first_step) % rec.checkpoint_every == 0:
                try:
                    save(step)
                except WorkerFailure as failure:
                    step = roll_back(failure, step)
        if report.cancelled:  # keep what was done: a checkpoint where it stopped
            if step > history[-1].step:
                try:
                    save(step)
                except WorkerFailure as failure:
                    step = roll_back(failure, step)
            break
        if not validate:
            break
        try:
            with hold():
                report.val_end = validation_loss(dep, valid, batch, microbatches)
            break
        except WorkerFailure as failure:  # the weights go back to the checkpoint: run again
            step = roll_back(failure, step)
    report.losses = [losses[s] for s in sorted(losses)]
    report.end_step = step
    return report


def train_task(
    dep: Deployment,
    params: TrainParams,
    corpora: tuple[Corpus, Corpus],
    schedule: Schedule,
    db: Database,
    task_id: int,
    first: int,
    recovering: Recovering,
    run_id: int,
    stop: Callable[[], bool],
    turn: Callable[[], contextlib.AbstractContextManager[None]],
    pause: Callable[[int], tuple[int, dict[str, Any] | None]] | None,
    swap: Callable[[int], Deployment | None] | None = None,
    shrink: ShrinkHook | None = None,
    plan_now: Callable[[], Plan] | None = None,
    live: Callable[[TrainReport], None] | None = None,
) -> TrainReport:
    """:func:`train` a task from its stored parameters, from step ``first``, at the learning
    rate of its schedule (:mod:`.lr_schedule`)."""
    settings = TrainSettings(
        lr=params.lr,
        lr_schedule=params.lr_schedule,
        warmup_steps=params.warmup_steps,
        min_lr_ratio=params.min_lr_ratio,
    )
    return train(
        dep,
        *corpora,
        params.steps,
        params.batch,
        params.microbatches,
        schedule,
        db,
        task_id,
        first_step=first,
        recovering=recovering,
        run_id=run_id,
        stop=stop,
        turn=turn,
        lr=lambda i: lr_at(i, params.steps, settings),
        sync=params.sync,
        pause=pause,
        swap=swap,
        shrink=shrink,
        plan_now=plan_now,
        live=live,
    )
