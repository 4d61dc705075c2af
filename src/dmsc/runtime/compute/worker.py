"""A stage worker process: one process serving one replica of one micro-model over gRPC.

Run as ``python -m dmsc.runtime.compute.worker --config FILE`` (the launcher writes FILE from a
:class:`WorkerConfig`). The process serves ``dmsc.Stage`` (:class:`StageWorker`, see
:mod:`.server`), registers itself in the registry and heartbeats until it is stopped (SIGTERM),
fenced, or orphaned. It tells its launcher on standard output how the start went, one line:
``READY HOST:PORT`` once it serves, or ``FENCED SID epoch N`` (exit status 3) when the registry
already holds its SID at a newer epoch. Its JSON log lines go to ``log_file`` when the config
names one (rotated, see :mod:`dmsc.runtime.transport.logs`), to standard error otherwise.
Besides the stage's methods it serves ``Renew``: the control plane's next leaf certificate for
this process (:func:`dmsc.runtime.transport.tls.renew`), sent before the one it holds expires.

The rest of the worker lives in one module per job: :mod:`.inbox` (frames waiting, fencing by
epoch), :mod:`.peers` (sends to the neighbouring stages), :mod:`.frames` (what a frame must
hold), :mod:`.executor` (one step's schedule), :mod:`.gradient_sync` (averaging between
replicas, late-gradient policy: by all-reduce in :mod:`.dp_collective`, each step's replicas
agreed in :mod:`.quorum`), :mod:`.checkpoints`, :mod:`.telemetry` (CPU, memory, I/O and GPU
use of the process and its node) and :mod:`.server` (the RPC methods).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import grpc

from dmsc.runtime.compute import host_memory, sealing
from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.compute.server import StageWorker
from dmsc.runtime.transport import processes, tls
from dmsc.runtime.transport.logs import file_logger
from dmsc.runtime.transport.messages import STAGE_SERVICE, Deregister, Heartbeat, Renew
from dmsc.runtime.transport.observe import json_logger, metrics_server
from dmsc.runtime.transport.replies import HeartbeatReply
from dmsc.runtime.transport.rpc import BadRequest, message_handler, serve

__all__ = ["STAGE_SERVICE", "StageWorker", "WorkerConfig", "main"]


def _logger(cfg: WorkerConfig) -> logging.Logger:
    """The worker's logger: JSON lines to ``cfg.log_file`` (rotated) or to standard error."""
    name = f"dmsc.worker.{cfg.sid}"
    return file_logger(name, Path(cfg.log_file)) if cfg.log_file else json_logger(name)


def owner_gone(owner: int) -> bool:
    """Has the process that launched this worker exited? (0: its parent, gone once this
    process belongs to init.) A zombie counts as gone: its parent may not have reaped it yet."""
    if owner <= 0:
        return os.getppid() == 1
    return not processes.alive(owner)


def renewed(m: Renew) -> dict[str, Any]:
    """Take the control plane's next leaf: new connections, both ways, are made with it."""
    try:
        tls.renew(tls.Leaf.from_wire(m.tls), same_name=True)
    except (KeyError, ValueError) as exc:
        raise BadRequest(f"tls: {exc}") from None
    return {"ok": True}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="dmsc stage worker")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    cfg = WorkerConfig(**json.loads(Path(args.config).read_text()))
    if cfg.die_with_parent and not processes.die_with(cfg.die_with_parent):
        sys.exit(4)  # the process that started us is gone already
    host_memory.keep_freed_memory()  # before the server's threads: one heap, kept (its module)
    # Read by torch's CUDA caching allocator when it first allocates (no CUDA use before this):
    # segments that grow in place rather than leave gaps, which the cost model's memory check
    # assumes (dmsc.netmodel.memory.MemoryBreakdown.required).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if cfg.tls is not None:  # its leaf (SID@epoch): every server and channel is mutual TLS
        tls.install(tls.Leaf.from_wire(cfg.tls))
    if cfg.checkpoint_key is not None:  # checkpoints sealed with the control plane's key
        sealing.install(bytes.fromhex(cfg.checkpoint_key))
    worker = StageWorker(cfg, _logger(cfg))
    at, floors = f"{cfg.host}:0", tls.FENCES  # floors: the registry's, from each heartbeat
    methods = {**worker.methods(), "Renew": message_handler(Renew, renewed)}
    server, port = serve(STAGE_SERVICE, methods, at, token=cfg.token, fences=floors)
    worker.metrics_address = metrics_server(worker.metrics)
    worker.address = f"{cfg.host}:{port}"
    registered = worker.register()
    tls.FENCES.raise_floors(registered.fences)
    if registered.fenced:
        print(f"FENCED {cfg.sid} epoch {cfg.epoch}", flush=True)
        sys.exit(3)
    ttl = registered.ttl_s
    print(f"READY {worker.address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(ttl / 3):
        beat = Heartbeat(sid=worker.cfg.sid, epoch=worker.cfg.epoch)  # a spare may take a stage
        try:
            reply = worker.registry.ask("Heartbeat", beat, HeartbeatReply, timeout_s=5)
            tls.FENCES.raise_floors(reply.fences)  # the leaves of fenced epochs refused here
            if beat.sid != worker.cfg.sid:  # a spare that took a stage over meanwhile
                continue
            if reply.fenced:  # a newer incarnation holds our SID: stop serving
                worker.log.warning("fenced by a newer epoch; exiting", extra=beat.model_dump())
                break
            if not reply.known:
                worker.register()
        except Exception as exc:
            denied = (
                isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.PERMISSION_DENIED
            )
            if denied and beat.sid == worker.cfg.sid:  # (a spare's leaf retires once it took over)
                worker.log.warning("our certificate's epoch is fenced; exiting")
                break
            if owner_gone(worker.cfg.owner_pid):  # the control plane is gone
                break
    # Leave the registry on the way out (a kill -9 leaves it to the TTL).
    with contextlib.suppress(Exception):
        leave = Deregister(sid=worker.cfg.sid, epoch=worker.cfg.epoch)
        worker.registry.send("Deregister", leave, timeout_s=2)
    worker.inbox.advance(-1)  # fail any wait in progress: the handlers return at once
    server.stop(grace=1).wait(2)
    logging.shutdown()
    os._exit(0)  # do not wait for handler threads (a stalled send) to wind down


if __name__ == "__main__":
    main()
