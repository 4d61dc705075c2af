"""A stage worker: one process serving one replica of one micro-model over gRPC.

It registers itself in the registry (and heartbeats), receives activations, gradients, tokens and
targets as wire frames on ``Push``, and on ``RunStep`` runs its part of a pipeline schedule
(GPipe or 1F1B over the step's micro-batches), sending its outputs straight to the neighbouring
stage's replica of the same data-parallel rank (addresses from the registry, cached).

Replicas of one stage average their gradients through the stage's leader (replica 0) over the same
``Push`` channel: every replica sends its flattened gradient, the leader waits a bounded time and
sends the average back. A torch.distributed (gloo) all-reduce did this before; it was replaced
because a gloo group is fixed at start: a collective with a dead or late member can only time out
the whole group, it cannot skip the late replica, and admitting a replacement means re-forming the
group on every member. The leader keeps the late-gradient policy in one place (``wait``: no bound
but the step's; ``skip``: average what arrived in time, re-weighted by the count, and send that to
everyone, the late replica included; ``restart``: tell every replica to drop the step, so that the
orchestrator runs it again). Optimizer steps are applied only on ``Commit``, once every stage has
finished the step, so a step that fails anywhere is applied nowhere.

Fencing: each worker serves one epoch (the deployment's generation, carried in every frame and
``RunStep``). ``Abort`` moves a worker to a newer epoch, which wakes and fails the step it is in
and drops frames of older epochs; a worker that the registry reports as fenced (its SID taken by
a newer incarnation) stops serving and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from dmsc.netmodel.schedule import schedule_ops
from dmsc.runtime.compute.models.gpt import build_stage, loss_fn
from dmsc.runtime.transport.messages import REGISTRY_SERVICE, STAGE_SERVICE
from dmsc.runtime.transport.observe import json_logger, metrics_server
from dmsc.runtime.transport.rpc import (
    Abandoned,
    BadRequest,
    Client,
    bytes_handler,
    json_handler,
    serve,
)
from dmsc.runtime.transport.wire import Kind, WireError, decode, encode
from dmsc.spec import TransformerSpec

LATE_POLICIES = ("wait", "skip", "restart")
RESEND_AFTER_S = 0.5  # a receive this long without its frame checks for failed sends


@dataclass
class WorkerConfig:
    """What a worker needs to start (written by the launcher as a JSON file)."""

    sid: str
    stage: int
    stages: int
    model: dict[str, Any]
    first: str
    last: str
    registry: str
    replica: int = 0
    replicas: int = 1
    seed: int = 0
    lr: float = 1e-3
    epoch: int = 0  # the deployment generation this worker was launched in
    spare: bool = False  # a warm spare: registered as such, takes a stage over on ``Assume``
    datacenter: str = "local"
    recv_timeout_s: float = 60.0
    max_message_bytes: int = 64 * 1024 * 1024
    threads: int = 1
    token: str | None = None  # the deployment's service credential
    log_file: str = ""  # JSON log lines go here, rotated (see dmsc.runtime.transport.logs)
    # Fault injection for rehearsals and tests: {"slow_grads": {"steps": [3], "seconds": 2.0}}
    # delivers this replica's gradient to the stage leader late, as a slow link would;
    # {"hang_health": 60} makes Health hang that long while heartbeats go on (a stuck worker).
    faults: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


class Aborted(Abandoned):
    """The step was abandoned: the worker moved to a newer epoch."""


class StepRestart(Abandoned):
    """The stage leader dropped the step (late gradients, policy ``restart``)."""


class Inbox:
    """Frames of the current epoch waiting to be consumed, by (kind, step, micro-batch)."""

    def __init__(self, epoch: int = 0) -> None:
        self._items: dict[tuple[int, int, int], torch.Tensor] = {}
        self._cond = threading.Condition()
        self.epoch = epoch

    def put(self, kind: Kind, step: int, mb: int, tensor: torch.Tensor, epoch: int) -> None:
        with self._cond:
            if epoch != self.epoch:
                raise BadRequest(
                    f"fenced: a frame of epoch {epoch}, this worker is at {self.epoch}"
                )
            self._items[(int(kind), step, mb)] = tensor
            self._cond.notify_all()

    def get(
        self, kind: Kind, step: int, mb: int, timeout_s: float, epoch: int | None = None
    ) -> torch.Tensor:
        """The frame, waiting at most ``timeout_s``; :class:`Aborted` once the inbox leaves
        ``epoch`` (default: the epoch it is at on entry)."""
        key = (int(kind), step, mb)
        with self._cond:
            epoch = self.epoch if epoch is None else epoch
            if not self._cond.wait_for(
                lambda: key in self._items or self.epoch != epoch, timeout=timeout_s
            ):
                raise TimeoutError(f"no {kind.name.lower()} for step {step} micro-batch {mb}")
            if self.epoch != epoch:
                raise Aborted(f"step {step} abandoned: moved to epoch {self.epoch}")
            return self._items.pop(key)

    def advance(self, epoch: int) -> None:
        """Move to ``epoch``: drop every frame held and fail every wait in progress."""
        with self._cond:
            self.epoch = epoch
            self._items.clear()
            self._cond.notify_all()

    def drop(self, kind: Kind, before_step: int) -> None:
        """Forget frames of ``kind`` from steps before ``before_step`` (a late replica's)."""
        with self._cond:
            for key in [k for k in self._items if k[0] == int(kind) and k[1] < before_step]:
                del self._items[key]


class StageWorker:
    """The state and the RPC methods of one stage replica."""

    def __init__(self, cfg: WorkerConfig) -> None:
        torch.set_num_threads(cfg.threads)
        self._build(cfg)
        self.inbox = Inbox(cfg.epoch)
        self._detached: list[Any] = []  # sends nobody waits for
        self.registry = Client(cfg.registry, REGISTRY_SERVICE, token=cfg.token)
        self._pending: list[tuple[tuple[int, int], bytes, Any]] = []
        self._lock = threading.Lock()
        self.address = ""
        self.metrics = CollectorRegistry()
        self.m_steps = Histogram(
            "dmsc_worker_step_seconds", "RunStep wall time", ["mode"], registry=self.metrics
        )
        self.m_compute = Counter(
            "dmsc_worker_compute_seconds_total", "Compute time", registry=self.metrics
        )
        self.m_bytes = Counter(
            "dmsc_worker_bytes_sent_total",
            "Bytes sent to neighbours",
            ["kind"],
            registry=self.metrics,
        )
        self.m_rejected = Counter(
            "dmsc_worker_rejected_messages_total", "Malformed messages", registry=self.metrics
        )
        self.metrics_address = ""
        self.log = json_logger(f"dmsc.worker.{cfg.sid}")

    def _build(self, cfg: WorkerConfig) -> None:
        """The stage this process serves: its layers, optimizer and step state."""
        self.cfg = cfg
        self.spec = TransformerSpec.model_validate(cfg.model)
        self.module = build_stage(self.spec, cfg.seed, cfg.first, cfg.last)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=cfg.lr)
        self.n_params = sum(p.numel() for p in self.module.parameters())
        self.steps_done = 0
        self.uncommitted: int | None = None  # the step whose gradients wait for Commit
        self._faults_fired: set[int] = set()
        self._peers: dict[tuple[int, int], Client] = {}

    @property
    def epoch(self) -> int:
        return self.inbox.epoch

    def record(self) -> dict[str, Any]:
        """This worker's registry record."""
        return {
            "sid": self.cfg.sid,
            "kind": "spare" if self.cfg.spare else "stage",
            "stage": self.cfg.stage,
            "replica": self.cfg.replica,
            "address": self.address,
            "datacenter": self.cfg.datacenter,
            "epoch": self.cfg.epoch,
        }

    def assume(self, req: dict[str, Any]) -> dict[str, Any]:
        """A spare takes a stage over: builds its layers, registers under its SID and epoch."""
        if not self.cfg.spare:
            raise BadRequest("only a spare can assume a stage")
        try:
            cfg = WorkerConfig(**req["config"])
            TransformerSpec.model_validate(cfg.model)
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"bad worker config: {exc}") from None
        if cfg.spare or cfg.token != self.cfg.token:
            raise BadRequest("the config must be a stage of this deployment")
        with self._lock:
            spare_sid = self.cfg.sid
            try:
                self._build(cfg)
            except ValueError as exc:
                raise BadRequest(f"cannot build the stage: {exc}") from None
            self.inbox.advance(cfg.epoch)
            if self.registry.call("Register", self.record()).get("fenced"):
                raise BadRequest(f"{cfg.sid} is held by a newer epoch than {cfg.epoch}")
            self.registry.call("Deregister", {"sid": spare_sid}, timeout_s=5)
        self.log.info("took over %s", cfg.sid, extra={"sid": cfg.sid, "stage": cfg.stage})
        return {"sid": cfg.sid, "stage": cfg.stage, "epoch": cfg.epoch}

    # -- peers ------------------------------------------------------------------------------
    def peer(self, stage: int, replica: int | None = None, refresh: bool = False) -> Client:
        """The client of ``stage``'s replica (ours by default), found in the registry."""
        key = (stage, self.cfg.replica if replica is None else replica)
        if refresh or key not in self._peers:
            found = self.registry.call("Lookup", {"stage": stage, "kind": "stage"})["services"]
            mine = [s for s in found if s["replica"] == key[1]]
            if not mine:
                raise RuntimeError(f"no live replica {key[1]} of stage {stage}")
            self._peers[key] = Client(mine[0]["address"], STAGE_SERVICE, token=self.cfg.token)
        return self._peers[key]

    def send(
        self,
        stage: int,
        kind: Kind,
        step: int,
        mb: int,
        tensor: torch.Tensor,
        replica: int | None = None,
    ) -> None:
        """Send without blocking the schedule (like an isend); :meth:`flush` waits for all."""
        key = (stage, self.cfg.replica if replica is None else replica)
        frame = encode(kind, step, mb, tensor, self.epoch)
        self.m_bytes.labels(kind.name.lower()).inc(len(frame))
        self._pending.append((key, frame, self.peer(*key).raw_future("Push", frame)))

    def flush(self) -> None:
        """Wait for every send; a peer that moved is looked up again (once). Gives up with
        :class:`Aborted` as soon as the worker moves to a newer epoch (a stalled peer must not
        hold the survivors of a failure)."""
        pending, self._pending = self._pending, []
        epoch = self.epoch
        for key, frame, fut in pending:
            while True:
                try:
                    fut.result(timeout=0.05)
                except grpc.FutureTimeoutError:
                    if self.epoch == epoch:
                        continue
                    fut.cancel()
                    raise Aborted("sends abandoned: moved to a newer epoch") from None
                except Exception:  # the peer moved or restarted: ask the registry again
                    self.peer(*key, refresh=True).raw("Push", frame, timeout_s=10)
                break

    def recv(self, kind: Kind, step: int, mb: int) -> torch.Tensor:
        """Wait for a frame of this step. Meanwhile a send that failed because its peer is gone
        (replaced since it was looked up) goes again to the address the registry has now: the
        peer may be waiting for exactly that frame before it sends the one awaited here."""
        epoch = self.epoch
        end = time.monotonic() + self.cfg.recv_timeout_s
        while True:
            left = end - time.monotonic()
            try:
                return self.inbox.get(kind, step, mb, max(0.0, min(RESEND_AFTER_S, left)), epoch)
            except TimeoutError:
                if left <= RESEND_AFTER_S:
                    raise
                self._resend_failed()

    def _resend_failed(self) -> None:
        for n, (key, frame, fut) in enumerate(self._pending):
            if not fut.done() or fut.cancelled():
                continue
            exc = fut.exception()
            if not isinstance(exc, grpc.RpcError) or exc.code() != grpc.StatusCode.UNAVAILABLE:
                continue
            try:
                peer = self.peer(*key, refresh=True)
            except Exception:  # no replacement registered yet: try again on the next round
                continue
            self._pending[n] = (key, frame, peer.raw_future("Push", frame))

    def expected_shape(self, kind: Kind) -> tuple[torch.dtype, str]:
        """What a frame of ``kind`` must hold at this stage (dtype and a shape description);
        raises BadRequest for a kind this stage never receives."""
        mod, spec = self.module, self.spec
        if kind in (Kind.TOKENS, Kind.TARGETS):
            if (kind == Kind.TOKENS and not mod.is_first) or (
                kind == Kind.TARGETS and not mod.is_last
            ):
                raise BadRequest(f"stage {self.cfg.stage} does not take {kind.name.lower()}")
            return torch.int64, f"[batch, 1..{spec.seq}] token ids below {spec.vocab}"
        if kind in (Kind.ACTIVATION, Kind.GRADIENT):
            if (kind == Kind.ACTIVATION and mod.is_first) or (
                kind == Kind.GRADIENT and mod.is_last
            ):
                raise BadRequest(f"stage {self.cfg.stage} does not take {kind.name.lower()}s")
            return torch.float32, f"[batch, 1..{spec.seq}, {spec.hidden}]"
        return torch.float32, f"[{self.n_params}]"

    def check_frame(self, kind: Kind, t: torch.Tensor) -> None:
        """Refuse a tensor of the wrong dtype, shape or range for ``kind`` at this stage."""
        dtype, shape = self.expected_shape(kind)
        spec = self.spec
        ok = t.dtype == dtype
        if ok and kind in (Kind.TOKENS, Kind.TARGETS):
            ok = t.dim() == 2 and t.shape[0] > 0 and 0 < t.shape[1] <= spec.seq
            if kind == Kind.TOKENS and ok:  # -100 is not a token; out-of-range ids are refused
                ok = t.numel() == 0 or (int(t.min()) >= 0 and int(t.max()) < spec.vocab)
            if kind == Kind.TARGETS and ok:
                ok = int(t.min()) >= 0 and int(t.max()) < spec.vocab
        elif ok and kind in (Kind.ACTIVATION, Kind.GRADIENT):
            ok = t.dim() == 3 and t.shape[0] > 0 and 0 < t.shape[1] <= spec.seq
            ok = ok and t.shape[2] == spec.hidden
        elif ok:
            restart = kind == Kind.GRAD_AVG and t.numel() == 0
            ok = t.dim() == 1 and (t.numel() == self.n_params or restart)
        if not ok:
            raise BadRequest(
                f"{kind.name.lower()} of {t.dtype} {tuple(t.shape)} refused: "
                f"stage {self.cfg.stage} takes {dtype} {shape}"
            )

    # -- RPC methods -----------------------------------------------------------------------
    def push(self, data: bytes) -> bytes:
        try:
            msg = decode(data, self.cfg.max_message_bytes)
            self.check_frame(msg.kind, msg.tensor)
            self.inbox.put(msg.kind, msg.step, msg.microbatch, msg.tensor, msg.epoch)
        except (WireError, BadRequest) as exc:
            self.m_rejected.inc()
            self.log.warning("rejected message: %s", exc, extra={"sid": self.cfg.sid})
            raise BadRequest(str(exc)) from None
        return b""

    def abort(self, req: dict[str, Any]) -> dict[str, Any]:
        """Move to a newer epoch: the step in progress fails, held frames are dropped."""
        try:
            epoch = int(req["epoch"])
        except (KeyError, TypeError, ValueError):
            raise BadRequest("Abort needs an integer epoch") from None
        if epoch < self.epoch:
            raise BadRequest(f"fenced: epoch {epoch} is older than {self.epoch}")
        self.inbox.advance(epoch)
        self._peers = {}  # a replaced peer has a new address
        self.log.info("moved to epoch %d", epoch, extra={"sid": self.cfg.sid})
        return {"epoch": epoch}

    def commit(self, req: dict[str, Any]) -> dict[str, Any]:
        """Apply the optimizer step of the gradients the last training RunStep left."""
        try:
            step, epoch = int(req["step"]), int(req.get("epoch", self.epoch))
        except (KeyError, TypeError, ValueError):
            raise BadRequest("Commit needs an integer step") from None
        with self._lock:
            if epoch != self.epoch:
                raise BadRequest(f"fenced: epoch {epoch}, this worker is at {self.epoch}")
            if self.uncommitted != step:
                raise BadRequest(f"nothing to commit for step {step} (have {self.uncommitted})")
            c0 = time.perf_counter()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.uncommitted = None
            self.steps_done += 1
            compute = time.perf_counter() - c0
        self.m_compute.inc(compute)
        self.log.info("step committed", extra={"sid": self.cfg.sid, "step": step})
        return {"steps": self.steps_done, "compute_s": compute}

    def run_step(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            step = int(req["step"])
            m = int(req["microbatches"])
            schedule = str(req.get("schedule", "1f1b"))
            train = bool(req.get("train", True))
            evaluate = bool(req.get("eval", False))
            epoch = int(req.get("epoch", self.epoch))
            policy = str(req.get("late_policy", "wait"))
            grad_wait_s = float(req.get("grad_wait_s", 5.0))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"bad RunStep request: {exc}") from None
        if m <= 0 or schedule not in ("gpipe", "1f1b"):
            raise BadRequest("microbatches must be positive and schedule gpipe or 1f1b")
        if policy not in LATE_POLICIES or not grad_wait_s > 0:
            raise BadRequest(f"late_policy must be one of {LATE_POLICIES}, grad_wait_s positive")
        if epoch != self.epoch:
            raise BadRequest(f"fenced: epoch {epoch}, this worker is at {self.epoch}")
        with self._lock:
            return self._run(step, m, schedule, train, evaluate, policy, grad_wait_s)

    def _run(
        self,
        step: int,
        m: int,
        schedule: str,
        train: bool,
        evaluate: bool = False,
        policy: str = "wait",
        grad_wait_s: float = 5.0,
    ) -> dict[str, Any]:
        cfg, mod = self.cfg, self.module
        self._pending = []  # sends left by an abandoned step are not ours to finish
        if train:  # gradients of a step that was never committed are dropped
            self.optimizer.zero_grad(set_to_none=True)
            self.uncommitted = None
        t0 = time.perf_counter()
        compute = 0.0
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        losses: dict[int, float] = {}
        last_logits: list[list[float]] = []
        mod.train(train)
        ops = (
            schedule_ops(schedule, cfg.stage, cfg.stages, m)
            if train
            else [("F", i) for i in range(m)]
        )
        for op, i in ops:
            if op == "F":
                if mod.is_first:
                    x = self.recv(Kind.TOKENS, step, i)
                else:
                    x = self.recv(Kind.ACTIVATION, step, i)
                    x.requires_grad_(train)
                c0 = time.perf_counter()
                with torch.set_grad_enabled(train):
                    y = mod(x)
                    if mod.is_last and (train or evaluate):
                        targets = self.recv(Kind.TARGETS, step, i)
                        loss = loss_fn(y, targets) / m
                        losses[i] = float(loss.detach()) * m
                        y = loss
                compute += time.perf_counter() - c0
                if train:
                    inputs[i], outputs[i] = x, y
                if mod.is_last and not train and not evaluate:
                    last_logits.extend(y[:, -1, :].tolist())
                if not mod.is_last:
                    self.send(cfg.stage + 1, Kind.ACTIVATION, step, i, y)
            else:
                grad = None
                if not mod.is_last:  # wait for the gradient first: waiting is not compute
                    grad = self.recv(Kind.GRADIENT, step, i)
                c0 = time.perf_counter()
                outputs[i].backward(grad)
                compute += time.perf_counter() - c0
                if not mod.is_first:
                    grad_in = inputs[i].grad
                    assert grad_in is not None
                    self.send(cfg.stage - 1, Kind.GRADIENT, step, i, grad_in)
                del inputs[i], outputs[i]
        self.flush()
        skipped: list[int] = []
        if train:
            if cfg.replicas > 1:
                skipped = self.sync_grads(step, policy, grad_wait_s)
            self.uncommitted = step
        wall = time.perf_counter() - t0
        self.m_steps.labels("train" if train else ("eval" if evaluate else "infer")).observe(wall)
        self.m_compute.inc(compute)
        if train:
            self.log.info(
                "step done",
                extra={"sid": cfg.sid, "step": step, "stage": cfg.stage, "replica": cfg.replica},
            )
        out: dict[str, Any] = {
            "stage": cfg.stage,
            "replica": cfg.replica,
            "compute_s": compute,
            "wall_s": time.perf_counter() - t0,
        }
        if skipped:
            out["skipped_replicas"] = skipped
        if mod.is_last:
            out["loss"] = sum(losses.values()) / m if losses else None
            if not train and not evaluate:
                out["logits"] = last_logits
        return out

    def sync_grads(self, step: int, policy: str, wait_s: float) -> list[int]:
        """Average the gradients of this stage's replicas through replica 0 (the leader).
        Returns the replicas whose gradient was left out (policy ``skip``)."""
        cfg = self.cfg
        params = list(self.module.parameters())
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        late: list[int] = []
        if cfg.replica == 0:
            self.inbox.drop(Kind.GRAD_PART, before_step=step)
            bound = cfg.recv_timeout_s if policy == "wait" else wait_s
            deadline = time.monotonic() + bound
            parts = [flat]
            for r in range(1, cfg.replicas):
                try:
                    left = max(0.0, deadline - time.monotonic())
                    parts.append(self.inbox.get(Kind.GRAD_PART, step, r, left))
                except TimeoutError:
                    late.append(r)
            if late and policy == "wait":
                raise TimeoutError(f"stage {cfg.stage}: no gradient from replicas {late}")
            avg = torch.empty(0) if late and policy == "restart" else torch.stack(parts).mean(0)
            for r in range(1, cfg.replicas):
                frame = encode(Kind.GRAD_AVG, step, 0, avg, self.epoch)
                fut = self.peer(cfg.stage, r).raw_future("Push", frame)
                if r not in late:
                    self._pending.append(((cfg.stage, r), frame, fut))
                else:  # a late replica may be stalled: do not wait on it (but keep the call
                    # alive: a grpc future that is garbage-collected is cancelled)
                    self._detached = [f for f in self._detached if not f.done()] + [fut]
            self.flush()
            if not avg.numel():
                raise StepRestart(f"restart: stage {cfg.stage}, gradients of replicas {late} late")
        else:
            slow = cfg.faults.get("slow_grads", {})
            if step in slow.get("steps", []) and step not in self._faults_fired:
                # A slow link: the gradient reaches the leader ``seconds`` late (once: a step run
                # again is on time). This replica goes on to wait for the average meanwhile.
                self._faults_fired.add(step)
                frame = encode(Kind.GRAD_PART, step, cfg.replica, flat, self.epoch)
                leader = self.peer(cfg.stage, 0)

                def deliver() -> None:
                    with contextlib.suppress(Exception):
                        leader.raw("Push", frame, timeout_s=10)

                threading.Timer(float(slow.get("seconds", 0.0)), deliver).start()
            else:
                self.send(cfg.stage, Kind.GRAD_PART, step, cfg.replica, flat, replica=0)
                self.flush()
            avg = self.recv(Kind.GRAD_AVG, step, 0)
            if not avg.numel():
                raise StepRestart(f"restart: stage {cfg.stage}, the leader dropped step {step}")
        offset = 0
        for p in params:
            p.grad = avg[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        return late

    def health(self, req: dict[str, Any]) -> dict[str, Any]:
        if "hang_health" in self.cfg.faults:  # a stuck worker that still heartbeats (rehearsal)
            time.sleep(float(self.cfg.faults["hang_health"]))
        return {
            "sid": self.cfg.sid,
            "stage": self.cfg.stage,
            "replica": self.cfg.replica,
            "status": "ok",
            "steps": self.steps_done,
            "epoch": self.epoch,
            "pid": os.getpid(),
            "metrics": self.metrics_address,
        }

    def save(self, req: dict[str, Any]) -> dict[str, Any]:
        path = Path(str(req.get("path", "")))
        if not path.name:
            raise BadRequest("save needs a path")
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            torch.save(
                {
                    "model": self.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "steps": self.steps_done,
                },
                path,
            )
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        return {"path": str(path), "sha256": digest}

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        path = Path(str(req.get("path", "")))
        if not path.is_file():
            raise BadRequest(f"no checkpoint at {path}")
        data = path.read_bytes()
        if req.get("sha256") and hashlib.sha256(data).hexdigest() != req["sha256"]:
            raise BadRequest("checkpoint fails its hash")
        with self._lock:
            state = torch.load(path, weights_only=True)
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.optimizer.zero_grad(set_to_none=True)
            self.uncommitted = None
            self.steps_done = int(state["steps"])
        return {"steps": self.steps_done}

    def methods(self) -> dict[str, Any]:
        return {
            "Push": bytes_handler(self.push),
            "RunStep": json_handler(self.run_step),
            "Health": json_handler(self.health),
            "Save": json_handler(self.save),
            "Load": json_handler(self.load),
            "Abort": json_handler(self.abort),
            "Assume": json_handler(self.assume),
            "Commit": json_handler(self.commit),
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="dmsc stage worker")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    cfg = WorkerConfig(**json.loads(Path(args.config).read_text()))
    worker = StageWorker(cfg)
    server, port = serve(STAGE_SERVICE, worker.methods(), token=cfg.token)
    worker.metrics_address = metrics_server(worker.metrics)
    worker.address = f"127.0.0.1:{port}"
    reply = worker.registry.call("Register", worker.record())
    if reply.get("fenced"):
        print(f"FENCED {cfg.sid} epoch {cfg.epoch}", flush=True)
        sys.exit(3)
    ttl = float(reply.get("ttl_s", 10.0))
    print(f"READY {worker.address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(ttl / 3):
        beat = {"sid": worker.cfg.sid, "epoch": worker.cfg.epoch}  # a spare may take a stage
        try:
            reply = worker.registry.call("Heartbeat", beat, timeout_s=5)
            if reply.get("fenced"):  # a newer incarnation holds our SID: stop serving
                worker.log.warning("fenced by a newer epoch; exiting", extra=beat)
                break
            if not reply["known"]:
                worker.registry.call("Register", worker.record())
        except Exception:
            if os.getppid() == 1:  # the control plane is gone and so is our parent
                break
    # Leave the registry on the way out (a kill -9 leaves it to the TTL).
    with contextlib.suppress(Exception):
        beat = {"sid": worker.cfg.sid, "epoch": worker.cfg.epoch}
        worker.registry.call("Deregister", beat, timeout_s=2)
    worker.inbox.advance(-1)  # fail any wait in progress: the handlers return at once
    server.stop(grace=1).wait(2)
    logging.shutdown()
    os._exit(0)  # do not wait for handler threads (a stalled send) to wind down


if __name__ == "__main__":
    main()
