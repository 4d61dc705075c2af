"""Inference over task heads: every replica's next-token distribution, combined into one.

A deployment trained with ``dmsc train --task-heads`` holds a business-segmented model: its
stages before the last are the shared backbone (averaged across the data-parallel replicas every
step), and the last stage of replica ``k`` is task head ``k``, trained on that replica's data
only (with ``--local-data``, its datacenter's files). ``dmsc infer --aggregate METHOD`` asks
every head for the next-token distribution of the same context, at once, and combines them with
:mod:`dmsc.runtime.control.serving.combiners` (``vote``, ``weighted``, ``attention``); the token
is drawn from the combined distribution as the request's sampling says (temperature 0: its argmax,
the voted byte for ``vote``).

- Each head keeps its own inference session (the stages' keys and values), so a token costs
  every head one cached step, in parallel.
- A head that fails or does not answer within the token's timeout drops out for the rest of the
  request, and the others' weights are renormalised over the heads still present (the rule of
  the combiners module); a failed replica also leaves routing until the watchdog heals it.
  Only when no head answers does the request fail.
- A request is in flight on every head's replica while it runs: a model version is loaded into
  one of them only after it ended, and one that comes during a load waits for it
  (:meth:`~.inference.Replicas.admitted`), so no head loses its session half-way.
- **Calibration.** ``weighted`` weighs each head by its next-byte accuracy and ``attention``
  needs a fitted combiner, both measured on held-out text through the deployed services: the
  first aggregate request after the weights changed runs ``windows`` validation windows through
  every head (the next byte after each window is the label), then fits the combiner on them.
  The result is kept until the weights change again (a training task, a version loaded).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from dmsc.data.corpus import Corpus
from dmsc.data.tokenizer import text_stream
from dmsc.runtime.control.launch import decoding
from dmsc.runtime.control.launch.failures import WorkerFailure
from dmsc.runtime.control.serving.combiners import (
    AttentionCombiner,
    combine,
    fit_attention,
    score,
)
from dmsc.runtime.control.serving.inference import NoReplica, Replicas
from dmsc.runtime.transport.messages import Sampling
from dmsc.runtime.transport.rpc import NoRoom

CALIBRATION = "\x00calibration"  # the calibration's party at the replicas' fair locks


@dataclass
class Calibration:
    """What the heads scored on held-out windows, and the combiners fitted there."""

    windows: int
    accuracy: list[float | None]  # per head (None: the head did not answer)
    combiner: AttentionCombiner
    combined: dict[str, float]  # method -> accuracy of the combination on the same windows

    def as_json(self) -> dict[str, object]:
        return {"windows": self.windows, "accuracy": self.accuracy, "combined": self.combined}


class Heads:
    """The replicas of a deployment as task heads of one model (module docstring)."""

    def __init__(
        self,
        replicas: Replicas,
        valid: Callable[[], Corpus],
        weights_key: Callable[[], Hashable],
        windows: int = 256,
        seed: int = 0,
    ) -> None:
        self.replicas, self.valid, self.weights_key = replicas, valid, weights_key
        self.windows, self.seed = windows, seed
        self.log: logging.Logger = replicas.log
        self._pool = ThreadPoolExecutor(
            max_workers=64, thread_name_prefix="head"
        )  # threads start as heads are asked: a resized deployment has more
        self._cal: tuple[Hashable, Calibration] | None = None
        self._cal_lock = threading.Lock()

    @property
    def count(self) -> int:
        return self.replicas.count

    def _ask(
        self,
        heads: list[int],
        step: int,
        ctx: torch.Tensor,
        timeout_s: float,
        session: str | None = None,
        start: int = 0,
    ) -> dict[int, torch.Tensor | str]:
        """Every head's next-token logits ``[B, V]`` of ``ctx`` at once, or why it has none."""
        dep = self.replicas.dep
        futures = {
            r: self._pool.submit(dep.logits, step, ctx, r, timeout_s, session, start) for r in heads
        }
        out: dict[int, torch.Tensor | str] = {}
        for r, fut in futures.items():
            try:
                out[r] = fut.result()
            except WorkerFailure as exc:
                self.replicas.down.add(r)  # out of routing until the watchdog heals it
                out[r] = f"failed: {exc}"
            except NoRoom as exc:
                out[r] = f"no room: {exc}"
        return out

    @contextlib.contextmanager
    def _turns(self, heads: list[int], party: str, until: float | None) -> Iterator[None]:
        """A turn at every head's replica (in replica order: two holders never deadlock)."""
        with contextlib.ExitStack() as stack:
            for r in sorted(heads):
                stack.enter_context(self.replicas.locks[r].turn(party, until))
            yield

    def calibration(self, timeout_s: float = 120.0) -> Calibration:
        """The heads' accuracy on held-out windows and the fitted attention combiner, measured
        again when the weights changed since the last time."""
        with self._cal_lock:
            key = self.weights_key()
            if self._cal is not None and self._cal[0] == key:
                return self._cal[1]
            heads = [r for r in range(self.count) if r not in self.replicas.down]
            x, y = self.valid().batch(0, self.windows)
            labels = y[:, -1]
            with self._turns(heads, CALIBRATION, None):
                got = self._ask(heads, self.replicas.next_base(), x, timeout_s)
            probs: list[torch.Tensor | None] = [None] * self.count
            for r, out in got.items():
                if isinstance(out, str):
                    self.log.warning("calibration: head %d %s", r, out, extra=self.replicas.extra)
                else:
                    probs[r] = torch.softmax(out.float(), -1)
            if all(p is None for p in probs):
                raise NoReplica("no head answered the calibration windows")
            accuracy = [None if p is None else score(p, labels).accuracy for p in probs]
            combiner = AttentionCombiner(self.count, seed=self.seed)
            fit_attention(combiner, probs, labels, steps=200, seed=self.seed)
            weights = [a or 0.0 for a in accuracy]
            combined = {
                m: score(
                    combine(m, probs, weights if m == "weighted" else None, combiner), labels
                ).accuracy
                for m in ("vote", "weighted", "attention")
            }
            cal = Calibration(len(labels), accuracy, combiner, combined)
            self.log.info("task heads calibrated: %s", cal.as_json(), extra=self.replicas.extra)
            self._cal = (key, cal)
            return cal

    def generate(
        self,
        prompt: str,
        tokens: int,
        method: str,
        sampling: Sampling | None = None,
        on_token: Callable[[int], None] | None = None,
        cancel: threading.Event | None = None,
        ids: list[int] | None = None,
        tenant: str = "default",
        deadline: float | None = None,
    ) -> tuple[str, str, dict[str, object]]:
        """``("heads", text, info)``: ``tokens`` drawn from the heads' combined distributions;
        ``info`` says which heads answered, their weights and the calibration. ``deadline``
        (``time.monotonic()``) stops it between tokens."""
        heads = [r for r in range(self.count) if r not in self.replicas.down]
        if not heads:
            raise NoReplica("no head is up: every replica is out of routing")
        cal = None if method == "vote" else self.calibration(self.replicas.token_timeout_s)
        weights = None if cal is None or method != "weighted" else [a or 0.0 for a in cal.accuracy]
        missing: dict[int, str] = {r: "out of routing" for r in range(self.count) if r not in heads}
        live = list(heads)

        def forward(
            step: int, ctx: torch.Tensor, timeout_s: float, session: str | None, start: int
        ) -> torch.Tensor:
            got = self._ask(list(live), step, ctx, timeout_s, session, start)
            probs: list[torch.Tensor | None] = [None] * self.count
            for r, out in got.items():
                if isinstance(out, str):
                    live.remove(r)  # its session is broken: out for the rest of the request
                    missing[r] = out
                    self.log.warning("head %d dropped: %s", r, out, extra=self.replicas.extra)
                else:
                    probs[r] = torch.softmax(out[0].float(), -1)[None]
            if not live:
                raise NoReplica(f"no head answered: {missing}")
            mixed = combine(method, probs, weights, None if cal is None else cal.combiner)
            return mixed[0].clamp_min(1e-30).log()

        session = uuid.uuid4().hex[:16]
        tok = self.replicas.tokenizer
        # in flight on every head's replica: a version loads into one only once it ended
        with self.replicas.admitted([f"replica-{r}" for r in heads], cancel=cancel):
            try:
                out = decoding.decode(
                    forward,
                    self.replicas.dep.layout.model.seq,
                    tok.encode(prompt),
                    tokens,
                    sampling or Sampling(seed=0),
                    step_base=self.replicas.next_base(),
                    cancel=cancel,
                    deadline=deadline,
                    turn=lambda until: self._turns(list(live), tenant, until),
                    token_timeout_s=self.replicas.token_timeout_s,
                    on_token=None if on_token is None else text_stream(tok, on_token),
                    session=session,
                )
            finally:
                for r in heads:
                    self.replicas.dep.end_session(session, r)
        if ids is not None:
            ids[:] = out
        info: dict[str, object] = {
            "aggregate": method,
            "heads": self.count,
            "answered": sorted(live),
            "missing": {str(r): why for r, why in sorted(missing.items())},
            "weights": weights,
        }
        if cal is not None:
            info["calibration"] = cal.as_json()
        return "heads", tok.decode(out), info

    def close(self) -> None:
        self._pool.shutdown(wait=False)
