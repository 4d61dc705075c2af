"""When to add or remove a serving replica: the autoscaler's rule, apart from what it drives.

The signal is the number of inference requests in flight in the whole deployment (each counted
from the moment it takes a replica until its answer, waiting for its turns included), sampled
every ``interval`` and averaged over the last ``window_s`` seconds. The rule:

- wanted = ceil(mean in flight / ``target``), clamped to [``min``, ``max``];
- above the current count: one replica more (a pipeline takes seconds to start; the next one is
  decided on the load it then sees);
- below it: one replica less, but only when the longer scale-in window (:data:`SCALE_IN_WINDOWS`
  windows: a minute at the default five seconds) is full and even its busiest sample fits in one
  replica fewer (so a lull between bursts does not remove what the next burst needs, and one
  tenant sending a burst every half minute cannot make the deployment start and stop pipelines
  at that pace: removal is slower than addition, like the scale-down stabilization window of
  Kubernetes' HorizontalPodAutoscaler);
- no change within ``cooldown_s`` of the last one.

:func:`parse_autoscale` reads ``dmsc up --autoscale infer:min=1,max=4,target=2,cooldown=10,
window=5``. Pure: no clock of its own, no I/O (:mod:`.serving` runs it against the deployment).
"""

from __future__ import annotations

import math
from collections import deque

from pydantic import ValidationError

from dmsc.runtime.transport.messages import AutoscaleSettings

SCALE_IN_WINDOWS = 12  # the scale-in window, in windows of the load's mean
KEYS = {
    "min": "min",
    "max": "max",
    "target": "target",
    "cooldown": "cooldown_s",
    "window": "window_s",
}


def parse_autoscale(text: str) -> AutoscaleSettings:
    """``infer:KEY=VALUE,...`` (keys ``min``, ``max``, ``target``, ``cooldown``, ``window``);
    ValueError says what is wrong."""
    kind, _, options = text.partition(":")
    if kind != "infer":
        raise ValueError(f"{text!r}: only inference replicas scale (infer:min=1,max=4)")
    values: dict[str, str] = {}
    for part in filter(None, options.split(",")):
        key, eq, value = part.partition("=")
        if not eq or key not in KEYS:
            raise ValueError(f"{part!r}: expected KEY=VALUE, KEY one of {', '.join(KEYS)}")
        values[KEYS[key]] = value
    try:
        return AutoscaleSettings.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{where}: {first['msg']}".removeprefix(": ")) from None


class ScalePolicy:
    """The rule of the module docstring, fed one sample at a time."""

    def __init__(self, settings: AutoscaleSettings) -> None:
        self.s = settings
        self.samples: deque[tuple[float, int]] = deque()
        self.last_change = -math.inf
        self.started: float | None = None

    def observe(self, now: float, in_flight: int, current: int) -> int:
        """The replica count wanted after the sample ``in_flight`` at ``now`` (``current``
        when nothing should change)."""
        if self.started is None:
            self.started = now
        self.samples.append((now, in_flight))
        scale_in_s = SCALE_IN_WINDOWS * self.s.window_s
        while self.samples and self.samples[0][0] < now - scale_in_s:
            self.samples.popleft()
        floor, ceiling = self.s.min, self.s.max
        if current < floor:
            return current + 1  # below the minimum: no load needed, no cooldown
        if now - self.last_change < self.s.cooldown_s:
            return current
        recent = [n for t, n in self.samples if t >= now - self.s.window_s]
        mean = sum(recent) / len(recent)
        wanted = min(ceiling, max(floor, math.ceil(mean / self.s.target)))
        if wanted > current:
            return current + 1
        window_full = now - self.started >= scale_in_s
        loads = [n for _, n in self.samples]
        busiest = min(ceiling, max(floor, math.ceil(max(loads) / self.s.target)))
        if wanted < current and window_full and busiest <= current - 1:
            return current - 1
        return current

    def changed(self, now: float) -> None:
        """A replica was added or removed at ``now``: the cooldown starts."""
        self.last_change = now
