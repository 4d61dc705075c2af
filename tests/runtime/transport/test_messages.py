"""The typed control messages: one model per RPC, limits defined once, errors that name fields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dmsc.runtime.transport import messages as msg
from dmsc.runtime.transport.rpc import BadRequest, parse


def test_the_gateway_and_the_control_plane_share_the_inference_limit() -> None:
    top = msg.MAX_INFER_TOKENS  # one request model for both doors (tests/.../test_infer_doors)
    assert msg.InferRequest(prompt="x", tokens=top).tokens == top
    with pytest.raises(ValidationError):
        msg.InferRequest(prompt="x", tokens=top + 1)


def test_a_bad_message_is_refused_with_every_field_and_reason() -> None:
    with pytest.raises(BadRequest) as err:
        parse(msg.RunStep, b'{"step": -1, "microbatches": 0, "shedule": "1f1b"}')
    text = str(err.value)
    assert text.startswith("bad RunStep: ")
    for field in ("step", "microbatches", "shedule"):
        assert f"{field}: " in text


@pytest.mark.parametrize("payload", [b"[1, 2]", b"not json", b'{"epoch": "one"}'])
def test_malformed_bodies_are_bad_requests(payload: bytes) -> None:
    with pytest.raises(BadRequest):
        parse(msg.Abort, payload)


def test_a_prompt_with_a_lone_surrogate_is_refused() -> None:
    with pytest.raises(BadRequest, match="prompt: "):  # pydantic refuses it as a str
        parse(msg.InferRequest, {"prompt": "\ud800", "tokens": 1})
    with pytest.raises(BadRequest):  # and its JSON parser refuses it outright
        parse(msg.InferRequest, b'{"prompt": "\\ud800", "tokens": 1}')
    assert parse(msg.InferRequest, '{"prompt": "\u00e9t\u00e9", "tokens": 1}'.encode()).tokens == 1


def test_a_step_carries_only_its_own_training_commit() -> None:
    from dmsc.runtime.transport.messages import Commit, RunStep

    assert RunStep(step=3, microbatches=1, commit=Commit(step=3, lr=0.1)).commit is not None
    for bad in (
        {"step": 3, "microbatches": 1, "commit": {"step": 4}},
        {"step": 3, "microbatches": 1, "train": False, "eval": True, "commit": {"step": 3}},
    ):
        with pytest.raises(ValidationError, match="commit: this training step's own"):
            RunStep.model_validate(bad)
