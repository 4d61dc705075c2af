"""The inbox: frames by (kind, step, micro-batch), fenced by epoch."""

from __future__ import annotations

import threading

import pytest
import torch

from dmsc.runtime.compute.inbox import Aborted, Inbox
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.runtime.transport.wire import Kind


def test_frames_of_another_epoch_are_refused_and_a_move_fails_the_wait() -> None:
    inbox = Inbox(epoch=1)
    inbox.put(Kind.TOKENS, 0, 0, torch.ones(1), epoch=1)
    assert torch.equal(inbox.get(Kind.TOKENS, 0, 0, 1.0), torch.ones(1))
    with pytest.raises(BadRequest, match="fenced"):
        inbox.put(Kind.TOKENS, 0, 1, torch.ones(1), epoch=0)
    with pytest.raises(TimeoutError):
        inbox.get(Kind.TOKENS, 0, 1, 0.05)
    inbox.put(Kind.TOKENS, 0, 2, torch.ones(1), epoch=1)
    threading.Timer(0.1, inbox.advance, args=(2,)).start()
    with pytest.raises(Aborted):
        inbox.get(Kind.TOKENS, 0, 1, 5.0)
    with pytest.raises(TimeoutError):  # the move dropped what was held
        inbox.get(Kind.TOKENS, 0, 2, 0.05)


def test_drop_forgets_only_older_steps_of_the_kind() -> None:
    inbox = Inbox()
    for step in (1, 2):
        inbox.put(Kind.GRAD_PART, step, 1, torch.full((1,), step), epoch=0)
    inbox.put(Kind.GRAD_AVG, 1, 0, torch.zeros(1), epoch=0)
    inbox.drop(Kind.GRAD_PART, before_step=2)
    with pytest.raises(TimeoutError):
        inbox.get(Kind.GRAD_PART, 1, 1, 0.05)
    assert inbox.get(Kind.GRAD_PART, 2, 1, 0.05).item() == 2
    assert inbox.get(Kind.GRAD_AVG, 1, 0, 0.05).item() == 0


def test_a_whole_batch_is_held_as_the_micro_batches_torch_chunk_cuts() -> None:
    inbox, x = Inbox(), torch.arange(10).reshape(5, 2)
    inbox.put(Kind.TOKENS, 3, 0, x, epoch=0, parts=2)
    for i, part in enumerate(x.chunk(2)):
        assert torch.equal(inbox.get(Kind.TOKENS, 3, i, 0.05), part)
    with pytest.raises(BadRequest, match="a batch of 3 rows cut into 4 micro-batches"):
        inbox.put(Kind.TOKENS, 4, 0, x[:3], epoch=0, parts=4)  # chunk gives 3 parts
    with pytest.raises(TimeoutError):  # nothing of a refused batch is held
        inbox.get(Kind.TOKENS, 4, 0, 0.05)
