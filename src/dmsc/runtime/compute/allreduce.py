"""The data-parallel all-reduce algorithms a plan may choose, run over one gloo process group.

``--allreduce`` names one of the three all-reduces the cost model prices
(:meth:`dmsc.netmodel.comm.CommModel.collective`); the replicas of a stage run the one their
worker configuration names (``WorkerConfig.allreduce``; ``auto``, not resolved by the time it
reaches the worker, is the ring):

- ``ring``: gloo's own ``allreduce`` (:mod:`.dp_collective` launches it directly): in torch 2.13
  ``ProcessGroupGloo`` calls ``gloo::allreduce`` without naming an algorithm, which is gloo's ring
  (a reduce-scatter, then an all-gather);
- ``tree``: a reduce up a binary tree (rank ``i``'s parent is ``(i - 1) // 2``, the cost model's
  tree), then a broadcast down it, cut in segments so that a parent forwards one segment while
  the next comes up: each tree edge carries the buffer once each way. gloo has no such
  all-reduce, and its ``reduce`` and ``broadcast`` are other shapes (gloo's ``reduce.cc`` is a
  ring reduce-scatter then a gather to the root; ``broadcast.cc`` a binomial tree from the
  root), so composing them would move other bytes over other links than the cost model prices;
  the tree is point-to-point ``send``/``recv`` on the group;
- ``hierarchical``: a ring reduce-scatter inside each datacenter, a ring all-reduce of each
  share across the datacenters (member ``i`` of each with member ``i`` of the others), then a
  ring all-gather inside (Horovod's hierarchical all-reduce; the cost model's
  ``_hierarchical``). Where the members do not split into two or more datacenters of equal
  size, more than one member each, the domains are their nodes (the host each worker serves
  on), as the cost model's node level; where neither splits so, it is the ring, as the cost
  model prices it then.

The tree and the hierarchical rings run off the caller's thread (one launch after the other,
in launch order, as gloo runs its collectives), behind a :class:`ThreadWork` that answers as a
gloo work does, so that the buckets' overlap with the backward, the waits and their timeouts
(:meth:`.replica_group.ReplicaGroup.wait`) are the same for every algorithm. A group's launches
share one :class:`LaunchThread` for as long as the group lives: until 2026-12-05 each launch
started a thread of its own, and a step's exchange by the int8 ring (:mod:`.int8_ring`, which
runs the same way) was exposed a median 10.7 ms that way against 8.1 ms on the kept thread,
smaller in each of four pairs alternated, the step 66.4 against 63.3 ms (``dp2-int8``;
``benchmarks/results/parallel_modes_cpu.json#/side_by_side_2026_12_05_launch_thread``).

:func:`link_bytes` says what each member sends to each other member for each algorithm, from the
same chunking the algorithms use: the meter books it by link, and a unit test holds it equal to
the bytes the cost model assumes on each link.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

Algorithm = Literal["ring", "tree", "hierarchical"]
ALGORITHMS: tuple[str, ...] = ("ring", "tree", "hierarchical")
SEGMENT_BYTES = 256 << 10  # the tree's pipelining unit
MAX_SEGMENTS = 1000  # a tree's segments: its tags up and down stay in a launch's range


def algorithm_of(name: str) -> Algorithm:
    """The algorithm a configuration's ``allreduce`` names (``auto``: the ring)."""
    if name in ("auto", "ring"):
        return "ring"
    if name == "tree":
        return "tree"
    if name == "hierarchical":
        return "hierarchical"
    raise ValueError(f"allreduce: {name!r} is not one of auto, {', '.join(ALGORITHMS)}")


def domains_of(places: Sequence[str]) -> list[list[int]] | None:
    """The ranks of each datacenter, in order of their first rank, given each rank's
    datacenter (``places[rank]``); None where the hierarchical all-reduce does not apply
    (one datacenter, unequal sizes, or one member each: the cost model's condition)."""
    by_place: dict[str, list[int]] = {}
    for rank, place in enumerate(places):
        by_place.setdefault(place, []).append(rank)
    domains = list(by_place.values())
    sizes = {len(d) for d in domains}
    if len(domains) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    return domains


def tree_parent(rank: int) -> int | None:
    return (rank - 1) // 2 if rank else None


def tree_children(rank: int, n: int) -> list[int]:
    return [c for c in (2 * rank + 1, 2 * rank + 2) if c < n]


def _split(numel: int, parts: int) -> list[tuple[int, int]]:
    """(offset, length) of ``parts`` near-equal chunks of ``numel`` elements (the first ones
    one element longer where it does not divide), as ``torch.tensor_split`` cuts."""
    base, extra = divmod(numel, parts)
    out, offset = [], 0
    for i in range(parts):
        length = base + (1 if i < extra else 0)
        out.append((offset, length))
        offset += length
    return out


