"""Both doors of an inference request take one request (issue 30, must-have 2): the control
plane's ``Infer`` call (gRPC, what ``dmsc infer`` sends) and the gateway's ``POST /v1/infer``
accept the same fields, refuse the same bad requests in the same words, and the one field a door
cannot serve (``redundant`` through the control plane's call) is refused there, saying why.
The refusals need no worker; what the fields do is checked on a control plane with real ones."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from runtime_helpers import control_plane, local_plan

from dmsc.data.db import Database
from dmsc.runtime.business.auth import create_key
from dmsc.runtime.business.gateway import create_app
from dmsc.runtime.control.plane import ControlPlane
from dmsc.runtime.control.serving.infer_calls import REDUNDANT
from dmsc.runtime.transport.messages import CONTROL_SERVICE
from dmsc.runtime.transport.rpc import Client, serve

Doors = tuple[ControlPlane, Client, TestClient, dict[str, str]]


@contextmanager
def _doors(cp: ControlPlane) -> Iterator[Doors]:
    server, port = serve(CONTROL_SERVICE, cp.methods())
    client = Client(f"127.0.0.1:{port}", CONTROL_SERVICE, timeout_s=60)
    gateway = TestClient(create_app(cp, cp.db, cp.queue))
    key = create_key(cp.db, "alice", ["infer", "read"])[1]
    try:
        yield cp, client, gateway, {"Authorization": f"Bearer {key}"}
    finally:
        client.close()
        server.stop(grace=0)


@pytest.fixture
def doors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Doors]:
    """No worker started: every request here is refused before one would be asked."""
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    cp = ControlPlane(local_plan(), Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}"))
    cp.stopped.set()
    try:
        with _doors(cp) as d:
            yield d
    finally:
        cp.deployment.shutdown()


def _rpc_refusal(client: Client, body: dict[str, Any]) -> str:
    with pytest.raises(grpc.RpcError) as info:
        client.call("Infer", body)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(info.value.details())


def _http_refusal(gateway: TestClient, auth: dict[str, str], body: dict[str, Any]) -> str:
    r = gateway.post("/v1/infer", json=body, headers=auth)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    if isinstance(detail, str):  # the control plane's check
        return detail
    # a field the request's model refuses: FastAPI's form of the same model's reason (a
    # reason about the whole body has no field: the control plane's explain says "body")
    return "; ".join(f"{'.'.join(map(str, d['loc'][1:])) or 'body'}: {d['msg']}" for d in detail)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "tokens": 0},
        {"prompt": "x", "tokens": 1025},
        {"prompt": ""},
        {"prompt": "x", "aggregate": "mean"},
        {"prompt": "x", "aggregate": "vote", "redundant": True},
        {"prompt": "x", "timeout_s": 0.01},
        {"prompt": "x", "session": "s" * 257},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "tokenz": 3},
    ],
)
def test_a_bad_field_is_refused_by_both_doors_in_the_same_words(
    doors: Doors, body: dict[str, Any]
) -> None:
    _, client, gateway, auth = doors
    by_gateway = _http_refusal(gateway, auth, body)
    assert _rpc_refusal(client, body) == f"bad InferRequest: {by_gateway}"


def test_aggregate_without_task_heads_is_refused_by_both_in_the_control_planes_words(
    doors: Doors,
) -> None:
    _, client, gateway, auth = doors
    body = {"prompt": "x", "tokens": 1, "aggregate": "vote"}
    said = _http_refusal(gateway, auth, body)
    assert said == _rpc_refusal(client, body)
    assert said.startswith("aggregate: ") and "dp >= 2" in said  # this plan has one replica


def test_every_field_reaches_the_same_place_through_both_doors(tmp_path: Path) -> None:
    with control_plane(local_plan(), tmp_path) as cp, _doors(cp) as (_, client, gateway, auth):
        body = {
            "prompt": "def f(",
            "tokens": 4,
            "temperature": 0.7,
            "top_k": 50,
            "top_p": 0.9,
            "seed": 11,
            "session": "alice-1",
            "timeout_s": 120.0,
        }
        r = gateway.post("/v1/infer", json=body, headers=auth)
        assert r.status_code == 200, r.text
        by_gateway, by_rpc = r.json(), client.call("Infer", body)
        # the same weights, seed and sampling: the same text, on the session's one replica
        assert by_gateway["text"] == by_rpc["text"] and len(by_rpc["token_ids"]) == 4
        assert by_gateway["seed"] == by_rpc["seed"] == 11
        assert by_gateway["replica"] == by_rpc["replica"]
        # racing two replicas is the gateway's: the call refuses it, saying so
        raced = gateway.post("/v1/infer", json={**body, "redundant": True}, headers=auth)
        assert raced.status_code == 200 and raced.json()["text"] == by_rpc["text"]
        assert _rpc_refusal(client, {**body, "redundant": True}) == REDUNDANT
        # a deadline too short for the tokens: both stop at it, in the same words
        late = {**body, "tokens": 1024, "timeout_s": 0.1}
        r = gateway.post("/v1/infer", json=late, headers=auth)
        assert r.status_code == 504 and r.json()["detail"].startswith("no answer within 0.1 s")
        with pytest.raises(grpc.RpcError) as info:
            client.call("Infer", late)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert str(info.value.details()).startswith("no answer within 0.1 s")


# -- a batch of requests as one queued task (dmsc infer --batch, POST /v1/tasks/infer) ----------
def _rpc_batch_refusal(client: Client, body: dict[str, Any]) -> str:
    with pytest.raises(grpc.RpcError) as info:
        client.call("InferBatch", body)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(info.value.details())


def _http_batch_refusal(gateway: TestClient, auth: dict[str, str], body: dict[str, Any]) -> str:
    r = gateway.post("/v1/tasks/infer", json=body, headers=auth)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    if isinstance(detail, str):
        return detail
    return "; ".join(f"{'.'.join(map(str, d['loc'][1:])) or 'body'}: {d['msg']}" for d in detail)


@pytest.mark.parametrize(
    ("body", "plane"),
    [
        ({"requests": []}, False),
        ({"requests": [{"prompt": "x"}, {"prompt": "x", "tokens": 0}]}, False),
        ({"requests": [{"prompt": "x"}], "lane": "fast"}, False),
        ({"requests": [{"prompt": "x"}, {"prompt": "y", "aggregate": "vote"}]}, True),
        ({"requests": [{"prompt": "x", "redundant": True}]}, True),
    ],
)
def test_a_bad_batch_is_refused_by_both_doors_in_the_same_words_before_it_queues(
    doors: Doors, body: dict[str, Any], plane: bool
) -> None:
    cp, client, gateway, auth = doors
    auth = {"Authorization": f"Bearer {create_key(cp.db, 'bob', ['submit'])[1]}"}
    by_gateway = _http_batch_refusal(gateway, auth, body)
    by_rpc = _rpc_batch_refusal(client, body)
    assert by_rpc == (by_gateway if plane else f"bad InferBatch: {by_gateway}")
    if plane:  # the control plane's check names the request and its field
        assert by_rpc.startswith(("requests.1.aggregate: ", "requests.0.redundant: "))
    assert not cp.db.tasks(cp.run.id)


def test_a_batch_queues_as_one_infer_task_and_its_caller_going_away_cancels_it(
    doors: Doors,
) -> None:
    cp, client, gateway, auth = doors
    auth = {"Authorization": f"Bearer {create_key(cp.db, 'bob', ['submit', 'read'])[1]}"}
    body = {"requests": [{"prompt": "x", "tokens": 2}], "priority": 5}
    r = gateway.post("/v1/tasks/infer", json=body, headers=auth)
    assert r.status_code == 202, r.text
    assert r.json()["kind"] == "infer" and r.json()["state"] == "queued"
    with pytest.raises(grpc.RpcError) as info:
        client.call("InferBatch", body, timeout_s=1.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    by_gateway, by_rpc = cp.db.tasks(cp.run.id)
    assert by_gateway.params_json == by_rpc.params_json
    assert (by_gateway.kind, by_gateway.lane, by_gateway.priority) == ("infer", "sync", 5)
    deadline = time.monotonic() + 10
    while cp.db.tasks(cp.run.id)[1].state != "cancelled":
        assert time.monotonic() < deadline, "the InferBatch call's task was not cancelled"
        time.sleep(0.1)
    assert cp.db.tasks(cp.run.id)[0].state == "queued"
