"""The control plane's ``Infer`` and ``InferStream``: one request, recorded as a task.

A request runs on the first replica that answers (:class:`~.inference.Replicas`; the answer
says the model version of the weights that produced it) or, with ``aggregate``, on every task
head at once (:class:`~.head_inference.Heads`). Either way it is an
``infer`` task in the database, done, failed (with the reason) or cancelled (the client went
away); a request no replica or head could serve is refused with the reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from dmsc.data.db import Database
from dmsc.runtime.control.launch.decoding import DeadlineExceeded
from dmsc.runtime.control.serving.head_inference import Heads
from dmsc.runtime.control.serving.inference import NoReplica, Replicas
from dmsc.runtime.control.serving.streaming import text_pieces
from dmsc.runtime.transport.messages import InferRequest, Sampling
from dmsc.runtime.transport.rpc import BadRequest

# (on_token or None, cancel or None, ids) -> (replica, text, what else the answer says)
Generate = Callable[
    [Callable[[int], None] | None, threading.Event | None, list[int]],
    tuple[str, str, dict[str, Any]],
]

# the one field of an inference request that the control plane's calls cannot serve
REDUNDANT = (
    "redundant: the control plane asks one replica at a time; racing two replicas is the "
    "gateway's (POST /v1/infer)"
)


def _timed(generate: Generate, timeout_s: float | None) -> Generate:
    """``generate`` whose stop at the request's deadline says so as a TimeoutError (a call's
    DEADLINE_EXCEEDED, the gateway's 504), in the gateway's words."""

    def run(
        on_token: Callable[[int], None] | None, cancel: threading.Event | None, ids: list[int]
    ) -> tuple[str, str, dict[str, Any]]:
        try:
            return generate(on_token, cancel, ids)
        except DeadlineExceeded as exc:
            raise TimeoutError(f"no answer within {timeout_s:g} s ({exc})") from None

    return run


class InferCalls:
    """Inference requests of one run: through the replicas or, aggregated, the task heads."""

    def __init__(
        self,
        db: Database,
        run_id: int,
        replicas: Replicas,
        heads: Heads,
    ) -> None:
        self.db, self.run_id, self.replicas, self.heads = db, run_id, replicas, heads

    def why_no_heads(self) -> str | None:
        """None when the replicas hold task heads to combine, else why they do not."""
        if self.replicas.count < 2:
            return "one replica holds one head: nothing to combine (plan with dp >= 2)"
        if not self.replicas.heads:
            return "the replicas hold one model, not task heads: train with --task-heads first"
        return None

    def check(self, req: InferRequest) -> None:
        """BadRequest when the control plane cannot serve ``req``, saying why (a batch's
        requests are checked before it queues)."""
        if req.redundant:
            raise BadRequest(REDUNDANT)
        why_not = None if req.aggregate is None else self.why_no_heads()
        if why_not is not None:
            raise BadRequest(f"aggregate: {why_not}")

    def _generate(self, req: InferRequest, sampling: Sampling) -> Generate:
        self.check(req)
        deadline = None if req.timeout_s is None else time.monotonic() + req.timeout_s
        if req.aggregate is None:

            def plain(
                on_token: Callable[[int], None] | None,
                cancel: threading.Event | None,
                ids: list[int],
            ) -> tuple[str, str, dict[str, Any]]:
                replica, text = self.replicas.generate(
                    req.prompt,
                    req.tokens,
                    sampling,
                    on_token,
                    cancel,
                    ids=ids,
                    deadline=deadline,
                    session=req.session,
                )
                # the version of the weights that answered (None: none, training's say)
                return replica, text, {"model_version": getattr(text, "model_version", None)}

            return _timed(plain, req.timeout_s)
        method = req.aggregate

        def aggregated(
            on_token: Callable[[int], None] | None,
            cancel: threading.Event | None,
            ids: list[int],
        ) -> tuple[str, str, dict[str, Any]]:
            return self.heads.generate(
                req.prompt, req.tokens, method, sampling, on_token, cancel, ids, deadline=deadline
            )

        return _timed(aggregated, req.timeout_s)

    def answer(self, req: InferRequest, cancel: threading.Event | None = None) -> dict[str, Any]:
        """The answer to ``req``, recorded nowhere (a batch's line, the gateway's aggregated
        request): text, replica, seed, token ids and what else the generation says.
        BadRequest says why it cannot be served, TimeoutError that its deadline passed."""
        sampling = req.sampling()
        ids: list[int] = []
        try:
            replica, text, info = self._generate(req, sampling)(None, cancel, ids)
        except NoReplica as exc:
            raise BadRequest(str(exc)) from None
        return {"text": text, "replica": replica, "seed": sampling.seed, **info, "token_ids": ids}

    def _task(self, req: InferRequest, sampling: Sampling) -> int:
        params = {"tokens": req.tokens, **sampling.model_dump()}
        if req.aggregate is not None:
            params["aggregate"] = req.aggregate
        return self.db.new_task(self.run_id, "infer", params, state="running").id

    def infer(self, req: InferRequest) -> dict[str, Any]:
        sampling = req.sampling()
        generate = self._generate(req, sampling)
        task = self._task(req, sampling)
        ids: list[int] = []
        try:
            replica, text, info = generate(None, None, ids)
        except NoReplica as exc:
            self.db.set_task_state(task, "failed", str(exc))
            raise BadRequest(str(exc)) from None
        except TimeoutError as exc:
            self.db.set_task_state(task, "failed", str(exc))
            raise
        self.db.set_task_state(task, "done")
        out = {"task": task, "text": text, "replica": replica, "seed": sampling.seed}
        return {**out, **info, "token_ids": ids}

    def infer_stream(self, req: InferRequest, gone: threading.Event) -> Iterator[dict[str, Any]]:
        """``Infer``, streamed: ``{"text": ...}`` as the bytes come (whole UTF-8 characters),
        then ``{"done": true, ...}`` with the task, replica and seed. A client that cancels
        (Ctrl-C) or goes away stops the generation at its next token."""
        sampling = req.sampling()
        generate = self._generate(req, sampling)
        task = self._task(req, sampling)
        ids: list[int] = []

        def settle(_: object, exc: BaseException | None) -> None:
            if exc is None:
                self.db.set_task_state(task, "done")
            elif gone.is_set():
                self.db.set_task_state(task, "cancelled", "the client went away")
            else:
                self.db.set_task_state(task, "failed", str(exc))

        pieces = text_pieces(lambda on_byte: generate(on_byte, gone, ids), settle, f"infer-{task}")
        try:
            for piece in pieces:
                if isinstance(piece, str):
                    yield {"text": piece}
                else:
                    replica, _, info = piece.result
                    end = {"done": True, "task": task, "replica": replica, "seed": sampling.seed}
                    yield {**end, **info, "token_ids": ids}
        except NoReplica as exc:
            raise BadRequest(str(exc)) from None