def link_bytes(
    algorithm: Algorithm,
    n: int,
    numel: int,
    element_size: int,
    domains: list[list[int]] | None = None,
) -> dict[tuple[int, int], int]:
    """Bytes rank ``a`` sends rank ``b`` (``(a, b)``) in one all-reduce of ``numel`` elements
    over ``n`` ranks; the hierarchical one over ``domains`` (``ring`` where None)."""
    out: dict[tuple[int, int], int] = {}
    if n < 2 or numel == 0:
        return out

    def add(a: int, b: int, elements: int) -> None:
        out[(a, b)] = out.get((a, b), 0) + elements * element_size

    if algorithm == "tree":
        for rank in range(1, n):
            parent = (rank - 1) // 2
            add(rank, parent, numel)  # up
            add(parent, rank, numel)  # down
        return out
    rings: list[tuple[list[int], int]] = []  # (ring, elements): RS then AG over it, each
    if algorithm == "hierarchical" and domains is not None:
        g = len(domains[0])
        shares = _split(numel, g)
        rings += [(d, numel) for d in domains]
        # member i of each datacenter holds share (i + 1) % g after the reduce-scatter
        rings += [([d[i] for d in domains], shares[(i + 1) % g][1]) for i in range(g)]
    else:
        rings.append((list(range(n)), numel))
    for ring, elements in rings:
        k = len(ring)
        chunks = _split(elements, k)
        for pos, rank in enumerate(ring):
            nxt = ring[(pos + 1) % k]
            # reduce-scatter: every chunk but the one it ends up receiving whole; all-gather:
            # every chunk but the one it is about to receive last
            sent_rs = sum(chunks[(pos - s) % k][1] for s in range(k - 1))
            sent_ag = sum(chunks[(pos + 1 - s) % k][1] for s in range(k - 1))
            add(rank, nxt, sent_rs + sent_ag)
    return out


# -- the algorithms, on a group's point-to-point sends ------------------------------------------
def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()
    works.clear()


def _ring_reduce_scatter(
    pg: Any, chunks: list[torch.Tensor], ring: list[int], pos: int, tag: int
) -> None:
    """Sum ``chunks`` (one per member of ``ring``, in place) so that this member, at ``pos``,
    ends with chunk ``(pos + 1) % k`` whole; each step sends one chunk to the next member and
    adds the one from the previous."""
    k = len(ring)
    nxt, prv = ring[(pos + 1) % k], ring[(pos - 1) % k]
    for s in range(k - 1):
        out, into = chunks[(pos - s) % k], chunks[(pos - s - 1) % k]
        buf = torch.empty_like(into)
        works = [pg.send([out], nxt, tag + s), pg.recv([buf], prv, tag + s)]
        _wait(works)
        into += buf


def _ring_all_gather(
    pg: Any, chunks: list[torch.Tensor], ring: list[int], pos: int, tag: int
) -> None:
    """Hand round the chunks, this member at ``pos`` holding chunk ``(pos + 1) % k`` whole to
    begin with, until every member holds them all."""
    k = len(ring)
    nxt, prv = ring[(pos + 1) % k], ring[(pos - 1) % k]
    for s in range(k - 1):
        out, into = chunks[(pos + 1 - s) % k], chunks[(pos - s) % k]
        _wait([pg.send([out], nxt, tag + s), pg.recv([into], prv, tag + s)])


