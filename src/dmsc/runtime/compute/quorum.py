"""Which replicas of a stage take part in one all-reduce: a quorum agreed through a key-value store.

The replicas of a stage average their gradients with a torch.distributed (gloo) all-reduce, and
a gloo group is fixed once formed: a collective with a dead or late member fails or waits for
the whole group. So each all-reduce is preceded by a quorum, in the way torchft does it (a
quorum per step; the members of a new quorum form a new group under a store prefix of its
own): every replica announces itself under the step's key in the deployment's TCPStore, the
first to arrive (the store's atomic counter says who) waits for the others, at most the bound
the late policy gives, and writes the decision every replica reads:

- ``members``: the replicas that arrived in time (ascending; a member's rank in the group is its
  index there) and ``late`` the others;
- ``group``: the process group the members reduce in. A replica announces the group it holds;
  when every member holds the same one and its members are exactly this quorum, the group is
  used again (no rendezvous on a step like the last); else the members form a new one under
  the new id (a replacement holds none, so the group always re-forms around it). Alone, no
  group is needed;
- ``verdict``: ``go``; ``restart`` when someone is late under policy ``restart`` (every
  replica drops the step); ``fail`` when someone is late under ``wait`` (whose bound is the
  receive timeout: the step fails, and the deployment's recovery takes over).

A step runs at most once per epoch (a restart and a recovery each open a new one), and the
store prefix carries the epoch, so a quorum's keys are never reused. Waiting is the store's own
blocking ``wait`` for the keys, on a connection of its own and a thread of its own
(:class:`Waiter`), while the caller looks every few milliseconds whether ``abandoned()`` says the
step was (a move to a newer epoch) and gives up at once if so. It polled the store (``check``
with pauses growing to 10 ms) until 2026-12-03: the last replica to arrive, the one the others
waited for, then waited a median 8.9 ms (7-15) for a decision the store could have told it in
0.25 ms, and every exchange after the backward (a codec's, a round's) carried it exposed. A
wait that reaches its deadline (a replica late past the policy's bound) leaves one warning line
of torch's store client in the log. Every request to the store is a round trip (50-95 us idle on
this project's 2-core VM): with every replica there, the decider reads their announcements in
one (``multi_get``), where until 2026-12-05 it looked at each twice (``check``, then ``get``),
and a quorum of two replicas took 611-697 us at the median instead of 845-994 (the slower
replica's, three runs side by side, the store in a third process).

Why not torchft itself (``torchft`` 0.2.0 installs from PyPI beside torch 2.13): its quorum is
served by its own lighthouse and a manager server per replica group, a second control plane
beside the registry and the epochs that already fence this deployment's workers; its policy is
one (a minimum of replicas and a join timeout, the late ones healing from a peer's checkpoint
over its own transport), where the policies here are three and ``skip`` hands the late replica
the average; and it brings the OpenTelemetry packages with it. What is taken from it is the
design: the per-step quorum, the fresh store prefix per group, the re-formed group.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist

from dmsc.runtime.compute.inbox import Aborted
from dmsc.runtime.transport.messages import LatePolicy

Verdict = Literal["go", "restart", "fail"]
ABANDON_CHECK_S = 0.005  # how often a wait looks whether its step was abandoned
_VERDICTS: dict[str, Verdict] = {"wait": "fail", "skip": "go", "restart": "restart"}
_WAITERS: dict[tuple[str, int], Waiter] = {}  # by the store's address (Waiter.of)
_WAITERS_LOCK = threading.Lock()


class Waiter:
    """Blocking waits for keys of one TCPStore, each on a client connection of its own and a
    thread of its own, so that the caller stays free to give up (module docstring). A client
    serves one wait at a time and goes back to the pool when its wait ends, even one its caller
    gave up on (it may block until its deadline); one whose wait failed early is dropped."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._idle: list[Any] = []
        self._pool_lock = threading.Lock()

    @classmethod
    def of(cls, store: Any) -> Waiter:
        """The waiter of ``store``'s server (one per address in this process)."""
        key = (str(store.host), int(store.port))
        with _WAITERS_LOCK:
            waiter = _WAITERS.get(key)
            if waiter is None:
                waiter = _WAITERS[key] = cls(*key)
            return waiter

    def _client(self, deadline: float) -> Any:
        with self._pool_lock:
            if self._idle:
                return self._idle.pop()
        # a new connection gets no longer than the wait has (at least a second to connect)
        connect = timedelta(seconds=max(1.0, deadline - time.monotonic()))
        return dist.TCPStore(  # type: ignore[attr-defined]
            self.host, self.port, is_master=False, timeout=connect
        )

    def until(self, keys: list[str], deadline: float, abandoned: Callable[[], bool]) -> bool:
        """Whether every one of ``keys`` was set by ``deadline`` (``time.monotonic()``);
        :class:`Aborted` as soon as ``abandoned()``. A wait that fails before its deadline
        (its connection lost: the store restarted on the same address) is tried again on a new
        connection, and the failed one is dropped, not pooled."""
        while True:
            done = threading.Event()
            got: list[bool | None] = []
            args = (keys, deadline, done, got)
            threading.Thread(target=self._block, args=args, daemon=True, name="quorum-wait").start()
            while not done.wait(ABANDON_CHECK_S):
                if abandoned():
                    raise Aborted("quorum abandoned: moved to a newer epoch")
            if got[0] is not None:
                return got[0]
            time.sleep(ABANDON_CHECK_S)  # a lost connection: a new one, while time is left

    def _block(
        self, keys: list[str], deadline: float, done: threading.Event, got: list[bool | None]
    ) -> None:
        """One blocking wait (its thread's): ``got`` True, False at the deadline, None when it
        failed before it."""
        client = None
        try:
            client = self._client(deadline)
            client.wait(keys, timedelta(seconds=max(0.001, deadline - time.monotonic())))
            got.append(True)
        except Exception:  # the deadline passed (DistStoreError), or the connection failed
            early = time.monotonic() < deadline - ABANDON_CHECK_S
            got.append(None if early else False)
            if early:
                client = None  # broken: not back to the pool
        finally:
            if client is not None:
                with self._pool_lock:
                    self._idle.append(client)
            done.set()


