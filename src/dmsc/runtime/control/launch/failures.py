"""Finding failed workers: who is dead or silent, who does not answer, and waiting on calls.

Three signs, in the order they are cheap to read: the process exited (the launcher knows), the
registry heard no heartbeat for its TTL (default 10 s, heartbeats every TTL/3), or the worker does
not answer ``Health`` within a deadline (:func:`probe`: a stuck worker can heartbeat and still
hang). While a step runs, :func:`gather` waits on every call and watches every worker meanwhile,
so that a failure is raised as soon as any sign shows (:class:`WorkerFailure`, naming the stage,
replica and SID) rather than when the step's deadline passes.

The functions work on anything shaped like :class:`Workers` (a deployment): they read its
handles, clients and registry and change nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

import grpc

from dmsc.runtime.business.registry import Registry
from dmsc.runtime.control.launch.launchers import Launcher, WorkerHandle
from dmsc.runtime.transport.messages import Health
from dmsc.runtime.transport.rpc import Client, NoRoom

Key = tuple[int, int]  # (stage, replica)


def key_of(h: WorkerHandle) -> Key:
    return (h.config.stage, h.config.replica)


class WorkerFailure(RuntimeError):
    """Workers that failed (possibly none identified) and why; ``at`` is the detection time."""

    def __init__(self, failed: dict[Key, str], sids: dict[Key, str], reason: str = "") -> None:
        self.failed = failed
        self.at = time.time()
        parts = [
            f"stage {k[0]} replica {k[1]} ({sids.get(k, '?')}): {r}" for k, r in failed.items()
        ]
        super().__init__("; ".join(parts) or reason or "a step failed")


class CheckpointRefused(RuntimeError):
    """Workers refused to load a checkpoint (its file missing, failing its hash, unreadable):
    ``refused`` says which and why; ``step`` is the checkpoint's, when known."""

    def __init__(self, refused: dict[Key, str], step: int | None = None) -> None:
        self.refused = refused
        self.step = step
        self.at = time.time()
        parts = [f"stage {k[0]} replica {k[1]}: {r}" for k, r in sorted(refused.items())]
        what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
        super().__init__(f"{what} does not verify: " + "; ".join(parts))


class StepRestartNeeded(RuntimeError):
    """A stage leader dropped the step (late gradients, policy ``restart``); nothing applied."""


class Workers(Protocol):
    """What detection reads: the serving workers, their clients, the launcher and registry."""

    @property
    def launcher(self) -> Launcher: ...

    @property
    def registry(self) -> Registry: ...

    @property
    def handles(self) -> Sequence[WorkerHandle]: ...

    @property
    def clients(self) -> Mapping[Key, Client]: ...


def suspects(ws: Workers, keys: Collection[Key] | None = None) -> dict[Key, str]:
    """Workers (of ``keys``, default all) that are not alive: exited, or silent in the registry
    past its TTL. A replica's tensor-parallel rank past the first (``ws.tp.handles``, where
    there are some) fails its replica's key."""
    out: dict[Key, str] = {}
    ttl = ws.registry.ttl_s
    for h in [*ws.handles, *getattr(getattr(ws, "tp", None), "handles", [])]:
        key = key_of(h)
        if keys is not None and key not in keys:
            continue
        if not ws.launcher.alive(h):
            out[key] = ws.launcher.exit_reason(h) + (
                f" (tp rank {h.config.tp_rank})" if h.config.tp_rank else ""
            )
            continue
        age = ws.registry.heartbeat_age(h.config.sid)
        if age is None:
            out[key] = "no heartbeat for the registry TTL"
        elif age > ttl:
            out[key] = f"no heartbeat for {age:.1f} s (TTL {ttl:g} s)"
    return out


def probe(ws: Workers, timeout_s: float, keys: Collection[Key] | None = None) -> dict[Key, str]:
    """Workers (of ``keys``, default all) that do not answer Health within ``timeout_s``; every
    worker is asked at once, so a dead one costs one timeout."""
    return health(ws, timeout_s, keys)[1]


