"""Both doors of a training task take one request (issue 30, must-have 2): ``dmsc train``'s Train
call (gRPC) and the gateway's ``POST /v1/tasks`` accept the same fields, refuse the same bad
requests with the same words, and store the same resolved parameters. The control plane is real
(no worker started: its queue's consumers are stopped, so a task stays queued)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from runtime_helpers import local_plan

from dmsc.data.db import Database
from dmsc.runtime.business.auth import create_key
from dmsc.runtime.business.gateway import create_app
from dmsc.runtime.control.plane import ControlPlane
from dmsc.runtime.transport.messages import CONTROL_SERVICE
from dmsc.runtime.transport.rpc import Client, serve

Doors = tuple[ControlPlane, Client, TestClient, dict[str, str]]


@pytest.fixture
def doors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Doors]:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    roots = [tmp_path / "data"]
    roots[0].mkdir()
    cp = ControlPlane(
        local_plan(), Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}"), data_roots=roots
    )
    cp.stopped.set()  # no consumer runs: a task stays queued
    server, port = serve(CONTROL_SERVICE, cp.methods())
    client = Client(f"127.0.0.1:{port}", CONTROL_SERVICE, timeout_s=10)
    gateway = TestClient(create_app(cp, cp.db, cp.queue))
    key = create_key(cp.db, "alice", ["submit", "read"])[1]
    try:
        yield cp, client, gateway, {"Authorization": f"Bearer {key}"}
    finally:
        client.close()
        server.stop(grace=0)
        cp.deployment.shutdown()


def _rpc_refusal(client: Client, body: dict[str, Any]) -> str:
    with pytest.raises(grpc.RpcError) as info:
        client.call("Train", body)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(info.value.details())


def _http_refusal(gateway: TestClient, auth: dict[str, str], body: dict[str, Any]) -> str:
    r = gateway.post("/v1/tasks", json=body, headers=auth)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    if isinstance(detail, str):  # the control plane's check
        return detail
    # a field the request's model refuses: FastAPI's form of the same model's reason
    return "; ".join(f"{'.'.join(map(str, d['loc'][1:]))}: {d['msg']}" for d in detail)


def test_the_same_bad_request_is_refused_by_both_doors_in_the_same_words(
    doors: Doors, tmp_path: Path
) -> None:
    cp, client, gateway, auth = doors
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("x" * 10_000)
    link = tmp_path / "data" / "link.txt"
    link.symlink_to(outside)  # inside by name, outside once followed
    (tmp_path / "data" / "short.txt").write_text("too short")
    bad = [
        {"steps": 1, "data": "/etc"},
        {"steps": 1, "data": str(link)},
        {"steps": 1, "data": "data/short.txt"},
        {"steps": 1, "data": str(tmp_path / "data" / "short.txt")},
        {"steps": 1, "data": str(tmp_path / "data" / "missing")},
        {"steps": 1, "batch": 6, "microbatches": 4},
        {"steps": 3, "warmup_steps": 9},
        {"steps": 1, "dp": 2},  # no cluster spec to re-plan on
    ]
    for body in bad:
        said = _http_refusal(gateway, auth, body)
        assert said and said == _rpc_refusal(client, body), body
    roots = _http_refusal(gateway, auth, bad[0])
    assert str(tmp_path / "data") in roots and "--data-root" in roots
    assert "outside" in _http_refusal(gateway, auth, bad[1])
    assert not cp.db.tasks(cp.run.id)  # refused before a task was made


@pytest.mark.parametrize(
    "body",
    [
        {"steps": 1, "first_step": 5},  # the control plane's own, once a task started
        {"steps": 1, "lane": "fast"},
        {"steps": 1, "priority": 101},
        {"steps": 1, "sync": {"mode": "sometimes"}},
        {"stepz": 1},
    ],
)
def test_a_field_the_request_lacks_or_limits_is_refused_by_both(
    doors: Doors, body: dict[str, Any]
) -> None:
    cp, client, gateway, auth = doors
    by_gateway = _http_refusal(gateway, auth, body)
    by_rpc = _rpc_refusal(client, body)
    assert by_rpc == f"bad TrainRequest: {by_gateway}"
    assert not cp.db.tasks(cp.run.id)


def test_every_field_is_accepted_by_both_doors_and_stored_alike(
    doors: Doors, tmp_path: Path
) -> None:
    cp, client, gateway, auth = doors
    text = tmp_path / "data" / "text.txt"
    text.write_text("def f(x):\n    return x\n" * 400)
    body = {
        "steps": 4,
        "checkpoint_every": 2,
        "late_policy": "skip",
        "grad_wait_s": 2.0,
        "lr": 3e-3,
        "lr_schedule": "cosine",
        "warmup_steps": 1,
        "min_lr_ratio": 0.1,
        "batch": 8,
        "microbatches": 2,
        "seed": 3,
        "data": str(text),
        "sync": {"mode": "every-step", "compress": "int8"},
        "dp": 1,
        "priority": 7,
        "lane": "sync",
    }
    r = gateway.post("/v1/tasks", json=body, headers=auth)
    assert r.status_code == 202, r.text
    # the Train call queues the same task and waits; its caller going away (here: its
    # deadline) cancels it
    with pytest.raises(grpc.RpcError) as info:
        client.call("Train", body, timeout_s=1.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    by_gateway, by_rpc = cp.db.tasks(cp.run.id)
    stored = json.loads(by_gateway.params_json)
    assert stored == json.loads(by_rpc.params_json)
    assert stored["data"] == str(text.resolve()) and stored["sync"]["compress"] == "int8"
    assert "first_step" not in stored
    assert (by_gateway.priority, by_gateway.lane) == (by_rpc.priority, by_rpc.lane) == (7, "sync")
    assert by_gateway.state == "queued"
    deadline = time.monotonic() + 10
    while cp.db.tasks(cp.run.id)[1].state != "cancelled":
        assert time.monotonic() < deadline, "the Train call's task was not cancelled"
        time.sleep(0.1)
