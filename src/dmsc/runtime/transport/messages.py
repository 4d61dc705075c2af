"""Typed control messages: one pydantic model per control RPC, shared by sender and receiver.

Every JSON request between the services (a stage worker's ``dmsc.Stage``, the registry's
``dmsc.Registry``, the control plane's ``dmsc.Control``) and the HTTP gateway's bodies are
validated by the models here, and the limits (tokens, steps, batch sizes, waits) are defined once
here, so the gateway, the control plane and the workers cannot drift apart. A request failing its
model is refused with the field and the reason (:func:`.rpc.message_handler`). Replies stay plain
JSON objects. Tensors travel as :mod:`.wire` frames (``Push``, ``RunWith``, ``Relay``), not here.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dmsc.spec.sync_forms import (
    MAX_INNER_STEPS,
    AggregatorForm,
    CompressForm,
    SyncForms,
    SyncMode,
    check_round,
)

# -- service names -------------------------------------------------------------------------------
STAGE_SERVICE = "dmsc.Stage"
REGISTRY_SERVICE = "dmsc.Registry"
CONTROL_SERVICE = "dmsc.Control"

# -- limits, defined once ------------------------------------------------------------------------
MAX_PROMPT_CHARS = 10_000
MAX_INFER_TOKENS = 1024
MAX_TRAIN_STEPS = 1_000_000
MAX_BATCH = 65_536
MAX_MICROBATCHES = 4096
MAX_GRAD_WAIT_S = 3600.0
MAX_PRIORITY = 100
MAX_SESSION_CHARS = 256
MAX_TOP_K = 1 << 20
MAX_SEED = (1 << 63) - 1
MAX_LR = 10.0
DEFAULT_CHECKPOINT_EVERY = 50  # steps between a training task's checkpoints
DEFAULT_GRAD_WAIT_S = 5.0

LatePolicy = Literal["wait", "skip", "restart"]
LATE_POLICIES: tuple[str, ...] = ("wait", "skip", "restart")
Schedule = Literal["gpipe", "1f1b"]
Lane = Literal["sync", "async"]
LrSchedule = Literal["constant", "cosine", "linear"]
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine", "linear")
DEFAULT_LR = 1e-3

Step = Annotated[int, Field(ge=0)]
SessionId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
MAX_POSITION = 10_000_000  # the model spec's longest sequence
Epoch = Annotated[int, Field(ge=0)]
Tokens = Annotated[int, Field(gt=0, le=MAX_INFER_TOKENS)]
Prompt = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
TrainSteps = Annotated[int, Field(gt=0, le=MAX_TRAIN_STEPS)]
GradWait = Annotated[float, Field(gt=0, le=MAX_GRAD_WAIT_S)]
CheckpointEvery = Annotated[int, Field(ge=0, le=MAX_TRAIN_STEPS)]


class Message(BaseModel):
    """A control message: unknown fields are refused, values are checked, nothing is coerced
    from a string that a typo would produce (``"steps": "ten"`` names ``steps``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def explain(exc: ValidationError, what: str) -> str:
    """One line naming every bad field and why: ``bad RunStep: microbatches: must be > 0``."""
    parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()]
    return f"bad {what}: " + "; ".join(parts)


InnerOptimizer = Literal["adamw", "sgd"]
# how task heads' outputs are combined at inference (dmsc.runtime.control.serving.combiners)
Aggregate = Literal["vote", "weighted", "attention"]


