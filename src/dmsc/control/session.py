"""A training session on a deployed plan: steps, validation, metrics in the database."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dmsc.control.orchestrator import Deployment, StageLayout
from dmsc.control.plan import Plan
from dmsc.data.corpus import Corpus
from dmsc.data.db import Database
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
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    val_start: float | None = None
    val_end: float | None = None
    tokens_per_step: int = 0

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


def train(
    dep: Deployment,
    corpus: Corpus,
    valid: Corpus,
    steps: int,
    batch: int,
    microbatches: int,
    schedule: str = "1f1b",
    db: Database | None = None,
    task_id: int | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    first_step: int = 0,
) -> TrainReport:
    """Run ``steps`` training steps; validation loss before and after."""
    report = TrainReport(steps, tokens_per_step=batch * dep.layout.model.seq)
    report.val_start = validation_loss(dep, valid, batch, microbatches)
    if db is not None and task_id is not None:
        db.set_task_state(task_id, "running")
    for step in range(first_step, first_step + steps):
        x, y = corpus.batch(step, batch)
        t0 = time.perf_counter()
        out = dep.train_step(step, x, y, microbatches, schedule)
        dt = time.perf_counter() - t0
        report.losses.append(out["loss"])
        report.step_s.append(dt)
        if db is not None and task_id is not None:
            db.add_metric(task_id, step, out["loss"], dt, report.tokens_per_step / dt)
        if on_step is not None:
            on_step(step, {**out, "tokens_per_s": report.tokens_per_step / dt})
    report.val_end = validation_loss(dep, valid, batch, microbatches)
    if db is not None and task_id is not None:
        db.set_task_state(task_id, "done")
    return report
