"""Which of a stage's pipeline frames hold a rank's slice of the sequence under sequence
parallelism (``tensor_parallel.split_edges``), and where its runs of blocks slice their input
and gather their output (``_block_runs``): one rule that both ends of every frame apply alike,
checked here against the boundaries it must give."""

from __future__ import annotations

import itertools

import pytest

from dmsc.runtime.compute.models.chain import build_stage, layer_names
from dmsc.runtime.compute.tensor_parallel import _block_runs, split_edges
from dmsc.spec import resolve_model

SPEC = resolve_model("gpt-mini")  # 4 blocks: embedding, block_0 .. block_3, head


def _module(chunks: list[tuple[str, str]]):  # type: ignore[no-untyped-def]
    module = build_stage(SPEC, 0, chunks[0][0], chunks[-1][1], chunks=chunks)
    module.split_in, module.split_out = split_edges(module, SPEC.layers)
    return module


@pytest.mark.parametrize(
    ("chunks", "into", "out"),
    [
        ([("embedding", "head")], set(), set()),  # one stage: no frames
        ([("embedding", "block_1")], set(), {0}),  # block_1 -> block_2: a slice
        ([("block_2", "head")], {0}, set()),
        ([("embedding", "block_0"), ("block_3", "head")], {1}, {0}),  # interleaved ends
        ([("block_0", "block_1"), ("block_3", "block_3")], {1}, {0}),  # after the embedding
        ([("embedding", "embedding"), ("head", "head")], set(), set()),
    ],
)
def test_a_frame_is_a_sequence_slice_only_between_two_blocks(
    chunks: list[tuple[str, str]], into: set[int], out: set[int]
) -> None:
    module = _module(chunks)
    assert (set(module.split_in), set(module.split_out)) == (into, out)


def test_both_ends_of_every_cut_agree() -> None:
    """Every way to cut the chain in two: the sender's output is split exactly when the
    receiver's input is."""
    names = layer_names(SPEC)
    for cut in range(1, len(names)):
        a = _module([(names[0], names[cut - 1])])
        b = _module([(names[cut], names[-1])])
        assert (0 in a.split_out) == (0 in b.split_in), names[cut - 1 : cut + 1]
        assert (0 in a.split_out) == (names[cut - 1].startswith("block") and names[cut] != "head")


def test_a_run_slices_and_gathers_only_where_its_frame_is_whole() -> None:
    module = _module([("embedding", "block_1"), ("block_3", "head")])
    runs = _block_runs(module)
    got = [(len(r.blocks), r.sliced, r.gathered) for r in runs]
    assert got == [(2, True, False), (1, False, True)]
    module = _module([("block_1", "block_2")])
    (run,) = _block_runs(module)
    assert (len(run.blocks), run.sliced, run.gathered) == (2, False, False)
    assert list(itertools.chain(run.blocks)) == list(module.layers)