class SyncSettings(SyncForms, Message):
    """How the data-parallel replicas of a training task agree (see
    :mod:`dmsc.runtime.compute.outer_sync`): ``every-step`` averages gradients every step;
    ``diloco`` takes ``inner_steps`` optimizer steps per replica, then an outer step of SGD with
    Nesterov momentum on the averaged pseudo-gradient; ``fedavg`` averages the models every
    ``inner_steps`` (outer rate 1, no momentum); ``fedprox`` adds the proximal term ``prox_mu``
    to the local steps. ``compress`` and ``aggregator`` act on what the replicas send, ``dp_*``
    clips each replica's update and adds Gaussian noise to their sum, ``secure`` masks the
    updates so that the stage leader learns only their sum. With ``task_heads`` each replica's
    last stage is a task head of its own: its gradients are not averaged (the backbone's are),
    so every replica's head learns from its own data (``dmsc infer --aggregate`` combines them)."""

    mode: SyncMode = "every-step"
    inner_steps: Annotated[int, Field(ge=1, le=MAX_INNER_STEPS)] = 1
    outer_lr: Annotated[float, Field(gt=0, le=MAX_LR)] = 0.7
    outer_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    prox_mu: Annotated[float, Field(ge=0, le=100)] = 0.01
    inner_optimizer: InnerOptimizer = "adamw"
    # forms of dmsc.spec.sync_forms, checked here so that a typo is refused before a task queues
    compress: CompressForm = "none"
    aggregator: AggregatorForm = "mean"
    privacy_clip: Annotated[float, Field(gt=0, le=1e6)] | None = None
    privacy_noise: Annotated[float, Field(ge=0, le=100)] = 0.0
    privacy_delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    secure: bool = False
    # each datacenter's replicas train on their own part of the task's files ("local data")
    local_data: bool = False
    skew: Annotated[float, Field(ge=0, le=1)] = 0.0
    task_heads: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> SyncSettings:
        check_round(self.mode, self.inner_steps)
        compress, mean = self.compression.kind, self.aggregator == "mean"
        if compress == "powersgd" and not mean:
            raise ValueError("aggregator: PowerSGD averages low-rank factors: only mean")
        if self.secure and not mean:
            raise ValueError("aggregator: secure aggregation reveals only the sum: only mean")
        if self.secure and compress != "none":
            raise ValueError("compress: secure aggregation masks fixed-point values: only none")
        if self.privacy_noise > 0 and self.privacy_clip is None:
            raise ValueError("privacy_noise: noise needs a clipping norm (privacy_clip)")
        if self.task_heads and self.outer:
            raise ValueError(
                "task_heads: a round averages whole models, heads included: only every-step"
            )
        return self

    @property
    def outer(self) -> bool:
        """Whether the replicas average their models every ``inner_steps`` (not gradients)."""
        return self.local_steps

    @property
    def round_rate(self) -> float:
        """The outer learning rate and momentum this mode uses."""
        return 1.0 if self.mode in ("fedavg", "fedprox") else self.outer_lr


# -- dmsc.Stage (a stage worker) -----------------------------------------------------------------
class Commit(Message):
    """Apply the optimizer step of the gradients the last training ``RunStep`` left, at the
    learning rate ``lr`` when given (the task's schedule)."""

    step: Step
    epoch: Epoch | None = None
    lr: Annotated[float, Field(ge=0, le=MAX_LR)] | None = None
    # a round's end (sync modes but every-step; a task's last step too): models averaged after
    outer: bool = False


class RunStep(Message):
    """Run this worker's part of one step (training, evaluation or inference)."""

    step: Step
    microbatches: Annotated[int, Field(gt=0, le=MAX_MICROBATCHES)]
    schedule: Schedule = "1f1b"  # a stage of several chunks runs 1f1b interleaved
    train: bool = True
    eval: bool = False
    epoch: Epoch | None = None  # default: the worker's own
    late_policy: LatePolicy = "wait"
    grad_wait_s: GradWait = DEFAULT_GRAD_WAIT_S
    budget_s: Annotated[float, Field(gt=0, le=3600)] | None = None  # then the step is dropped
    # inference with a KV cache: the session the stage keeps, this step's first position
    session: SessionId | None = None
    start: Annotated[int, Field(ge=0, le=MAX_POSITION)] = 0
    # training: how the replicas agree (none: every step, the settings a worker has)
    sync: SyncSettings | None = None
    # training on the shard the worker holds (LoadShard): this replica's batch, drawn there
    local_batch: Annotated[int, Field(gt=0, le=MAX_BATCH)] | None = None
    # inference at the first stage: the step's token ids ([batch][positions]) carried in the
    # call itself, instead of a Push awaited before it (a round trip more for every token)
    tokens: Annotated[list[list[int]], Field(min_length=1, max_length=MAX_BATCH)] | None = None
    # inference, last stage: only each row's top largest logits and their ids come back
    top: Annotated[int, Field(gt=0, le=MAX_TOP_K)] | None = None
    # inference: the later stages' epochs; this one calls the next (Relay), answers the last's
    relay: Annotated[list[Epoch], Field(max_length=MAX_MICROBATCHES)] | None = None
    # training: this stage applies the step as that Commit would once its part is done
    commit: Commit | None = None

    @model_validator(mode="after")
    def _inference_only(self) -> RunStep:
        carried = [n for n in ("tokens", "relay") if getattr(self, n) is not None]
        if carried and (self.train or self.eval or self.microbatches > 1):
            raise ValueError(f"{carried[0]}: carried in an inference step of one micro-batch only")
        if self.top is not None and (self.train or self.eval):
            raise ValueError("top: the largest logits of an inference step, not of training")
        if self.commit is not None and not (self.train and self.commit.step == self.step):
            raise ValueError("commit: this training step's own")
        return self


