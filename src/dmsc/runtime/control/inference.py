"""Inference over a deployment's data-parallel replicas: routing, failover and model versions.

Each replica is a whole pipeline and answers requests on its own. Its workers serve one step at
a time, and a request takes the replica per token (a :class:`~.turns.FairLock`): the requests on
a replica interleave token by token, tenants in round robin, so a tenant's long requests cannot
hold a replica against another tenant's short one. A request stops at its deadline and frees the
replica (no call outlives it); each token's worker calls wait at most the failure timeout, so a
frozen worker fails its request within it. A request whose replica fails goes to the next
replica at once; the failed replica leaves routing until the watchdog has healed it
(:mod:`.watchdog`). Model
versions: the production version is loaded into every replica and, during a gray release, the
canary into the last one (with two or more replicas), so the gateway can route by version.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from dmsc.data.db import Database
from dmsc.data.tokenizer import ByteTokenizer, Tokenizer, text_stream
from dmsc.runtime.compute.checkpoints import replica_file, stage_file
from dmsc.runtime.control.deployment import Deployment
from dmsc.runtime.control.failures import WorkerFailure
from dmsc.runtime.control.model_store import versions
from dmsc.runtime.control.turns import FairLock
from dmsc.runtime.transport.messages import Load, Sampling
from dmsc.runtime.transport.rpc import NoRoom

TRAINING = "\x00training"  # the training session's party at the replicas' fair locks
if TYPE_CHECKING:
    from dmsc.runtime.control.serving import ServingPool

STEP_BASE = 10_000_000  # inference steps live far above training ones; 10_000 per request


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
        self.locks = [FairLock() for _ in range(self.count)]
        self.token_timeout_s = token_timeout_s
        self.served: dict[int, int] = {}  # replica -> model version it serves
        self.down: set[int] = set()  # replicas out of routing until healed
        # whether the replicas' last stages are task heads of their own (trained with
        # task_heads, or loaded from a version that saved every replica's)
        self.heads = False
        self._signature: list[tuple[int, str]] = []
        self._calls = itertools.count(1)
        # elastic serving replicas (dmsc up --autoscale), which serve the production version
        self.pool: ServingPool | None = None
        self.production: int | None = None
        self._in_flight: dict[str, int] = {}
        self._counting = threading.Lock()

    def rebind(self, dep: Deployment) -> None:
        """Serve from ``dep`` (the deployment, resized): its replicas, none loaded yet."""
        self.dep, self.count = dep, dep.layout.replicas
        self.locks = [FairLock() for _ in range(self.count)]
        self.served, self._signature, self.down = {}, [], set()

    def names(self) -> list[str]:
        """The replicas in routing (a failed one leaves until it is healed), serving ones last."""
        own = [f"replica-{r}" for r in range(self.count) if r not in self.down]
        return own + (self.pool.names() if self.pool is not None else [])

    def for_version(self, version_id: int | None) -> list[str]:
        """The replicas in routing that serve ``version_id`` (all of them when none does)."""
        serving = [
            f"replica-{r}" for r, v in self.served.items() if v == version_id and r not in self.down
        ]
        if serving and self.pool is not None and version_id == self.production:
            serving += self.pool.names()
        return serving or self.names()

    def in_flight(self, name: str | None = None) -> int:
        """Requests in flight on replica ``name``, or on all of them."""
        with self._counting:
            if name is None:
                return sum(self._in_flight.values())
            return self._in_flight.get(name, 0)

    @contextlib.contextmanager
    def _counted(self, name: str) -> Iterator[None]:
        with self._counting:
            self._in_flight[name] = self._in_flight.get(name, 0) + 1
        try:
            yield
        finally:
            with self._counting:
                self._in_flight[name] -= 1

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
        with self._counted(replica):
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
        dep, r, lock = self._route(replica)
        base = self.next_base()
        try:
            out = dep.generate(
                self.tokenizer.encode(prompt),
                tokens,
                step_base=base,
                replica=r,
                cancel=cancel,
                deadline=deadline,
                turn=lambda until: lock.turn(tenant, until),
                token_timeout_s=self.token_timeout_s,
                sampling=sampling,
                on_token=None if on_token is None else text_stream(self.tokenizer, on_token),
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
        return self.tokenizer.decode(out)

    def _route(self, replica: str) -> tuple[Deployment, int, FairLock]:
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
        held: list[FairLock] = []
        try:
            for lock in self.locks:  # in order: two holders of several never deadlock
                lock.acquire(TRAINING)
                held.append(lock)
            yield
        finally:
            for lock in reversed(held):
                lock.release()

    def generate(
        self,
        prompt: str,
        tokens: int,
        sampling: Sampling | None = None,
        on_token: Callable[[int], None] | None = None,
        cancel: threading.Event | None = None,
        ids: list[int] | None = None,
    ) -> tuple[str, str]:
        """``(replica, text)`` from the first replica that answers, trying each in turn.
        ``on_token`` sees each byte once: a replica that takes over after another failed draws
        the same bytes again (same seed, same weights), and those already seen are not
        repeated."""
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

        for replica in self.names():
            try:
                return replica, self.infer_on(
                    replica, prompt, tokens, cancel, sampling=sampling, on_token=once([]), ids=ids
                )
            except (WorkerFailure, NoRoom) as exc:  # a full replica: another may have room
                errors.append(f"{replica}: {exc}")
        raise NoReplica(f"no replica could serve the request: {'; '.join(errors) or 'none up'}")

    def healed(self, r: int) -> None:
        """Replica ``r`` was repaired: back into routing, its version loaded again."""
        self.served.pop(r, None)
        self._signature = []
        self.down.discard(r)

    def sync_versions(self) -> None:
        """Load the production version into the replicas and, during a gray release, the
        canary into the last replica (with two or more replicas)."""
        all_versions = versions(self.db)
        signature = [(v.id, v.status) for v in all_versions]
        if signature == self._signature:
            return
        self._signature = signature
        production = next((v for v in all_versions if v.status == "production"), None)
        self.production = production.id if production is not None else None
        canary = next((v for v in all_versions if v.status == "canary"), None)
        R = self.count
        for r in range(R):
            want = canary if (canary is not None and R > 1 and r == R - 1) else production
            if want is None or self.served.get(r) == want.id:
                continue
            digests = json.loads(want.metrics_json or "{}")
            with self.lock:
                for key in self.dep.pipeline(r):
                    path = str(stage_file(Path(want.path), key[0]))
                    own = str(replica_file(Path(want.path), *key))  # a task head's, say
                    path = own if key[1] and own in digests else path
                    load = Load(path=path, sha256=digests.get(path, ""), epoch=self.dep.epochs[key])
                    self.dep.clients[key].send("Load", load)
            if r:  # a version of task heads saved every replica's last stage
                last = (self.dep.stages - 1, r)
                self.heads = str(replica_file(Path(want.path), *last)) in digests
            self.served[r] = want.id
            self.log.info("replica %d serves version %d", r, want.id, extra=self.extra)