@dataclass(frozen=True)
class Decision:
    """One quorum's outcome (see the module docstring)."""

    members: tuple[int, ...]
    late: tuple[int, ...]
    group: str  # "" when alone
    new: bool  # whether the members form ``group`` now
    verdict: Verdict

    def rank(self, replica: int) -> int | None:
        """``replica``'s rank in the group (None: not a member)."""
        return self.members.index(replica) if replica in self.members else None


def group_members(group: str) -> tuple[int, ...]:
    """The members a group id names (its part after ``|``)."""
    _, _, tail = group.rpartition("|")
    return tuple(int(r) for r in tail.split(".")) if tail else ()


class Quorum:
    """One replica's side of the quorums of its stage, over ``store`` (a torch.distributed
    store; keys under the prefix the caller gives)."""

    def __init__(self, store: Any, replica: int, replicas: int) -> None:
        self.store = store
        self.replica = replica
        self.replicas = replicas
        self.waiter = Waiter.of(store)

    def join(
        self,
        key: str,
        policy: LatePolicy,
        bound_s: float,
        timeout_s: float,
        held: str,
        abandoned: Callable[[], bool],
        delay_s: float = 0.0,
    ) -> Decision:
        """Take part in the quorum ``key`` holding group ``held`` ("" none). The first replica
        to arrive decides after at most ``bound_s``; the others wait for its decision at most
        ``timeout_s`` (TimeoutError). ``delay_s`` > 0 announces this replica that much later
        while the decision is awaited meanwhile (a slow link, for rehearsals and tests)."""
        if delay_s > 0:

            def late() -> None:
                with contextlib.suppress(Exception):  # its step may be long over
                    self._announce(key, held, policy, bound_s, lambda: False)

            threading.Timer(delay_s, late).start()
        else:
            decided = self._announce(key, held, policy, bound_s, abandoned)
            if decided is not None:
                return decided
        return self._await(key, timeout_s, abandoned)

    def _announce(
        self,
        key: str,
        held: str,
        policy: LatePolicy,
        bound_s: float,
        abandoned: Callable[[], bool],
    ) -> Decision | None:
        """Announce this replica; the decision if it was the first (the decider)."""
        self.store.set(f"{key}/join/{self.replica}", held)
        if self.store.add(f"{key}/arrived", 1) != 1:
            return None
        return self._decide(key, policy, bound_s, abandoned)

    def _decide(
        self, key: str, policy: LatePolicy, bound_s: float, abandoned: Callable[[], bool]
    ) -> Decision:
        joins = [f"{key}/join/{r}" for r in range(self.replicas)]
        members = tuple(range(self.replicas))
        if not self.store.check(joins) and not self.waiter.until(
            joins, time.monotonic() + bound_s, abandoned
        ):  # someone is late: who came, key by key
            members = tuple(r for r in members if self.store.check([joins[r]]))
        late = tuple(r for r in range(self.replicas) if r not in members)
        # the groups the members hold, in one round trip (MULTI_GET)
        held = {v.decode() for v in self.store.multi_get([joins[r] for r in members])}
        verdict: Verdict = "go"
        if late:
            verdict = _VERDICTS[policy]
        group, new = "", False
        if len(members) > 1:
            same = held.pop() if len(held) == 1 else ""
            if same and group_members(same) == members:
                group = same
            else:
                group, new = f"{key}|" + ".".join(map(str, members)), True
        decision = Decision(members, late, group, new, verdict)
        self.store.set(f"{key}/decision", json.dumps(decision.__dict__))
        return decision

    def _await(self, key: str, timeout_s: float, abandoned: Callable[[], bool]) -> Decision:
        name = f"{key}/decision"
        if not self.store.check([name]) and not self.waiter.until(
            [name], time.monotonic() + timeout_s, abandoned
        ):
            raise TimeoutError(f"quorum {key}: no decision within {timeout_s:g} s")
        raw = json.loads(self.store.get(name))
        return Decision(
            tuple(raw["members"]), tuple(raw["late"]), raw["group"], raw["new"], raw["verdict"]
        )
