"""Typed replies (:mod:`dmsc.runtime.transport.replies`): a malformed reply names its field, the
JSON on the wire is what the handler set, and both ends of a real gRPC call go through them."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from dmsc.runtime.transport.messages import RevokeRequest, StatusRequest
from dmsc.runtime.transport.replies import (
    BadReply,
    InferEnd,
    InferPiece,
    InferReply,
    RevokeReply,
    StatusReply,
    parse_reply,
    stream_item,
)
from dmsc.runtime.transport.rpc import Client, message_handler, serve


def _status(**change: Any) -> dict[str, Any]:
    service = {
        "sid": "s0",
        "stage": 0,
        "replica": 0,
        "address": "127.0.0.1:1",
        "health": "ok",
        "pid": 7,
        "node": "local",
        "registered": True,
        "heartbeat_age_s": None,
    }
    return {
        "run": 1,
        "model": "gpt-mini",
        "steps": 0,
        "epoch": 0,
        "services": [service],
        "tasks": [],
        "faults": [],
        "replicas_down": [],
        "spares": [],
        **change,
    }


def test_a_malformed_reply_names_the_field_and_why() -> None:
    bad = _status()
    bad["services"][0]["pid"] = "seven"
    with pytest.raises(BadReply, match=r"bad StatusReply: services\.0\.pid: Input should be"):
        parse_reply(StatusReply, bad)
    with pytest.raises(BadReply, match=r"bad StatusReply: run: Field required"):
        parse_reply(StatusReply, {k: v for k, v in _status().items() if k != "run"})
    with pytest.raises(BadReply, match=r"services\.0\.health"):
        parse_reply(StatusReply, _status(services=[{**bad["services"][0], "health": "fine"}]))
    with pytest.raises(BadReply, match=r"surprise: Extra inputs are not permitted"):
        parse_reply(StatusReply, _status(surprise=1))
    with pytest.raises(BadReply, match="bad StatusReply"):
        parse_reply(StatusReply, b"not json")


def test_the_wire_json_is_what_the_handler_set() -> None:
    """``weights_lost`` only when lost, a plain inference without task-head fields."""
    assert parse_reply(StatusReply, _status()).wire() == _status()
    lost = _status(weights_lost="no checkpoint")
    assert parse_reply(StatusReply, lost).wire() == lost
    plain = {"task": 3, "text": "x", "replica": "replica-0", "seed": 5, "token_ids": [120]}
    plain["model_version"] = None
    reply = parse_reply(InferReply, plain)
    assert reply.wire() == plain and reply.aggregate is None


def test_a_stream_message_is_a_piece_or_the_end() -> None:
    assert stream_item({"text": "ab"}) == InferPiece(text="ab")
    end = stream_item({"done": True, "task": 1, "replica": "heads", "seed": 2, "token_ids": []})
    assert isinstance(end, InferEnd) and end.replica == "heads"
    with pytest.raises(BadReply, match=r"bad InferPiece: text: Field required"):
        stream_item({"txt": "ab"})


def test_both_ends_of_a_call_go_through_the_reply_model() -> None:
    """A handler whose answer does not fit its model sends nothing (a server error naming the
    field); a client reading an untyped server's malformed answer gets BadReply."""

    def revoke(req: RevokeRequest) -> dict[str, Any]:
        return {"revoked": req.key_id} if req.key_id < 100 else {"revoked": "all"}

    methods = {
        "Revoke": message_handler(RevokeRequest, revoke, reply=RevokeReply),
        "Status": message_handler(StatusRequest, lambda _: {"run": 1}),  # no reply model
    }
    server, port = serve("test.Replies", methods)
    client = Client(f"127.0.0.1:{port}", "test.Replies")
    try:
        assert client.ask("Revoke", RevokeRequest(key_id=4), RevokeReply) == RevokeReply(revoked=4)
        with pytest.raises(grpc.RpcError) as err:
            client.ask("Revoke", RevokeRequest(key_id=400), RevokeReply)
        assert err.value.code() == grpc.StatusCode.UNKNOWN
        assert "bad RevokeReply: revoked" in str(err.value.details())
        with pytest.raises(BadReply, match=r"bad StatusReply: model: Field required"):
            client.ask("Status", StatusRequest(), StatusReply)
    finally:
        client.close()
        server.stop(0)