class EndSession(Message):
    """Free an inference session's keys and values (unknown sessions are no error)."""

    session: SessionId


class LoadShard(Message):
    """The training text this replica keeps (each datacenter's part of a task's files): read
    by the worker from its own disk, never sent; batches are drawn from it by step."""

    files: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=4096)]],
        Field(min_length=1, max_length=100_000),
    ]
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    epoch: Epoch | None = None


class Abort(Message):
    """Move to a newer epoch: the step in progress fails, held frames are dropped."""

    epoch: Epoch


class Save(Message):
    """Write this stage's weights and optimizer state to ``path``."""

    path: Annotated[str, Field(min_length=1, max_length=4096)]
    epoch: Epoch | None = None


class Load(Message):
    """Load a checkpoint written by ``Save``; ``sha256`` (when given) must match the file.
    ``others``: the checkpoint's other stage files (path -> SHA-256), where the stage finds the
    tensors its own file lacks (a checkpoint of another cut: interleaved, or plain)."""

    path: Annotated[str, Field(min_length=1, max_length=4096)]
    sha256: str = ""
    epoch: Epoch | None = None
    others: Annotated[dict[str, str], Field(max_length=4096)] = Field(default_factory=dict)


class Assume(Message):
    """A warm spare takes a stage over; ``config`` is the stage's worker configuration."""

    config: dict[str, Any]
    epoch: Epoch | None = None


class Renew(Message):
    """A worker's next leaf certificate (``ca``, ``cert``, ``key`` PEM), sent by the control plane
    before the one it holds expires (:mod:`dmsc.runtime.control.launch.renewal`)."""

    tls: dict[str, str]


class Health(Message):
    """Is the worker serving? (no fields)"""

    epoch: Epoch | None = None


# -- dmsc.Registry -------------------------------------------------------------------------------
class Register(Message):
    """A service instance announcing itself (the registry keeps it as a ``ServiceInfo``)."""

    sid: Annotated[str, Field(min_length=1, max_length=256)]
    kind: Annotated[str, Field(min_length=1, max_length=32)]
    stage: Annotated[int, Field(ge=0)]
    address: Annotated[str, Field(min_length=1, max_length=256)]
    replica: Annotated[int, Field(ge=0)] = 0
    tp_rank: Annotated[int, Field(ge=0)] = 0  # its rank in its replica's tensor-parallel group
    model_version: str = "0"
    datacenter: str = "local"
    capacity: Annotated[float, Field(ge=0)] = 1.0
    epoch: Epoch = 0  # the incarnation: a replacement registers the same SID with a higher one


class Heartbeat(Message):
    sid: Annotated[str, Field(min_length=1, max_length=256)]
    epoch: Epoch | None = None


class Deregister(Message):
    sid: Annotated[str, Field(min_length=1, max_length=256)]
    epoch: Epoch | None = None  # only the instance at this epoch (a fenced one leaving)


class Lookup(Message):
    stage: Annotated[int, Field(ge=0)] | None = None
    kind: str | None = None


class Watch(Message):
    since: int = -1
    timeout_s: Annotated[float, Field(ge=0, le=60)] = 5.0


# -- dmsc.Control (the control plane) ------------------------------------------------------------
class TrainSettings(Message):
    """How a training task trains, beside how long: the optimizer's learning rate and its
    schedule over the task's steps (:mod:`dmsc.runtime.control.training.lr_schedule`), the global
    batch and its micro-batches (the plan's by default), and the seed that orders the data."""

    batch: Annotated[int, Field(gt=0, le=MAX_BATCH)] | None = None
    microbatches: Annotated[int, Field(gt=0, le=MAX_MICROBATCHES)] | None = None
    lr: Annotated[float, Field(gt=0, le=MAX_LR)] = DEFAULT_LR
    lr_schedule: LrSchedule = "constant"
    warmup_steps: Annotated[int, Field(ge=0, le=MAX_TRAIN_STEPS)] = 0
    # the learning rate a decaying schedule ends at, as a fraction of ``lr``
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0


