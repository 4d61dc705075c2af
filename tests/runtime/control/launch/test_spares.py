"""Which warm spares take a tensor-parallel group over (no processes: the choice alone;
tests/integration/test_tensor_parallel_deployment.py takes a group over with real spares)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dmsc.runtime.control.launch.spares import on_one_node


def _spare(sid: str, datacenter: str, node: str | None) -> Any:
    process = SimpleNamespace(node=node) if node is not None else SimpleNamespace()
    return SimpleNamespace(config=SimpleNamespace(sid=sid, datacenter=datacenter), process=process)


def _sids(picked: list[Any] | None) -> list[str] | None:
    return None if picked is None else [h.config.sid for h in picked]


def test_a_group_is_taken_over_by_spares_of_one_node_of_its_datacenter() -> None:
    # Ray spread the spares over nodes: the first two of dc-0 are on different nodes, so a
    # group of two takes two of one node (it took the first two, across nodes, before)
    pool = [
        _spare("s1", "dc-0", "a"),
        _spare("s2", "dc-0", "b"),
        _spare("s3", "dc-1", "b"),
        _spare("s4", "dc-0", "b"),
        _spare("s5", "dc-0", "a"),
    ]
    assert _sids(on_one_node(pool, 2, "dc-0")) == ["s1", "s5"]
    assert _sids(on_one_node(pool[1:], 2, "dc-0")) == ["s2", "s4"]
    assert on_one_node(pool[:3], 2, "dc-0") is None  # none holds two: new processes
    assert _sids(on_one_node(pool[:3], 2, None)) == ["s2", "s3"]  # any datacenter will do
    assert on_one_node(pool, 4, "dc-0") is None


def test_local_spares_share_this_machine() -> None:
    pool = [_spare(f"s{i}", "local", None) for i in range(3)]
    assert _sids(on_one_node(pool, 3, None)) == ["s0", "s1", "s2"]
