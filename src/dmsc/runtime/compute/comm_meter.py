"""The time and bytes of each parallel mode's communication in a worker's step.

Each mode's exchange is timed where it happens, as the worker waits for it:

- ``tp``: the tensor-parallel all-reduces (Megatron's ``g`` in the forward, ``f`` in the
  backward, :mod:`.tensor_parallel`), or under sequence parallelism their all-gathers and
  reduce-scatters (:mod:`.sequence_parallel`);
- ``ep``: the expert-parallel all-to-alls (the counts, the tokens out and back in the forward,
  and the two exchanges of their gradients in the backward, :mod:`.expert_parallel`);
- ``dp``: the exposed part of the data-parallel all-reduce, from the end of the backward until
  every gradient is averaged (what the buckets launched during the backward did not hide);
- ``pp``: the waits for a neighbouring stage's activation or gradient and for this stage's own
  sends at the end of the step (:mod:`.executor`).

Beside the expert-parallel exchange's time, the tokens the worker's mixtures routed (each
token's top-k choices) and the tokens its experts received from every rank of its group, in
all (``routed``, ``received``) and mixture forward by mixture forward (``tokens``: a list of
``[routed, received]``, at most :data:`MAX_WALLS`): each mixture's all-to-alls wait for the rank
that received most, so the deployment puts the calls together over each expert-parallel group
(:func:`group_routing`: ``busiest``, the sum over the calls of the most any member received)
and the step's trace keeps that sum, not the calls. The routing's imbalance, which the cost
model prices (``JobSpec.expert_imbalance``), is ``busiest`` over the tokens a replica routed
(:func:`dmsc.data.comm_modes.expert_imbalance`).

Beside each mode's seconds, the wall-clock times (``time.time()``) its first timed exchange of the
step began and its last ended (``t0``, ``t1``): the replicas of a stage are compared on them
(:mod:`dmsc.data.comm_modes`: an exchange's exposed time is from the last replica's entry to the
last one's exit).

A tensor-parallel rank's wait in a call is also its partner's lateness: a rank that reaches the
all-reduce first waits there for the other's compute, which the cost model prices as compute.
On this project's 2-core machine one rank's tp wait at tp = 2 went from 12 to 98 ms a step from
step to step, around a step of 80-120 ms (2026-12-05). So the meter keeps each tensor-parallel
call's wall-clock entry and exit too (``walls``, at most :data:`MAX_WALLS` a step) and
:func:`group_exposed` puts a replica's ranks together: each call's exposed time is from the last
rank's entry to the last one's exit, the step's ``s`` their sum (the rank's own wait kept as
``wait_s``). The expert-parallel all-to-alls likewise, over the replicas of each expert-parallel
group (:func:`replicas_exposed`): the replica that waited least in them had still waited, call
by call, for whichever of the others came late.

The collectives run deep inside the model's modules (an autograd function, an expert layer),
where nothing of the worker's is at hand, and in the data-parallel communication thread; a
worker process serves one stage and runs one step at a time, so one meter per process
(:data:`METER`), locked for those threads, is the worker's step's. The server takes its figures
with the step's reply (:meth:`CommMeter.take`) and empties it at the start of each step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

MODES = ("tp", "dp", "ep", "pp")
Key = tuple[int, int]  # a worker's (stage, replica)
CALL_WALLS = ("tp", "ep")  # the modes whose calls' walls are kept one by one (docstring)
MAX_WALLS = 4096  # a step's calls kept at most (a serving worker's meter is taken rarely)


class CommMeter:
    """Seconds and bytes of each mode's communication since it was last taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._bytes: dict[str, int] = {}
        self._calls: dict[str, int] = {}
        self._wall: dict[str, tuple[float, float]] = {}  # first timed entry, last exit
        self._walls: dict[str, list[tuple[float, float]] | None] = {}  # None: past MAX_WALLS
        self._tokens: list[tuple[int, int]] = []  # each mixture's routed, received (docstring)

    def add(
        self, mode: str, seconds: float, nbytes: int = 0, wall: tuple[float, float] | None = None
    ) -> None:
        """Count one exchange of ``mode``: ``seconds`` waited, ``nbytes`` this worker sent, and
        where timed, the wall-clock ``(entry, exit)`` of the wait."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        with self._lock:
            self._seconds[mode] = self._seconds.get(mode, 0.0) + seconds
            self._bytes[mode] = self._bytes.get(mode, 0) + nbytes
            self._calls[mode] = self._calls.get(mode, 0) + 1
            if wall is not None:
                was = self._wall.get(mode, wall)
                self._wall[mode] = (min(was[0], wall[0]), max(was[1], wall[1]))
                if mode in CALL_WALLS:
                    calls = self._walls.setdefault(mode, [])
                    if calls is not None and len(calls) < MAX_WALLS:
                        calls.append(wall)
                    else:
                        self._walls[mode] = None
            elif mode in CALL_WALLS:  # a call without its wall clock: the calls do not pair up
                self._walls[mode] = None

    def count_tokens(self, routed: int, received: int) -> None:
        """Count one expert-parallel mixture's forward: the (token, choice) pairs it routed
        and those its experts received."""
        with self._lock:
            if len(self._tokens) < MAX_WALLS:
                self._tokens.append((routed, received))

    @contextmanager
    def timed(self, mode: str, nbytes: int = 0) -> Iterator[None]:
        """Count the block as one exchange of ``mode`` (also when it raises)."""
        t0, w0 = time.perf_counter(), time.time()
        try:
            yield
        finally:
            took = time.perf_counter() - t0
            self.add(mode, took, nbytes, (w0, w0 + took))

    def take(self) -> dict[str, dict[str, float]]:
        """The figures so far by mode (``s``, ``bytes``, ``calls``; ``t0``, ``t1`` where a
        call was timed), and a fresh start."""
        with self._lock:
            out: dict[str, dict[str, float]] = {
                m: {"s": self._seconds[m], "bytes": self._bytes[m], "calls": self._calls[m]}
                for m in MODES
                if m in self._seconds
            }
            for m, (t0, t1) in self._wall.items():
                out[m] |= {"t0": t0, "t1": t1}
            for m, walls in self._walls.items():
                if walls is not None and m in out:
                    out[m]["walls"] = [list(w) for w in walls]  # type: ignore[assignment]
            if self._tokens and "ep" in out:
                out["ep"] |= {
                    "routed": sum(r for r, _ in self._tokens),
                    "received": sum(r for _, r in self._tokens),
                    "tokens": [list(t) for t in self._tokens],  # type: ignore[dict-item]
                }
            self._seconds, self._bytes, self._calls = {}, {}, {}
            self._wall, self._walls, self._tokens = {}, {}, []
        return out


def ring_allreduce_bytes(numel: int, element_size: int, n: int) -> int:
    """The bytes one member of a ring all-reduce of ``n`` members sends: ``2 (n - 1) / n`` of
    the tensor (a reduce-scatter, then an all-gather; Patarasuk and Yuan, JPDC 2009)."""
    return 0 if n < 2 else int(2 * (n - 1) * numel * element_size / n)


def split_sent(stage: int, replica: int, sent: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    """The pipeline's and the data-parallel exchange's shares of a worker's bytes pushed to each
    peer (``"STAGE/REPLICA"``, as a step's trace keeps them): to another stage is ``pp``, to
    another replica of its own stage ``dp``."""
    out: dict[str, dict[str, Any]] = {}
    for key, n in sent.items():
        s, _, r = key.partition("/")
        if (int(s), int(r)) == (stage, replica):
            continue
        mode = "dp" if int(s) == stage else "pp"
        entry = out.setdefault(mode, {"bytes": 0, "links": {}})
        entry["bytes"] += int(n)
        entry["links"][key] = entry["links"].get(key, 0) + int(n)
    return out


def step_comm(
    taken: Mapping[str, Mapping[str, float]], stage: int, replica: int, sent: Mapping[str, int]
) -> dict[str, dict[str, Any]]:
    """A step's figures by mode as its trace keeps them: the meter's (``taken``) with the
    pipeline's and the data-parallel bytes, by link, from what the worker pushed (``sent``,
    :func:`split_sent`; the meter times those exchanges, the peers count their bytes)."""
    out: dict[str, dict[str, Any]] = {m: dict(v) for m, v in taken.items()}
    for mode, share in split_sent(stage, replica, sent).items():
        entry = out.setdefault(mode, {"s": 0.0, "calls": 0})
        entry["bytes"], entry["links"] = share["bytes"], share["links"]
    return out


def group_exposed(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Rank 0's figure of a mode (``ranks[0]``) with its seconds (``s``) the group's exposed
    time in its calls (module docstring): call by call, from the last rank's entry to the last
    one's exit, kept between the least and the most any rank waited in it (so that clocks a
    little apart cannot carry it out), summed; rank 0's own wait as ``wait_s``. Where the ranks'
    calls do not pair up (a rank without its walls, or with another count of them) the figure
    stays rank 0's wait. The walls are left out of what it returns."""
    out = {k: v for k, v in ranks[0].items() if k != "walls"}
    walls: list[list[list[float]]] = [r.get("walls") or [] for r in ranks]
    paired = all("walls" in r for r in ranks) and len({len(w) for w in walls}) == 1
    if len(ranks) < 2 or not paired:
        return out
    exposed = 0.0
    for calls in zip(*walls, strict=True):
        waits = [b - a for a, b in calls]
        span = max(b for _, b in calls) - max(a for a, _ in calls)
        exposed += min(max(span, min(waits)), max(waits))
    return out | {"s": exposed, "wait_s": ranks[0].get("s", 0.0)}