def _pieces(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    return [flat.narrow(0, o, n) for o, n in _split(flat.numel(), parts)]


def ring_all_reduce(pg: Any, flat: torch.Tensor, ring: list[int], pos: int, tag: int) -> None:
    """Sum ``flat`` over ``ring`` in place: a reduce-scatter, then an all-gather."""
    if len(ring) < 2:
        return
    chunks = _pieces(flat, len(ring))
    _ring_reduce_scatter(pg, chunks, ring, pos, tag)
    _ring_all_gather(pg, chunks, ring, pos, tag + len(ring))


def tree_all_reduce(pg: Any, flat: torch.Tensor, rank: int, n: int, tag: int) -> None:
    """Sum ``flat`` over ranks ``0 .. n - 1`` in place, up and down the binary tree, a segment
    at a time (each segment's sends go on while the next one is reduced)."""
    if n < 2:
        return
    nbytes = flat.numel() * flat.element_size()
    segments = max(1, min(MAX_SEGMENTS, math.ceil(nbytes / SEGMENT_BYTES)))
    segs = _pieces(flat, segments)
    parent, children = tree_parent(rank), tree_children(rank, n)
    bufs = {c: _pieces(torch.empty_like(flat), segments) for c in children}
    ups = {c: [pg.recv([b], c, tag + i) for i, b in enumerate(bufs[c])] for c in children}
    sends: list[Any] = []
    for i, seg in enumerate(segs):
        for c in children:
            ups[c][i].wait()
            seg += bufs[c][i]
        if parent is not None:
            sends.append(pg.send([seg], parent, tag + i))
    _wait(sends)  # the segments went up before the broadcast writes over them
    down = tag + MAX_SEGMENTS
    got = (
        [pg.recv([seg], parent, down + i) for i, seg in enumerate(segs)]
        if parent is not None
        else []
    )
    for i, seg in enumerate(segs):
        if got:
            got[i].wait()
        sends += [pg.send([seg], c, down + i) for c in children]
    _wait(sends)


def hierarchical_all_reduce(
    pg: Any, flat: torch.Tensor, rank: int, domains: list[list[int]], tag: int
) -> None:
    """Sum ``flat`` over the ranks of ``domains`` in place: a ring reduce-scatter inside this
    rank's domain, a ring all-reduce of its share with the same member of the other domains,
    a ring all-gather inside."""
    mine = next(d for d in domains if rank in d)
    pos = mine.index(rank)
    g = len(mine)
    chunks = _pieces(flat, g)
    # the share held whole after the reduce-scatter is chunk (pos + 1) % g, as it is for the
    # member at the same place of every other domain
    share = (pos + 1) % g
    _ring_reduce_scatter(pg, chunks, mine, pos, tag)
    cross = [d[pos] for d in domains]
    ring_all_reduce(pg, chunks[share], cross, cross.index(rank), tag + 2 * g)
    _ring_all_gather(pg, chunks, mine, pos, tag + 2 * g + 2 * len(domains))


def _nothing() -> None:
    pass


class LaunchThread:
    """One daemon thread that runs the launches handed to it (:meth:`submit`) one after the
    other, in order, until :meth:`close`: a group's point-to-point launches (module docstring).
    A launch stuck on a member that never comes holds the thread up to the group's timeout; the
    group is dropped then, and its successor has a thread of its own."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        threading.Thread(target=self._main, daemon=True, name="dp-allreduce").start()

    def _main(self) -> None:
        while (job := self._queue.get()) is not None:
            job()
            del job  # let go of the launch (and its buffer) before waiting for the next

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` after those submitted before it."""
        self._queue.put(job)

    def close(self) -> None:
        """End the thread once the launches submitted so far are over."""
        self._queue.put(None)


class ThreadWork:
    """One launch of a point-to-point algorithm, run after the launch before it (``after``) is
    over, on ``thread`` (else a thread of its own), answering as a gloo work does
    (``get_future``, ``wait``)."""

    def __init__(
        self,
        run: Callable[[], None],
        after: ThreadWork | None,
        thread: LaunchThread | None = None,
    ) -> None:
        self._future: torch.futures.Future[None] = torch.futures.Future()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._after = after
        self._run = run
        if thread is not None:
            thread.submit(self._main)
        else:
            threading.Thread(target=self._main, daemon=True, name="dp-allreduce").start()

    def _main(self) -> None:
        # let go of the launch before and of the buffer once they are used: each launch would
        # otherwise hold every earlier one, and its bucket, for as long as the group lives
        after, self._after = self._after, None
        run, self._run = self._run, _nothing
        try:
            if after is not None:
                after.done.wait()
                if after.error is not None:
                    raise RuntimeError("all-reduce: an earlier bucket's all-reduce failed")
            del after
            run()
            self._future.set_result(None)
        except BaseException as exc:
            self.error = exc
            self._future.set_exception(exc)  # type: ignore[arg-type]  # (a stub mistake)
        finally:
            del run
            self.done.set()

    def get_future(self) -> torch.futures.Future[None]:
        return self._future

    def wait(self) -> None:
        self._future.wait()


def launch(
    pg: Any,
    flat: torch.Tensor,
    algorithm: Algorithm,
    rank: int,
    n: int,
    domains: list[list[int]] | None,
    seq: int,
    after: ThreadWork | None,
    thread: LaunchThread | None = None,
) -> Any:
    """Start summing ``flat`` over the group ``pg`` (rank ``rank`` of ``n``) in place with
    ``algorithm``: gloo's work for the ring, a :class:`ThreadWork` for the others (on
    ``thread``, the group's). ``seq`` is the launch's number in the group (the same on every
    member), which keeps its tags apart from the launch before's."""
    if algorithm == "hierarchical" and domains is None:
        algorithm = "ring"
    if algorithm == "ring":
        return pg.allreduce([flat])
    tag = (seq % 1000) * 4 * MAX_SEGMENTS
    if algorithm == "tree":
        return ThreadWork(lambda: tree_all_reduce(pg, flat, rank, n, tag), after, thread)
    assert domains is not None
    return ThreadWork(lambda: hierarchical_all_reduce(pg, flat, rank, domains, tag), after, thread)