class TrainRequest(TrainSettings):
    """A training task, the one request of both doors: ``dmsc train`` (the ``Train`` call, which
    waits for its end) and the gateway's ``POST /v1/tasks`` (which answers once it is queued).
    ``data`` is a text file or a directory of them that the control plane reads, inside one of
    its data roots (``dmsc up --data-root``; the standard library's sources when empty).
    ``priority`` and ``lane`` place it in the task queue (:mod:`dmsc.runtime.control.tasks`).
    What the control plane adds once the task runs (its first step) is no field here: a client
    cannot set it."""

    steps: TrainSteps = 100
    checkpoint_every: CheckpointEvery = DEFAULT_CHECKPOINT_EVERY
    late_policy: LatePolicy = "wait"
    grad_wait_s: GradWait = DEFAULT_GRAD_WAIT_S
    data: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    sync: SyncSettings | None = None  # how the replicas agree (none: as the plan says)
    # the data-parallel degree to train at (none: the deployment's); another one resizes the
    # deployment from a checkpoint before the first step (dmsc.runtime.control.training.resize)
    dp: Annotated[int, Field(ge=1, le=1024)] | None = None
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0
    # the long lane (async) by default; dmsc train asks for the short one (sync)
    lane: Lane = "async"


class Sampling(Message):
    """How the next token is drawn from the logits: ``temperature`` 0 is greedy (the most
    likely token); ``top_k`` keeps the k most likely (0: all), ``top_p`` the smallest set of
    most likely tokens whose probability reaches p; ``seed`` makes the draw repeatable (a
    fresh one is drawn, and returned, when absent)."""

    temperature: Annotated[float, Field(ge=0, le=100)] = 0.8
    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] = 0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None

    def sampling(self) -> Sampling:
        """These settings alone (of a request that carries more), with a seed: a fresh random
        one when the request gave none, so that the answer can say which seed repeats it."""
        seed = self.seed if self.seed is not None else secrets.randbelow(MAX_SEED + 1)
        fields = {k: getattr(self, k) for k in Sampling.model_fields}
        return Sampling(**{**fields, "seed": seed})


class InferRequest(Sampling):
    """An inference request, the one request of both doors: ``dmsc infer`` (the control plane's
    ``Infer``/``InferStream`` calls, and each line of ``dmsc infer --batch``) and the gateway's
    ``POST /v1/infer``. Generate ``tokens`` tokens after ``prompt``; with ``aggregate``, every
    token from the task heads' distributions combined (one head per data-parallel replica,
    trained with ``task_heads``; see :mod:`dmsc.runtime.control.serving.head_inference`).
    ``session`` keeps a client's requests on one replica (at the gateway, on one model
    version too); ``timeout_s`` is the request's deadline (past it, it stops and frees its
    replica). ``redundant`` (two replicas at once, the first answer wins) is the gateway's
    alone: the control plane's calls refuse it, saying so."""

    prompt: Prompt
    tokens: Tokens = 40
    aggregate: Aggregate | None = None
    session: Annotated[str, Field(max_length=MAX_SESSION_CHARS)] | None = None
    redundant: bool = False
    timeout_s: Annotated[float, Field(ge=0.1, le=600)] | None = None

    @model_validator(mode="after")
    def _one_way(self) -> InferRequest:
        if self.redundant and self.aggregate is not None:
            raise ValueError(
                "redundant: an aggregated answer asks every task head at once: no replica to race"
            )
        return self


MAX_BATCH_REQUESTS = 256  # inference requests in one queued batch


class InferBatch(Message):
    """A batch of inference requests run as one queued task (kind ``infer``): ``dmsc infer
    --batch FILE`` (the ``InferBatch`` call, which waits for its end) and the gateway's
    ``POST /v1/tasks/infer`` (which answers once it is queued). Each request is the one both
    inference doors take; ``priority`` and ``lane`` place the task as a training task's do
    (the short lane, ``sync``, by default: a batch holds no weights)."""

    requests: Annotated[list[InferRequest], Field(min_length=1, max_length=MAX_BATCH_REQUESTS)]
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0
    lane: Lane = "sync"


class StatusRequest(Message):
    """The deployment's state (no fields)."""


class InjectRequest(Message):
    """``dmsc chaos``: send a fault to one stage worker through the control plane's launcher
    (the worker may run on another machine): ``kill`` (kill -9), ``freeze`` (SIGSTOP) or
    ``thaw`` (SIGCONT, to a frozen instance even after it was replaced)."""

    sid: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")]
    fault: Literal["kill", "freeze", "thaw"]


class ReplanRequest(Message):
    """``dmsc replan``: the functional modules on the run's measurements, the orchestrator's
    decision on each proposal and, unless ``dry_run``, what it decided applied."""

    dry_run: bool = True
    threshold: Annotated[float, Field(ge=0, le=10)] = 0.05
    horizon_steps: Annotated[int, Field(ge=0, le=10_000_000)] = 1000


class DownRequest(Message):
    """Stop the control plane and its workers (no fields)."""


class RevokeRequest(Message):
    """Revoke an API key: in the database and in the running gateway's key cache."""

    key_id: Annotated[int, Field(ge=1, le=2**62)]


