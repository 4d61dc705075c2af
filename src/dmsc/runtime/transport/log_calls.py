"""The control plane's ``Logs`` call: the lines of the logs that Ray nodes hold elsewhere.

``dmsc logs --grep`` reads the files of its own machine; for a deployment on Ray it also asks
the control plane, which asks each node's host actor
(:mod:`dmsc.runtime.control.launch.ray_logs`). The request carries what ``dmsc logs`` filters
on, checked at the boundary like every control message; the reply the lines found (service,
time, line), at most ``lines`` of them (the newest), and the nodes that did not answer.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from dmsc.runtime.transport.messages import Message
from dmsc.runtime.transport.replies import Reply

MAX_LINES = 20_000  # lines in one reply: a few MB of log lines on the wire


class LogsRequest(Message):
    """Search the logs the deployment's Ray nodes hold (``dmsc logs --grep``)."""

    pattern: Annotated[str, Field(max_length=4096)] | None = None  # a regular expression
    since_s: Annotated[float, Field(ge=0)] | None = None  # unix seconds
    services: list[Annotated[str, Field(max_length=256)]] | None = None
    lines: Annotated[int, Field(ge=1, le=MAX_LINES)] = MAX_LINES  # the newest this many
    everywhere: bool = False  # this machine's nodes too (their files are the CLI's own)


class LogsReply(Reply):
    launcher: Literal["local", "ray"]
    # service, time, line; oldest first
    entries: list[tuple[str, float | None, str]] = Field(default_factory=list)
    unreachable: list[str] = Field(default_factory=list)  # Ray nodes that did not answer in time
