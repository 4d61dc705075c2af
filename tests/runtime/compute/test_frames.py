"""What a frame must hold at a stage: the check refuses every other tensor, with the reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dmsc.runtime.compute.frames import FrameSpec, check_frame, expected_frame, finite
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.runtime.transport.wire import Kind

FIRST = FrameSpec(stage=0, first=True, last=False, seq=8, vocab=16, hidden=4, n_params=10)
LAST = FrameSpec(stage=1, first=False, last=True, seq=8, vocab=16, hidden=4, n_params=6)
TIED = FrameSpec(
    stage=1, first=False, last=True, seq=8, vocab=16, hidden=4, n_params=6, tied_rows=16
)
# tp = 2, the vocabulary split: the stage holds (and swaps the gradient of) 8 of the 16 rows
TIED_SHARE = FrameSpec(
    stage=1, first=False, last=True, seq=8, vocab=16, hidden=4, n_params=6, tied_rows=8
)


def _ids(*shape: int, value: int = 3) -> torch.Tensor:
    return torch.full(shape, value, dtype=torch.int64)


@pytest.mark.parametrize(
    ("at", "kind", "tensor"),
    [
        (FIRST, Kind.TOKENS, _ids(2, 8)),
        (FIRST, Kind.TOKENS, _ids(1, 1, value=15)),
        (FIRST, Kind.GRADIENT, torch.zeros(2, 5, 4)),
        (FIRST, Kind.GRAD_PART, torch.zeros(10)),
        (FIRST, Kind.GRAD_AVG, torch.zeros(0)),  # an empty average: the leader's restart
        (LAST, Kind.TARGETS, _ids(2, 8, value=0)),
        (LAST, Kind.ACTIVATION, torch.zeros(1, 8, 4)),
        (LAST, Kind.GRAD_AVG, torch.zeros(6)),
        (TIED, Kind.TIED_GRAD, torch.zeros(16, 4)),
        (TIED_SHARE, Kind.TIED_GRAD, torch.zeros(8, 4)),
    ],
)
def test_frames_a_stage_takes_pass(at: FrameSpec, kind: Kind, tensor: torch.Tensor) -> None:
    check_frame(at, kind, tensor)


@pytest.mark.parametrize(
    ("at", "kind", "tensor", "why"),
    [
        (FIRST, Kind.TOKENS, torch.zeros(2, 8), "torch.float32"),  # wrong dtype
        (FIRST, Kind.TOKENS, _ids(2, 3, 4), "(2, 3, 4)"),  # wrong shape
        (FIRST, Kind.TOKENS, _ids(1, 9), "1..8"),  # longer than the sequence
        (FIRST, Kind.TOKENS, _ids(0, 8), "(0, 8)"),  # an empty batch
        (FIRST, Kind.TOKENS, _ids(1, 8, value=16), "below 16"),  # past the vocabulary
        (FIRST, Kind.TOKENS, _ids(1, 8, value=-100), "below 16"),  # -100 is not a token
        (LAST, Kind.TARGETS, _ids(1, 8, value=-1), "below 16"),
        (LAST, Kind.ACTIVATION, torch.zeros(1, 8, 5), "4]"),  # wrong width
        (FIRST, Kind.GRAD_PART, torch.zeros(7), "[10]"),  # another stage's gradient
        (FIRST, Kind.GRAD_PART, torch.zeros(0), "[10]"),  # only an average may be empty
        (FIRST, Kind.ACTIVATION, torch.zeros(1, 8, 4), "does not take activations"),
        (FIRST, Kind.TARGETS, _ids(1, 8), "does not take targets"),
        (LAST, Kind.TOKENS, _ids(1, 8), "does not take tokens"),
        (LAST, Kind.GRADIENT, torch.zeros(1, 8, 4), "does not take gradients"),
        (LAST, Kind.TIED_GRAD, torch.zeros(16, 4), "shares no embedding"),
        (TIED, Kind.TIED_GRAD, torch.zeros(4, 16), "[16, 4]"),  # transposed
        (TIED_SHARE, Kind.TIED_GRAD, torch.zeros(16, 4), "[8, 4]"),  # the whole matrix
    ],
)
def test_other_frames_are_refused_with_the_reason(
    at: FrameSpec, kind: Kind, tensor: torch.Tensor, why: str
) -> None:
    with pytest.raises(BadRequest, match=f"stage {at.stage}") as info:
        check_frame(at, kind, tensor)
    assert why in str(info.value)


def test_expected_frame_describes_what_is_taken() -> None:
    assert expected_frame(FIRST, Kind.TOKENS) == (torch.int64, "[batch, 1..8] token ids below 16")
    assert expected_frame(LAST, Kind.ACTIVATION) == (torch.float32, "[batch, 1..8, 4]")
    assert expected_frame(LAST, Kind.GRAD_PART) == (torch.float32, "[6]")


@pytest.mark.parametrize(
    ("values", "why"),
    [
        ([float("nan"), 1.0], "NaN"),
        ([float("inf"), 1.0], "infinite"),
        ([float("-inf"), 1.0], "infinite"),
        ([float("inf"), float("-inf")], "NaN"),  # their sum is NaN
    ],
)
def test_activations_and_gradients_with_a_value_not_finite_are_refused(
    values: list[float], why: str
) -> None:
    t = torch.zeros(1, 8, 4)
    t.view(-1)[: len(values)] = torch.tensor(values)
    for at, kind in ((LAST, Kind.ACTIVATION), (FIRST, Kind.GRADIENT)):
        with pytest.raises(BadRequest, match="NaN or infinite"):
            check_frame(at, kind, t)
    assert not finite(t), why


def test_finite_values_whose_sum_overflows_pass() -> None:
    t = torch.full((1, 8, 4), 3e38)  # each finite, their sum past float32's largest
    assert not torch.isfinite(t.sum())
    check_frame(LAST, Kind.ACTIVATION, t)
    assert finite(t)


def test_at_tp_2_an_activation_or_gradient_frame_holds_one_ranks_half_of_the_hidden() -> None:
    """Each rank sends the next stage its slice of the hidden dimension (``pp_shards``): a
    stage of two ranks takes halves, and refuses the whole, naming the width it takes."""
    last = FrameSpec(stage=1, first=False, last=True, seq=8, vocab=16, hidden=4, n_params=6, tp=2)
    first = FrameSpec(stage=0, first=True, last=False, seq=8, vocab=16, hidden=4, n_params=6, tp=2)
    check_frame(last, Kind.ACTIVATION, torch.zeros(2, 8, 2))
    check_frame(first, Kind.GRADIENT, torch.zeros(2, 8, 2))
    with pytest.raises(BadRequest, match=r"takes torch.float32 \[batch, 1\.\.8, 2\]"):
        check_frame(last, Kind.ACTIVATION, torch.zeros(2, 8, 4))


def test_under_sequence_parallelism_a_frame_may_hold_one_ranks_slice_of_the_sequence() -> None:
    """Between two stages' blocks a training step sends each rank's slice of the sequence,
    whole in the hidden dimension (``sequence_parallel``): taken at half the length; a whole
    sequence of whole width, or a slice at tp = 2 without sequence parallelism, is refused."""
    at = FrameSpec(
        stage=1, first=False, last=True, seq=8, vocab=16, hidden=4, n_params=6, tp=2, sequence=True
    )
    check_frame(at, Kind.ACTIVATION, torch.zeros(2, 4, 4))  # a sequence slice
    check_frame(at, Kind.ACTIVATION, torch.zeros(2, 8, 2))  # a hidden slice (eval, decoding)
    with pytest.raises(BadRequest, match=r"\[batch, 1\.\.8, 2\] or \[batch, 1\.\.4, 4\]"):
        check_frame(at, Kind.ACTIVATION, torch.zeros(2, 8, 4))
    plain = dataclasses.replace(at, sequence=False)
    with pytest.raises(BadRequest):
        check_frame(plain, Kind.ACTIVATION, torch.zeros(2, 4, 4))


def test_the_ranks_slices_are_the_tensor() -> None:
    from dmsc.runtime.compute.pp_shards import shard, whole

    t = torch.arange(2 * 3 * 8, dtype=torch.float32).reshape(2, 3, 8)
    halves = [shard(t, 2, r) for r in range(2)]
    assert all(h.shape == (2, 3, 4) and h.is_contiguous() for h in halves)
    assert torch.equal(torch.cat(halves, dim=-1), t)
    assert shard(t, 1, 0) is t and whole(t, 1) is t