def health(
    ws: Workers, timeout_s: float, keys: Collection[Key] | None = None
) -> tuple[dict[Key, dict[str, Any]], dict[Key, str]]:
    """Ask every worker of ``keys`` (default all) for Health at once: the answers, and why each
    worker that gave none did not."""
    keys = list(ws.clients) if keys is None else list(keys)
    answers, silent, futures = {}, {}, {}
    for k in keys:
        client = ws.clients.get(k)  # None: replaced meanwhile by a recovery on another thread
        if client is None:
            silent[k] = "it was taken out of the deployment while being asked"
            continue
        try:
            futures[k] = client.send_future("Health", Health(), timeout_s)
        except ValueError:  # grpc's "Channel closed!": a stopped deployment (a failed shrink's)
            silent[k] = "its channel is closed: the deployment was stopped"
    for k, fut in futures.items():
        try:
            reply = fut.result()
        except grpc.RpcError as exc:
            silent[k] = f"no answer to Health within {timeout_s:g} s ({exc.code().name})"
            continue
        try:  # it answered: what it said matters only to the readers of its telemetry
            answers[k] = json.loads(reply)
        except ValueError:
            answers[k] = {}
    return answers, silent


def failure(
    ws: Workers, reason: str, keys: Collection[Key], culprits: dict[Key, str] | None = None
) -> WorkerFailure:
    """The failure to raise after ``reason``: the workers of ``keys`` found dead, if any."""
    failed = dict(culprits or {})
    deadline = time.monotonic() + 1.0  # an exit may take a moment to be seen
    while not failed and time.monotonic() < deadline:
        failed = suspects(ws, keys)
        if not failed:
            time.sleep(0.05)
    return WorkerFailure(failed, {key_of(h): h.config.sid for h in ws.handles}, reason)


def _code(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.RpcError) else None


def gather(
    ws: Workers,
    futures: dict[Key, Any],
    deadline_s: float,
    watch: Collection[Key] | None = None,
) -> dict[Key, dict[str, Any]]:
    """Wait for calls to every worker in ``futures`` (grpc futures of JSON replies), watching
    the workers meanwhile (those of ``watch`` too: the later stages a chained inference step
    reaches through the first, :mod:`dmsc.runtime.compute.relay`). Raises
    :class:`WorkerFailure` at the first sign of one, :class:`StepRestartNeeded` when a stage
    leader dropped the step, :class:`CheckpointRefused` when a worker found the checkpoint it
    was told to load missing or corrupt, RuntimeError when a worker refused the request (a bug,
    not a failure: no recovery would help)."""
    end = time.monotonic() + deadline_s
    replies: dict[Key, dict[str, Any]] = {}
    pending = dict(futures)
    watched = {*futures, *(watch or ())}
    wake = threading.Event()  # grpc futures are not concurrent.futures ones: a callback
    for fut in futures.values():
        fut.add_done_callback(lambda _: wake.set())
    while pending:
        wake.wait(0.1)
        wake.clear()
        for key in [k for k, f in pending.items() if f.done()]:
            fut = pending.pop(key)
            exc = fut.exception()
            if exc is None:
                # a replica's ranks' replies as one (tp_ranks.GroupFuture.reply)
                reply = getattr(fut, "reply", None)
                replies[key] = reply() if reply is not None else json.loads(fut.result())
                continue
            details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            if _code(exc) == grpc.StatusCode.ABORTED and details.startswith("restart:"):
                raise StepRestartNeeded(details)
            if _code(exc) == grpc.StatusCode.DATA_LOSS:
                raise CheckpointRefused({key: details})
            if _code(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED:  # full, not failed
                raise NoRoom(details)
            if _code(exc) == grpc.StatusCode.INVALID_ARGUMENT:
                raise RuntimeError(f"stage {key[0]} replica {key[1]} refused: {details}")
            raise failure(ws, f"stage {key[0]} replica {key[1]}: {details}", watched)
        found = suspects(ws, watched)
        if found:
            raise failure(ws, "", watched, found)
        if time.monotonic() > end:
            slow = {k: "missed the step deadline" for k in pending}
            raise failure(ws, "step deadline", watched, slow)
    return replies
