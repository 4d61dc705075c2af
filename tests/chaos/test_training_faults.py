"""Training survives a stage worker killed (kill -9) or frozen (SIGSTOP) at a random step.

Real worker processes on 127.0.0.1. The reference is the same run without the fault: since every
worker returns to the last checkpoint and the steps after it run again on the same batches, the
whole loss curve must equal the failure-free one.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from runtime_helpers import reference_losses

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.runtime.compute.reference import train_diloco_reference
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.training.session import Recovering, train
from dmsc.runtime.transport.messages import SyncSettings
from dmsc.spec import resolve_model
from dmsc.testing.chaos import train_under_fault

SPEC = resolve_model("gpt-mini")
RANGES = [("embedding", "block_0"), ("block_1", "block_2"), ("block_3", "head")]
STEPS, BATCH, MICRO, TTL = 14, 8, 4, 3.0


@pytest.fixture(scope="module")
def corpora() -> tuple[Corpus, Corpus]:
    train_text, valid_text = stdlib_text(max_bytes=400_000)
    return Corpus(train_text, SPEC.seq, seed=1), Corpus(valid_text, SPEC.seq, seed=2)


@pytest.fixture(scope="module")
def reference(corpora) -> list[float]:  # type: ignore[no-untyped-def]
    """Single-process training on the same batches: the failure-free run."""
    batches = [corpora[0].batch(s, BATCH) for s in range(STEPS)]
    return reference_losses(SPEC, 0, 1e-3, batches, MICRO)


@pytest.mark.parametrize(
    ("fault", "spares", "stage"), [("kill", 0, 1), ("freeze", 0, 2), ("kill", 1, 1)]
)
def test_training_recovers_from_a_failed_stage_worker(
    fault: str, spares: int, stage: int, corpora, reference
) -> None:  # type: ignore[no-untyped-def]
    at_step = random.Random(f"{fault}{spares}").randint(6, STEPS - 3)
    report, fr = train_under_fault(
        StageLayout(SPEC, RANGES),
        *corpora,
        STEPS,
        BATCH,
        MICRO,
        fault,  # type: ignore[arg-type]
        stage=stage,
        at_step=at_step,
        checkpoint_every=4,
        registry_ttl_s=TTL,
        spares=spares,
    )
    assert len(report.recoveries) == 1, report.recoveries
    assert report.recoveries[0].failed == [f"stage{stage}-r0"]
    assert len(report.losses) == STEPS
    # The run goes on as the failure-free run from the same checkpoint.
    assert max(abs(a - b) for a, b in zip(report.losses, reference, strict=True)) < 1e-5
    # Nothing is lost beyond the checkpoint (every 4 steps) and detection is bounded: at once
    # for a dead process, within the registry TTL (heartbeats every TTL/3) for a frozen one.
    assert 0 <= fr.steps_lost <= 4
    assert fr.detected_after_s is not None and fr.recovered_after_s is not None
    # (a kill: before the heartbeats' TTL could have told it, the bound of a loaded machine)
    assert fr.detected_after_s < (TTL if fault == "kill" else TTL + TTL / 3 + 1.5)
    assert fr.recovered_after_s < fr.detected_after_s + 30
    if spares:  # a warm spare takes the stage over: no process start on the recovery path
        # (the takeover moves the epoch and loads a checkpoint; the bound leaves a loaded machine
        # room)
        assert fr.recovered_after_s - fr.detected_after_s < 4.0
    if fault == "freeze":
        # Thawed, the old instance finds its SID held by a newer epoch and leaves: one copy.
        assert fr.fenced and fr.live_copies == 1
        assert fr.extra["registered"] == [fr.extra["replacement"]]


def test_a_resumed_session_continues_from_its_checkpoint(corpora, reference, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Checkpoint at step 6 in one deployment, resume in a fresh one: the same curve."""
    train_c, valid_c = corpora
    keep = Recovering(checkpoint_every=6, checkpoint_dir=tmp_path)
    with Deployment(StageLayout(SPEC, RANGES), home=tmp_path) as dep:
        first = train(dep, train_c, valid_c, 6, BATCH, MICRO, recovering=keep, validate=False)
    assert first.checkpoint is not None and first.checkpoint.step == 6
    with Deployment(StageLayout(SPEC, RANGES)) as dep:
        resume = Recovering(start=first.checkpoint)
        rest = train(dep, train_c, valid_c, STEPS, BATCH, MICRO, recovering=resume, validate=False)
    assert len(rest.losses) == STEPS - 6
    curve = first.losses + rest.losses
    assert max(abs(a - b) for a, b in zip(curve, reference, strict=True)) < 1e-5


