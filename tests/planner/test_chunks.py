"""A plan's chunks are the layers each device holds: every layer in exactly one chunk of exactly
one stage, each chunk a contiguous run of the model's layers, a stage's chunks in the order the
interleaved schedule runs them (virtual stage ``c x pp + s`` is chunk ``c`` of stage ``s``)."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dmsc.netmodel import build_layer_costs
from dmsc.netmodel.iteration import assign_stage_layers
from dmsc.planner.plan import stage_chunks
from dmsc.spec import JobSpec, resolve_model


def _expand(names: list[str], chunk: tuple[str, str]) -> list[str]:
    first, last = chunk
    return names[names.index(first) : names.index(last) + 1]


def test_llama3_70b_interleaved_stage_0_holds_four_chunks_of_its_own() -> None:
    model = resolve_model("llama3-70b")
    job = JobSpec(global_batch=512, pp=4, schedule="interleaved", interleave=4)
    (names, chunks), second = stage_chunks(model, job)[:2]
    assert len(names) == 21
    assert chunks == [
        ("embedding", "block_4"),
        ("block_20", "block_24"),
        ("block_40", "block_44"),
        ("block_60", "block_64"),
    ]
    assert second[1] == [
        ("block_5", "block_9"),
        ("block_25", "block_29"),
        ("block_45", "block_49"),
        ("block_65", "block_69"),
    ]


@settings(max_examples=150, deadline=None)
@given(
    layers=st.integers(1, 48),
    pp=st.integers(1, 8),
    v=st.integers(1, 6),
    ends=st.booleans(),
)
def test_chunks_are_the_layers_each_device_holds(layers: int, pp: int, v: int, ends: bool) -> None:
    assume(layers + (2 if ends else 0) >= pp * v)
    assume(v == 1 or pp > 1)
    model = resolve_model("gpt-mini").model_copy(update={"layers": layers})
    job = JobSpec(
        global_batch=8,
        pp=pp,
        schedule="interleaved" if v > 1 else "1f1b",
        interleave=v,
        split_counts_embedding_and_loss=ends,
    )
    costs = build_layer_costs(model, job)
    names = [lc.name for lc in costs]
    held = assign_stage_layers(costs, job)  # what the cost model prices each device with
    out = stage_chunks(model, job)
    assert len(out) == pp
    for s, (stage_names, chunks) in enumerate(out):
        assert stage_names == [lc.name for lc in held[s]]
        # A stage's chunks hold its layers, each once, and nothing else.
        assert [n for c in chunks for n in _expand(names, c)] == stage_names
        assert len(chunks) == v
    # In the schedule's order (chunk c of every stage, then chunk c + 1) the chunks are the
    # model, every layer once.
    in_order = [n for c in range(v) for s in range(pp) for n in _expand(names, out[s][1][c])]
    assert in_order == names
