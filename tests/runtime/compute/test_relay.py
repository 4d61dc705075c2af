"""The chained inference step's pure parts: the Relay request, the onward step, who chains."""

from __future__ import annotations

import pytest
import torch

from dmsc.runtime.compute import relay
from dmsc.runtime.transport.messages import RunStep
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.runtime.transport.wire import Kind, WireError, encode

STEP = RunStep(step=7, microbatches=1, train=False, epoch=3, relay=[4], session="s", start=5)


def test_a_relay_request_carries_the_step_and_its_activations() -> None:
    x = torch.randn(1, 2, 8)
    m, frame = relay.unpack(relay.pack(STEP, encode(Kind.ACTIVATION, 7, 0, x, 4)), 1 << 20)
    assert m == STEP and frame.epoch == 4 and torch.equal(frame.tensor, x)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x00\x00", "too short"),
        (b"\x00\x00\x10\x00{}", "a step of 4096 bytes in a request of 6"),
        (relay.pack(STEP, b"junk"), "truncated header"),
        (relay.pack(STEP, encode(Kind.TOKENS, 7, 0, torch.ones(1, 2).long())), "a tokens frame"),
        (relay.pack(STEP, encode(Kind.ACTIVATION, 8, 0, torch.ones(1, 2, 8))), "of step 8"),
        (relay.pack(STEP.model_copy(update={"relay": None}), b""), "chained inference step"),
    ],
)  # fmt: skip
def test_a_malformed_relay_request_is_refused_saying_why(data: bytes, why: str) -> None:
    with pytest.raises((BadRequest, WireError), match=why):
        relay.unpack(data, 1 << 20)


def test_a_relay_must_name_every_later_stage_and_not_an_interleaved_one() -> None:
    assert relay.chained(STEP, 1, 3, False)  # stage 1 of 3 calls stage 2
    assert not relay.chained(STEP.model_copy(update={"relay": []}), 2, 3, False)  # the last
    assert not relay.chained(STEP.model_copy(update={"relay": None}), 0, 3, False)
    with pytest.raises(BadRequest, match="1 stages after stage 0"):
        relay.chained(STEP, 0, 3, False)
    with pytest.raises(BadRequest, match="interleaved"):
        relay.chained(STEP, 1, 3, True)
    with pytest.raises(ValueError, match="relay: carried in an inference step"):
        RunStep(step=1, microbatches=1, relay=[0])  # train defaults to True


def test_the_onward_step_is_the_next_stages_within_what_is_left_less_the_margin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the clock stands still: what is left is exact (a loaded machine's preemption between the
    # test's reading and the relay's made "a tenth of 0.1 s" fall out of its 10 ms window)
    monkeypatch.setattr(relay.time, "monotonic", lambda: 1000.0)
    m = STEP.model_copy(update={"relay": [4, 9], "tokens": [[1, 2]], "budget_s": 2.0})
    step, wait_s = relay.onward(m, 1002.0, 60.0)
    assert (step.epoch, step.relay, step.tokens, step.session, step.start) == (4, [9], None, "s", 5)
    assert step.budget_s == wait_s == pytest.approx(2.0 - relay.MARGIN_S)
    _, short = relay.onward(m, 1000.1, 60.0)  # a tenth kept when shorter
    assert short == pytest.approx(0.09)
    assert relay.onward(m, None, 60.0)[1] == 60.0 - relay.MARGIN_S  # no deadline: the wait
    with pytest.raises(TimeoutError, match="budget ran out"):
        relay.onward(m, 999.0, 60.0)
