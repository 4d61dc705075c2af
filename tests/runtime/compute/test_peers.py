"""A stage worker's sends and receives (peers), against a real registry and real gRPC."""

from __future__ import annotations

import socket
import threading
import time

import torch

from dmsc.runtime.business.registry import REGISTRY_SERVICE, Registry, ServiceInfo, registry_methods
from dmsc.runtime.compute.worker import STAGE_SERVICE, StageWorker, WorkerConfig
from dmsc.runtime.transport.rpc import serve
from dmsc.runtime.transport.wire import Kind
from dmsc.spec import resolve_model

SPEC = resolve_model("gpt-mini")


def _dead_address() -> str:
    """An address nobody listens on: a port bound and released."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_send_to_a_replaced_peer_goes_again_while_the_sender_waits() -> None:
    """The sender looked its peer up before the peer was replaced: the frame fails on the dead
    address. It must reach the replacement while the sender waits for the answer to it, not
    only when the step ends (the two would wait on each other until the receive timeout)."""
    reg = Registry(ttl_s=60)
    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(reg))
    common = {"stages": 2, "model": SPEC.model_dump(), "registry": f"127.0.0.1:{reg_port}"}
    common["recv_timeout_s"] = 8.0
    a = StageWorker(WorkerConfig(sid="s0", stage=0, first="embedding", last="block_1", **common))
    b = StageWorker(WorkerConfig(sid="s1", stage=1, first="block_2", last="head", **common))
    b_server, b_port = serve(STAGE_SERVICE, b.methods())
    try:
        reg.register(ServiceInfo(sid="s1", kind="stage", stage=1, address=_dead_address()))
        x = torch.randn(2, 8, SPEC.hidden)
        a.peers.send(1, Kind.ACTIVATION, 0, 0, x)  # to the old, dead address
        time.sleep(0.2)
        reg.register(ServiceInfo("s1", "stage", 1, f"127.0.0.1:{b_port}", epoch=1))

        def answer() -> None:  # b answers the activation with a gradient, as a stage would
            got = b.inbox.get(Kind.ACTIVATION, 0, 0, 10.0)
            a.inbox.put(Kind.GRADIENT, 0, 0, torch.ones_like(got), a.epoch)

        threading.Thread(target=answer, daemon=True).start()
        t0 = time.monotonic()
        grad = a.peers.recv(Kind.GRADIENT, 0, 0)
        assert time.monotonic() - t0 < 5.0  # well within the receive timeout
        assert torch.equal(grad, torch.ones_like(x))
        a.peers.flush()  # the re-sent frame is the one waited for now: nothing left failing
    finally:
        b_server.stop(0)
        reg_server.stop(0)


def test_a_step_moved_past_before_it_ran_fails_at_once() -> None:
    """A RunStep of epoch 0 passes the epoch check, then waits for the worker while an Abort
    moves it to epoch 1 (its orchestrator gave the step up and is recovering). The step must
    fail then, not wait for frames of epoch 1 that never come: it used to wait the whole
    receive timeout (60 s by default, CI's chaos tests of a killed replica) holding the worker,
    and the recovery's Load waited behind it."""
    from dmsc.runtime.compute.inbox import Aborted
    from dmsc.runtime.transport.messages import Abort, RunStep

    reg = Registry(ttl_s=60)
    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(reg))
    registry = f"127.0.0.1:{reg_port}"
    whole = {"first": "embedding", "last": "head", "model": SPEC.model_dump()}
    cfg = WorkerConfig(sid="s0", stage=0, stages=1, registry=registry, recv_timeout_s=20, **whole)
    worker = StageWorker(cfg)
    outcome: list[BaseException | None] = []

    def step() -> None:
        try:
            worker.run_step(RunStep(step=0, microbatches=1, epoch=0))
            outcome.append(None)
        except BaseException as exc:  # what the handler would answer
            outcome.append(exc)

    try:
        with worker._lock:  # another call holds the worker
            runner = threading.Thread(target=step, daemon=True)
            runner.start()
            time.sleep(0.3)  # the step has passed its epoch check and waits for the lock
            worker.abort(Abort(epoch=1))
        t0 = time.monotonic()
        runner.join(15)
        assert outcome and isinstance(outcome[0], Aborted), outcome
        assert time.monotonic() - t0 < 10  # not the 20 s receive timeout
    finally:
        reg_server.stop(0)
