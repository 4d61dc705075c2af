"""A stage worker answers hostile step requests and frames with a reason (issue 29, item 17): a
``RunStep`` that cannot be served is INVALID_ARGUMENT (more micro-batches than samples) or, when
the frames it waits for never come, DEADLINE_EXCEEDED naming them — never a raw ``UNKNOWN:
Exception calling application``; activations or gradients holding NaN or infinity are refused."""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import pytest
import torch
from runtime_helpers import first_stage

from dmsc.runtime.business.registry import REGISTRY_SERVICE, Registry, registry_methods
from dmsc.runtime.compute.frames import FrameSpec, check_frame
from dmsc.runtime.compute.worker import STAGE_SERVICE, StageWorker
from dmsc.runtime.transport.rpc import BadRequest, Client, serve
from dmsc.runtime.transport.wire import Kind, encode


@pytest.fixture
def stage() -> Iterator[Client]:
    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(Registry(ttl_s=60)))
    worker = StageWorker(first_stage(f"127.0.0.1:{reg_port}", recv_timeout_s=5.0))
    server, port = serve(STAGE_SERVICE, worker.methods())
    client = Client(f"127.0.0.1:{port}", STAGE_SERVICE, timeout_s=60)
    try:
        yield client
    finally:
        client.close()
        server.stop(0)
        reg_server.stop(0)


def _code(client: Client, method: str, body: dict | bytes) -> tuple[grpc.StatusCode, str]:  # type: ignore[type-arg]
    with pytest.raises(grpc.RpcError) as info:
        if isinstance(body, bytes):
            client.raw(method, body)
        else:
            client.call(method, body)
    return info.value.code(), info.value.details() or ""


def test_a_run_step_of_4096_micro_batches_without_frames_says_why(stage: Client) -> None:
    code, why = _code(stage, "RunStep", {"step": 1, "microbatches": 4096})
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, why)
    assert "no tokens for step 1 micro-batch 0" in why
    code, why = _code(stage, "RunStep", {"step": 2, "microbatches": 4096, "local_batch": 8})
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "4096 micro-batches of a batch of 8" in why
    # still serving
    assert stage.call("Health", {})["stage"] == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_frame_holding_nan_or_infinity_is_refused(stage: Client, bad: float) -> None:
    grad = torch.zeros(1, 8, 128)
    grad[0, 3, 5] = bad
    code, why = _code(stage, "Push", encode(Kind.GRADIENT, 1, 0, grad))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "NaN or infinite" in why
    at = FrameSpec(stage=1, first=False, last=True, seq=8, vocab=16, hidden=4, n_params=6)
    act = torch.zeros(2, 8, 4)
    act[1, 0, 0] = bad
    with pytest.raises(BadRequest, match="NaN or infinite"):
        check_frame(at, Kind.ACTIVATION, act)
    check_frame(at, Kind.ACTIVATION, torch.zeros(2, 8, 4))  # finite ones pass
