"""A stage worker's inbox: the frames that have arrived and not yet been consumed, per epoch.

``Push`` puts a frame in; the pipeline executor and the gradient averaging take it out by
(kind, step, micro-batch), waiting a bounded time. The inbox is also where fencing takes effect:
it holds the epoch the worker serves, refuses frames of any other, and moving it to a newer epoch
(``Abort``) drops what it holds and fails every wait in progress with :class:`Aborted`.
"""

from __future__ import annotations

import threading

import torch

from dmsc.runtime.transport.rpc import Abandoned, BadRequest
from dmsc.runtime.transport.wire import Kind


class Aborted(Abandoned):
    """The step was abandoned: the worker moved to a newer epoch."""


class Inbox:
    """Frames of the current epoch waiting to be consumed, by (kind, step, micro-batch)."""

    def __init__(self, epoch: int = 0) -> None:
        self._items: dict[tuple[int, int, int], torch.Tensor] = {}
        self._cond = threading.Condition()
        self.epoch = epoch

    def put(
        self, kind: Kind, step: int, mb: int, tensor: torch.Tensor, epoch: int, parts: int = 1
    ) -> None:
        """Hold ``tensor`` as the frame (kind, step, mb); with ``parts`` > 1 a whole batch, cut
        along its first dimension into the micro-batches ``mb .. mb + parts - 1`` (as
        ``torch.chunk`` cuts it)."""
        cut = tensor.chunk(parts) if parts > 1 else (tensor,)
        if len(cut) != parts:
            raise BadRequest(f"a batch of {tensor.shape[0]} rows cut into {parts} micro-batches")
        with self._cond:
            if epoch != self.epoch:
                raise BadRequest(
                    f"fenced: a frame of epoch {epoch}, this worker is at {self.epoch}"
                )
            for i, part in enumerate(cut):
                self._items[(int(kind), step, mb + i)] = part
            self._cond.notify_all()

    def get(
        self, kind: Kind, step: int, mb: int, timeout_s: float, epoch: int | None = None
    ) -> torch.Tensor:
        """The frame, waiting at most ``timeout_s``; :class:`Aborted` once the inbox leaves
        ``epoch`` (default: the epoch it is at on entry)."""
        key = (int(kind), step, mb)
        with self._cond:
            epoch = self.epoch if epoch is None else epoch
            if not self._cond.wait_for(
                lambda: key in self._items or self.epoch != epoch, timeout=timeout_s
            ):
                raise TimeoutError(f"no {kind.name.lower()} for step {step} micro-batch {mb}")
            if self.epoch != epoch:
                raise Aborted(f"step {step} abandoned: moved to epoch {self.epoch}")
            return self._items.pop(key)

    def advance(self, epoch: int) -> None:
        """Move to ``epoch``: drop every frame held and fail every wait in progress."""
        with self._cond:
            self.epoch = epoch
            self._items.clear()
            self._cond.notify_all()

    def drop(self, kind: Kind, before_step: int) -> None:
        """Forget frames of ``kind`` from steps before ``before_step`` (a late replica's)."""
        with self._cond:
            for key in [k for k in self._items if k[0] == int(kind) and k[1] < before_step]:
                del self._items[key]
