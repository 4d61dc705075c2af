"""Data-parallel averaging as a collective: bucketed gloo all-reduces overlapped with the backward.

Plain data parallelism (no secure aggregation, robust aggregator or central privacy: those keep
the leader's star of :mod:`.gradient_sync`, which is their point) averages a stage's gradients
with a torch.distributed all-reduce among its replicas, as ``DistributedDataParallel`` does:

- the parameters are cut into buckets, last layer first (the order the backward produces their
  gradients; the first bucket small, so that communication starts early). A hook on each
  parameter (``register_post_accumulate_grad_hook``) counts the backward passes that reached it;
  once it has seen every micro-batch's the gradient is whole, and once a bucket's gradients all
  are, the bucket is flattened and its all-reduce launched (asynchronous: the backward goes on),
  buckets always in the same order on every replica, one at a time on the step's communication
  thread. The step waits for the handles before the optimizer's (``Commit``), awake at first
  (:data:`.waiting.DP_SPIN_S`), so only what is left of that queue when the backward ends is
  exposed: the bucket cut and the timeline are the
  cost model's (:mod:`dmsc.netmodel.dp_buckets`);
- the all-reduce is the plan's algorithm (``--allreduce``, ``WorkerConfig.allreduce``; run by
  :mod:`.allreduce`) over the group, on the host: ``ring`` (and ``auto``) is gloo's own (torch
  2.13's ``ProcessGroupGloo`` runs gloo's ring, a reduce-scatter then an all-gather); ``tree``
  a reduce up a binary tree and a broadcast down it, in segments; ``hierarchical`` a ring
  reduce-scatter inside each datacenter (the replicas publish theirs, and their node, in the
  store), a ring all-reduce of each share across the datacenters and a ring all-gather inside;
  by node where the datacenters are not two or more of equal size, and the ring where the
  nodes are not either (as the cost model prices it,
  :meth:`dmsc.netmodel.comm.CommModel.collective`);
- before the first bucket goes, the replicas agree on a quorum (:mod:`.quorum`): who is in this
  step, in which process group (formed again when the quorum changed, under a fresh store
  prefix). A late replica is left out as the late policy says (``skip``: the members average
  their own, re-weighted by their count, and the lowest member sends the average to the late
  one over ``Push``, as the star did; ``restart``: every replica drops the step; ``wait``: the
  step fails past the receive timeout). A collective that fails (a member died: gloo sees the
  socket close) or outlives the receive timeout drops its group, and the step fails; the next
  quorum forms a new group around the replicas that are there. A move to a newer epoch
  (``Abort``) abandons a wait at once.

The same quorum and group average a round's pseudo-gradient for DiLoCo and FedAvg
(:meth:`DataParallel.mean`), gather the top-k payloads that cannot be summed on the way
(:meth:`DataParallel.gathered_mean`) and sum int8 ones re-quantised at each hop
(:meth:`DataParallel.int8_mean`). The bytes a replica puts on its links are its
algorithm's, by peer (:func:`.allreduce.link_bytes`: a ring's 2 (n - 1) / n of each bucket to its
successor, a tree's whole bucket to its parent and to each child), what the cost model
assumes; a thin link (``dp_link_mbps``) books them on the replica's
:class:`~.gradient_sync.LinkShaper` at launch and the step waits for the link too.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dmsc.netmodel.dp_buckets import pack_buckets
from dmsc.runtime.compute.aggregators import summed
from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.compute.inbox import Aborted, Inbox
from dmsc.runtime.compute.int8_ring import int8_ring_all_reduce, sent_bytes
from dmsc.runtime.compute.peers import Peers
from dmsc.runtime.compute.quorum import Decision
from dmsc.runtime.compute.replica_group import ReplicaGroup
from dmsc.runtime.compute.waiting import DP_SPIN_S, awake_until, sleep_until
from dmsc.runtime.transport.messages import LatePolicy
from dmsc.runtime.transport.rpc import Abandoned
from dmsc.runtime.transport.wire import Kind, encode


class StepRestart(Abandoned):
    """The stage's replicas dropped the step (late gradients, policy ``restart``)."""


