"""Inference over a deployment's data-parallel replicas: routing, failover and model versions.

Each replica is a whole pipeline and answers requests on its own; at ep > 1 each
expert-parallel group of replicas is one (``replica-R``, R its first replica: a request runs on
every replica of the group, and loads and heals take the group whole). Its workers serve one step at
a time, and a request takes the replica per token (a :class:`~.turns.FairLock`, as many tokens
at once as the replica's pipeline can hold, ``StageLayout.tokens_in_flight``): the requests on a
replica interleave token by token, tenants in round robin, so a tenant's long requests cannot
hold a replica against another tenant's short one. A request stops at its deadline and frees the
replica (no call outlives it); each token's worker calls wait at most the failure timeout, so a
frozen worker fails its request within it. A request whose replica fails goes to the next
replica at once; the failed replica leaves routing until the watchdog has healed it
(:mod:`..watchdog`). Model
versions: the production version is loaded into every replica and, during a gray release, the
canary into the last one (with two or more replicas), so the gateway can route by version
(:mod:`.version_sync`). What each replica holds is recorded (:mod:`.held`) and every answer
carries the version of the weights that produced it: a training task changes the replicas'
weights, so from its first step until the versions are loaded again they hold no version. A new
training task goes on from the run's newest training weights (:meth:`Replicas.lineage`), not
from the version that served in between.

Loading a version into a replica waits for the requests it is answering (:meth:`Replicas.drained`:
loading replaces the weights and drops the keys and values the stages keep for every open
session, so a request cut there would fail). While it waits, the replica takes no new request:
they go to another replica, or, when none other is in routing, wait at the replica's gate
(:meth:`Replicas.admitted`) and start on the new version once it is loaded. So every answer comes
from one version, the one it started on or, for a request that came during the load, the new one.
This drains rather than keeping the old weights beside the new ones until their sessions end:
that would hold two copies of every stage in the workers' memory, the very memory a version
fills, while a drain costs only the wait of the requests that arrive during it, bounded by
``drain_timeout_s`` (:mod:`.version_sync` puts a load off past it rather than cut a request).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from dmsc.data.db import Database
from dmsc.data.tokenizer import ByteTokenizer, Tokenizer, text_stream
from dmsc.runtime.control.launch.decoding import Cancelled, DeadlineExceeded
from dmsc.runtime.control.launch.deployment import Checkpoint, Deployment
from dmsc.runtime.control.launch.failures import WorkerFailure
from dmsc.runtime.control.serving import held as weights
from dmsc.runtime.control.serving.held import Held, Labelled
from dmsc.runtime.control.serving.turns import FairLock
from dmsc.runtime.control.serving.version_sync import sync
from dmsc.runtime.transport.messages import Sampling
from dmsc.runtime.transport.rpc import NoRoom

TRAINING = "\x00training"  # the training session's party at the replicas' fair locks
# the answered requests' latencies kept for the control loop's inference objective (infer_p99_s)
ANSWERED_KEPT = 10_000
if TYPE_CHECKING:
    from dmsc.runtime.control.serving.elastic import ServingPool

STEP_BASE = 10_000_000  # inference steps live far above training ones; 10_000 per request
# the longest a load waits for a replica's requests in flight (the new ones wait as long)
DRAIN_TIMEOUT_S = 60.0


def _instances(dep: Deployment) -> list[int]:
    """The replicas that serve as instances: every one, or at ep > 1 the first of each
    expert-parallel group, which stands for the group (a request runs on all of its replicas:
    :mod:`dmsc.runtime.control.launch.forwarding`)."""
    return list(range(0, dep.layout.replicas, dep.layout.ep))


class NoReplica(RuntimeError):
    """No replica could serve a request; the message says what each one answered."""


class Replicas:
    """The replicas of a deployment as inference sees them: which serve, and which version."""

    def __init__(
        self,
        dep: Deployment,
        db: Database,
        lock: threading.Lock,
        log: logging.Logger,
        run_id: int,
        token_timeout_s: float = 120.0,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.dep, self.db, self.log = dep, db, log
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.extra = {"run": run_id}  # the context of every log line
        self.lock = lock  # the control plane's: loading weights must not overlap training
        self.count = dep.layout.replicas
        self.instances = _instances(dep)
        self.locks = [FairLock(dep.layout.tokens_in_flight) for _ in range(self.count)]
        self.token_timeout_s = token_timeout_s
        self.held: dict[int, Held] = {}  # replica -> what it holds (held.py), when known
        self.down: set[int] = set()  # replicas out of routing until healed
        # whether the replicas' last stages are task heads of their own (trained with
        # task_heads, or loaded from a version that saved every replica's)
        self.heads = False
        self.signature: list[tuple[int, str]] = []  # the versions' statuses last synced
        # the replicas hold the run's newest training weights (its newest checkpoint, or beyond)
        self.trained = True
        self._training = False  # a training task changed the weights since the last load
        self._calls = itertools.count(1)
        # elastic serving replicas (dmsc up --autoscale), which serve the production version
        self.pool: ServingPool | None = None
        self.production: int | None = None
        self.drain_timeout_s = DRAIN_TIMEOUT_S
        self._in_flight: dict[str, int] = {}
        self.arrivals = 0  # requests admitted so far (the autoscaler forecasts their rate)
        # (unix seconds when answered, seconds it took) of the newest answers, whichever door
        # they came through (the gateway's requests are no task rows): the loop's p99
        self._answered: deque[tuple[float, float]] = deque(maxlen=ANSWERED_KEPT)
        self._loading: set[str] = set()  # replicas a version is being loaded into (gate shut)
        self._counting = threading.Condition()  # guards both; notified as they change
        self._syncing = threading.Lock()  # one version sync at a time

    @property
    def served(self) -> dict[int, int | None]:
        """The model version each replica holds (None: none does), where known."""
        return {r: h.version for r, h in self.held.items()}

    def held_by(self, name: str) -> Held | None:
        """What replica ``name`` holds, when known."""
        if name.startswith("serve-"):
            with contextlib.suppress(KeyError):
                return self.pool.get(name).held if self.pool is not None else None
            return None
        return self.held.get(int(name.rsplit("-", 1)[1]))

    def hold(self, name: str, held: Held) -> None:
        """Replica ``name`` now holds ``held``: recorded (held.py)."""
        if name.startswith("serve-"):
            if self.pool is not None:
                with contextlib.suppress(KeyError):
                    self.pool.get(name).held = held
        else:
            r = int(name.rsplit("-", 1)[1])
            self.held[r] = held
            if held.what != weights.TRAINING:  # loaded: the run's newest weights, or not
                self._training = False
                self.trained = self.trained and self._newest(held)
        weights.record(self.db, self.extra["run"], name, held)

    def _newest(self, held: Held) -> bool:
        """Whether ``held`` is the run's newest checkpoint (every stage's file)."""
        newest = self.db.last_checkpoint(self.extra["run"])
        files = {} if newest is None else json.loads(newest.files_json)
        stages = {int(k): f[1] for k, f in files.items() if "/" not in k}
        return bool(stages) and stages == held.digests

    def failed(self, name: str, why: str) -> None:
        """Replica ``name`` failed: out of routing (the watchdog heals one of the plan's)."""
        if name.startswith("serve-"):
            if self.pool is not None:
                self.pool.failed(name, why)
            return
        self.down.add(int(name.rsplit("-", 1)[1]))
        self.log.warning("%s failed: %s", name, why, extra=self.extra)

    def lineage(self, checkpoints: Sequence[Checkpoint], step: int) -> Checkpoint | None:
        """The checkpoint a new training task at ``step`` must load first: None when the
        replicas hold the run's newest training weights, else the run's newest checkpoint
        (``checkpoints``, newest first) when it is of ``step``."""
        if self.trained or not checkpoints or checkpoints[0].step != step:
            return None
        return checkpoints[0]

    def rebind(self, dep: Deployment) -> None:
        """Serve from ``dep`` (the deployment, resized): its replicas, none loaded yet (the
        weights moved with them: training goes on from them)."""
        self.dep, self.count, self.instances = dep, dep.layout.replicas, _instances(dep)
        self.locks = [FairLock(dep.layout.tokens_in_flight) for _ in range(self.count)]
        self.held, self.signature, self.down = {}, [], set()
        for r in self.instances:
            moved = Held({s: "" for s in range(dep.stages)}, None, "weights moved to a new layout")
            self.held[r] = moved
            weights.record(self.db, self.extra["run"], f"replica-{r}", moved)

    def names(self) -> list[str]:
        """The replicas in routing (a failed one leaves until it is healed), serving ones last;
        one that a version is being loaded into only when no other is (its requests wait for
        the load)."""
        own = [f"replica-{r}" for r in self.instances if r not in self.down]
        routed = own + (self.pool.names() if self.pool is not None else [])
        with self._counting:
            ready = [name for name in routed if name not in self._loading]
        return ready or routed

    def for_version(self, version_id: int | None) -> list[str]:
        """The replicas in routing that hold ``version_id`` (all of them when none does)."""
        serving = [
            name
            for name in self.names()
            if (h := self.held_by(name)) is not None and h.version == version_id
        ]
        return serving or self.names()

    def version_of(self, name: str) -> int | None:
        """The model version replica ``name`` holds now (None: none, or not known)."""
        h = self.held_by(name)
        return h.version if h is not None else None

    def in_flight(self, name: str | None = None) -> int:
        """Requests in flight on replica ``name``, or on all of them."""
        with self._counting:
            if name is None:
                return sum(self._in_flight.values())
            return self._in_flight.get(name, 0)

    @contextlib.contextmanager
    def admitted(
        self,
        names: Sequence[str],
        deadline: float | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[None]:
        """One request in flight on the replicas ``names`` while it runs. It starts once no
        version is being loaded into any of them (:meth:`drained`): it waits for the load, so
        that it runs on one version from first token to last. Waiting past ``deadline``
        (``time.monotonic()``) raises :class:`DeadlineExceeded`; ``cancel`` stops it too."""
        with self._counting:
            while self._loading.intersection(names):
                if cancel is not None and cancel.is_set():
                    raise Cancelled("cancelled while a model version loaded")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise DeadlineExceeded("deadline passed while a model version loaded")
                self._counting.wait(0.1 if left is None else min(left, 0.1))  # sees cancel
            for name in names:
                self._in_flight[name] = self._in_flight.get(name, 0) + 1
            self.arrivals += 1
        t0 = time.monotonic()
        answered = False
        try:
            yield
            answered = True
        finally:
            with self._counting:
                for name in names:
                    self._in_flight[name] -= 1
                if answered:
                    self._answered.append((time.time(), time.monotonic() - t0))
                self._counting.notify_all()

    def answered_since(self, since_s: float) -> list[float]:
        """The latencies (seconds, from taking a replica to the answer, its turns included) of
        the requests answered since ``since_s`` (unix seconds), through any door."""
        with self._counting:
            return [s for at, s in self._answered if at >= since_s]

    @contextlib.contextmanager
    def drained(self, name: str, why: str) -> Iterator[int]:
        """Shut replica ``name``'s gate for ``why`` (a load): no new request starts there, and
        this waits, at most ``drain_timeout_s``, for those in flight to end. Yields how many
        are still in flight (0: drained); the gate opens again on leaving."""
        with self._counting:
            if name in self._loading:
                raise RuntimeError(f"{name}: already being loaded")
            self._loading.add(name)
            left = self._in_flight.get(name, 0)
        try:
            if left:
                n = f"{left} request{'s' if left > 1 else ''}"
                wait = f"{why} waits for {n} in flight (at most {self.drain_timeout_s:g} s)"
                self.log.info("%s: %s", name, wait, extra=self.extra)
                with self._counting:
                    self._counting.wait_for(
                        lambda: not self._in_flight.get(name, 0), self.drain_timeout_s
                    )
                    left = self._in_flight.get(name, 0)
            yield left
        finally:
            with self._counting:
                self._loading.discard(name)
                self._counting.notify_all()

    @contextlib.contextmanager
    def paused(self, why: str, timeout_s: float) -> Iterator[int]:
        """Shut every replica's gate of the deployment for ``why`` (a move: the workers
        restart), all at once: new requests wait at the gates (or go to the elastic serving
        replicas), and this waits, at most ``timeout_s``, for those in flight to end. Yields how
        many are still in flight (0: drained); the gates open again on leaving."""
        names = [f"replica-{r}" for r in self.instances]
        with self._counting:
            busy = self._loading.intersection(names)
            if busy:
                raise RuntimeError(f"{', '.join(sorted(busy))}: a version is being loaded")
            self._loading.update(names)

        def left() -> int:
            return sum(self._in_flight.get(n, 0) for n in names)

        try:
            with self._counting:
                if left():
                    n = left()
                    self.log.info("%s waits for %d requests in flight", why, n, extra=self.extra)
                    self._counting.wait_for(lambda: not left(), timeout_s)
                n = left()
            yield n
        finally:
            with self._counting:
                self._loading.difference_update(names)
                self._counting.notify_all()

    def infer_on(
        self,
        replica: str,
        prompt: str,
        tokens: int,
        cancel: threading.Event | None = None,
        tenant: str = "default",
        deadline: float | None = None,
        sampling: Sampling | None = None,
        on_token: Callable[[int], None] | None = None,
        ids: list[int] | None = None,
    ) -> str:
        """Generate on one replica, taking its turns as ``tenant``, drawing as ``sampling``
        says (``on_token`` sees each byte as it comes; ``ids`` gets the token ids drawn). A
        failure names the stage and takes the replica out of routing (the watchdog heals it);
        ``cancel`` and ``deadline`` (``time.monotonic()``) stop it between tokens."""
        with self.admitted([replica], deadline, cancel):
            return self._infer_on(
                replica, prompt, tokens, cancel, tenant, deadline, sampling, on_token, ids
            )

    def _infer_on(
        self,
        replica: str,
        prompt: str,
        tokens: int,
        cancel: threading.Event | None,
        tenant: str,
        deadline: float | None,
        sampling: Sampling | None,
        on_token: Callable[[int], None] | None,
        ids: list[int] | None,
    ) -> str:
        dep, r, lock = self.route(replica)
        base = self.next_base()
        labels: set[int | None] = set()  # the versions held at each token

        @contextlib.contextmanager
        def turn(until: float | None) -> Iterator[None]:
            with lock.turn(tenant, until):
                labels.add(self.version_of(replica))
                yield

        try:
            out = dep.generate(
                self.tokenizer.encode(prompt),
                tokens,
                step_base=base,
                replica=r,
                cancel=cancel,
                deadline=deadline,
                turn=turn,
                token_timeout_s=self.token_timeout_s,
                sampling=sampling,
                on_token=None if on_token is None else text_stream(self.tokenizer, on_token),
                # a run of tokens a turn while no other request waits for the replica
                alone=lambda: not lock.waiting() and lock.held() <= 1,
            )
        except WorkerFailure as exc:
            if dep is self.dep:
                self.down.add(r)
            elif self.pool is not None:
                self.pool.failed(replica, str(exc))
            self.log.warning("%s failed: %s", replica, exc, extra=self.extra)
            raise
        if ids is not None:
            ids[:] = out
        text = self.tokenizer.decode(out)
        return Labelled.of(text, labels.pop() if len(labels) == 1 else None)

    def route(self, replica: str) -> tuple[Deployment, int, FairLock]:
        """The deployment, its replica index and the fair lock of the replica ``replica``."""
        if replica.startswith("serve-"):
            try:  # removed since it was routed to: another replica takes the request
                if self.pool is None:
                    raise KeyError(replica)
                rep = self.pool.get(replica)
            except KeyError:
                raise NoRoom(f"{replica} does not serve any more") from None
            return rep.dep, 0, rep.lock
        r = int(replica.rsplit("-", 1)[1])
        return self.dep, r, self.locks[r]

    def next_base(self) -> int:
        """The first step number of a new request: each has 10,000 of its own."""
        return STEP_BASE + next(self._calls) * 10_000  # next() on a count is atomic

    @contextlib.contextmanager
    def training_turn(self) -> Iterator[None]:
        """Every replica, for one training step: a step runs on all of them (gradients are
        averaged across replicas), so inference waits for it to end, and takes its next token
        between two steps. Without this, a request's forward pass ran inside a training step,
        the worker dropped the step's sends, and training rolled back to its checkpoint."""
        taken: list[FairLock] = []
        try:
            for lock in self.locks:  # in order: two holders of several never deadlock
                lock.acquire(TRAINING)
                taken.append(lock)
            if not self._training:  # the weights change from this step on: no version's
                for r in self.instances:
                    stages = {s: "" for s in range(self.dep.stages)}
                    self.hold(f"replica-{r}", Held(stages, None, weights.TRAINING))
                self._training = self.trained = True
                self.signature = []  # load the versions that serve again after the task
                self.log.info("the replicas hold %s", weights.TRAINING, extra=self.extra)
            yield
        finally:
            for lock in reversed(taken):
                lock.release()

    def generate(
        self,
        prompt: str,
        tokens: int,
        sampling: Sampling | None = None,
        on_token: Callable[[int], None] | None = None,
        cancel: threading.Event | None = None,
        ids: list[int] | None = None,
        deadline: float | None = None,
        session: str | None = None,
    ) -> tuple[str, str]:
        """``(replica, text)`` from the first replica that answers, trying each in turn (a
        ``session``'s own replica first, the same for every request of it). ``on_token`` sees
        each byte once: a replica that takes over after another failed draws the same bytes
        again (same seed, same weights), and those already seen are not repeated. ``deadline``
        (``time.monotonic()``) stops it between tokens."""
        errors, seen = [], 0

        def once(drawn: list[int]) -> Callable[[int], None] | None:
            if on_token is None:
                return None

            def forward(b: int) -> None:
                nonlocal seen
                drawn.append(b)
                if len(drawn) > seen:
                    seen += 1
                    on_token(b)

            return forward

        names = self.names()
        if session is not None and names:  # sticky: the session's replica, then the others
            k = zlib.crc32(session.encode()) % len(names)
            names = names[k:] + names[:k]
        for replica in names:
            try:
                return replica, self.infer_on(
                    replica,
                    prompt,
                    tokens,
                    cancel,
                    deadline=deadline,
                    sampling=sampling,
                    on_token=once([]),
                    ids=ids,
                )
            except (WorkerFailure, NoRoom) as exc:  # a full replica: another may have room
                errors.append(f"{replica}: {exc}")
        raise NoReplica(f"no replica could serve the request: {'; '.join(errors) or 'none up'}")

    def healed(self, r: int) -> None:
        """Replica ``r`` was repaired from a checkpoint: back into routing, the version that
        serves loaded again (and a training task first brings back the run's newest weights)."""
        self.held.pop(r, None)
        self.signature, self.trained = [], False
        self.down.discard(r)

    def sync_versions(self) -> None:
        """Load the production version into the replicas and, during a gray release, the
        canary into the last replica (with two or more replicas): :mod:`.version_sync`."""
        with self._syncing:  # two lanes' consumers may call it at once
            sync(self)
