"""Typed replies: one pydantic model per reply of the control plane's ``dmsc.Control`` service and
of the registry's ``Register`` / ``Heartbeat``, the counterparts of the requests in
:mod:`.messages`.

A server builds its reply through the model (:func:`dmsc.runtime.transport.rpc.message_handler`'s
``reply``: a reply that does not fit its model is a server error naming the field, never sent),
and a client parses what it receives with :func:`parse_reply` (a malformed reply raises
:class:`BadReply` naming each bad field). The JSON on the wire is what the handlers wrote before
these models existed: a reply carries the fields its handler set (:meth:`Reply.wire`), so a
plain ``Infer`` answer has no task-head fields and ``Status`` has ``weights_lost`` only when the
weights are lost. Open-ended documents (a proposal's details, a task's sync summary, a
calibration) stay JSON objects inside the typed reply.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from dmsc.runtime.transport.messages import explain


class BadReply(RuntimeError):
    """A reply that does not fit its model: the message names each bad field and why."""


class Reply(BaseModel):
    """A reply: unknown fields are refused (a server and its client come from one source)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def wire(self) -> dict[str, Any]:
        """The reply as JSON: the fields its builder set (defaults it left alone stay out)."""
        return self.model_dump(mode="json", exclude_unset=True)


R = TypeVar("R", bound=Reply)


def parse_reply(model: type[R], payload: bytes | str | dict[str, Any]) -> R:
    """``payload`` as a ``model``; :class:`BadReply` names each bad field and why."""
    try:
        if isinstance(payload, dict):
            return model.model_validate(payload)
        return model.model_validate_json(payload)
    except ValidationError as exc:
        raise BadReply(explain(exc, model.__name__)) from None


# -- dmsc.Registry -------------------------------------------------------------------------------
class Registered(Reply):
    """``Register``: taken (``ok``), or refused because a newer incarnation holds the SID."""

    ok: bool
    fenced: bool
    ttl_s: float
    fences: dict[str, int] = {}  # per SID, the lowest epoch served (.tls: older leaves refused)


class HeartbeatReply(Reply):
    """``Heartbeat``: whether the registry still knows the SID, and whether it is fenced."""

    known: bool
    fenced: bool
    fences: dict[str, int] = {}  # as in Registered


# -- dmsc.Control: Status --------------------------------------------------------------------------
class ServiceState(Reply):
    """A stage worker as ``Status`` sees it."""

    sid: str
    stage: int
    replica: int
    tp_rank: int = 0  # its rank in its replica's tensor-parallel group
    address: str
    health: Literal["ok", "unreachable"]
    pid: int
    node: str = "local"
    registered: bool
    heartbeat_age_s: float | None
    # what the worker's process uses (dmsc.runtime.compute.telemetry); None: it did not say
    host: str | None = None
    cpu_percent: float | None = None  # over the last second, percent of one core
    rss_bytes: int | None = None
    gpu_memory_bytes: int | None = None  # held by its allocator, every GPU (None: no CUDA)
    gpu_utilization_percent: float | None = None


class NodeState(Reply):
    """A machine the workers run on, as one of them read it, and the sums over its workers."""

    node: str  # "local", or the Ray node's address
    host: str | None = None
    cpus: float | None = None
    cpu_percent: float | None = None  # over the last second, percent of all its cores
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    net_sent_bytes_s: float | None = None
    net_recv_bytes_s: float | None = None
    workers: int
    workers_cpu_percent: float | None = None
    workers_rss_bytes: float | None = None
    workers_gpu_memory_bytes: float | None = None


class TaskState(Reply):
    id: int
    kind: str
    state: str


class FaultState(Reply):
    """A fault of the run and what was done about it."""

    id: int
    kind: str
    task: int | None
    services: str
    reason: str
    detected_at: float
    recovered_at: float | None
    checkpoint_step: int | None
    steps_lost: int
    epoch: int


class SpareState(Reply):
    sid: str
    address: str
    pid: int


class ModeState(Reply):
    """One parallel mode's communication per step: the plan's prediction against the traces."""

    mode: Literal["tp", "dp", "ep", "pp"]
    predicted_s: float | None
    measured_s: float | None  # dp, ep: the least-waiting replica's (dmsc.data.comm_modes)
    measured_bytes: float | None
    ratio: float | None
    steps: int
    slowest_s: float | None = None  # the slowest worker's wait


class LoopState(Reply):
    """The control loop as ``dmsc status`` shows it (none with ``--control-interval 0``)."""

    interval_s: float
    mode: Literal["act", "advise"]
    ticks: int
    open_alerts: int
    last_decision: str | None = None  # "N: VERDICT MODULE KIND (TARGET) -> OUTCOME"


