"""A whole-model stage worker (one replica) under a sync mode, over real gRPC on 127.0.0.1: its
own shard of text, a round's state in its checkpoint, and hostile sync payloads refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from runtime_helpers import first_stage
from safetensors.torch import load_file

from dmsc.runtime.business.registry import REGISTRY_SERVICE, Registry, registry_methods
from dmsc.runtime.compute.checkpoints import optimizer_path
from dmsc.runtime.compute.worker import STAGE_SERVICE, StageWorker
from dmsc.runtime.transport.rpc import Client, serve
from dmsc.runtime.transport.wire import Kind, encode

DILOCO = {"mode": "diloco", "inner_steps": 3}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Client, StageWorker]]:
    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(Registry(ttl_s=60)))
    cfg = first_stage(f"127.0.0.1:{reg_port}", stages=1, last="head", root=str(tmp_path))
    worker = StageWorker(cfg)
    server, port = serve(STAGE_SERVICE, worker.methods())
    c = Client(f"127.0.0.1:{port}", STAGE_SERVICE)
    try:
        yield c, worker
    finally:
        c.close()
        server.stop(0)
        reg_server.stop(0)


def _shard(tmp_path: Path) -> list[str]:
    files = []
    for i in range(2):
        f = tmp_path / f"part{i}.txt"
        f.write_text("def f(x):\n    return x + 1\n" * (40 + i))
        files.append(str(f))
    return files


def test_a_replica_trains_on_its_own_shard_without_being_sent_tokens(served, tmp_path) -> None:  # type: ignore[no-untyped-def]
    client, worker = served
    assert client.call("LoadShard", {"files": _shard(tmp_path)})["bytes"] > 0
    losses = []
    for step in range(3):
        out = client.call(
            "RunStep", {"step": step, "microbatches": 2, "local_batch": 4, "sync": DILOCO}
        )
        client.call("Commit", {"step": step, "outer": step == 2})
        losses.append(out["loss"])
    assert losses[-1] < losses[0]  # the same two lines over and over: learnt at once
    assert worker.sync is not None and worker.sync.rounds == 1


def test_a_missing_shard_file_is_refused_with_its_name(served, tmp_path) -> None:  # type: ignore[no-untyped-def]
    client, _ = served
    with pytest.raises(grpc.RpcError) as info:
        client.call("LoadShard", {"files": [str(tmp_path / "nope.txt")]})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nope.txt" in info.value.details()


def test_a_step_from_local_data_without_a_shard_is_refused(served) -> None:  # type: ignore[no-untyped-def]
    client, _ = served
    with pytest.raises(grpc.RpcError) as info:
        client.call("RunStep", {"step": 0, "microbatches": 1, "local_batch": 2})
    assert "LoadShard" in info.value.details()


def test_the_round_state_travels_in_the_checkpoint(served, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Mid-round (anchor != weights), Save then Load: the anchor and momentum come back."""
    client, worker = served
    client.call("LoadShard", {"files": _shard(tmp_path)})
    for step in range(4):  # a round of 3 (outer step after step 2), then one more inner step
        client.call("RunStep", {"step": step, "microbatches": 1, "local_batch": 2, "sync": DILOCO})
        client.call("Commit", {"step": step, "outer": step == 2})
    assert worker.sync is not None and worker.sync.anchor is not None
    anchor, momentum = worker.sync.anchor.clone(), worker.sync.momentum.clone()  # type: ignore[union-attr]
    path = tmp_path / "ck" / "stage0.safetensors"
    client.call("Save", {"path": str(path)})
    assert "dmsc.sync.anchor" in load_file(str(optimizer_path(path)))
    client.call("RunStep", {"step": 4, "microbatches": 1, "local_batch": 2, "sync": DILOCO})
    client.call("Commit", {"step": 4, "outer": True})  # the anchor moves on
    assert not torch.equal(worker.sync.anchor, anchor)
    client.call("Load", {"path": str(path)})
    assert torch.equal(worker.sync.anchor, anchor)
    assert torch.equal(worker.sync.momentum, momentum)  # type: ignore[arg-type]
    assert worker.sync.rounds == 1


@pytest.mark.parametrize(
    "payload",
    [torch.zeros(10, 10, dtype=torch.uint8), torch.zeros(1 << 24, dtype=torch.float32)],
    ids=["two-dimensional", "too-large"],
)
def test_a_hostile_sync_payload_is_refused(served, payload) -> None:  # type: ignore[no-untyped-def]
    client, _ = served
    with pytest.raises(grpc.RpcError) as info:
        client.raw("Push", encode(Kind.SYNC_PART, 0, 1, payload))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sync_part" in info.value.details()
