"""A deployment's forward-only requests: next-token logits through a replica's pipeline, a
request decoded token by token, and the end of its inference session.

:class:`ForwardRequests` is the part of :class:`~.deployment.Deployment` that serves inference;
it reaches the workers through the deployment's calls (:meth:`~.deployment.Deployment.calls`:
every tp rank of a replica at once).

Expert parallelism (ep > 1). The replicas of an expert-parallel group hold a share of each
mixture's experts each, and a mixture's forward pairs them in all-to-alls
(:mod:`dmsc.runtime.compute.expert_parallel`): no replica can run a forward alone. So a request
routed to a replica runs on every replica of its group (:meth:`ForwardRequests.instance`): each
gets the same tokens, runs the same forward (the tokens it routes to the others' experts come
back computed), keeps the same keys and values in its session, and the replica asked answers.
Every replica's dense weights are the same and each expert is held once in the group, so the
answer is the whole model's (tests/integration/test_expert_parallel_deployment.py decodes as
one process does). The group's cost: each expert runs the request's tokens ``ep`` times, once
for each replica's copy; serving another request on each replica would need the groups to
batch them, which is not done.

Two calls in flight to one group at once could pair one's collectives with the other's: a
worker serves its calls one at a time, in the order they reach it, and two workers may see two
calls in opposite orders. Two forwards paired so would still compute right (each forward runs
the same all-to-alls, and an expert computes each token alone), but a forward paired with a
training step's backward or a Save's gathers would not, and a request that one replica turns
away as busy past its budget while the other runs it would leave that one waiting for its
partner. So at ep > 1 every call that runs the mixtures is made holding its group's lock
(:meth:`ForwardRequests.in_turn`): a request's token its group's, a training or evaluation
step and a Save every group's, in order. The groups serve their requests side by side.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel

from dmsc.runtime.compute import drawing
from dmsc.runtime.compute.sampling import reply_logits, shipped_top
from dmsc.runtime.control.launch import decoding
from dmsc.runtime.control.launch.failures import Key
from dmsc.runtime.control.launch.layout import StageLayout
from dmsc.runtime.control.launch.tp_ranks import TensorRanks
from dmsc.runtime.transport.drawing import Draw
from dmsc.runtime.transport.messages import EndSession, RunStep, Sampling
from dmsc.runtime.transport.rpc import Client
from dmsc.runtime.transport.wire import Kind


class ForwardRequests:
    """Inference on a deployment's replicas (a mixin of the deployment: what it uses of it is
    declared here)."""

    layout: StageLayout
    tp: TensorRanks
    clients: dict[Key, Client]
    epochs: dict[Key, int]
    _ending: set[Any]
    group_locks: list[threading.RLock]  # each expert-parallel group's, at ep > 1 (in_turn)

    if TYPE_CHECKING:

        @property
        def stages(self) -> int: ...

        def pipeline(self, replica: int) -> list[Key]: ...

        def checked(self, key: Key, kind: Kind, t: torch.Tensor) -> torch.Tensor: ...

        def calls(
            self,
            method: str,
            message: Callable[[int], BaseModel],
            keys: Collection[Key],
            timeout_s: float,
        ) -> dict[Key, Any]: ...

        def gather(
            self,
            futures: dict[Key, Any],
            deadline_s: float,
            watch: Collection[Key] | None = None,
        ) -> dict[Key, dict[str, Any]]: ...

    def instance(self, replica: int) -> list[Key]:
        """The workers a request routed to ``replica`` runs on: its pipeline and, at ep > 1, the
        pipelines of the other replicas of its expert-parallel group (``ep`` consecutive
        replicas: the cost model's layout), each first stage first."""
        lead = replica - replica % self.layout.ep
        return [k for r in range(lead, lead + self.layout.ep) for k in self.pipeline(r)]

    def in_turn(self, replica: int | None = None) -> contextlib.AbstractContextManager[Any]:
        """Held around a call that runs the mixtures at ep > 1 (module docstring): the lock of
        ``replica``'s expert-parallel group, or every group's (in order) for a call to all
        replicas; at ep = 1 nothing (the replicas run their forwards apart)."""
        if self.layout.ep == 1:
            return contextlib.nullcontext()
        if replica is not None:
            return self.group_locks[replica // self.layout.ep]
        every = contextlib.ExitStack()
        for lock in self.group_locks:
            every.enter_context(lock)
        return every

    def logits(
        self,
        step: int,
        tokens: torch.Tensor,
        replica: int = 0,
        timeout_s: float = 120.0,
        session: str | None = None,
        start: int = 0,
        top: int | None = None,
    ) -> torch.Tensor:
        """Next-token logits of every sequence (forward only, through one replica's pipeline, and
        at ep > 1 its group's: :meth:`instance`; one call to each first stage, which calls the
        next stage itself, and so on: :mod:`dmsc.runtime.compute.relay`); with a ``session``,
        ``tokens`` are positions ``start ..`` and the stages keep the keys and values; with
        ``top``, each row's ``top`` largest only (the rest -inf). A failure raises
        :class:`WorkerFailure` naming the stage that failed, a full stage :class:`NoRoom`."""
        keys = self.instance(replica)
        rows = self.checked((0, replica), Kind.TOKENS, tokens).tolist()
        chained = not self.layout.chunks  # an interleaved pipeline's stages each get a call

        def run(epoch: int, first: int | None = None) -> RunStep:  # tokens go in stage 0's call
            if first is None:
                return _inference_step(step, epoch, timeout_s, session, start, top)
            relay = self._later_epochs(first) if chained else None
            return _inference_step(step, epoch, timeout_s, session, start, top, rows, relay)

        with self.in_turn(replica):
            later = [] if chained else [k for k in keys if k[0]]
            calls = self.calls("RunStep", run, later, timeout_s)
            for k in (k for k in keys if not k[0]):  # each first stage: the tokens
                head = run(self.epochs[k], first=k[1])
                calls[k] = self.tp.send(k, self.clients[k], "RunStep", head, timeout_s)
            replies = self.gather(calls, timeout_s, watch=keys)  # every stage watched
        last = (0, replica) if chained else (self.stages - 1, replica)
        return reply_logits(replies[last], self.layout.model.vocab)

    def generate(
        self,
        prompt: Sequence[int],
        tokens: int,
        step_base: int = 1_000_000,
        sampling: Sampling | None = None,
        replica: int = 0,
        cancel: threading.Event | None = None,
        deadline: float | None = None,
        turn: Callable[[float | None], contextlib.AbstractContextManager[None]] | None = None,
        token_timeout_s: float = 120.0,
        on_token: Callable[[int], None] | None = None,
        use_cache: bool = True,
        alone: Callable[[], bool] | None = None,
        runs: bool = True,
    ) -> list[int]:
        """Sample ``tokens`` token ids after ``prompt`` (ids; bytes for a byte-level model) as
        ``sampling`` says (its defaults, seed 0, when None). ``cancel`` stops it between tokens
        (the slower copy of a redundant request, a client gone); so does ``deadline``
        (``time.monotonic()``), and no worker call outlives it. ``turn(deadline)`` is entered
        around each token (a replica's fair lock: requests take turns per token, not per
        request); each token's worker calls wait at most ``token_timeout_s`` (a frozen worker
        fails the request within it). ``on_token`` gets each token as it is drawn (streaming).

        With ``use_cache`` the stages keep the request's keys and values (an inference
        session): the prompt runs once, then each token alone; past the model's sequence
        length the context slides and every token runs it whole again. With ``runs`` too (and
        a pipeline that chains its calls, ep 1), the first stage draws the session's
        tokens in runs of one call each (:mod:`.decoding`) whenever ``alone()`` says that no
        other request waits for the replica; with a ``turn`` and no ``alone``, one a turn."""
        if alone is None and turn is not None:
            alone = _never
        sampling = sampling or Sampling(seed=0)
        session = uuid.uuid4().hex[:16] if use_cache else None
        top = shipped_top(sampling, self.layout.model.vocab)  # the logits the draw reads

        def forward(
            step: int, ctx: torch.Tensor, timeout_s: float, session: str | None, start: int
        ) -> torch.Tensor:
            return self.logits(step, ctx, replica, timeout_s, session, start, top)[0]

        def draw_runs(
            step: int,
            ctx: torch.Tensor,
            wait_s: float,
            session: str,
            start: int,
            count: int,
            g: torch.Generator,
        ) -> list[int]:
            return self.drawn(step, ctx, replica, wait_s, session, start, top, count, sampling, g)

        try:
            return decoding.decode(
                forward,
                self.layout.model.seq,
                prompt,
                tokens,
                sampling,
                step_base=step_base,
                cancel=cancel,
                deadline=deadline,
                turn=turn,
                token_timeout_s=token_timeout_s,
                on_token=on_token,
                session=session,
                runs=draw_runs if runs and self.draws_at_first_stage else None,
                alone=alone,
            )
        finally:
            if session is not None:
                self.end_session(session, replica)

    def _later_epochs(self, replica: int) -> list[int]:
        """The epochs of ``replica``'s stages after the first: what its first stage's chained
        call names them by (:mod:`dmsc.runtime.compute.relay`)."""
        return [self.epochs[(s, replica)] for s in range(1, self.stages)]

    @property
    def draws_at_first_stage(self) -> bool:
        """Whether a session's tokens may be drawn in runs at the first stage (``Draw``): its
        calls chain through the stages (not interleaved) and one replica answers them (ep 1;
        at ep > 1 a call a token goes to every replica of the group). At tp > 1 every rank of
        the first stage draws the run, agreeing token by token
        (:mod:`dmsc.runtime.compute.drawing`)."""
        lay = self.layout
        return not lay.chunks and lay.ep == 1

    def drawn(
        self,
        step: int,
        tokens: torch.Tensor,
        replica: int,
        timeout_s: float,
        session: str,
        start: int,
        top: int | None,
        count: int,
        sampling: Sampling,
        g: torch.Generator,
    ) -> list[int]:
        """``count`` tokens drawn at ``replica``'s first stage after ``tokens`` (positions
        ``start ..`` of ``session``), with ``sampling`` and ``g``, which moves past them (fewer
        tokens when the worker's budget, ``timeout_s``, runs short; one at least). A failure
        raises :class:`WorkerFailure` naming the stage, as :meth:`logits` does."""
        first = (0, replica)
        rows = self.checked(first, Kind.TOKENS, tokens).tolist()
        relay = self._later_epochs(replica)
        step_m = _inference_step(
            step, self.epochs[first], timeout_s, session, start, top, rows, relay
        )
        rng = None if sampling.temperature == 0 else drawing.state(g)  # greedy draws use none
        m = Draw(step=step_m, count=count, sampling=sampling, rng=rng)
        call = self.tp.send(first, self.clients[first], "Draw", m, timeout_s)
        reply = self.gather({first: call}, timeout_s, watch=self.pipeline(replica))[first]
        if rng is not None:
            g.set_state(drawing.generator(reply["rng"], None).get_state())
        return [int(t) for t in reply["drawn"]]

    def end_session(self, session: str, replica: int = 0) -> None:
        """Free ``session``'s keys and values at every stage of ``replica`` (of its group at
        ep > 1): sent, not waited
        for (a stage that is gone or frozen must not hold up the request's end; its sessions
        go with it, or at their idle timeout). The calls are kept until they end: gRPC cancels
        a call whose future is garbage-collected."""
        calls = self.calls(
            "EndSession", lambda _: EndSession(session=session), self.instance(replica), 5.0
        )
        for fut in calls.values():
            self._ending.add(fut)
            fut.add_done_callback(self._ending.discard)


def _never() -> bool:
    return False


def _inference_step(
    step: int,
    epoch: int,
    budget_s: float,
    session: str | None,
    start: int,
    top: int | None,
    rows: list[list[int]] | None = None,
    relay: list[int] | None = None,
) -> RunStep:
    """A forward-only step of one micro-batch (``rows``: the tokens, for a first stage)."""
    return RunStep(
        step=step, microbatches=1, train=False, epoch=epoch, budget_s=budget_s, session=session,
        start=start, tokens=rows, top=top, relay=relay,
    )  # fmt: skip
