"""Thin links of a layout: each worker's pipeline sends to a stage in another datacenter take
that pair's rate; inside a datacenter, or between a pair not named, there is no limit."""

from __future__ import annotations

from dmsc.runtime.control.launch.layout import StageLayout
from dmsc.spec import TransformerSpec, resolve_model


def test_each_worker_gets_the_rate_of_the_link_to_each_neighbouring_stage() -> None:
    model = resolve_model("gpt-mini")
    assert isinstance(model, TransformerSpec)
    layout = StageLayout(
        model,
        [("embedding", "block_0"), ("block_1", "block_2"), ("block_3", "head")],
        replicas=2,
        datacenters={(0, 0): "a", (1, 0): "b", (2, 0): "b", (0, 1): "a", (1, 1): "a", (2, 1): "c"},
        link_mbps={("b", "a"): 10.0, ("a", "c"): 50.0},
    )
    assert layout.pp_link_mbps(0, 0, 3) == {"1": 10.0}  # a -> b, named the other way round
    assert layout.pp_link_mbps(1, 0, 3) == {"0": 10.0}  # b -> b to stage 2: the same fabric
    assert layout.pp_link_mbps(2, 0, 3) == {}
    assert layout.pp_link_mbps(1, 1, 3) == {"2": 50.0}
    assert layout.pp_link_mbps(0, 1, 3) == {}


def test_an_interleaved_last_stage_hands_on_to_the_first_over_their_link() -> None:
    model = resolve_model("gpt-mini")
    assert isinstance(model, TransformerSpec)
    chunks = [
        [("embedding", "block_0"), ("block_2", "block_2")],
        [("block_1", "block_1"), ("block_3", "head")],
    ]
    plain = StageLayout(model, [("embedding", "block_1"), ("block_2", "head")], pp_gloo=True)
    layout = StageLayout(
        model,
        [c[0] for c in chunks],
        chunks=chunks,
        datacenters={(0, 0): "a", (1, 0): "b"},
        link_mbps={("a", "b"): 10.0},
    )
    assert layout.pp_link_mbps(0, 0, 2) == {"1": 10.0}
    assert layout.pp_link_mbps(1, 0, 2) == {"0": 10.0}
    fields = layout.stage_fields(1)
    layers = {"first": "block_1", "last": "block_1", "chunks": [list(c) for c in chunks[1]]}
    direct = {"pp_group": False, "pp_stream": False}  # two datacenters
    assert fields == {**layers, "allreduce": "auto", **direct}
    assert plain.stage_fields(1) == {
        "first": "block_2", "last": "head", "chunks": [], "allreduce": "auto", "pp_group": True,
        "pp_stream": False,  # gloo's group asked for: it comes first
    }  # fmt: skip


def test_a_pipeline_meets_in_a_gloo_group_only_inside_one_datacenter() -> None:
    model = resolve_model("gpt-mini")
    assert isinstance(model, TransformerSpec)
    ranges = [("embedding", "block_1"), ("block_2", "head")]
    dcs = {(0, 0): "a", (1, 0): "a", (0, 1): "a", (1, 1): "b"}
    split = StageLayout(model, ranges, replicas=2, datacenters=dcs, pp_gloo=True)
    assert [split.pp_group(r) for r in range(2)] == [True, False]
    assert split.pp_groups()
    assert not StageLayout(model, ranges, pp_stream=False).pp_groups()  # gRPC where asked for
    assert not StageLayout(model, [("embedding", "head")], pp_gloo=True).pp_groups()  # one stage


def test_a_pipeline_sends_over_streams_only_inside_one_datacenter_and_gloo_comes_first() -> None:
    """And the workers listen for step calls there (a single stage's too)."""
    model = resolve_model("gpt-mini")
    assert isinstance(model, TransformerSpec)
    ranges = [("embedding", "block_1"), ("block_2", "head")]
    dcs = {(0, 0): "a", (1, 0): "a", (0, 1): "a", (1, 1): "b"}
    split = StageLayout(model, ranges, replicas=2, datacenters=dcs)  # streams: the default
    assert [split.pp_stream_of(r) for r in range(2)] == [True, False]
    assert split.pp_groups()  # the store is hosted for their addresses
    assert split.stage_fields(0, 0)["pp_stream"] and not split.stage_fields(0, 1)["pp_stream"]
    both = StageLayout(model, ranges, pp_stream=True, pp_gloo=True)
    assert both.pp_group(0) and not both.pp_stream_of(0)
    one = StageLayout(model, [("embedding", "head")])  # a single stage listens for step calls
    assert one.pp_stream_of(0) and one.pp_groups() and one.stage_fields(0)["pp_stream"]


def test_tokens_in_flight_one_a_stage_and_one_drawn_where_order_does_not_matter() -> None:
    """A replica's fair lock is this wide: its stages work on different requests' tokens side
    by side. One where two calls seen in opposite orders would pair the wrong collectives (tp,
    ep) or wait on each other (an interleaved stage's chunks)."""
    model = resolve_model("gpt-mini")
    assert isinstance(model, TransformerSpec)
    three = [("embedding", "block_0"), ("block_1", "block_2"), ("block_3", "head")]
    assert StageLayout(model, three).tokens_in_flight == 4
    assert StageLayout(model, three, replicas=2).tokens_in_flight == 4
    assert StageLayout(model, [("embedding", "head")]).tokens_in_flight == 2
    assert StageLayout(model, three, tp=2).tokens_in_flight == 1
    assert StageLayout(model, three, replicas=2, ep=2).tokens_in_flight == 1
    chunks = [[("embedding", "block_0"), ("block_2", "block_2")],
              [("block_1", "block_1"), ("block_3", "head")]]  # fmt: skip
    two = [("embedding", "block_0"), ("block_1", "block_1")]
    assert StageLayout(model, two, chunks=chunks).tokens_in_flight == 1
