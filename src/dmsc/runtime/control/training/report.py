"""What a training session reports: losses, step times, recoveries, the sync mode's traffic,
and the segments of steps run at one data-parallel degree.

A task's dp may change while it runs (a resize the control loop asked for between two steps,
:class:`~.resize.Between`; a shrink after a lost node, :mod:`.shrink`). Each layout the steps ran
on is one :class:`Segment`: the step it began at, its dp, the plan in force (the control plane's,
when it tells the session), and the times of the steps run on it (steps run again after a
rollback count where they ran). The control plane sets each segment's prediction
(:func:`dmsc.runtime.control.advisors.prediction.predict_segments`), so that each segment's
measured median is compared with the prediction for its own dp and plan, not the final one's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dmsc.planner.plan import Plan
from dmsc.runtime.compute.privacy import PrivacyLedger
from dmsc.runtime.control.launch.deployment import Checkpoint
from dmsc.runtime.control.launch.recovery import Recovery
from dmsc.runtime.transport.messages import SyncSettings


def median_step_s(step_s: list[float]) -> float:
    """The median of ``step_s`` past its first fifth (the warm-up steps)."""
    s = sorted(step_s[len(step_s) // 5 :] or step_s)
    return s[len(s) // 2]


@dataclass
class Segment:
    """Steps run at one dp, on one layout (module docstring)."""

    first_step: int
    dp: int
    plan: Plan | None = None  # the plan in force when it began (None: not told)
    step_s: list[float] = field(default_factory=list)
    # the prediction its median compares with (``predicted_step_s``, ``prediction``,
    # ``not_comparable``), set by the control plane (None: not set)
    prediction: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        timed = bool(self.step_s)
        return {
            "first_step": self.first_step,
            "dp": self.dp,
            "steps": len(self.step_s),
            "median_step_s": median_step_s(self.step_s) if timed else None,
            **(self.prediction or {}),
        }


@dataclass
class TrainReport:
    """What a training session did: its steps, losses, times, recoveries and segments."""

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
    checkpoint: Checkpoint | None = None  # the last one taken (or gone back to)
    cancelled: bool = False  # stopped before its last step (``stop`` said so)
    end_step: int = 0  # the step the weights are at when the session ends
    sync: SyncSettings | None = None  # how the replicas agreed (None: every step, plain)
    dp_bytes: int = 0  # what the replicas sent each other (gradients, updates), all steps
    rounds: int = 0  # the times they agreed (steps, or rounds of the sync mode)
    segments: list[Segment] = field(default_factory=list)  # one per layout the steps ran on
    # the prediction the task's median step compares with (None: not set by the control plane)
    prediction: dict[str, Any] | None = None

    @property
    def median_step_s(self) -> float:
        return median_step_s(self.step_s)

    def timed(self, dt: float) -> None:
        """A step ran in ``dt`` seconds, on the layout of the newest segment."""
        self.step_s.append(dt)
        if self.segments:
            self.segments[-1].step_s.append(dt)

    def segment(self, step: int, dp: int, plan: Plan | None) -> None:
        """From ``step`` on the steps run on a layout of ``dp`` replicas (``plan``'s); a segment
        where no step ran (a shrink before the first step) is replaced."""
        if self.segments and not self.segments[-1].step_s:
            self.segments.pop()
        self.segments.append(Segment(step, dp, plan))

    def as_json(self) -> dict[str, Any]:
        """What ``dmsc train`` and the Train call answer about the session."""
        timed = bool(self.step_s)
        return {
            "steps": self.end_step - self.first_step,
            "loss_first": self.losses[0] if self.losses else None,
            "loss_last": self.losses[-1] if self.losses else None,
            "val_start": self.val_start,
            "val_end": self.val_end,
            "median_step_s": self.median_step_s if timed else None,
            "tokens_per_s": self.tokens_per_step / self.median_step_s if timed else None,
            "recoveries": [
                {
                    "services": r.failed,
                    "reason": r.reason,
                    "detected_at": r.detected_at,
                    "recovered_after_s": r.recovered_at - r.detected_at,
                    "checkpoint_step": r.checkpoint_step,
                }
                for r in self.recoveries
            ],
            "steps_lost": self.steps_lost,
            "restarts": self.restarts,
            "skipped": self.skipped,
            "sync": self.sync_json(),
            "segments": [s.as_json() for s in self.segments],
            **(self.prediction or {}),
        }

    def sync_json(self) -> dict[str, Any]:
        """The sync mode, the bytes it moved, and the privacy spent (epsilon at the task's
        delta, from the accountant) when its updates were clipped and noised."""
        s = self.sync or SyncSettings()
        steps = max(1, len(self.losses))
        out: dict[str, Any] = {
            "mode": s.mode if not s.outer else f"{s.mode}:{s.inner_steps}",
            "compress": s.compress,
            "aggregator": s.aggregator,
            "secure": s.secure,
            "local_data": s.local_data,
            "task_heads": s.task_heads,
            "dp_bytes": self.dp_bytes,
            "bytes_per_step": self.dp_bytes / steps,
            "rounds": self.rounds,
        }
        if s.privacy_clip is not None:
            ledger = PrivacyLedger(s.privacy_noise, s.privacy_clip, rounds=self.rounds)
            privacy = ledger.as_json(s.privacy_delta)
            if privacy["epsilon"] == float("inf"):  # no noise: no guarantee (JSON has no inf)
                privacy["epsilon"] = None  # type: ignore[assignment]
            out["privacy"] = privacy
        return out
