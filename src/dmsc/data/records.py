"""The tables of the data layer: runs, tasks, services, metrics and traces per step, model
versions, checkpoints, faults, API keys, tenants, scale events, and the control loop's decisions
and alerts (:mod:`dmsc.data.db` reads and writes them, :mod:`dmsc.data.control_records` the
last two; every name here is also importable from there)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import BigInteger, ForeignKey, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    pass


class IdentityRecord(Base):
    """The database's identity: one row, made with the database. A file that holds another
    token, or none, is not this database any more (:mod:`dmsc.runtime.control.db_watch`), and
    checkpoint folders carry its start (:meth:`dmsc.data.db.Database.run_key`)."""

    __tablename__ = "dmsc_identity"
    id: Mapped[int] = mapped_column(primary_key=True)
    token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)


class RunRecord(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)
    model: Mapped[str] = mapped_column(String(128))
    cluster: Mapped[str] = mapped_column(String(128))
    plan_json: Mapped[str]
    status: Mapped[str] = mapped_column(String(32), default="running")


# Every state a task can be in (queued -> running -> done, failed or cancelled; cancelling while a
# running task is asked to stop).
TASK_STATES = ("queued", "running", "cancelling", "done", "failed", "cancelled")


class TaskRecord(Base):
    __tablename__ = "tasks"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    kind: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(32), default="queued")
    params_json: Mapped[str] = mapped_column(default="{}")
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    error: Mapped[str | None]
    # Queueing (dmsc.runtime.control.tasks.task_queue): who asked, how urgent, tries, why it failed.
    tenant: Mapped[str] = mapped_column(String(64), default="default")
    priority: Mapped[int] = mapped_column(default=0)
    weight: Mapped[float] = mapped_column(default=1.0)
    lane: Mapped[str] = mapped_column(String(16), default="sync")
    attempts: Mapped[int] = mapped_column(default=0)
    max_attempts: Mapped[int] = mapped_column(default=3)
    exception_type: Mapped[str | None] = mapped_column(String(128))
    log_excerpt: Mapped[str | None]
    # what a finished task produced (a training task's report: losses, its sync mode, the bytes
    # its replicas sent, the privacy spent)
    result_json: Mapped[str | None]


class ServiceRecord(Base):
    __tablename__ = "services"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    sid: Mapped[str] = mapped_column(String(128))
    stage: Mapped[int]
    replica: Mapped[int]
    address: Mapped[str] = mapped_column(String(64))
    datacenter: Mapped[str] = mapped_column(String(64), default="local")
    status: Mapped[str] = mapped_column(String(32), default="up")


class MetricRecord(Base):
    __tablename__ = "metrics"
    id: Mapped[int] = mapped_column(primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"))
    step: Mapped[int]
    loss: Mapped[float]
    step_s: Mapped[float]
    tokens_per_s: Mapped[float]
    val_loss: Mapped[float | None]


class StepTraceRecord(Base):
    """One worker's part of a training step: its ops' times and what it sent to whom
    (:mod:`dmsc.data.traces`)."""

    __tablename__ = "step_traces"
    id: Mapped[int] = mapped_column(primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"), index=True)
    step: Mapped[int]
    stage: Mapped[int]
    replica: Mapped[int]
    compute_s: Mapped[float]
    spans_json: Mapped[str] = mapped_column(default="[]")  # [[op, micro-batch, t0, t1], ...]
    sent_json: Mapped[str] = mapped_column(default="{}")  # {"STAGE/REPLICA": bytes}
    # the worker process's CPU % over its part of the step, its RSS at the end, and (on a GPU) the
    # memory torch allocated at the step's peak (dmsc.runtime.compute.telemetry); None: not known
    cpu_percent: Mapped[float | None]
    rss_bytes: Mapped[int | None] = mapped_column(BigInteger)
    gpu_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # the worker's node's CPU % (all its cores, 100: every core busy) over the last telemetry
    # window before the step ended; None: not known (or kept before workers reported it)
    node_cpu_percent: Mapped[float | None]
    # each parallel mode's communication in the step, by mode ("tp", "dp", "ep", "pp"): seconds
    # waited, bytes sent, calls and, for pp and dp, bytes by peer; None in traces kept before
    comm_json: Mapped[str | None]


class ModelVersionRecord(Base):
    __tablename__ = "model_versions"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    step: Mapped[int]
    path: Mapped[str]
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)
    metrics_json: Mapped[str] = mapped_column(default="{}")
    # candidate, production, canary or retired; the canary's share of inference traffic.
    status: Mapped[str] = mapped_column(String(16), default="candidate")
    canary_percent: Mapped[float] = mapped_column(default=0.0)
    task_id: Mapped[int | None]  # the training task that produced it


class CheckpointRecord(Base):
    """A consistent training checkpoint (every stage between the same two steps)."""

    __tablename__ = "checkpoints"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    task_id: Mapped[int | None]
    step: Mapped[int]
    files_json: Mapped[str]  # stage -> [path, sha256]
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)
    refused: Mapped[str | None]  # why a recovery could not load it (then it is not tried again)


class FaultRecord(Base):
    """A failure the runtime detected and what it did about it."""

    __tablename__ = "faults"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    task_id: Mapped[int | None]
    kind: Mapped[str] = mapped_column(String(32))  # worker, checkpoint, control-plane, ...
    services: Mapped[str] = mapped_column(default="")  # the SIDs replaced
    reason: Mapped[str] = mapped_column(default="")
    detected_at: Mapped[float] = mapped_column(default=0.0)  # unix time
    recovered_at: Mapped[float | None]
    checkpoint_step: Mapped[int | None]
    steps_lost: Mapped[int] = mapped_column(default=0)
    epoch: Mapped[int] = mapped_column(default=0)


class ApiKeyRecord(Base):
    """An API key, stored as its SHA-256 (the key itself is shown once, at creation)."""

    __tablename__ = "api_keys"
    id: Mapped[int] = mapped_column(primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    tenant: Mapped[str] = mapped_column(String(64))
    scopes: Mapped[str] = mapped_column(String(256))  # comma-separated
    revoked: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)
    # The tenant's rate limit when this key is used (requests/s, burst); None: the gateway's.
    rate: Mapped[float | None] = mapped_column(default=None)
    burst: Mapped[float | None] = mapped_column(default=None)


class TenantRecord(Base):
    """A tenant's settings: its weight in the task queue's fair share (``dmsc token create
    --weight``; a tenant without a row weighs 1)."""

    __tablename__ = "tenants"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    weight: Mapped[float] = mapped_column(default=1.0)


class ScaleEventRecord(Base):
    """A serving replica added or removed (``dmsc up --autoscale``), or a change refused."""

    __tablename__ = "scale_events"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    at: Mapped[dt.datetime] = mapped_column(default=_now)
    action: Mapped[str] = mapped_column(String(16))  # out, in, refused, failed
    replica: Mapped[str] = mapped_column(String(64))
    replicas_after: Mapped[int]  # pipelines serving inference after it
    in_flight: Mapped[float]  # the load it answered (mean requests in flight)
    reason: Mapped[str]
    placement_json: Mapped[str] = mapped_column(default="[]")  # [[stage, datacenter, devices]]


class ReplicaWeightsRecord(Base):
    """What one stage of one serving replica holds now (:mod:`dmsc.runtime.control.serving.held`):
    the SHA-256 of the checkpoint file it loaded or training saved, and the model version
    whose file that is (None: weights no version holds, such as a training task's)."""

    __tablename__ = "replica_weights"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    replica: Mapped[str] = mapped_column(String(64))  # replica-N, serve-N
    stage: Mapped[int]
    sha256: Mapped[str] = mapped_column(String(64), default="")
    version_id: Mapped[int | None]
    what: Mapped[str] = mapped_column(default="")  # "version 3", "training task 7 at step 40"
    at: Mapped[dt.datetime] = mapped_column(default=_now)


class DecisionRecord(Base):
    """One decision of the control loop on one proposal, with why, and what became of it."""

    __tablename__ = "control_decisions"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    at: Mapped[dt.datetime] = mapped_column(default=_now)
    tick: Mapped[int]  # the loop's tick that made it (from 1, per control-plane start)
    mode: Mapped[str] = mapped_column(String(16))  # act or advise
    module: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(32))  # the proposal's kind
    target: Mapped[str] = mapped_column(String(128))
    verdict: Mapped[str] = mapped_column(String(16))  # apply, refuse, raise, note
    reason: Mapped[str]  # the proposal's reason and the rule's, one line each
    # applied, proposed (advise), deferred, failed: ..., or "" for a note or a refusal
    outcome: Mapped[str] = mapped_column(default="")
    gain_s_per_step: Mapped[float] = mapped_column(default=0.0)
    cost_s: Mapped[float] = mapped_column(default=0.0)
    # the measured effect of an applied move: the median step time of the training task it was
    # measured on, and of the first steps of the next training task after it
    task_before: Mapped[int | None]
    step_before_s: Mapped[float | None]
    step_after_s: Mapped[float | None]
    task_after: Mapped[int | None]
    details_json: Mapped[str] = mapped_column(default="{}")


class AlertRecord(Base):
    """An objective the run broke (a service-level objective of the policy), raised once per
    breach until it holds again (``resolved_at``)."""

    __tablename__ = "alerts"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    at: Mapped[dt.datetime] = mapped_column(default=_now)
    slo: Mapped[str] = mapped_column(String(32))  # step_time_s, infer_p99_s, ...
    value: Mapped[float]  # what was measured
    objective: Mapped[float]  # the limit it broke
    reason: Mapped[str]
    task_id: Mapped[int | None]  # the task at fault, when one is
    exception_task: Mapped[int | None]  # the exception the loop raised for it, if any
    action: Mapped[str] = mapped_column(String(32), default="alert")  # what the policy names
    action_outcome: Mapped[str] = mapped_column(default="")
    webhook: Mapped[str] = mapped_column(default="")  # "", pending, sent, failed: ...
    resolved_at: Mapped[dt.datetime | None]
