"""The ``dmsc.Stage`` service: one stage replica's state and the RPC methods over it.

``Push`` takes a wire frame (checked by :mod:`.frames`) into the inbox (an inference ``RunStep``
may carry its tokens, ``RunWith`` a training step with its batch: :mod:`..transport.batched`,
``Relay`` a chained inference step with its activations: :mod:`.relay`; these three also on a
stream, :meth:`StageWorker.streamed`); every other method takes the typed message of its name
(:mod:`dmsc.runtime.transport.messages`), so this module only checks what needs its state.
``RunStep`` runs this stage's part of a step (:mod:`.executor`) and, with several replicas,
averages the gradients (:mod:`.gradient_sync`); optimizer steps are applied on ``Commit`` once
every stage has finished the step, or where its ``RunStep`` carries the commit at the end of the
stage's part (``Deployment.applies_in_step``). ``Save`` and ``Load`` go through
:mod:`.checkpoints`, ``Assume`` makes a warm spare the stage it is told, its certificate too.

Fencing: each worker serves one epoch (the deployment's generation, carried in every frame and
``RunStep``). ``Abort`` moves a worker to a newer epoch, which wakes and fails the step it is in
and drops frames of older epochs; a worker that the registry reports as fenced (its SID taken by
a newer incarnation) stops serving and exits (see :mod:`.worker`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from dmsc.runtime.compute import checkpoints as ckpt
from dmsc.runtime.compute import cpuset, drawing, relay, tp_worker
from dmsc.runtime.compute.comm_meter import METER, step_comm
from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.compute.decode_layout import DecodeLayout
from dmsc.runtime.compute.decode_weights import DecodeCasts
from dmsc.runtime.compute.devices import autocast_dtype, stage_device
from dmsc.runtime.compute.ep_worker import ExpertRanks
from dmsc.runtime.compute.executor import logits_reply, run_ops, step_ops
from dmsc.runtime.compute.frames import FrameSpec, carried_tokens, check_frame
from dmsc.runtime.compute.gradient_sync import GradientSync, LinkShaper
from dmsc.runtime.compute.inbox import Inbox
from dmsc.runtime.compute.local_shard import LocalShard
from dmsc.runtime.compute.models.attention import inference_attention
from dmsc.runtime.compute.models.chain import tied_weight
from dmsc.runtime.compute.outer_sync import ReplicaSync, make_optimizer, optimizer_kind, plain_sync
from dmsc.runtime.compute.peers import Peers
from dmsc.runtime.compute.pipe_stream import PipeStream, pipe_of
from dmsc.runtime.compute.sessions import Sessions
from dmsc.runtime.compute.telemetry import Telemetry
from dmsc.runtime.transport import batched, tls
from dmsc.runtime.transport import messages as msg
from dmsc.runtime.transport.drawing import Draw
from dmsc.runtime.transport.observe import json_logger
from dmsc.runtime.transport.replies import Registered
from dmsc.runtime.transport.rpc import (
    Abandoned,
    BadRequest,
    Client,
    DataLost,
    bytes_handler,
    message_fn,
    message_handler,
)
from dmsc.runtime.transport.stream_calls import STREAMED, Handler
from dmsc.runtime.transport.wire import Kind, Message, WireError, decode
from dmsc.spec import TransformerSpec

T = TypeVar("T")


class StageWorker:
    """The state and the RPC methods of one stage replica."""

    def __init__(self, cfg: WorkerConfig, log: logging.Logger | None = None) -> None:
        cpuset.pin(cfg.cpus)  # before any thread of its own starts: they inherit it
        torch.set_num_threads(cfg.threads)
        self.metrics = CollectorRegistry()
        self.m_steps = Histogram(
            "dmsc_worker_step_seconds", "RunStep wall time", ["mode"], registry=self.metrics
        )
        self.m_compute = Counter(
            "dmsc_worker_compute_seconds_total", "Compute time", registry=self.metrics
        )
        sent = "dmsc_worker_bytes_sent_total", "Bytes sent to neighbours", ["kind"]
        self.m_bytes = Counter(*sent, registry=self.metrics)
        self.m_rejected = Counter(
            "dmsc_worker_rejected_messages_total", "Malformed messages", registry=self.metrics
        )
        self.telemetry = Telemetry(self.metrics)  # CPU, memory, I/O of this process, its node
        self.traced_step = self.telemetry.traced(self.run_step)  # training replies: telemetry
        self.inbox = Inbox(cfg.epoch)
        self.registry = Client(cfg.registry, msg.REGISTRY_SERVICE, token=cfg.token)
        self.log = log or json_logger(f"dmsc.worker.{cfg.sid}")
        self._build(cfg)
        self._lock = threading.Lock()
        self.address = self.metrics_address = ""

    def _build(self, cfg: WorkerConfig) -> None:
        """The stage this process serves: its layers, optimizer, peers and step state."""
        self.cfg = cfg
        self.spec = TransformerSpec.model_validate(cfg.model)
        self.device = stage_device(cfg.device)
        self.autocast = autocast_dtype(self.spec, self.device)
        # ep > 1: this replica's share of the experts, its groups formed per epoch: the running
        # step's (an Abort mid-step must not let it form the new epoch's groups), else the inbox's
        self.experts = ExpertRanks(cfg, lambda: self.peers.epoch) if cfg.ep > 1 else None
        # built (or read from its checkpoint) on the host, then moved: the float32 master copy
        self.module = tp_worker.stage(self.spec, cfg, self.experts).to(self.device)
        self.optimizer = make_optimizer("adamw", self.module, cfg.lr)
        self.layout = DecodeLayout(self.module)  # its weights' strides while it decodes
        # on a GPU, its linear weights cast once for decoding, not once a token
        casts = DecodeCasts(self.module, self.autocast) if self.autocast is not None else None
        self.decode_casts = casts
        self.sync: ReplicaSync | None = None  # a task's sync mode, other than plain averaging
        self.sync_held: dict[str, torch.Tensor] = {}  # its round state, as last loaded
        first, last = self.module.is_first, self.module.is_last  # own training text: LoadShard
        self.shard = LocalShard(self.spec.seq, cfg.replica, first, last)
        self.n_params = sum(p.numel() for p in self.module.parameters())
        self.tied = tied_weight(self.spec, self.module) if cfg.stages > 1 else None
        self.frames = FrameSpec(
            stage=cfg.stage, first=first, last=last, seq=self.spec.seq, vocab=self.spec.vocab,
            hidden=self.spec.hidden, n_params=self.n_params,
            tied_rows=0 if self.tied is None else self.tied.shape[0],
            chunks=self.module.chunks, tp=cfg.tp, sequence=cfg.sequence_parallel,
        )  # fmt: skip
        self.steps_done = 0
        self.sessions = Sessions()  # inference sessions' keys and values
        self.uncommitted: int | None = None  # the step whose gradients wait for Commit
        self.peers = Peers(
            self.registry, self.inbox, cfg.replica, cfg.recv_timeout_s, self.m_bytes, cfg.token,
            self.device, {int(k): LinkShaper(v) for k, v in cfg.pp_link_mbps.items()},
            cfg.tp_rank, pipe_of(cfg, self.frames, self.push, self.log), cfg.tp,
        )  # fmt: skip
        self.grads = GradientSync(cfg, self.module, self.peers, self.inbox, self.tied, self.experts)
        self.drawn = (self.spec.vocab, drawing.agreement(cfg.tp, self.device))  # for Draw
        self.bytes_reported = 0  # of self.grads.link.bytes, by the last Commit

    @property
    def epoch(self) -> int:
        return self.inbox.epoch

    def record(self) -> msg.Register:
        """This worker's registry record."""
        return msg.Register(
            sid=self.cfg.sid,
            kind="spare" if self.cfg.spare else "stage",
            stage=self.cfg.stage,
            replica=self.cfg.replica,
            tp_rank=self.cfg.tp_rank,
            address=self.address,
            datacenter=self.cfg.datacenter,
            epoch=self.cfg.epoch,
        )

    def register(self) -> Registered:
        """Announce this worker (``fenced``: a newer incarnation holds its SID); where it has a
        stream listener, its calls there first (whoever finds it finds them)."""
        if isinstance(self.peers.pipe, PipeStream) and self.address:
            self.peers.pipe.answer_calls(self.streamed(), self.address)
        return self.registry.ask("Register", self.record(), Registered)

    def streamed(self) -> dict[str, Handler]:
        """The methods answered on a stream too (:mod:`..transport.stream_calls`): gRPC's."""
        step = message_fn(msg.RunStep, self.traced_step)
        return {"Relay": self.relay, "RunStep": step, "RunWith": self.run_with}

    def _check_epoch(self, epoch: int | None) -> None:
        """Refuse a call of another epoch than this worker's (none given: this worker's)."""
        if epoch is not None and epoch != self.epoch:
            raise BadRequest(f"fenced: epoch {epoch}, this worker is at {self.epoch}")

    # -- RPC methods -----------------------------------------------------------------------
    def push(self, data: bytes) -> bytes:
        self._take(lambda: (None, [decode(data, self.cfg.max_message_bytes)]))
        return b""

    def _take(self, read: Callable[[], tuple[T, list[Message]]], whole: bool = False) -> T:
        """Put the frames ``read`` gives (with what came with it, returned) in the inbox; with
        ``whole``, each is a whole batch cut into the step's micro-batches (``RunWith``). A
        request with a frame malformed or wrong for this stage is refused whole and counted."""
        try:
            got, frames = read()
            for f in frames:
                check_frame(self.frames, f.kind, f.tensor)
            for f in frames:
                cut = got.microbatches if whole and isinstance(got, msg.RunStep) else 1
                self.inbox.put(f.kind, f.step, f.microbatch, f.tensor, f.epoch, cut)
        except (WireError, BadRequest) as exc:
            self.m_rejected.inc()
            self.log.warning("rejected message: %s", exc, extra={"sid": self.cfg.sid})
            raise BadRequest(str(exc)) from None
        return got

    def run_step(self, m: msg.RunStep) -> dict[str, Any]:
        """One step. With a ``budget_s`` it waits for the worker and for frames only until its
        caller stopped waiting: a request past its deadline frees the worker for the next."""
        self._check_epoch(m.epoch)
        if m.local_batch is not None and m.microbatches > m.local_batch:
            raise BadRequest(
                f"RunStep: {m.microbatches} micro-batches of a batch of {m.local_batch} "
                "(each micro-batch needs a sample at least)"
            )
        deadline = None if m.budget_s is None else time.monotonic() + m.budget_s
        if not self._lock.acquire(timeout=-1 if m.budget_s is None else m.budget_s):
            raise Abandoned(f"step {m.step}: worker busy past the step's {m.budget_s:g} s budget")
        try:
            self.peers.deadline = deadline
            with self.peers.at_epoch(m.epoch):
                out, handed = self._run(m)
                if handed is not None:
                    onward = relay.packed_on(self.peers, self.cfg.stage, m, handed, deadline)
        finally:
            self.peers.deadline = None
            self._lock.release()
        if handed is None:
            return out  # else a chained step: the next stage's part, this worker free meanwhile
        return relay.hand_on(self.peers, self.cfg.stage, *onward, deadline)

    def relay(self, data: bytes) -> bytes:
        """``Relay``: a chained inference step with its activations, from the stage before."""
        m = self._take(lambda: _listed(relay.unpack(data, self.cfg.max_message_bytes)))
        return json.dumps(self.run_step(m)).encode()

    def run_with(self, data: bytes) -> bytes:
        """``RunWith``: a training or evaluation step with its batch (:mod:`.batched`)."""
        m = self._take(lambda: batched.unpack(data, self.cfg.max_message_bytes), whole=True)
        return json.dumps(self.traced_step(m)).encode()

    def _run(self, m: msg.RunStep) -> tuple[dict[str, Any], torch.Tensor | None]:
        """This stage's part of step ``m``: its reply, and the activations it hands on to the
        next stage itself (a chained inference step, :mod:`.relay`; else None)."""
        cfg = self.cfg
        chained = relay.chained(m, cfg.stage, cfg.stages, bool(cfg.chunks))
        self.peers.abandon()  # sends left by an abandoned step are not ours to finish
        if m.train:  # gradients of a step that was never committed are dropped
            self.optimizer.zero_grad(set_to_none=True)
            self.uncommitted = None
            if self.decode_casts is not None:  # their memory is the training step's
                self.decode_casts.clear()
        t0 = time.perf_counter()
        if m.train:
            self._use_sync(m.sync)
            self.grads.prepare(m, self.sync)  # and the step's late policy
        if m.local_batch is not None:
            self.shard.feed(self.inbox, m.step, m.local_batch, m.microbatches, self.epoch)
        if m.tokens is not None:  # an inference step's tokens, carried in the call
            ids = carried_tokens(self.frames, m.tokens)  # checked as a TOKENS frame is
            self.inbox.put(Kind.TOKENS, m.step, 0, ids, self.epoch)
        try:  # a stage of several chunks runs the interleaved schedule
            ops = step_ops(
                m.schedule, cfg.stage, cfg.stages, m.microbatches, m.train, len(cfg.ranges())
            )
        except ValueError as exc:
            raise BadRequest(f"RunStep: {exc}") from None
        cache = None
        if m.session and not m.train:  # :mod:`.sessions`
            c = cfg.max_sessions, cfg.session_idle_s, cfg.stage, self.spec.seq
            cache = self.sessions.take(m.session, m.start, *c)
        if (cache is not None or m.train) and self.layout.use(decode=cache is not None):
            self.log.info(f"weights laid out: {self.layout.describe()}")
        casts = self.decode_casts if cache is not None else None
        try:
            with (
                casts.applied() if casts is not None else contextlib.nullcontext(),
                contextlib.nullcontext() if m.train else inference_attention(self.device),
            ):
                done = run_ops(
                    self.module, self.peers, cfg.stage, m.step, ops, m.microbatches, m.train,
                    m.eval, cache, m.start, self.autocast, cfg.stages, chained,
                )  # fmt: skip
        except BaseException:
            if m.session:  # a step that failed half-way leaves the cache half-extended
                self.sessions.pop(m.session, None)
            raise
        skipped: list[int] = []
        if m.train:
            self._add_tied_grad(m.step)
            if m.sync is not None and m.sync.task_heads and self.module.is_last:
                pass  # this replica's own task head: its gradient stays here
            elif self.sync is not None and not self.sync.settings.outer:
                skipped = self.sync.sync_gradients(m.step, m.late_policy, m.grad_wait_s)
            elif self.sync is None and cfg.replicas > 1:
                skipped = self.grads.sync(m.step, m.late_policy, m.grad_wait_s)
            self.uncommitted = m.step
        applied = self._apply(m.commit) if m.commit is not None else None  # no Commit follows
        mode = "train" if m.train else ("eval" if m.eval else "infer")
        self.m_steps.labels(mode).observe(time.perf_counter() - t0)
        self.m_compute.inc(done.compute_s)
        if m.train:
            where = {"sid": cfg.sid, "step": m.step, "stage": cfg.stage, "replica": cfg.replica}
            self.log.info("step done", extra=where)
        out: dict[str, Any] = {
            "stage": cfg.stage,
            "replica": cfg.replica,
            "compute_s": done.compute_s,
            "wall_s": time.perf_counter() - t0,
        }
        if skipped:
            out["skipped_replicas"] = skipped
        if applied is not None:
            out["commit"] = applied
        if m.train:  # what the operator's view draws: the step's Gantt and its traffic
            out["spans"] = done.spans
            out["sent"] = {f"{s}/{r}": n for (s, r), n in self.peers.sent.items()}
            out["comm"] = step_comm(METER.take(), cfg.stage, cfg.replica, out["sent"])
        if self.module.is_last:
            out["loss"] = sum(done.losses.values()) / m.microbatches if done.losses else None
            if not m.train and not m.eval:
                out.update(logits_reply(torch.cat(done.logits), m.top))
        return out, done.handed

    def _use_sync(self, settings: msg.SyncSettings | None) -> None:
        """Take a training step's sync settings: plain averaging, or a new :class:`ReplicaSync`
        when they changed (its round starts from the weights as they are, or from the round
        state last loaded), with the inner optimizer they name."""
        settings = settings or msg.SyncSettings()
        kind = settings.inner_optimizer
        if kind != optimizer_kind(self.optimizer):
            self.optimizer = make_optimizer(kind, self.module, self.cfg.lr)
        if plain_sync(settings):
            self.sync = None
        elif self.sync is None or self.sync.settings != settings:
            layout = tp_worker.shard_layout(self.spec, self.cfg, self.module)
            self.sync = ReplicaSync(settings, self.module, self.grads, self.cfg.seed, layout)
            if self.sync_held:
                self.sync.restore(self.sync_held)

    def load_shard(self, m: msg.LoadShard) -> dict[str, Any]:
        """Read this replica's part of a task's files from this machine's disk."""
        self._check_epoch(m.epoch)
        return {"bytes": self.shard.load(m.files, m.seed)}

    def _add_tied_grad(self, step: int) -> None:
        """Add the other end's gradient of a tied embedding to this end's (first and last
        stage of the same replica swap theirs), so that both copies take the same step."""
        if self.tied is None:
            return
        grad = self.tied.grad if self.tied.grad is not None else torch.zeros_like(self.tied)
        other = self.cfg.stages - 1 if self.module.is_first else 0
        self.peers.send(other, Kind.TIED_GRAD, step, 0, grad)
        theirs = self.peers.recv(Kind.TIED_GRAD, step, 0)
        self.peers.flush()
        self.tied.grad = grad + theirs

    def end_session(self, m: msg.EndSession) -> dict[str, Any]:
        with self._lock:
            gone = self.sessions.pop(m.session, None)
        return {"ended": gone is not None}

    def commit(self, m: msg.Commit) -> dict[str, Any]:
        """Apply the optimizer step of the gradients the last training RunStep left (at the
        learning rate the Commit gives, else the one the optimizer has)."""
        with self._lock:
            self._check_epoch(self.epoch if m.epoch is None else m.epoch)
            out = self._apply(m)
            if m.outer:  # the round's exchange, metered in the step it ends (.comm_meter)
                out["comm"] = METER.take()
                out["comm"].get("dp", {})["bytes"] = out["dp_bytes"]
            return out

    def _apply(self, m: msg.Commit) -> dict[str, Any]:
        """:meth:`commit`'s work, the worker's lock held (a RunStep's own ``commit`` too)."""
        if self.uncommitted != m.step:
            raise BadRequest(f"nothing to commit for step {m.step} (have {self.uncommitted})")
        c0 = time.perf_counter()
        if m.lr is not None:  # this step's rate of the task's schedule
            for group in self.optimizer.param_groups:
                group["lr"] = m.lr
        rounds = self.sync if self.sync is not None and self.sync.settings.outer else None
        if rounds is not None:
            rounds.add_proximal()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.uncommitted = None
        self.steps_done += 1
        compute = time.perf_counter() - c0
        if rounds is not None and m.outer:
            policy, wait_s = self.grads.round_policy
            rounds.outer_step(m.step, "wait" if policy == "restart" else policy, wait_s)
        self.m_compute.inc(compute)
        self.log.info("step committed", extra={"sid": self.cfg.sid, "step": m.step})
        sent = self.grads.link.bytes - self.bytes_reported  # this step's, both calls together
        self.bytes_reported = self.grads.link.bytes
        return {"steps": self.steps_done, "compute_s": compute, "dp_bytes": sent}

    def abort(self, m: msg.Abort) -> dict[str, Any]:
        """Move to a newer epoch: the step in progress fails, held frames are dropped."""
        if m.epoch < self.epoch:
            raise BadRequest(f"fenced: epoch {m.epoch} is older than {self.epoch}")
        self.inbox.advance(m.epoch)
        self.peers.forget()  # a replaced peer has a new address
        self.log.info("moved to epoch %d", m.epoch, extra={"sid": self.cfg.sid})
        return {"epoch": m.epoch}

    def assume(self, m: msg.Assume) -> dict[str, Any]:
        """A spare takes a stage over: builds its layers, registers under its SID and epoch."""
        if not self.cfg.spare:
            raise BadRequest("only a spare can assume a stage")
        try:
            cfg = WorkerConfig(**m.config)
            TransformerSpec.model_validate(cfg.model)
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"bad worker config: {exc}") from None
        if cfg.spare or cfg.token != self.cfg.token:
            raise BadRequest("the config must be a stage of this deployment")
        with self._lock:
            spare_sid = self.cfg.sid
            tls.renew_wire(cfg.tls)  # the stage's leaf (SID@epoch) from now on; the spare's retires
            cpuset.pin(cfg.cpus)  # the stage's node's cores
            try:
                self._build(cfg)
            except ValueError as exc:
                raise BadRequest(f"cannot build the stage: {exc}") from None
            self.inbox.advance(cfg.epoch)
            if self.register().fenced:
                raise BadRequest(f"{cfg.sid} is held by a newer epoch than {cfg.epoch}")
            self.registry.send("Deregister", msg.Deregister(sid=spare_sid), timeout_s=5)
        self.log.info("took over %s", cfg.sid, extra={"sid": cfg.sid, "stage": cfg.stage})
        return {"sid": cfg.sid, "stage": cfg.stage, "epoch": cfg.epoch}

    def health(self, m: msg.Health) -> dict[str, Any]:
        if "hang_health" in self.cfg.faults:  # a stuck worker that still heartbeats (rehearsal)
            time.sleep(float(self.cfg.faults["hang_health"]))
        return {
            "sid": self.cfg.sid,
            "stage": self.cfg.stage,
            "replica": self.cfg.replica,
            "status": "ok",
            "steps": self.steps_done,
            "epoch": self.epoch,
            "sessions": len(self.sessions),
            "device": str(self.device),
            "pid": os.getpid(),
            "metrics": self.metrics_address,
        }

    def save(self, m: msg.Save) -> dict[str, Any]:
        path = Path(m.path)
        if not path.name:
            raise BadRequest("save needs a path")
        root = Path(self.cfg.root).resolve() if self.cfg.root else None
        if root is not None and not path.resolve().is_relative_to(root):
            raise BadRequest(f"save: {path} is outside the deployment directory {root}")
        with self._lock:
            extra = self.sync.state() if self.sync is not None else {}
            args = (self.spec, self.cfg, self.module, self.optimizer, self.steps_done, extra)
            names = tp_worker.write(path, *args, self.experts)  # tp, ep > 1: gathered
        sha = ckpt.checkpoint_sha256(path) if names else ""
        return {"path": str(path), "sha256": sha, "tensors": names}

    def load(self, m: msg.Load) -> dict[str, Any]:
        """Load a checkpoint; one that is missing, fails its hash or cannot be read is refused
        with DATA_LOSS (the caller may try an older one) before anything is loaded."""
        path = Path(m.path)
        try:
            ckpt.verify_checkpoint(path, m.sha256)
            state = ckpt.read_states(path, m.others, ckpt.checkpoint_keys(self.spec, self.module))
            kind = "adamw" if not state.param_groups or "betas" in state.param_groups[0] else "sgd"
            with self._lock:
                if kind != optimizer_kind(self.optimizer):
                    self.optimizer = make_optimizer(kind, self.module, self.cfg.lr)
                args = (self.spec, self.cfg, self.module, self.optimizer)
                self.steps_done = tp_worker.load(state, *args)  # tp > 1: this rank's shard
                self.sync_held = tp_worker.round_state(state, *args[:3])  # tp > 1: cut
                if self.sync is not None:
                    self.sync.restore(self.sync_held)
                self.uncommitted = None
                self.sessions.clear()  # keys and values of the weights replaced
        except ckpt.CheckpointError as exc:
            self.log.warning("refused %s: %s", path, exc, extra={"sid": self.cfg.sid})
            raise DataLost(f"{exc}: {path}") from None
        # what this stage now holds, by the digest its file was checked against
        return {"steps": self.steps_done, "sha256": m.sha256 or ckpt.checkpoint_sha256(path)}

    def methods(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "Push": bytes_handler(self.push),
            **{name: bytes_handler(fn, STREAMED[name]) for name, fn in self.streamed().items()},
            "Draw": message_handler(Draw, lambda m: drawing.run(self.run_step, m, *self.drawn)),
            "Health": message_handler(msg.Health, self.telemetry.reported(self.health)),
            "Save": message_handler(msg.Save, self.save),
            "Load": message_handler(msg.Load, self.load),
            "Abort": message_handler(msg.Abort, self.abort),
            "Assume": message_handler(msg.Assume, self.assume),
            "Commit": message_handler(msg.Commit, self.commit),
            "EndSession": message_handler(msg.EndSession, self.end_session),
            # a shard's list of paths: larger than a control message
            "LoadShard": message_handler(msg.LoadShard, self.load_shard, max_bytes=64 << 20),
        }


def _listed(got: tuple[T, Message]) -> tuple[T, list[Message]]:
    """What came with one frame, and the frame as a list of one."""
    return got[0], [got[1]]