def buckets_of(
    params: Sequence[torch.nn.Parameter], last: torch.nn.Parameter | None = None
) -> list[list[int]]:
    """Indices of ``params`` in buckets, the last parameter first, packed by the cost model's
    rule (:func:`dmsc.netmodel.dp_buckets.pack_buckets`: the first bucket at most
    ``FIRST_BUCKET_BYTES``, the others ``BUCKET_BYTES``, unless one parameter is more), so that
    what the cost model prices is what runs. ``last`` (a tied weight, whose gradient is complete
    only after the backward) goes alone in the final bucket."""
    order = [i for i in reversed(range(len(params))) if params[i] is not last]
    sizes = [params[i].numel() * params[i].element_size() for i in order]
    out = [[order[j] for j in b] for b in pack_buckets(sizes)]
    if last is not None:
        out.append([next(i for i, p in enumerate(params) if p is last)])
    return out


@dataclass(eq=False)
class _Step:
    """One training step's all-reduces: what the hooks counted and the communication thread
    launched."""

    step: int
    epoch: int
    backwards: int
    policy: LatePolicy
    wait_s: float
    seen: list[int]
    waiting: list[int]
    queued: int = 0  # buckets handed to the communication thread, in order
    decision: Decision | None = None
    pg: Any = None  # the group it agreed on (a later step's may replace the replica's)
    works: list[tuple[int, torch.Tensor, Any]] = field(default_factory=list)
    error: BaseException | None = None
    bytes_until: float = 0.0  # when a thin link is through this step's bytes
    launched: threading.Event = field(default_factory=threading.Event)
    over: bool = False  # finished, or left by a step that failed half-way
    launch: bool = True  # False: the hooks agree on the quorum only (DataParallel.agreed)
    jobs: queue.SimpleQueue[int | None] = field(default_factory=queue.SimpleQueue)


