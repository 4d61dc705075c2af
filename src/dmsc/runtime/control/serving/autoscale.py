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
- no change within ``cooldown_s`` of the last one;
- with ``lookahead`` (``lookahead_s`` > 0) it also scales out *ahead* of a ramp: the rate of
  requests arriving (a counter, read with the load) is taken once a window (the last
  :data:`RATE_WINDOWS` of them), forecast ``lookahead_s`` ahead (the time a new pipeline takes
  to be ready: the setting, or the last measured start when that was longer) by Holt's linear
  smoothing (:mod:`dmsc.data.forecast`), and one replica is added when the forecast exceeds
  what the replicas serve. What a replica serves at ``target`` in flight comes from queueing
  theory: its requests take turns (a token each), a processor-sharing queue, whose mean number
  in system is L = rho / (1 - rho) and time in system W = s / (1 - rho) whatever the
  distribution of the service time ``s`` (Kleinrock, *Queueing Systems* vol. 2, 1976, ch. 4).
  Over the last window Little's law (L = lambda W) gives W = mean in flight / rate, the load per
  replica gives rho, hence ``s`` = W / (1 + L per replica); at ``target`` in flight a replica
  runs at rho = target / (1 + target), so it serves ``target / (1 + target) / s`` requests per
  second.
  The reason then says so (``forecast: 9.1 req/s in 20s > capacity 6.0 req/s``), and a replica
  the forecast still needs is not removed.

:func:`parse_autoscale` reads ``dmsc up --autoscale infer:min=1,max=4,target=2,cooldown=10,
window=5,lookahead=20``. Pure: no clock of its own, no I/O (:mod:`.serving` runs it against the
deployment).
"""

from __future__ import annotations

import math
from collections import deque

from pydantic import ValidationError

from dmsc.data.forecast import MIN_POINTS, forecast_ahead
from dmsc.runtime.transport.messages import AutoscaleSettings

SCALE_IN_WINDOWS = 12  # the scale-in window, in windows of the load's mean
RATE_WINDOWS = 24  # the request rates the forecast is fitted on, one a window
KEYS = {
    "min": "min",
    "max": "max",
    "target": "target",
    "cooldown": "cooldown_s",
    "window": "window_s",
    "lookahead": "lookahead_s",
}


def parse_autoscale(text: str) -> AutoscaleSettings:
    """``infer:KEY=VALUE,...`` (keys ``min``, ``max``, ``target``, ``cooldown``, ``window``,
    ``lookahead``);
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
    """The rule of the module docstring, fed one sample at a time; :attr:`why` says why the
    last sample wanted what it wanted."""

    def __init__(self, settings: AutoscaleSettings) -> None:
        self.s = settings
        self.samples: deque[tuple[float, int]] = deque()
        # a point a window: (time, req/s, mean in flight)
        self.rates: deque[tuple[float, float, float]] = deque(maxlen=RATE_WINDOWS)
        self.last_change = -math.inf
        self.started: float | None = None
        self.counts: tuple[float, int] | None = None  # (time, arrivals so far) a window ago
        self.ready_s = 0.0  # how long the last scale-out took to be ready (measured)
        self.why = "no sample yet"

    @property
    def lookahead_s(self) -> float:
        """How far ahead the rate is forecast: 0 (no forecast), or the setting and the last
        measured start, whichever is longer."""
        return max(self.s.lookahead_s, self.ready_s) if self.s.lookahead_s > 0 else 0.0

    def observe(self, now: float, in_flight: int, current: int, arrivals: int | None = None) -> int:
        """The replica count wanted after the sample ``in_flight`` at ``now`` (``current``
        when nothing should change); ``arrivals``: the requests that arrived so far (a
        counter), from which the rate is forecast."""
        if self.started is None:
            self.started = now
        self.samples.append((now, in_flight))
        scale_in_s = SCALE_IN_WINDOWS * self.s.window_s
        self._rate(now, arrivals)
        while self.samples and self.samples[0][0] < now - scale_in_s:
            self.samples.popleft()
        floor, ceiling = self.s.min, self.s.max
        if current < floor:
            self.why = f"{current} replicas, below the minimum {floor}"
            return current + 1  # below the minimum: no load needed, no cooldown
        if now - self.last_change < self.s.cooldown_s:
            self.why = f"cooldown: {now - self.last_change:g} s since the last change"
            return current
        recent = [n for t, n in self.samples if t >= now - self.s.window_s]
        mean = sum(recent) / len(recent)
        wanted = min(ceiling, max(floor, math.ceil(mean / self.s.target)))
        if wanted > current:
            self.why = f"{mean:.1f} requests in flight, {current} replicas: want {wanted}"
            return current + 1
        ahead = self.forecast(current)
        if ahead is not None and current < ceiling:
            rate, capacity, needed = ahead
            if needed > current:
                self.why = (
                    f"forecast: {rate:.1f} req/s in {self.lookahead_s:.0f}s > capacity "
                    f"{capacity:.1f} req/s ({current} replicas)"
                )
                return current + 1
        window_full = now - self.started >= scale_in_s
        loads = [n for _, n in self.samples]
        busiest = min(ceiling, max(floor, math.ceil(max(loads) / self.s.target)))
        if ahead is not None:
            busiest = max(busiest, ahead[2])  # what the forecast needs stays
        if wanted < current and window_full and busiest <= current - 1:
            self.why = f"{mean:.1f} requests in flight, {current} replicas: want {wanted}"
            return current - 1
        self.why = f"{mean:.1f} requests in flight, {current} replicas: keep"
        return current

    def _rate(self, now: float, arrivals: int | None) -> None:
        """Close a window of arrivals: once ``window_s`` has passed since the last one, its
        rate and mean in flight become one point of the series the forecast reads (a point a
        window: sample by sample the counts are too noisy to extrapolate a trend from)."""
        if arrivals is None:
            return
        if self.counts is None:
            self.counts = (now, arrivals)
            return
        t0, n0 = self.counts
        if now - t0 < self.s.window_s:
            return
        loads = [n for t, n in self.samples if t > t0]
        self.rates.append((now, (arrivals - n0) / (now - t0), sum(loads) / len(loads)))
        self.counts = (now, arrivals)

    def forecast(self, current: int) -> tuple[float, float, int] | None:
        """(the rate forecast :attr:`lookahead_s` ahead, what ``current`` replicas serve, the
        replicas the forecast needs); None without a look-ahead or enough windows, or when
        nothing arrived in the last one (no time in flight to measure)."""
        if self.lookahead_s <= 0 or len(self.rates) < MIN_POINTS:
            return None
        _, rate_now, load_now = self.rates[-1]
        if rate_now <= 0 or load_now <= 0:
            return None
        in_flight_s = load_now / rate_now  # Little's law: W = L / lambda
        busy = load_now / current  # in flight per replica
        alone_s = in_flight_s / (1 + busy)  # processor sharing: W = s (1 + L) (docstring)
        times = [t for t, _, _ in self.rates]
        interval = (times[-1] - times[0]) / (len(times) - 1)
        rate = max(0.0, forecast_ahead([r for _, r, _ in self.rates], self.lookahead_s / interval))
        per_replica = self.s.target / (1 + self.s.target) / alone_s  # rho at target, times mu
        needed = min(self.s.max, max(self.s.min, math.ceil(rate / per_replica)))
        return rate, current * per_replica, needed

    def changed(self, now: float, ready_s: float | None = None) -> None:
        """A replica was added or removed at ``now`` (an added one took ``ready_s`` to be
        ready, when measured): the cooldown starts."""
        self.last_change = now
        if ready_s is not None:
            self.ready_s = ready_s
