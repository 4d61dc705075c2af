"""A stage worker: one process serving one replica of one micro-model over gRPC.

It registers itself in the registry (and heartbeats), receives activations, gradients, tokens and
targets as wire frames on ``Push``, and on ``RunStep`` runs its part of a pipeline schedule
(GPipe or 1F1B over the step's micro-batches), sending its outputs straight to the neighbouring
stage's replica of the same data-parallel rank (addresses from the registry, cached). Replicas of
one stage average their gradients with an all-reduce (torch.distributed, gloo: the group of a
stage's replicas is static) before the optimizer step.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from dmsc.business.observe import json_logger, metrics_server
from dmsc.business.registry import REGISTRY_SERVICE
from dmsc.business.rpc import BadRequest, Client, bytes_handler, json_handler, serve
from dmsc.compute.model import build_stage, loss_fn
from dmsc.compute.wire import Kind, WireError, decode, encode
from dmsc.netmodel.schedule import schedule_ops
from dmsc.spec import TransformerSpec

STAGE_SERVICE = "dmsc.Stage"


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
    dp_init: str | None = None
    datacenter: str = "local"
    recv_timeout_s: float = 60.0
    max_message_bytes: int = 64 * 1024 * 1024
    threads: int = 1
    token: str | None = None  # the deployment's service credential
    extra: dict[str, Any] = field(default_factory=dict)


class Inbox:
    """Frames waiting to be consumed, by (kind, step, micro-batch)."""

    def __init__(self) -> None:
        self._items: dict[tuple[int, int, int], torch.Tensor] = {}
        self._cond = threading.Condition()

    def put(self, kind: Kind, step: int, mb: int, tensor: torch.Tensor) -> None:
        with self._cond:
            self._items[(int(kind), step, mb)] = tensor
            self._cond.notify_all()

    def get(self, kind: Kind, step: int, mb: int, timeout_s: float) -> torch.Tensor:
        key = (int(kind), step, mb)
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._items, timeout=timeout_s):
                raise TimeoutError(f"no {kind.name.lower()} for step {step} micro-batch {mb}")
            return self._items.pop(key)


class StageWorker:
    """The state and the RPC methods of one stage replica."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.threads)
        spec = TransformerSpec.model_validate(cfg.model)
        self.module = build_stage(spec, cfg.seed, cfg.first, cfg.last)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=cfg.lr)
        self.inbox = Inbox()
        self.steps_done = 0
        self.registry = Client(cfg.registry, REGISTRY_SERVICE, token=cfg.token)
        self._neighbours: dict[int, Client] = {}
        self._pending: list[tuple[int, bytes, Any]] = []
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
        if cfg.replicas > 1:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=cfg.dp_init, rank=cfg.replica, world_size=cfg.replicas
            )

    # -- neighbours -----------------------------------------------------------------------
    def neighbour(self, stage: int, refresh: bool = False) -> Client:
        if refresh or stage not in self._neighbours:
            found = self.registry.call("Lookup", {"stage": stage, "kind": "stage"})["services"]
            mine = [s for s in found if s["replica"] == self.cfg.replica]
            if not mine:
                raise RuntimeError(f"no live replica {self.cfg.replica} of stage {stage}")
            self._neighbours[stage] = Client(
                mine[0]["address"], STAGE_SERVICE, token=self.cfg.token
            )
        return self._neighbours[stage]

    def send(self, stage: int, kind: Kind, step: int, mb: int, tensor: torch.Tensor) -> None:
        """Send without blocking the schedule (like an isend); :meth:`flush` waits for all."""
        frame = encode(kind, step, mb, tensor)
        self.m_bytes.labels(kind.name.lower()).inc(len(frame))
        self._pending.append((stage, frame, self.neighbour(stage).raw_future("Push", frame)))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for stage, frame, fut in pending:
            try:
                fut.result()
            except Exception:  # the neighbour moved or restarted: ask the registry again, once
                self.neighbour(stage, refresh=True).raw("Push", frame)

    # -- RPC methods -----------------------------------------------------------------------
    def push(self, data: bytes) -> bytes:
        try:
            msg = decode(data, self.cfg.max_message_bytes)
        except WireError as exc:
            self.m_rejected.inc()
            self.log.warning("rejected message: %s", exc, extra={"sid": self.cfg.sid})
            raise BadRequest(str(exc)) from None
        self.inbox.put(msg.kind, msg.step, msg.microbatch, msg.tensor)
        return b""

    def run_step(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            step = int(req["step"])
            m = int(req["microbatches"])
            schedule = str(req.get("schedule", "1f1b"))
            train = bool(req.get("train", True))
            evaluate = bool(req.get("eval", False))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"bad RunStep request: {exc}") from None
        if m <= 0 or schedule not in ("gpipe", "1f1b"):
            raise BadRequest("microbatches must be positive and schedule gpipe or 1f1b")
        with self._lock:
            return self._run(step, m, schedule, train, evaluate)

    def _run(
        self, step: int, m: int, schedule: str, train: bool, evaluate: bool = False
    ) -> dict[str, Any]:
        cfg, mod = self.cfg, self.module
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
                    x = self.inbox.get(Kind.TOKENS, step, i, cfg.recv_timeout_s)
                else:
                    x = self.inbox.get(Kind.ACTIVATION, step, i, cfg.recv_timeout_s)
                    x.requires_grad_(train)
                c0 = time.perf_counter()
                with torch.set_grad_enabled(train):
                    y = mod(x)
                    if mod.is_last and (train or evaluate):
                        targets = self.inbox.get(Kind.TARGETS, step, i, cfg.recv_timeout_s)
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
                    grad = self.inbox.get(Kind.GRADIENT, step, i, cfg.recv_timeout_s)
                c0 = time.perf_counter()
                outputs[i].backward(grad)
                compute += time.perf_counter() - c0
                if not mod.is_first:
                    grad_in = inputs[i].grad
                    assert grad_in is not None
                    self.send(cfg.stage - 1, Kind.GRADIENT, step, i, grad_in)
                del inputs[i], outputs[i]
        self.flush()
        if train:
            c0 = time.perf_counter()
            if cfg.replicas > 1:
                import torch.distributed as dist

                for p in mod.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad /= cfg.replicas
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            compute += time.perf_counter() - c0
            self.steps_done += 1
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
        if mod.is_last:
            out["loss"] = sum(losses.values()) / m if losses else None
            if not train and not evaluate:
                out["logits"] = last_logits
        return out

    def health(self, req: dict[str, Any]) -> dict[str, Any]:
        return {
            "sid": self.cfg.sid,
            "stage": self.cfg.stage,
            "replica": self.cfg.replica,
            "status": "ok",
            "steps": self.steps_done,
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
            self.steps_done = int(state["steps"])
        return {"steps": self.steps_done}

    def methods(self) -> dict[str, Any]:
        return {
            "Push": bytes_handler(self.push),
            "RunStep": json_handler(self.run_step),
            "Health": json_handler(self.health),
            "Save": json_handler(self.save),
            "Load": json_handler(self.load),
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
    record = {
        "sid": cfg.sid,
        "kind": "stage",
        "stage": cfg.stage,
        "replica": cfg.replica,
        "address": worker.address,
        "datacenter": cfg.datacenter,
    }
    reply = worker.registry.call("Register", record)
    ttl = float(reply.get("ttl_s", 10.0))
    print(f"READY {worker.address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(ttl / 3):
        try:
            if not worker.registry.call("Heartbeat", {"sid": cfg.sid}, timeout_s=5)["known"]:
                worker.registry.call("Register", record)
        except Exception:
            if os.getppid() == 1:  # the control plane is gone and so is our parent
                break
    # Leave the registry on the way out (a kill -9 leaves it to the TTL).
    with contextlib.suppress(Exception):
        worker.registry.call("Deregister", {"sid": cfg.sid}, timeout_s=2)
    server.stop(grace=1)
    sys.exit(0)


if __name__ == "__main__":
    main()
