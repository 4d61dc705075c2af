"""The inference sessions a stage worker keeps: each request's keys and values (a KV cache per
layer) from one token to the next, at most a configured number of them, idle ones dropped."""

from __future__ import annotations

import time

from dmsc.runtime.compute.models.attention import StageCache, StageSession
from dmsc.runtime.transport.rpc import BadRequest, NoRoom


class Sessions(dict[str, StageSession]):
    """A stage's open inference sessions, by session id."""

    def take(
        self, session: str, start: int, most: int, idle_s: float, stage: int, seq: int
    ) -> StageCache:
        """The keys and values of ``session`` for a step from position ``start`` (0 opens it), a
        position inside the model's sequence length ``seq`` (past it the context slides,
        uncached). Sessions idle past ``idle_s`` go first; a new one past ``most`` open is
        refused (:class:`NoRoom`), as is a step that does not start where the session ends."""
        if start >= seq:
            raise BadRequest(f"session {session}: position {start} is past the model's last")
        now = time.monotonic()
        for key in [k for k, s in self.items() if now - s.used > idle_s]:
            del self[key]
        if start == 0:
            self.pop(session, None)
            if len(self) >= most:
                raise NoRoom(
                    f"stage {stage}: {len(self)} inference sessions open, the most it keeps; "
                    "retry when one ends"
                )
            self[session] = StageSession(StageCache(), now)
        held = self.get(session)
        if held is None:
            raise BadRequest(f"session {session}: not open here (ended, idle too long, or lost)")
        if held.cache.length != start:
            raise BadRequest(
                f"session {session} holds {held.cache.length} positions, the step starts at {start}"
            )
        held.used = now
        return held.cache