class StatusReply(Reply):
    """``Status``: the run, its services, their health and use, nodes, tasks, faults, spares,
    and the control loop."""

    run: int
    model: str
    steps: int
    epoch: int
    services: list[ServiceState]
    tasks: list[TaskState]
    faults: list[FaultState]
    replicas_down: list[int]
    spares: list[SpareState]
    nodes: list[NodeState] = []  # the machines under the services, with their totals
    weights_lost: str | None = None  # set only when no checkpoint could restore the workers
    undeployed: str | None = None  # set only while a failed shrink left no workers
    queue: Literal["fcfs", "priority", "fair"] | None = None  # the task queue's policy
    modes_task: int | None = None  # the training task whose communication ``modes`` compares
    modes: list[ModeState] = []
    # what the task's step is compared with where not the plan's prediction (then ``modes`` has
    # no predicted figures: the plan's are of another job); None: the plan's
    modes_prediction: str | None = None
    # the routing's measured imbalance over that task's last steps (expert parallelism only)
    # and the one the plan priced (JobSpec.expert_imbalance)
    expert_imbalance: float | None = None
    planned_expert_imbalance: float = 1.0
    control: LoopState | None = None


# -- dmsc.Control: Train ---------------------------------------------------------------------------
class RecoveryState(Reply):
    """A failure a training task survived."""

    services: list[str]
    reason: str
    detected_at: float
    recovered_after_s: float
    checkpoint_step: int


class SegmentState(Reply):
    """Steps a training task ran at one dp, on one layout: their median against the prediction
    for that dp and plan (``not_comparable``: why there is none)."""

    first_step: int
    dp: int
    steps: int
    median_step_s: float | None
    predicted_step_s: float | None = None
    prediction: str | None = None
    not_comparable: str | None = None


class TrainReply(Reply):
    """``Train``: the task, how it ended, what it trained, and the prediction of its job (of each
    dp it ran at, in ``segments``, when a resize or a shrink changed it)."""

    task: int
    state: Literal["done", "cancelled"]
    model_version: int
    steps: int
    loss_first: float | None
    loss_last: float | None
    val_start: float | None
    val_end: float | None
    median_step_s: float | None
    tokens_per_s: float | None
    recoveries: list[RecoveryState]
    steps_lost: int
    restarts: int
    skipped: list[tuple[int, int, int]]  # step, stage, replica
    sync: dict[str, Any]  # the sync mode, the bytes it moved, the privacy spent
    predicted_step_s: float | None
    prediction: str  # the prediction's basis, or why there is none
    not_comparable: str | None
    segments: list[SegmentState] = []  # one per layout the steps ran on, in order


# -- dmsc.Control: Infer and InferStream -----------------------------------------------------------
class InferDone(Reply):
    """What an inference answers besides its text: the task, who answered, the seed that repeats
    it, the token ids; with task heads (``aggregate``), which heads answered and how they were
    combined."""

    task: int
    replica: str
    seed: int
    token_ids: list[int]
    model_version: int | None = None
    aggregate: str | None = None
    heads: int | None = None
    answered: list[int] | None = None
    missing: dict[str, str] | None = None
    weights: list[float] | None = None
    calibration: dict[str, Any] | None = None


class InferReply(InferDone):
    """``Infer``: the generated text and :class:`InferDone`'s fields."""

    text: str


class InferPiece(Reply):
    """A piece of ``InferStream``: text as it is generated (whole UTF-8 characters)."""

    text: str


class InferEnd(InferDone):
    """The last message of ``InferStream``."""

    done: Literal[True]


class InferBatchReply(Reply):
    """``InferBatch``: the task, how it ended, and one answer per request, in order (each the
    fields of an ``Infer`` reply, or ``error`` with why that request got none; a cancelled
    batch has the answers of the requests it ran)."""

    task: int
    state: Literal["done", "cancelled"]
    answers: list[dict[str, Any]]


def stream_item(payload: dict[str, Any]) -> InferPiece | InferEnd:
    """One message of ``InferStream``, typed (:class:`BadReply` when it is neither)."""
    if "done" in payload:
        return parse_reply(InferEnd, payload)
    return parse_reply(InferPiece, payload)


# -- dmsc.Control: Inject, Replan, Down, Revoke ----------------------------------------------------
class InjectReply(Reply):
    """``Inject``: the fault sent, to which processes, when."""

    sid: str
    fault: Literal["kill", "freeze", "thaw"]
    pids: list[int]
    at: float


class DecisionState(Reply):
    """A functional module's proposal and the orchestrator's decision on it."""

    module: str
    kind: str
    target: str
    reason: str
    predicted_gain_s_per_step: float
    current_s_per_step: float
    cost_s: float
    payback_steps: float | None
    details: dict[str, Any]
    decision: str
    verdict: str
    why: str


class Applied(Reply):
    target: str
    move_s: float


class ReplanReply(Reply):
    """``Replan`` (and ``dmsc replan --dry-run`` offline, which leaves the running plane's
    fields unset): the measurements, the decisions and, unless a dry run, what was applied."""

    run: int
    task: int | None
    dry_run: bool
    steps_measured: int
    median_step_s: float | None
    remaining_steps: int | None
    predicted_step_s: float | None
    prediction: str
    not_comparable: str | None
    decisions: list[DecisionState]
    cluster: str | None = None
    decide_s: float | None = None
    applied: Applied | None = None
    exceptions_raised: list[int] = []
    datacenters: list[str] = []


class DownReply(Reply):
    ok: bool


class RevokeReply(Reply):
    revoked: int