# -- from the CLI to the control-plane process -------------------------------------------------
class AutoscaleSettings(Message):
    """``dmsc up --autoscale infer:...``: the pipelines that serve inference, between ``min``
    and ``max`` (the plan's replicas count, and always serve), sized so that each has about
    ``target`` requests in flight; ``cooldown_s`` between two changes, the load averaged over
    ``window_s``, the request rate forecast ``lookahead_s`` ahead
    (:mod:`dmsc.runtime.control.serving.autoscale`)."""

    min: Annotated[int, Field(ge=1, le=64)] = 1
    max: Annotated[int, Field(ge=1, le=64)] = 4
    target: Annotated[float, Field(gt=0, le=1024)] = 2.0
    cooldown_s: Annotated[float, Field(ge=0, le=3600)] = 10.0
    window_s: Annotated[float, Field(gt=0, le=3600)] = 5.0
    lookahead_s: Annotated[float, Field(ge=0, le=3600)] = 0.0  # 0: no forecast

    @model_validator(mode="after")
    def _ordered(self) -> AutoscaleSettings:
        if self.min > self.max:
            raise ValueError(f"min: {self.min} is above max ({self.max})")
        return self


RayAddress = Annotated[
    str, Field(min_length=3, max_length=256, pattern=r"^([^\s:\[\]]+|\[[0-9A-Fa-f:.]+\]):\d{1,5}$")
]


class ControlSettings(Message):
    """What ``dmsc up`` tells the control-plane process (as JSON on its standard input): the
    settings are parsed once, by the CLI, and the daemon has no parser of its own."""

    plan: Annotated[str, Field(min_length=1)]  # path of the plan file
    home: Annotated[str, Field(min_length=1)]  # the data directory (DMSC_HOME)
    gateway: str | None = None  # HOST:PORT of the HTTP gateway, when one is wanted
    # HTTPS at the gateway: its certificate and key files (dmsc up --tls, --tls-cert/--tls-key)
    tls_cert: str | None = None
    tls_key: str | None = None
    # Checkpoints sealed with AES-GCM, the key under the home (dmsc up --encrypt-checkpoints)
    encrypt_checkpoints: bool = False
    router: str = "least_outstanding"  # replica routing policy of the gateway
    failure_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    spares: Annotated[int, Field(ge=0, le=64)] = 0
    # Where the workers run: ``plan`` (each replica's device), ``cpu``, or one GPU: cuda[:N]
    device: Annotated[str, Field(pattern=r"^(plan|cpu|cuda(:\d{1,3})?)$")] = "plan"
    # Who starts the workers: this machine (``local``) or a Ray cluster (``ray``, joined at
    # ``ray_address``, its head's HOST:PORT; None: a private cluster on 127.0.0.1 for this
    # run; never ``auto``, which joins whichever cluster /tmp/ray names, maybe another user's).
    launcher: Literal["local", "ray"] = "local"
    ray_address: RayAddress | None = None
    # The gateway's limits per tenant: requests/s (and the burst saved up), inference in flight
    rate_limit: Annotated[float, Field(gt=0, le=1e6)] = 20.0
    burst: Annotated[float, Field(ge=1, le=1e6)] = 40.0
    tenant_requests: Annotated[int, Field(ge=1, le=1024)] = 4
    max_body_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] = 64 * 1024
    # Elastic serving replicas, placed on free devices of the cluster spec at ``cluster``.
    autoscale: AutoscaleSettings | None = None
    cluster: str | None = None
    # A training task's newest checkpoints kept on disk (0: all), and a tenant's checkpoint
    # bytes (None: no quota): dmsc.runtime.control.training.retention.
    keep_checkpoints: Annotated[int, Field(ge=0, le=1_000_000)] = 3
    checkpoint_quota_bytes: Annotated[int, Field(gt=0)] | None = None
    # Make a new database even though a salvaged copy of a lost one lies beside its path.
    new_database: bool = False
    # The order the task queue's consumers claim tasks in (dmsc.runtime.control.tasks).
    queue: Literal["fcfs", "priority", "fair"] = "priority"
    # The directories a training task's data must lie in (symlinks followed): dmsc up
    # --data-root, by default the directory it was started in.
    data_roots: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=4096)]], Field(max_length=64)
    ] = []
    # The control loop (dmsc.runtime.control.loop): seconds between ticks (0: off), accepted
    # moves applied or only proposed, and the policy file's content (checked by dmsc up).
    control_interval_s: Annotated[float, Field(ge=0, le=3600)] = 5.0
    control: Literal["act", "advise"] = "act"
    policy: dict[str, Any] | None = None