def replicas_exposed(
    comm: Mapping[Key, Mapping[str, Mapping[str, Any]]], mode: str, groups: Sequence[Sequence[int]]
) -> dict[Key, dict[str, dict[str, Any]]]:
    """A step's figures by worker (``(stage, replica)``) with each member's ``mode`` at its
    group's exposed time (:func:`group_exposed`), for ``groups`` of each stage's replicas (the
    expert-parallel groups); a group whose calls do not pair up keeps each member's own wait
    (its walls left out), one missing a member's figure is left as it was."""
    out = {k: {m: dict(f) for m, f in v.items()} for k, v in comm.items()}
    for stage in {s for s, _ in comm}:
        for group in groups:
            keys = [(stage, r) for r in group]
            if len(keys) < 2 or not all(mode in comm.get(k, {}) for k in keys):
                continue
            figs = [comm[k][mode] for k in keys]
            for i, k in enumerate(keys):
                out[k][mode] = group_exposed([figs[i], *figs[:i], *figs[i + 1 :]])
    return out


def group_routing(
    comm: Mapping[Key, Mapping[str, Mapping[str, Any]]], groups: Sequence[Sequence[int]]
) -> dict[Key, dict[str, dict[str, Any]]]:
    """A step's figures by worker with each expert-parallel group's ``busiest`` on its members'
    ``ep`` figure: mixture forward by mixture forward, the most tokens any member received,
    summed (module docstring). A group whose members did not all keep their calls, or kept
    different counts of them, gets the most any member received in all."""
    out = {k: {m: dict(f) for m, f in v.items()} for k, v in comm.items()}
    for stage in {s for s, _ in comm}:
        for group in groups:
            keys = [(stage, r) for r in group]
            figs = [comm.get(k, {}).get("ep", {}) for k in keys]
            if not all(f.get("routed") for f in figs):
                continue
            calls = [f.get("tokens") or [] for f in figs]
            if all(calls) and len({len(c) for c in calls}) == 1:
                busiest = sum(max(c[1] for c in call) for call in zip(*calls, strict=True))
            else:
                busiest = max(f["received"] for f in figs)
            for k in keys:
                out[k]["ep"]["busiest"] = busiest
    return out


def without_walls(comm: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A step's figures by mode without the calls' walls and tokens (what a step's trace keeps:
    :func:`group_exposed` and :func:`group_routing` put them together first)."""
    return {
        m: {k: v for k, v in f.items() if k not in ("walls", "tokens")} for m, f in comm.items()
    }


def with_commit(
    step: Mapping[str, Mapping[str, Any]], commit: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """A step's figures by mode (:func:`step_comm`) with those its ``Commit`` call metered after
    it (a DiLoCo or FedAvg round's exchange, run as the round's last step is applied) added."""
    out = {m: dict(v) for m, v in step.items()}
    for mode, fig in commit.items():
        entry = out.setdefault(mode, {"s": 0.0, "bytes": 0, "calls": 0})
        for key in ("s", "bytes", "calls"):
            entry[key] = entry.get(key, 0) + fig.get(key, 0)
        if "t0" in fig:  # the wall-clock span of both
            entry["t0"] = min(entry.get("t0", fig["t0"]), fig["t0"])
            entry["t1"] = max(entry.get("t1", fig["t1"]), fig["t1"])
    return out


METER = CommMeter()  # this worker process's (module docstring)