def test_a_last_stage_frozen_between_steps_is_found_within_the_ttl(corpora, reference) -> None:  # type: ignore[no-untyped-def]
    """Frozen between two steps, the last stage takes the next step's targets into its socket
    buffer and never answers: the fault is seen within the registry TTL, as during a step, not
    when the push's call times out (30 s)."""
    frozen: list[float] = []
    with Deployment(StageLayout(SPEC, RANGES), registry_ttl_s=TTL) as dep:
        victim = dep.handle((2, 0))

        def on_step(step: int, _out: dict[str, object]) -> None:
            if step == 5 and not frozen:
                os.kill(victim.process.pid, signal.SIGSTOP)
                frozen.append(time.time())

        report = train(dep, *corpora, 8, BATCH, MICRO, on_step=on_step,
                       recovering=Recovering(checkpoint_every=4), validate=False)  # fmt: skip
    assert len(report.recoveries) == 1 and report.recoveries[0].failed == ["stage2-r0"]
    assert report.recoveries[0].detected_at - frozen[0] < TTL + TTL / 3 + 1.5
    assert max(abs(a - b) for a, b in zip(report.losses, reference[:8], strict=True)) < 1e-5


def test_diloco_rounds_survive_a_killed_replica_as_if_nothing_happened(corpora) -> None:  # type: ignore[no-untyped-def]
    """Two replicas in rounds of 4 (checkpoints at the rounds' ends); replica 1 is killed in
    the second round. Every worker goes back to the checkpoint (its anchor and momentum too),
    the round runs again, and the loss curve is the failure-free DiLoCo's, computed in one
    process."""
    steps, inner = 10, 4
    sync = SyncSettings(mode="diloco", inner_steps=inner)
    report, fr = train_under_fault(
        StageLayout(SPEC, [("embedding", "head")], replicas=2),
        *corpora,
        steps,
        BATCH,
        2,
        "kill",
        stage=0,
        at_step=6,
        replica=1,
        checkpoint_every=inner,
        registry_ttl_s=TTL,
        sync=sync,
    )
    assert len(report.recoveries) == 1 and fr.steps_lost > 0
    batches = [corpora[0].batch(s, BATCH) for s in range(steps)]
    want = train_diloco_reference(SPEC, 0, 1e-3, batches, 2, 2, inner, 0.7, 0.9)
    assert max(abs(a - b) for a, b in zip(report.losses, want, strict=True)) < 1e-4


def test_a_replica_killed_mid_step_is_replaced_and_the_group_reforms_around_it(
    corpora, reference
) -> None:  # type: ignore[no-untyped-def]
    """Plain data parallelism over the all-reduce: replica 1 is killed while a step runs. The
    survivor's collective fails (or its quorum is abandoned), the replica is replaced, the two
    form a new group at the next step and the loss curve is the failure-free one (the same
    batches in one process: each replica takes half of every batch in half the micro-batches)."""
    steps = 6
    report, fr = train_under_fault(
        StageLayout(SPEC, [("embedding", "head")], replicas=2),
        *corpora,
        steps,
        BATCH,
        MICRO // 2,
        "kill",
        stage=0,
        at_step=4,
        replica=1,
        checkpoint_every=4,
        registry_ttl_s=TTL,
    )
    assert [r.failed for r in report.recoveries] == [["stage0-r1"]]
    assert fr.detected_after_s is not None and fr.detected_after_s < TTL  # not by heartbeats
    assert max(abs(a - b) for a, b in zip(report.losses, reference[:steps], strict=True)) < 1e-5
