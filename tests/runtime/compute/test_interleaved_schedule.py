"""The order a stage worker of an interleaved pipeline runs its forwards and backwards is the
order the cost model's replay (``dmsc plan --gantt``, the plan's pipeline time) runs them, and
a stage of several chunks takes the frames its chunks need (issue 31, point 4)."""

from __future__ import annotations

import pytest
import torch

from dmsc.planner.gantt import replay
from dmsc.runtime.compute.executor import hop, step_ops
from dmsc.runtime.compute.frames import FrameSpec, check_frame
from dmsc.runtime.compute.models.chain import build_stage
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.runtime.transport.wire import Kind
from dmsc.spec import resolve_model


@pytest.mark.parametrize(("stages", "chunks"), [(2, 2), (2, 3), (3, 2), (4, 2)])
@pytest.mark.parametrize("microbatches", [1, 3, 4, 5, 8])
def test_the_runtime_runs_the_order_the_cost_model_replays(
    stages: int, chunks: int, microbatches: int
) -> None:
    # uneven stage times and transfers, so that the replay's timing, not a formula, orders it
    fwd = [1.0 + 0.3 * s for s in range(stages)]
    bwd = [2.0 + 0.1 * s for s in range(stages)]
    ops = replay(fwd, bwd, [0.2] * (stages - 1), microbatches, "1f1b", chunks=chunks)
    for s in range(stages):
        replayed = [
            (op.kind, op.microbatch, op.chunk)
            for op in sorted(ops, key=lambda o: o.start)
            if op.stage == s and op.kind in "FB"
        ]
        assert step_ops("1f1b", s, stages, microbatches, True, chunks) == replayed


def test_one_chunk_runs_the_plain_schedules() -> None:
    assert step_ops("1f1b", 0, 2, 3, True) == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("B", 0, 0),
        ("F", 2, 0),
        ("B", 1, 0),
        ("B", 2, 0),
    ]
    assert step_ops("gpipe", 1, 2, 2, True) == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]


def test_forwards_only_go_chunk_by_chunk_in_groups_of_stages() -> None:
    # inference and evaluation: the interleaved table's forwards, the same at every stage
    assert step_ops("1f1b", 1, 2, 3, False, chunks=2) == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("F", 2, 0),
        ("F", 0, 1),
        ("F", 1, 1),
        ("F", 2, 1),
    ]


def test_gpipe_is_refused_for_a_stage_of_chunks() -> None:
    with pytest.raises(ValueError, match="interleaved 1F1B schedule, not gpipe"):
        step_ops("gpipe", 0, 2, 4, True, chunks=2)


def test_a_chunk_sends_to_the_next_virtual_stage() -> None:
    # chunk c of stage s is virtual stage c p + s: the last stage hands on to the first
    assert hop(0, 2, 0, 1) == (1, 0)
    assert hop(1, 2, 0, 1) == (0, 1)
    assert hop(0, 2, 1, -1) == (1, 0)
    assert hop(1, 2, 0, -1) == (0, 0)


def test_a_stage_of_chunks_holds_its_layers_once_and_runs_each_chunk() -> None:
    spec = resolve_model("gpt-mini")
    chunks = [("embedding", "block_0"), ("block_2", "block_2")]
    module = build_stage(spec, 0, *chunks[0], chunks=chunks)
    whole = build_stage(spec, 0, "embedding", "head")
    assert module.names == ["embedding", "block_0", "block_2"]
    assert (module.chunks, module.chunk_first(0), module.chunk_first(1)) == (2, True, False)
    assert not module.chunk_last(1)
    # the same initial weights as the whole model's layers of the same names
    theirs = dict(zip(whole.names, whole.layers, strict=True))
    for name, layer in zip(module.names, module.layers, strict=True):
        for a, b in zip(layer.parameters(), theirs[name].parameters(), strict=True):
            assert torch.equal(a, b)
    x = torch.randn(1, 5, spec.hidden)
    assert torch.equal(module(x, chunk=1), theirs["block_2"](x, None, 0))
    with pytest.raises(ValueError, match="overlap or are out of order"):
        build_stage(spec, 0, "block_2", "block_2", chunks=[("block_2", "block_2"), *chunks])


def test_the_first_stage_of_chunks_takes_activations_and_the_last_gradients() -> None:
    act = torch.zeros(1, 4, 8)
    first = FrameSpec(stage=0, first=True, last=False, seq=16, vocab=32, hidden=8, n_params=1)
    last = FrameSpec(stage=1, first=False, last=True, seq=16, vocab=32, hidden=8, n_params=1)
    with pytest.raises(BadRequest, match="does not take activations"):
        check_frame(first, Kind.ACTIVATION, act)
    with pytest.raises(BadRequest, match="does not take gradients"):
        check_frame(last, Kind.GRADIENT, act)
    for at, kind in ((first, Kind.ACTIVATION), (last, Kind.GRADIENT)):
        check_frame(FrameSpec(**{**at.__dict__, "chunks": 2}), kind, act)
