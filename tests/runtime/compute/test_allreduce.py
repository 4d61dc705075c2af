"""The data-parallel all-reduce algorithms over real gloo groups (ranks are threads of this
process, each with its own store client, as workers are), against the plain sum and gloo's own
all-reduce; and the bytes each algorithm puts on each link against the cost model's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dmsc.netmodel import DEFAULT_CALIBRATION, CommModel, Topology
from dmsc.runtime.compute.allreduce import (
    Algorithm,
    LaunchThread,
    ThreadWork,
    algorithm_of,
    domains_of,
    launch,
    link_bytes,
)
from dmsc.spec import ClusterSpec


class _Counting:
    """A group whose point-to-point sends are counted by destination."""

    def __init__(self, pg: Any, rank: int) -> None:
        self.pg, self.rank, self.sent = pg, rank, {}  # type: ignore[var-annotated]

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        t = tensors[0]
        key = (self.rank, dst)
        self.sent[key] = self.sent.get(key, 0) + t.numel() * t.element_size()
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self.pg.recv(tensors, src, tag)

    def allreduce(self, tensors: list[torch.Tensor]) -> Any:
        return self.pg.allreduce(tensors)


def _run(n: int, algorithm: Algorithm, places: list[str], inputs: list[list[torch.Tensor]]):  # type: ignore[no-untyped-def]
    """Each rank's tensors summed with ``algorithm``, one launch after the other as the
    buckets go; and what each rank sent to each other."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    domains = domains_of(places)

    def rank(r: int) -> tuple[list[torch.Tensor], dict[tuple[int, int], int]]:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)  # type: ignore[attr-defined]
        pg = dist.ProcessGroupGloo(
            dist.PrefixStore("g", client),  # type: ignore[attr-defined]
            r,
            n,
            timedelta(seconds=20),
        )
        counting = _Counting(pg, r)
        flats = [t.clone() for t in inputs[r]]
        works: list[Any] = []
        last = None
        for seq, flat in enumerate(flats):
            works.append(launch(counting, flat, algorithm, r, n, domains, seq, last))
            last = works[-1] if isinstance(works[-1], ThreadWork) else None
        for w in works:
            w.wait()
        return flats, counting.sent

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(rank, range(n)))


