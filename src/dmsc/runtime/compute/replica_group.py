"""This replica's process group with the other replicas of its stage (the same tensor-parallel
rank), formed again for each quorum through the deployment's store, and what runs on it: the
plan's all-reduce (:mod:`.allreduce`), point-to-point algorithms on a thread of their own, the
bytes each member sends, and a wait that a newer epoch or the timeout ends (see
:mod:`.dp_collective`, which uses it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dmsc.runtime.compute.allreduce import (
    MAX_SEGMENTS,
    LaunchThread,
    ThreadWork,
    algorithm_of,
    domains_of,
    launch,
    link_bytes,
)
from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.compute.inbox import Aborted
from dmsc.runtime.compute.quorum import Decision, Quorum
from dmsc.runtime.compute.waiting import awake_until
from dmsc.runtime.transport.messages import LatePolicy

STORE_CONNECT_S = 30.0  # the least time a replica gives its connection to the store


class ReplicaGroup:
    """This replica's process group with the other replicas of its stage (same tp rank), formed
    per quorum through the deployment's store (``cfg.tp_store``)."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.timeout_s = cfg.recv_timeout_s
        self.algorithm = algorithm_of(cfg.allreduce)
        self._store: Any = None
        self.pg: Any = None  # a ProcessGroupGloo (torch's stubs do not export the name)
        self.group = ""  # its id ("" none)
        self.rank, self.size = 0, 1  # this replica's in it
        self.domains: list[list[int]] | None = None  # its members' ranks by datacenter
        self._launches = 0  # the all-reduces launched in it (the same count on every member)
        self._last: ThreadWork | None = None  # the latest point-to-point one
        self._thread: LaunchThread | None = None  # where the group's point-to-point ones run

    def store(self) -> Any:
        if self._store is None:
            host, _, port = self.cfg.tp_store.rpartition(":")
            # connecting is given at least STORE_CONNECT_S: with a receive timeout of 2 s a
            # connection on a loaded machine timed out before the store could answer it (CI,
            # 2026-12-03); a missing member is still found out by the receive timeout
            connect = max(self.timeout_s, STORE_CONNECT_S)
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                host, int(port), is_master=False, timeout=timedelta(seconds=connect)
            )
            # where this replica is, for the hierarchical all-reduce's domains (set before its
            # first quorum, so that a group's members find each other's)
            place = f"{self.cfg.datacenter}\n{self.cfg.host}"
            self._store.set(self._place_key(self.cfg.replica), place)
        return self._store

    def _place_key(self, replica: int) -> str:
        return f"dp/{self.cfg.stage}/{self.cfg.tp_rank}/dc/{replica}"

    def agree(
        self,
        epoch: int,
        key: str,
        policy: LatePolicy,
        bound_s: float,
        abandoned: Callable[[], bool],
        delay_s: float = 0.0,
    ) -> Decision:
        """The quorum ``key`` of ``epoch``, and this replica in the group it names."""
        prefix = f"dp/{self.cfg.stage}/{self.cfg.tp_rank}/e{epoch}/"
        if not self.group.startswith(prefix):
            self.drop()  # a group of an older epoch: its members may have moved on
        quorum = Quorum(self.store(), self.cfg.replica, self.cfg.replicas)
        timeout = bound_s + self.timeout_s
        d = quorum.join(prefix + key, policy, bound_s, timeout, self.group, abandoned, delay_s)
        rank = d.rank(self.cfg.replica)
        if d.verdict == "go" and rank is not None and d.group and d.group != self.group:
            self.drop()
            pg_store = dist.PrefixStore(f"{d.group}/pg", self.store())  # type: ignore[attr-defined]
            self.pg = dist.ProcessGroupGloo(
                pg_store, rank, len(d.members), timedelta(seconds=self.timeout_s)
            )
            self.group = d.group
            self.rank, self.size, self._launches, self._last = rank, len(d.members), 0, None
            self.domains = None
            if self.algorithm == "hierarchical":
                # by datacenter, else (the datacenters unequal, or one) by node
                places = [self.store().get(self._place_key(r)).decode() for r in d.members]
                dcs = [p.partition("\n")[0] for p in places]
                self.domains = domains_of(dcs) or domains_of(places)
        return d

    def _launch_thread(self) -> LaunchThread:
        if self._thread is None:
            self._thread = LaunchThread()
        return self._thread

    def allreduce(self, flat: torch.Tensor) -> Any:
        """Start summing ``flat`` over the group in place with the plan's algorithm; its work."""
        thread = None if self.algorithm == "ring" else self._launch_thread()
        work = launch(
            self.pg, flat, self.algorithm, self.rank, self.size, self.domains, self._launches,
            self._last, thread,
        )  # fmt: skip
        self._launches += 1
        if isinstance(work, ThreadWork):
            self._last = work
        return work

    def run(self, algorithm: Callable[[Any, int], None]) -> ThreadWork:
        """Start a point-to-point ``algorithm(group, first tag)`` on the group's thread, after
        the launch before; its work."""
        pg, tag = self.pg, (self._launches % 1000) * 4 * MAX_SEGMENTS
        work = ThreadWork(lambda: algorithm(pg, tag), self._last, self._launch_thread())
        self._launches += 1
        self._last = work
        return work

    def sent(self, flat: torch.Tensor) -> dict[int, int]:
        """The bytes one all-reduce of ``flat`` has this replica send to each member's rank."""
        pairs = link_bytes(
            self.algorithm if self.domains is not None or self.algorithm == "tree" else "ring",
            self.size,
            flat.numel(),
            flat.element_size(),
            self.domains,
        )
        return {b: v for (a, b), v in pairs.items() if a == self.rank}

    def drop(self) -> None:
        """Leave the group (its next quorum forms a new one). The group is let go on a thread
        of its own: gloo's ``abort`` does not end a collective in progress, and destroying the
        group waits for it, up to its timeout (measured: 20 s of a 20 s timeout, with a member
        that never came), which no step must wait for."""
        held, self.pg, self.group, self._last = [self.pg], None, "", None
        if self._thread is not None:  # a launch in progress may hold it up to the timeout
            self._thread.close()
            self._thread = None
        if held[0] is not None:
            held[0].abort()
            threading.Thread(target=held.clear, daemon=True, name="dp-drop").start()

    def wait(self, work: Any, abandoned: Callable[[], bool], spin_s: float = 0.0) -> None:
        """Wait for an all-reduce: at most the receive timeout, given up once abandoned; a
        failure drops the group. Gloo's own all-reduce is waited for awake first, at most
        ``spin_s`` (:func:`.waiting.awake_until`; a point-to-point algorithm's, run on Python
        threads, is not: a spinning thread would take their turns at the interpreter)."""
        if (
            spin_s > 0
            and not isinstance(work, ThreadWork)
            and awake_until(work.is_completed, spin_s)
        ):
            return self._finished(work)
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        end = time.monotonic() + self.timeout_s
        while not done.wait(0.05):
            if abandoned() or time.monotonic() > end:
                self.drop()
                if abandoned():
                    raise Aborted("all-reduce abandoned: moved to a newer epoch")
                raise TimeoutError(f"all-reduce: no answer within {self.timeout_s:g} s")
        self._finished(work)

    def _finished(self, work: Any) -> None:
        """What a completed ``work`` raised, if anything (the group dropped then)."""
        try:
            work.wait()
        except Exception:
            self.drop()
            raise
