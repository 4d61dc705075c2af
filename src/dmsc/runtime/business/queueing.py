"""What the gateway expects of a task queue: the protocol, and the refusals it answers in HTTP
(the queue itself, :mod:`dmsc.runtime.control.tasks.task_queue`, raises them; the control layer
drives the business layer, not the other way round, so they are declared here)."""

from __future__ import annotations

from typing import Any, Protocol

from dmsc.data.db import TaskRecord


class QuotaExceeded(ValueError):
    """A tenant's queued work would pass a quota; the message names it (HTTP 429)."""


class TaskFinished(ValueError):
    """The task is over (done, failed or cancelled): there is nothing to cancel (HTTP 409)."""


class TaskQueue(Protocol):
    """Where the gateway puts long work: the control plane's persistent task queue
    (:class:`dmsc.runtime.control.tasks.task_queue.TaskQueue`)."""

    def cancel(self, task_id: int) -> str:
        """The task's new state (``cancelled`` or ``cancelling``); KeyError for an unknown
        task, :class:`TaskFinished` for one that is over."""
        ...

    def submit(
        self,
        kind: str,
        params: dict[str, Any],
        tenant: str = "default",
        priority: int = 0,
        weight: float = 1.0,
        lane: str = "sync",
        max_attempts: int = 3,
    ) -> TaskRecord: ...

    def requeue(self, task_id: int) -> None: ...

    def exceptions(self) -> list[TaskRecord]: ...
