"""A training task's parameters: its request
(:class:`~dmsc.runtime.transport.messages.TrainRequest`) completed from the plan and checked
against it, once, when it is submitted; the task stores them and its consumer runs from them as
stored (:meth:`TrainParams.from_stored`), without resolving the request again. ``first_step`` is
added by the control plane once the task has started; no client sets it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from dmsc.planner.plan import Plan
from dmsc.runtime.compute import ep_worker
from dmsc.runtime.compute.aggregators import parse_aggregator
from dmsc.runtime.transport.messages import (
    DEFAULT_LR,
    LatePolicy,
    LrSchedule,
    SyncSettings,
    TrainRequest,
)
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
    lr: float = DEFAULT_LR
    lr_schedule: LrSchedule = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    seed: int = 0
    data: str | None = None  # a file or directory of text (the standard library's when None)
    first_step: int | None = None  # set once the task has started: a rerun resumes
    dp: int | None = None  # another degree than the deployment's: resized first
    sync: SyncSettings = field(default_factory=SyncSettings)

    def as_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        return out | {"sync": self.sync.model_dump()}

    @staticmethod
    def resolved(stored: dict[str, Any]) -> bool:
        """Whether ``stored`` holds resolved parameters (:meth:`as_json`), rather than a request
        queued as it came (a test's, or an older database's)."""
        return stored.keys() >= _REQUIRED

    @classmethod
    def from_stored(cls, stored: dict[str, Any]) -> TrainParams:
        """The parameters :meth:`as_json` stored (ValueError names a field that is not one)."""
        try:
            return _ADAPTER.validate_python(stored)
        except ValidationError as exc:
            raise ValueError(f"stored task parameters: {exc.errors()[0]['msg']}") from None


_REQUIRED = frozenset(
    {"steps", "batch", "microbatches", "checkpoint_every", "late_policy", "grad_wait_s", "sync"}
)
_ADAPTER = TypeAdapter(TrainParams)


def task_params(req: TrainRequest, plan: Plan) -> TrainParams:
    """A training request completed from ``plan`` (batch and micro-batches default to its) and
    checked against it (ValueError says what is wrong)."""
    batch = req.batch if req.batch is not None else plan.job.global_batch
    micro = req.microbatches if req.microbatches is not None else plan.job.microbatches
    dp = req.dp or plan.job.dp
    if batch % (micro * dp):
        raise ValueError(f"batch ({batch}) must be divisible by microbatches x dp ({micro} x {dp})")
    if req.warmup_steps > req.steps:
        raise ValueError(f"warmup_steps ({req.warmup_steps}) exceeds steps ({req.steps})")
    sync, planned = req.sync, plan.job.sync
    if sync is None:  # the plan's sync mode (dmsc plan --sync) when the task names none
        sync = SyncSettings(
            mode=planned.mode, inner_steps=planned.inner_steps, compress=planned.compress
        )
    if sync.outer and req.late_policy == "restart":
        raise ValueError(
            "late_policy: restart runs a step again; a round spans inner_steps steps: "
            "use wait or skip"
        )
    try:  # the aggregator's own rule on how many replicas it needs
        parse_aggregator(sync.aggregator).check_replicas(dp)
    except ValueError as exc:
        raise ValueError(f"sync.aggregator: {exc} (dp = {dp})") from None
    if sync.task_heads:
        if plan.job.pp < 2 or dp < 2:
            raise ValueError(
                f"sync.task_heads: one head per replica after a shared backbone needs a pipeline "
                f"of 2 or more stages and dp >= 2 (the plan has pp = {plan.job.pp}, dp = {dp})"
            )
        model = plan.model_spec or resolve_model(plan.model)
        if isinstance(model, TransformerSpec) and model.tied_embeddings:
            raise ValueError(
                "sync.task_heads: the output layer is tied to the backbone's embedding, so a "
                "head cannot be a replica's own"
            )
    job = plan.job
    if (problem := ep_worker.task_problem(job.ep, job.dp, dp, sync, req.late_policy)) is not None:
        raise ValueError(problem)
    if sync.local_data and (req.data is None or not Path(req.data).is_dir()):
        raise ValueError("sync.local_data: needs data, a directory of files to share out")
    fields = {k: getattr(req, k) for k in TrainParams.__dataclass_fields__ if k != "first_step"}
    return TrainParams(**{**fields, "batch": batch, "microbatches": micro, "sync": sync})
