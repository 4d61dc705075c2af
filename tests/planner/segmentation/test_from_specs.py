from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.netmodel import DoesNotFit, estimate_iteration
from dmsc.planner.segmentation.cuts import CyclicBlockGraph
from dmsc.planner.segmentation.from_specs import (
    segment_by_blocks,
    segment_by_business,
    segment_by_layers,
)
from dmsc.spec import BlockGraphSpec, ClusterSpec, JobSpec, SpecError, load_spec, resolve_model
from dmsc.spec.presets import parse_any_model

ROOT = Path(__file__).resolve().parents[3]
VISION = ROOT / "examples" / "models" / "multitask-vision.yaml"


def _vision() -> BlockGraphSpec:
    model = load_spec(BlockGraphSpec, VISION)
    assert isinstance(model, BlockGraphSpec)
    return model


def test_layer_segments_cover_the_model_and_respect_memory(selene: ClusterSpec) -> None:
    model = resolve_model("gpt3-6.7b")
    # standard attention: its s x s scores make the even cut overflow (flash keeps none)
    job = JobSpec(global_batch=64, pp=2, micro_batch=2, attention="standard")
    segments = segment_by_layers(selene, model, job)
    names = [n for s in segments for n in s.members]
    assert names[0] == "embedding" and names[-1] == "head" and len(names) == model.layers + 2
    assert all(s.memory_gib <= 80 for s in segments)
    # The even cut the cost model uses by default overflows the first stage (it holds two
    # micro-batches in flight, the last stage one); the DP's cut fits, and the cost model agrees.
    counts = [sum(1 for n in s.members if n.startswith("block")) for s in segments]
    assert counts[0] < counts[1]
    with pytest.raises(DoesNotFit, match="stage 0"):
        estimate_iteration(selene, model, job)
    recut = estimate_iteration(selene, model, job.model_copy(update={"stage_layers": counts}))
    assert max(s.memory.required for s in recut.stages) <= 80 * 1024**3


def test_block_groups_partition_the_graph(local_cpu: ClusterSpec) -> None:
    segments, method = segment_by_blocks(local_cpu, _vision(), 3)
    members = sorted(n for s in segments for n in s.members)
    assert members == sorted(b.name for b in _vision().blocks)
    assert all(s.members for s in segments)
    assert method in ("exact", "tabu")
    small = BlockGraphSpec.model_validate(
        {
            "kind": "blocks",
            "blocks": [b.model_dump() for b in _vision().blocks[:5]],
            "edges": [list(e) for e in _vision().edges[:4]],
        }
    )
    _, method = segment_by_blocks(local_cpu, small, 2)
    assert method == "exact"


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_block_groups_are_a_chain_and_name_their_inputs(
    local_cpu: ClusterSpec, groups: int
) -> None:
    model = _vision()
    segments, _ = segment_by_blocks(local_cpu, model, groups)
    where = {b: k for k, s in enumerate(segments) for b in s.members}
    assert all(where[a] <= where[b] for a, b in model.edges)
    for k, s in enumerate(segments):
        inputs = sorted({where[a] for a, b in model.edges if where[b] == k and where[a] != k})
        assert s.reads_from == (", ".join(f"group {i}" for i in inputs) or None)
    assert all(s.reads_from for s in segments[1:])


def test_a_cyclic_block_graph_names_its_cycle(local_cpu: ClusterSpec) -> None:
    doc = _vision().model_dump()
    doc["edges"] = [*doc["edges"], ("det_head", "stage4")]
    cyclic = BlockGraphSpec.model_validate(doc)
    with pytest.raises(CyclicBlockGraph, match="stage4 -> det_neck -> det_head -> stage4"):
        segment_by_blocks(local_cpu, cyclic, 2)
    with pytest.raises(CyclicBlockGraph):
        segment_by_business(local_cpu, cyclic)


def test_business_split(local_cpu: ClusterSpec) -> None:
    segments = segment_by_business(local_cpu, _vision())
    assert [s.name for s in segments] == ["backbone", "head:detection", "head:segmentation"]
    assert segments[0].members == ("stem", "stage1", "stage2", "stage3", "stage4")
    assert segments[1].reads_from == "backbone"


def test_block_graph_validation() -> None:
    base = {
        "kind": "blocks",
        "blocks": [
            {
                "name": "a",
                "forward_gflop": 1,
                "params": 1,
                "activation_bytes": 1,
                "output_bytes": 1,
            },
            {
                "name": "b",
                "forward_gflop": 1,
                "params": 1,
                "activation_bytes": 1,
                "output_bytes": 1,
            },
        ],
    }
    with pytest.raises(SpecError, match="unknown block 'c'"):
        parse_any_model({**base, "edges": [["a", "c"]]}, "m.yaml")
    with pytest.raises(SpecError, match="feeds itself"):
        parse_any_model({**base, "edges": [["a", "a"]]}, "m.yaml")
    with pytest.raises(SpecError, match="dmsc segment"):
        from dmsc.spec import parse_model

        parse_model({**base, "edges": []}, "m.yaml")
