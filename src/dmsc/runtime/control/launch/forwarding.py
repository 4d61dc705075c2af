"""A deployment's forward-only requests: next-token logits through a replica's pipeline, a
request decoded token by token, and the end of its inference session.

:class:`ForwardRequests` is the part of :class:`~.deployment.Deployment` that serves inference;
it holds no state of its own and reaches the workers through the deployment's calls
(:meth:`~.deployment.Deployment.calls`: every tp rank of a replica at once).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel

from dmsc.runtime.control.launch import decoding
from dmsc.runtime.control.launch.failures import Key
from dmsc.runtime.control.launch.layout import StageLayout
from dmsc.runtime.control.launch.sampling import reply_logits, shipped_top
from dmsc.runtime.control.launch.tp_ranks import TensorRanks
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
            self, futures: dict[Key, Any], deadline_s: float
        ) -> dict[Key, dict[str, Any]]: ...

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
        """Next-token logits of every sequence (forward only, through one replica's pipeline);
        with a ``session``, ``tokens`` are positions ``start ..`` and the stages keep the keys
        and values; with ``top``, each row's ``top`` largest only (the rest -inf). A failure
        raises :class:`WorkerFailure` naming the stage that failed, a stage without room for a
        new session :class:`NoRoom`."""
        keys = self.pipeline(replica)
        rows = self.checked(keys[0], Kind.TOKENS, tokens).tolist()

        def run(epoch: int, first: bool = False) -> RunStep:  # tokens go in stage 0's call
            return RunStep(
                step=step, microbatches=1, train=False, epoch=epoch, budget_s=timeout_s,
                session=session, start=start, tokens=rows if first else None, top=top
            )  # fmt: skip

        calls = self.calls("RunStep", run, keys[1:], timeout_s)
        head = run(self.epochs[keys[0]], first=True)
        calls[keys[0]] = self.tp.send(keys[0], self.clients[keys[0]], "RunStep", head, timeout_s)
        replies = self.gather(calls, timeout_s)
        return reply_logits(replies[(self.stages - 1, replica)], self.layout.model.vocab)

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
        length the context slides and every token runs it whole again."""
        sampling = sampling or Sampling(seed=0)
        session = uuid.uuid4().hex[:16] if use_cache else None
        top = shipped_top(sampling, self.layout.model.vocab)  # the logits the draw reads

        def forward(
            step: int, ctx: torch.Tensor, timeout_s: float, session: str | None, start: int
        ) -> torch.Tensor:
            return self.logits(step, ctx, replica, timeout_s, session, start, top)[0]

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
            )
        finally:
            if session is not None:
                self.end_session(session, replica)

    def end_session(self, session: str, replica: int = 0) -> None:
        """Free ``session``'s keys and values at every stage of ``replica``: sent, not waited
        for (a stage that is gone or frozen must not hold up the request's end; its sessions
        go with it, or at their idle timeout). The calls are kept until they end: gRPC cancels
        a call whose future is garbage-collected."""
        calls = self.calls(
            "EndSession", lambda _: EndSession(session=session), self.pipeline(replica), 5.0
        )
        for fut in calls.values():
            self._ending.add(fut)
            fut.add_done_callback(self._ending.discard)