PLACES = {2: ["a", "b"], 3: ["a", "a", "b"], 4: ["a", "b", "a", "b"], 6: ["a"] * 3 + ["b"] * 3}


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_tree_and_hierarchical_average_as_gloos_ring_and_one_process_do(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    # buckets of several sizes: one element, fewer elements than ranks, a tree of segments
    sizes = [1, n - 1, 1000, 200_003]
    inputs = [[torch.randn(s, generator=g) for s in sizes] for _ in range(n)]
    want = [torch.stack([inputs[r][b] for r in range(n)]).sum(0) for b in range(len(sizes))]
    ring = _run(n, "ring", PLACES[n], inputs)
    for algorithm in ("tree", "hierarchical"):
        got = _run(n, algorithm, PLACES[n], inputs)  # type: ignore[arg-type]
        for (out, _), (ring_out, _) in zip(got, ring, strict=True):
            for o, r, w in zip(out, ring_out, want, strict=True):
                # the averages the replicas apply, against one process's and gloo's ring's
                assert (o / n - w / n).abs().max() < 1e-6
                assert (o / n - r / n).abs().max() < 1e-6
        domains = domains_of(PLACES[n])
        if algorithm == "hierarchical" and domains is None:
            continue  # gloo's ring ran (not counted here)
        # every member sent what link_bytes says, link by link
        sent_all: dict[tuple[int, int], int] = {}
        for _, sent in got:
            sent_all |= sent
        expect: dict[tuple[int, int], int] = {}
        for s in sizes:
            for k, v in link_bytes(algorithm, n, s, 4, domains).items():  # type: ignore[arg-type]
                expect[k] = expect.get(k, 0) + v
        assert sent_all == expect, algorithm


def test_which_members_form_datacenters_and_what_a_name_means() -> None:
    assert domains_of(["a", "b", "a", "b"]) == [[0, 2], [1, 3]]
    assert domains_of(["a", "a", "b"]) is None  # unequal
    assert domains_of(["a", "b"]) is None  # one member each
    assert domains_of(["a", "a"]) is None  # one datacenter
    assert algorithm_of("auto") == "ring" and algorithm_of("tree") == "tree"
    with pytest.raises(ValueError, match="allreduce: 'star'"):
        algorithm_of("star")


def _two_sites(devices: int) -> ClusterSpec:
    node = {"device": "g", "devices": devices, "link": {"bandwidth_gbit_s": 400, "latency_us": 1}}
    return ClusterSpec.model_validate(
        {
            "device_types": {
                "g": {"peak_tflops": {"bf16": 100}, "memory_gib": 80, "memory_bw_gbyte_s": 2000}
            },
            "node_types": {"n": node},
            "datacenters": [
                {
                    "name": name,
                    "nodes": [{"type": "n", "count": 1}],
                    "network": {"gbit_s_per_node": 100, "latency_us": 2},
                }
                for name in ("east", "west")
            ],
            "links": [{"a": "east", "b": "west", "km": 500, "bandwidth_gbit_s": 10}],
        }
    )


@pytest.mark.parametrize("algorithm", ["ring", "tree", "hierarchical"])
@pytest.mark.parametrize("per_site", [1, 2, 3])
def test_the_bytes_booked_on_each_link_are_the_cost_models(algorithm: str, per_site: int) -> None:
    """Replicas on devices of two datacenters: what :func:`link_bytes` books for each pair of
    members, laid on the topology's path between their devices, equals the cost model's bytes
    on every link."""
    topo = Topology(_two_sites(per_site))
    by_dc: dict[str, list[int]] = {}
    for d in topo.devices:
        by_dc.setdefault(str(d.dc), []).append(d.index)
    east, west = by_dc.values()
    group = tuple(x for pair in zip(east, west, strict=True) for x in pair)  # interleaved
    places = [str(topo.devices[d].dc) for d in group]
    n, numel = len(group), 6 * 1024  # divides by every count of members here
    cost = CommModel(topo, DEFAULT_CALIBRATION).collective(
        "all_reduce", [group], numel * 4.0, algorithm
    )
    booked: dict[int, float] = {}
    pairs = link_bytes(algorithm_of(algorithm), n, numel, 4, domains_of(places))
    for (a, b), nbytes in pairs.items():
        for lid, _ in topo.path(group[a], group[b]):
            booked[lid] = booked.get(lid, 0.0) + nbytes
    assert booked == pytest.approx(cost.link_bytes)
    assert sum(pairs.values()) == pytest.approx(cost.bytes_sent)


def test_a_finished_launch_holds_neither_its_bucket_nor_the_launches_before() -> None:
    """Each launch waits for the one before; once over, the last one a group keeps must not
    hold every earlier launch and its bucket for as long as the group lives."""
    import gc
    import weakref

    order: list[int] = []
    buckets = [torch.zeros(1000) for _ in range(3)]
    gone = [weakref.ref(b) for b in buckets]
    last = None
    for i, bucket in enumerate(buckets):
        last = ThreadWork(lambda i=i, b=bucket: order.append(i + int(b.sum())), last)
    assert last is not None
    last.wait()
    last.done.wait()  # set once its thread let go of its bucket
    del buckets, bucket
    gc.collect()
    assert order == [0, 1, 2] and all(ref() is None for ref in gone)


def test_a_groups_launches_run_in_order_on_one_kept_thread_until_it_is_closed() -> None:
    """A group's point-to-point launches share one thread (a thread a launch cost the int8
    ring about a millisecond a step in a worker); each still waits for the one before, a
    failed one fails those after it, and a closed thread ends once its launches are over."""
    import threading

    thread = LaunchThread()
    seen: list[tuple[int, int]] = []
    gate = threading.Event()

    def first() -> None:
        gate.wait(5)
        seen.append((0, threading.get_ident()))

    works = [ThreadWork(first, None, thread)]
    for i in (1, 2):
        works.append(
            ThreadWork(lambda i=i: seen.append((i, threading.get_ident())), works[-1], thread)
        )
    assert not works[-1].done.wait(0.05)  # the second waits behind the first
    gate.set()
    works[-1].wait()
    assert [i for i, _ in seen] == [0, 1, 2] and len({t for _, t in seen}) == 1
    assert seen[0][1] != threading.get_ident()

    def boom() -> None:
        raise RuntimeError("a member left")

    failed = ThreadWork(boom, None, thread)
    after = ThreadWork(lambda: None, failed, thread)
    with pytest.raises(RuntimeError, match="a member left"):
        failed.wait()
    with pytest.raises(RuntimeError, match="an earlier bucket's all-reduce failed"):
        after.wait()
    workers = [t for t in threading.enumerate() if t.ident == seen[0][1]]
    thread.close()
    workers[0].join(5)
    assert not workers[0].is_alive()