class DataParallel:
    """One replica's side of its stage's all-reduces (see the module docstring). The hooks
    run in the backward; the quorum and the launches run on a communication thread of the
    step's own, so that a replica waiting for its quorum does not hold up its backward (nor,
    through it, the stages before it), and a thread left stuck by a failed step (a rendezvous
    with a member that died) holds up no later step."""

    def __init__(
        self,
        cfg: WorkerConfig,
        params: Sequence[torch.nn.Parameter],
        tied: torch.nn.Parameter | None,
        peers: Peers,
        inbox: Inbox,
        link: Any,
    ) -> None:
        self.cfg, self.peers, self.inbox, self.link = cfg, peers, inbox, link
        self.params = list(params)
        self.group = ReplicaGroup(cfg)
        self.buckets = buckets_of(self.params, tied)
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        for i, p in enumerate(self.params):
            if p is not tied:
                p.register_post_accumulate_grad_hook(self._hook(i))
        self._faults_fired: set[int] = set()
        self.current: _Step | None = None

    @property
    def armed(self) -> bool:
        return self.current is not None and not self.current.over

    def disarm(self) -> None:
        if self.current is not None:
            self.current.over = True

    # -- a training step ---------------------------------------------------------------------
    def begin(
        self, step: int, backwards: int, policy: LatePolicy, wait_s: float, launch: bool = True
    ) -> None:
        """Arm the hooks for ``step``, whose stage runs ``backwards`` backward passes; with
        ``launch`` False they only agree on the step's quorum, once the first bucket's gradients
        are whole, for an exchange run whole after the backward (:meth:`agreed`)."""
        old = self.current
        if old is not None and not old.over:  # a step that failed half-way
            old.over = True
            if old.works:
                self.group.drop()
        seen = [0] * len(self.params)
        waiting = [len(b) for b in self.buckets]
        st = _Step(step, self.inbox.epoch, backwards, policy, wait_s, seen, waiting)
        st.launch = launch
        self.current = st
        threading.Thread(target=self._communicate, args=(st,), daemon=True, name="dp-comm").start()

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def ready(_: torch.Tensor) -> None:
            st = self.current
            if st is None or st.over:
                return
            st.seen[i] += 1
            if st.seen[i] == st.backwards:
                st.waiting[self.bucket_of[i]] -= 1
                self._queue_ready(st)

        return ready

    def _queue_ready(self, st: _Step) -> None:
        """Hand the communication thread every bucket whose gradients are whole, in order."""
        while st.queued < len(self.buckets) and st.waiting[st.queued] == 0:
            st.jobs.put(st.queued)
            st.queued += 1

    def _communicate(self, st: _Step) -> None:
        """The step's communication thread: its quorum, then each bucket's launch in order."""
        while True:
            try:
                b = st.jobs.get(timeout=0.5)
            except queue.Empty:
                if st.over:  # a step that failed half-way
                    return
                continue
            if b is None:
                st.launched.set()
                return
            if st.error is not None or st.over:
                continue
            try:
                self._launch(st, b)
            except BaseException as exc:  # raised by finish()
                st.error = exc

    def _abandoned(self, st: _Step) -> Callable[[], bool]:
        return lambda: st.over or self.inbox.epoch != st.epoch

    def _agree(
        self, st: _Step, key: str, policy: LatePolicy, wait_s: float, gradients: bool
    ) -> Decision:
        bound = self.cfg.recv_timeout_s if policy == "wait" else wait_s
        slow = self.cfg.faults.get("slow_grads", {}) if gradients else {}
        delay = 0.0
        if st.step in slow.get("steps", []) and st.step not in self._faults_fired:
            # a slow link: this replica's gradients reach the others late (once: a step run
            # again is on time); it waits for the quorum's decision meanwhile
            self._faults_fired.add(st.step)
            delay = float(slow.get("seconds", 0.0))
        return self.group.agree(st.epoch, key, policy, bound, self._abandoned(st), delay)

    def _launch(self, st: _Step, b: int) -> None:
        if st.decision is None:
            st.decision = self._agree(st, f"g{st.step}", st.policy, st.wait_s, True)
            st.pg = self.group.pg
        d = st.decision
        if not st.launch:
            return  # the quorum only: the exchange runs whole after the backward (agreed)
        if st.over or d.verdict != "go" or d.rank(self.cfg.replica) is None or len(d.members) < 2:
            return  # nothing to reduce here
        if st.pg is not self.group.pg:  # left since (a later step's begin dropped it)
            raise RuntimeError(f"step {st.step}: its data-parallel group was left")
        flat = torch.cat([self._grad(i).reshape(-1) for i in self.buckets[b]]).cpu()
        self._book(st, flat, d)
        st.works.append((b, flat, self.group.allreduce(flat)))

    def _grad(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _book(self, st: _Step, flat: torch.Tensor, d: Decision) -> None:
        """Count the bytes the algorithm has this replica send each member and book its
        link with them."""
        total = 0
        for rank, nbytes in self.group.sent(flat).items():
            key = (self.cfg.stage, d.members[rank])
            self.peers.sent[key] = self.peers.sent.get(key, 0) + nbytes
            total += nbytes
        st.bytes_until = max(st.bytes_until, self.link.reserve(total))

    def finish(self) -> list[int]:
        """After the backward (and the tied weight's exchange): launch what is left, wait for
        every all-reduce and set each gradient to the average. Returns the replicas left out."""
        st = self.current
        assert st is not None
        # the step's wait from here on: awake at first, where the buckets are gloo's own ring
        # (the other algorithms run on Python threads, whose turns a spinning thread would take)
        spin = DP_SPIN_S if self.group.algorithm == "ring" else 0.0
        awake = time.perf_counter() + spin
        try:
            self._drain(st, spin)
            return self._average(st, awake)
        finally:
            st.over = True

    def _drain(self, st: _Step, spin: float = 0.0) -> None:
        """Hand the step's communication thread every bucket left and wait until it is through
        them (awake for at most ``spin`` seconds first); :class:`Aborted` once abandoned."""
        st.waiting = [0] * len(self.buckets)
        self._queue_ready(st)
        st.jobs.put(None)
        abandoned = self._abandoned(st)
        if spin:
            awake_until(st.launched.is_set, spin)
        while not st.launched.wait(0.05):
            if abandoned():
                raise Aborted(f"step {st.step} abandoned: moved to a newer epoch")

    def agreed(self, step: int) -> tuple[Decision, int] | None:
        """The quorum the hooks agreed on in ``step``'s backward (armed by :meth:`begin` with
        ``launch`` False) and the epoch it was agreed in, once the backward is over; None where
        the hooks were not so armed for ``step`` or no bucket came to agree on it. The step is
        over for the hooks then: the exchange that uses the quorum waits on its own."""
        st = self.current
        if st is None or st.over or st.launch or st.step != step:
            return None
        try:
            self._drain(st)
        finally:
            st.over = True
        if st.error is not None:
            raise st.error
        if st.decision is None:
            return None
        if st.pg is not self.group.pg:  # left since (a later quorum's group replaced it)
            raise RuntimeError(f"step {st.step}: its data-parallel group was left")
        return st.decision, st.epoch

    def _average(self, st: _Step, awake: float = 0.0) -> list[int]:
        """Wait for the step's buckets and set the gradients to their average; awake until the
        ``perf_counter`` time ``awake``."""
        if st.error is not None:
            raise st.error
        d, cfg = st.decision, self.cfg
        assert d is not None
        if d.verdict == "restart":
            late = list(d.late)
            raise StepRestart(f"restart: stage {cfg.stage}, gradients of replicas {late} late")
        if d.verdict == "fail":
            raise TimeoutError(f"stage {cfg.stage}: no gradient from replicas {list(d.late)}")
        if d.rank(cfg.replica) is None:  # late: the members' average comes over Push
            avg = self.peers.recv(Kind.GRAD_AVG, st.step, 0)
            self._assign(range(len(self.params)), avg, copy=True)  # a frame's buffer: copied
            return []
        for b, flat, work in st.works:
            self.group.wait(work, self._abandoned(st), awake - time.perf_counter())
            self._assign(self.buckets[b], flat.div_(len(d.members)))
        sleep_until(st.bytes_until)  # a thin link's turn
        if d.late and d.members[0] == cfg.replica:
            flat = torch.cat([self._grad(i).reshape(-1) for i in range(len(self.params))])
            self._send_late(Kind.GRAD_AVG, st.step, 0, flat.cpu(), d.late)
        return list(d.late)

    def _assign(self, indices: Sequence[int], flat: torch.Tensor, copy: bool = False) -> None:
        """Set the gradients of ``indices`` to their slices of ``flat``, in order: views of it
        where it is on their device and ``copy`` is not asked (a bucket of this step's own, as
        DDP's ``gradient_as_bucket_view``: no pass over the gradients), else copies."""
        offset = 0
        for i in indices:
            p = self.params[i]
            p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.device, copy=copy)
            offset += p.numel()

    def _send_late(
        self, kind: Kind, step: int, mb: int, flat: torch.Tensor, late: Sequence[int]
    ) -> None:
        """Hand the late replicas the members' average (they may be stalled: nobody waits)."""
        frame = encode(kind, step, mb, flat, self.peers.epoch)
        for r in late:
            self.link.take(len(frame))
            self.peers.count(kind, len(frame))
            self.peers.push_detached((self.cfg.stage, r), frame)

    # -- a round of a sync mode ----------------------------------------------------------------
    def mean(
        self,
        step: int,
        round_: int,
        mb: int,
        vector: torch.Tensor,
        policy: LatePolicy,
        wait_s: float,
    ) -> tuple[torch.Tensor, list[int]]:
        """The mean of every replica's ``vector`` (flat, on the host) by all-reduce: the
        members', re-weighted by their count, under ``skip``; a late replica gets it from the
        lowest member (``SYNC_DOWN`` of ``step``, micro-batch ``mb``). Also the replicas left
        out. ``restart`` is not a round's policy: read as ``wait``."""
        st, d = self._round(step, round_, policy, wait_s)
        if d.rank(self.cfg.replica) is None:
            return self.peers.recv(Kind.SYNC_DOWN, step, mb).cpu(), []
        out = vector.clone()
        if len(d.members) > 1:
            self._book(st, out, d)
            self.group.wait(self.group.allreduce(out), self._abandoned(st))
            out /= len(d.members)
            sleep_until(st.bytes_until)
        if d.late and d.members[0] == self.cfg.replica:
            self._send_late(Kind.SYNC_DOWN, step, mb, out, d.late)
        return out, list(d.late)

    def gathered_mean(
        self,
        step: int,
        round_: int,
        payload: torch.Tensor,
        decode: Callable[[torch.Tensor], torch.Tensor],
        policy: LatePolicy,
        wait_s: float,
    ) -> tuple[torch.Tensor, list[int]]:
        """The mean of every replica's vector sent as a codec's ``payload`` that cannot be
        summed on the way (top-k: the replicas keep different indices), by all-gather (gloo's
        ring: each member sends the ``n - 1`` payloads to its successor, as the cost model's
        ``all_gather`` prices it): each member decodes every payload and averages them in
        replica order. The payloads must be equal in size (a codec's are, for one vector
        length). Quorum, late replicas and the thin link as :meth:`mean`."""
        st, d = self._round(step, round_, policy, wait_s)
        rank = d.rank(self.cfg.replica)
        if rank is None:
            return self.peers.recv(Kind.SYNC_DOWN, step, round_).cpu(), []
        parts = [payload]
        if len(d.members) > 1:
            n = len(d.members)
            parts = [torch.empty_like(payload) for _ in range(n)]
            self._to_successor(st, d, rank, (n - 1) * payload.numel() * payload.element_size())
            work = self.group.pg.allgather([parts], [payload.contiguous()])
            self.group.wait(work, self._abandoned(st))
            sleep_until(st.bytes_until)
        out = summed([decode(p) for p in parts]) / len(parts)
        if d.late and d.members[0] == self.cfg.replica:
            self._send_late(Kind.SYNC_DOWN, step, round_, out, d.late)
        return out, list(d.late)

    def int8_mean(
        self,
        step: int,
        round_: int,
        vector: torch.Tensor,
        block: int,
        policy: LatePolicy,
        wait_s: float,
    ) -> tuple[torch.Tensor, list[int]]:
        """The mean of every replica's float32 ``vector`` by the int8 ring, re-quantised at
        each hop in blocks of ``block`` (:mod:`.int8_ring`: the cost model's int8 all-reduce).
        ``vector`` is the caller's to give: the ring sums into it and divides it in place, and
        it is returned (no copy of the update: every caller hands a vector it made for the
        exchange). Quorum, late replicas and the thin link as :meth:`mean`."""
        st, d = self._round(step, round_, policy, wait_s)
        rank = d.rank(self.cfg.replica)
        if rank is None:
            return self.peers.recv(Kind.SYNC_DOWN, step, round_).cpu(), []
        out = vector
        n = len(d.members)
        if n > 1:
            self._to_successor(st, d, rank, sent_bytes(out.numel(), n, block, rank))
            ring = list(range(n))
            work = self.group.run(
                lambda pg, tag: int8_ring_all_reduce(pg, out, ring, rank, tag, block)
            )
            self.group.wait(work, self._abandoned(st))
            out /= n
            sleep_until(st.bytes_until)
        if d.late and d.members[0] == self.cfg.replica:
            self._send_late(Kind.SYNC_DOWN, step, round_, out, d.late)
        return out, list(d.late)

    def _round(
        self, step: int, round_: int, policy: LatePolicy, wait_s: float
    ) -> tuple[_Step, Decision]:
        """The quorum of a sync round (``restart`` is not a round's policy: read as ``wait``);
        TimeoutError when it does not go."""
        policy = "wait" if policy == "restart" else policy
        ahead = self.agreed(step) if round_ == 0 else None  # agreed in the backward
        if ahead is not None:
            d, epoch = ahead
            st = _Step(step, epoch, 0, policy, wait_s, [], [])
        else:
            st = _Step(step, self.inbox.epoch, 0, policy, wait_s, [], [])
            d = self._agree(st, f"r{step}/{round_}", policy, wait_s, False)
        if d.verdict != "go":
            raise TimeoutError(f"stage {self.cfg.stage}: no update from replicas {list(d.late)}")
        return st, d

    def _to_successor(self, st: _Step, d: Decision, rank: int, nbytes: int) -> None:
        """Book a ring's ``nbytes`` to this member's successor on its link."""
        key = (self.cfg.stage, d.members[(rank + 1) % len(d.members)])
        self.peers.sent[key] = self.peers.sent.get(key, 0) + nbytes
        st.bytes_until = self.link.reserve(nbytes)
