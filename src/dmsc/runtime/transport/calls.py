"""Calls sent without waiting, run on threads that stay: the data path's sends.

grpcio's synchronous client runs a call made with ``.future()`` on a channel's "spin" thread,
which it starts when the channel's first call begins and which ends when its last call does
(``grpc/_channel.py``, ``_run_channel_spin_thread``). Between two stages one call is in flight
at a time, so every frame sent started a thread: on this 2-core machine under a load of 8, a
40 KB ``Push`` took 1.0-1.5 ms as a future against 0.6-0.9 ms as a blocking call and 0.7-0.8 ms
as a blocking call on a thread already running (median of 200, three rounds, side by side). Here
the blocking call runs on a thread pool's thread instead, and :class:`PooledCall` answers as the
grpc future it replaces (``result``, ``exception``, ``done``, ``add_done_callback``, ``cancel``),
so that callers need not know.

What it does not do: a call already running cannot be cancelled (the blocking call has no
handle); it ends at its own deadline, and ``cancel()`` says False, as grpc's does for a call that
finished. So only short calls with a deadline go this way (frames between stages, a decoding
step's calls), never a call that waits for a person.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

# Threads are started only while none is idle and kept afterwards: the pool grows to the most
# calls ever in flight at once (a stage sends to two neighbours and its replicas), never queues
# below this bound, and a call blocked until its deadline holds one thread, not the others.
MAX_THREADS = 256


class _Threads:
    """Daemon threads taking calls from one queue. Not ``concurrent.futures``'
    ThreadPoolExecutor: its threads are joined when the interpreter exits, so a process whose
    peer froze would wait out the calls' deadlines before it could end."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[tuple[futures.Future[Any], Callable[[], Any]]]
        self._work = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for work and not yet promised any
        self._count = 0

    def submit(self, call: Callable[[], Any]) -> futures.Future[Any]:
        future: futures.Future[Any] = futures.Future()
        with self._lock:
            self._work.put((future, call))
            if self._idle:
                self._idle -= 1
            elif self._count < MAX_THREADS:
                self._count += 1
                threading.Thread(target=self._serve, name="dmsc-call", daemon=True).start()
        return future

    def _serve(self) -> None:
        while True:
            future, call = self._work.get()
            if not future.set_running_or_notify_cancel():
                self._ready()
                continue
            try:
                result = call()
            except BaseException as exc:  # the caller's to see, as grpc's future gives it
                self._ready()
                future.set_exception(exc)
            else:
                self._ready()
                future.set_result(result)

    def _ready(self) -> None:
        """Count this thread idle *before* its caller hears the answer: a caller that sends its
        next call at once then finds it, instead of starting a thread (which it did on a loaded
        machine when the count came after the answer)."""
        with self._lock:
            self._idle += 1


_lock = threading.Lock()
_pool: tuple[int, _Threads] | None = None  # (pid, threads): a forked child starts its own


def _executor() -> _Threads:
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), _Threads())
        return _pool[1]


class PooledCall:
    """A blocking call running on a pool thread, seen as a grpc future."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._future = _executor().submit(call)

    def done(self) -> bool:
        return self._future.done()

    def running(self) -> bool:
        return self._future.running()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def cancel(self) -> bool:
        """Cancel a call not yet started (one that runs ends at its deadline)."""
        return self._future.cancel()

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._future.result(timeout)
        except futures.TimeoutError:
            raise grpc.FutureTimeoutError() from None
        except futures.CancelledError:
            raise grpc.FutureCancelledError() from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return self._future.exception(timeout)
        except futures.TimeoutError:
            raise grpc.FutureTimeoutError() from None
        except futures.CancelledError:
            raise grpc.FutureCancelledError() from None

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """``fn(self)`` once the call is done (at once if it is)."""
        self._future.add_done_callback(lambda _: fn(self))
