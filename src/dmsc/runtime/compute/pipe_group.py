"""Pipeline sends inside one datacenter over torch.distributed point-to-point (gloo).

Where a deployment asks for it (``StageLayout.pp_gloo``, off by default) and a replica's stages
share one datacenter (so no link between them is shaped), a training step's activations and
gradients go between them as gloo ``send``/``recv`` in a process group of the pipeline's stages
(rank = stage) rather than as gRPC ``Push`` frames, which pass a call thread, grpc's threads on
both sides, the server's handler and the inbox before the waiting stage wakes. Across
datacenters (shaped links, TLS) and for every other frame (tokens, targets, tied embeddings,
data-parallel traffic, inference steps, which carry a deadline) the gRPC path stays.

Why it is off (``benchmarks/results/pipeline_gloo_cpu.json``, this 2-core machine): on a quiet
machine (5 alternated rounds) a step took 172.0 ms over gloo against 175.8 ms over gRPC (0.98;
by round 0.93-1.04) and torch.distributed.pipelining 159.5 ms. An idle stage saw its frame
1.1-1.4 ms after it was sent over gloo against 2.2-2.4 ms over gRPC, but with three busy
processes on two cores the step moved by less than the rounds' spread (earlier, with other jobs
running, load 6-11: 398 against 412 ms a step, and gloo's own loop thread cost the middle stage
more CPU, 21 ms a step, than grpc's threads, 13 ms). And a gloo group has no authentication:
its frames would bypass the workers' mutual TLS inside a datacenter.

- The group is formed per epoch under the deployment's store (``cfg.tp_store``, prefix
  ``pp/<replica>/<tp rank>/e<epoch>``), lazily at the first frame of a step of that epoch:
  every stage of the pipeline takes part in every step, so all of them arrive. A recovery
  opens a new epoch, and with it a new group (the replacement meets the survivors there).
- A frame is two messages: a header (step, kind, micro-batch, dtype, shape) and the payload; the
  receiver checks the header against what it waits for and the payload as ``Push`` checks a
  frame (:func:`.frames.check_frame`). Tags keep kinds and micro-batches apart, so frames may
  be taken in another order than sent (interleaved stages).
- gloo's works cannot be interrupted and have no future (torch 2.13: ``Work::getFuture not
  implemented`` for send and recv; a wait that times out fails the whole group): two threads
  of the group wait for them in turn, one for its receives and one for its sends (a send ends
  only once its peer took it, which may be after this stage received what it waits for now),
  and the stage waits for their signal,
  looking every 50 ms whether the step was abandoned (a move to a newer epoch) or ran out of
  time. Any failure, a timeout or an abandoned wait drops the group (on a thread of its own: a
  wait in progress ends at the group's timeout, or at once when its peer's socket closes) and
  fails the step; the group is not formed again in the same epoch, so a step of that epoch
  fails at once with the reason until the recovery moves the workers on.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.compute.inbox import Aborted
from dmsc.runtime.transport.wire import Kind

HEADER_LEN = 8  # int64: step, kind, micro-batch, dtype, ndim, up to three dimensions
_MAX_DIMS = HEADER_LEN - 5
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # by header code
CARRIED = (Kind.ACTIVATION, Kind.GRADIENT)  # the frames that go this way
POLL_S = 0.05  # how often a wait looks whether its step was abandoned
_MB_BITS = 19  # micro-batch field in a tag: gloo's tags are 32-bit


def header_of(kind: Kind, step: int, mb: int, t: torch.Tensor) -> torch.Tensor:
    """The header sent before a payload ``t``."""
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise ValueError(
            f"a {t.dtype} frame of {t.dim()} dimensions: at most {_MAX_DIMS} dimensions of "
            f"{', '.join(str(d) for d in _DTYPES)} go this way"
        )
    dims = list(t.shape) + [0] * (_MAX_DIMS - t.dim())
    code = _DTYPES.index(t.dtype)
    return torch.tensor([step, int(kind), mb, code, t.dim(), *dims], dtype=torch.int64)


def payload_of(
    header: torch.Tensor, kind: Kind, step: int, mb: int, max_bytes: int
) -> torch.Tensor:
    """An empty tensor of the payload a header announces, once it is the frame awaited and
    no larger than ``max_bytes`` (ValueError otherwise: the two ends disagree about the
    schedule, or the sender is not a stage of this pipeline)."""
    h = [int(x) for x in header.tolist()]
    ok = h[:3] == [step, int(kind), mb] and 0 <= h[3] < len(_DTYPES) and 0 <= h[4] <= _MAX_DIMS
    shape = tuple(h[5 : 5 + h[4]])
    if ok:
        numel = 1
        for d in shape:
            numel *= d
        ok = min(shape, default=0) >= 0 and numel * _DTYPES[h[3]].itemsize <= max_bytes
    if not ok:
        raise ValueError(
            f"pipeline group: awaited {kind.name.lower()} of step {step} micro-batch {mb} "
            f"(at most {max_bytes} bytes), got the header {h}"
        )
    return torch.empty(shape, dtype=_DTYPES[h[3]])


def tag_of(kind: Kind, mb: int, payload: bool) -> int:
    """The gloo tag of a frame's header (``payload`` False) or payload."""
    if not 0 <= mb < 1 << _MB_BITS:
        raise ValueError(f"micro-batch {mb} does not fit a tag")
    return (int(kind) << (_MB_BITS + 1)) | (mb << 1) | int(payload)


def pipe_group_of(
    cfg: WorkerConfig, check: Callable[[Kind, torch.Tensor], None]
) -> PipeGroup | None:
    """The pipeline group of the worker ``cfg`` configures (None: its frames go over gRPC)."""
    if not cfg.pp_group or cfg.stages < 2 or not cfg.tp_store:
        return None
    return PipeGroup(
        cfg.tp_store, cfg.stage, cfg.stages, cfg.replica, cfg.tp_rank, cfg.recv_timeout_s,
        check, cfg.max_message_bytes,
    )  # fmt: skip


class _Waiter:
    """A thread that waits for gloo works in turn and signals each one's end."""

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue[tuple[Any, threading.Event, list[Any]] | None]
        self._todo = queue.SimpleQueue()
        threading.Thread(target=self._main, daemon=True, name="pp-wait").start()

    def _main(self) -> None:
        while (item := self._todo.get()) is not None:
            work, done, error = item
            try:
                work.wait()
            except BaseException as exc:  # the waiting stage's to raise
                error.append(exc)
            done.set()

    def watch(self, work: Any) -> tuple[threading.Event, list[Any]]:
        done, error = threading.Event(), []  # type: ignore[var-annotated]
        self._todo.put((work, done, error))
        return done, error

    def stop(self) -> None:
        self._todo.put(None)


class PipeGroup:
    """This worker's process group with the other stages of its replica's pipeline (same tp
    rank), formed per epoch; its sends in flight."""

    def __init__(
        self,
        store_address: str,
        stage: int,
        stages: int,
        replica: int,
        tp_rank: int,
        timeout_s: float,
        check: Callable[[Kind, torch.Tensor], None],
        max_bytes: int,
    ) -> None:
        self.store_address = store_address
        self.stage, self.stages = stage, stages
        self.prefix = f"pp/{replica}/{tp_rank}"
        self.timeout_s = timeout_s
        self.check = check  # a received frame's check, as Push does it
        self.max_bytes = max_bytes  # the largest payload taken (a Push's message limit)
        self._store: Any = None
        self.pg: Any = None  # a ProcessGroupGloo (torch's stubs do not export the name)
        self.epoch: int | None = None  # the group's
        self.broken: str | None = None  # why this epoch's group was dropped
        # receives and sends are waited for on threads of their own: a send ends only once its
        # peer took it, which may be after this stage received what it waits for now
        self._waiter: _Waiter | None = None
        self._send_waiter: _Waiter | None = None
        self._sends: list[tuple[threading.Event, list[Any], tuple[torch.Tensor, ...]]] = []

    @property
    def active(self) -> bool:
        """Whether this epoch's group is formed (its sends are for :meth:`flush`)."""
        return self.pg is not None

    def _store_of(self) -> Any:
        if self._store is None:
            host, _, port = self.store_address.rpartition(":")
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                host, int(port), is_master=False, timeout=timedelta(seconds=self.timeout_s)
            )
        return self._store

    def ready(self, epoch: int, abandoned: Callable[[], bool], end: float) -> None:
        """The group of ``epoch``, formed if need be (every stage forms it at once)."""
        if self.epoch == epoch and self.pg is not None:
            return
        if self.epoch == epoch and self.broken:
            raise RuntimeError(f"pipeline group of epoch {epoch} dropped: {self.broken}")
        self.drop(None)
        self.epoch, self.broken = epoch, None
        box: list[Any] = []
        formed = threading.Event()

        def form() -> None:
            try:
                store = dist.PrefixStore(  # type: ignore[attr-defined]
                    f"{self.prefix}/e{epoch}", self._store_of()
                )
                box.append(
                    dist.ProcessGroupGloo(
                        store, self.stage, self.stages, timedelta(seconds=self.timeout_s)
                    )
                )
            except BaseException as exc:
                box.append(exc)
            formed.set()

        threading.Thread(target=form, daemon=True, name="pp-form").start()
        self._until(formed, abandoned, end, "forming the pipeline group")
        if isinstance(box[0], BaseException):
            self.broken = f"forming it failed: {box[0]}"
            raise RuntimeError(f"pipeline group of epoch {epoch}: {self.broken}")
        self.pg, self._waiter, self._send_waiter = box[0], _Waiter(), _Waiter()

    def _until(
        self, done: threading.Event, abandoned: Callable[[], bool], end: float, what: str
    ) -> None:
        while not done.wait(POLL_S):
            if abandoned():
                self.drop("the step was abandoned (a newer epoch)")
                raise Aborted(f"{what}: moved to a newer epoch")
            if time.monotonic() > end:
                self.drop(f"{what} timed out")
                raise TimeoutError(f"{what}: no answer within the receive timeout")

    def send(self, to: int, kind: Kind, step: int, mb: int, t: torch.Tensor) -> int:
        """Start sending ``t`` (on the host) to stage ``to``; the bytes it puts on the link."""
        assert self.pg is not None and self._send_waiter is not None
        t = t.detach().contiguous()
        head = header_of(kind, step, mb, t)
        for part, payload in ((head, False), (t, True)):
            work = self.pg.send([part], to, tag_of(kind, mb, payload))
            done, error = self._send_waiter.watch(work)
            self._sends.append((done, error, (part,)))
        return head.numel() * head.element_size() + t.numel() * t.element_size()

    def recv(
        self,
        src: int,
        kind: Kind,
        step: int,
        mb: int,
        abandoned: Callable[[], bool],
        end: float,
    ) -> torch.Tensor:
        """The frame of ``kind`` (step, micro-batch) from stage ``src``, checked."""
        head = torch.empty(HEADER_LEN, dtype=torch.int64)
        self._take(head, src, tag_of(kind, mb, False), abandoned, end, kind, step, mb)
        try:
            t = payload_of(head, kind, step, mb, self.max_bytes)
        except ValueError as exc:
            self.drop(str(exc))
            raise
        self._take(t, src, tag_of(kind, mb, True), abandoned, end, kind, step, mb)
        try:
            self.check(kind, t)
        except Exception as exc:  # a refused frame: the two ends are out of step from here
            self.drop(str(exc))
            raise
        return t

    def _take(
        self,
        buf: torch.Tensor,
        src: int,
        tag: int,
        abandoned: Callable[[], bool],
        end: float,
        kind: Kind,
        step: int,
        mb: int,
    ) -> None:
        assert self.pg is not None and self._waiter is not None
        done, error = self._waiter.watch(self.pg.recv([buf], src, tag))
        what = f"{kind.name.lower()} of step {step} micro-batch {mb} from stage {src}"
        self._until(done, abandoned, end, what)
        if error:
            self.drop(f"{what}: {error[0]}")
            raise RuntimeError(f"pipeline group: {what} failed: {error[0]}")

    def flush(self, abandoned: Callable[[], bool], end: float) -> None:
        """Wait for every send started."""
        sends, self._sends = self._sends, []
        for done, error, _ in sends:
            self._until(done, abandoned, end, "a pipeline send")
            if error:
                self.drop(f"a send failed: {error[0]}")
                raise RuntimeError(f"pipeline group: a send failed: {error[0]}")

    def drop(self, why: str | None) -> None:
        """Leave the group (``why`` None: for a newer epoch's; else this epoch's is broken).
        Let go on a thread of its own: a wait in progress holds it up to its timeout."""
        held, self.pg, self._sends = [self.pg], None, []
        if why is not None:
            self.broken = why
        for waiter in (self._waiter, self._send_waiter):
            if waiter is not None:
                waiter.stop()
        self._waiter = self._send_waiter = None
        if held[0] is not None:
            held[0].abort()  # its sockets close: the peers' waits fail now, not at the timeout
            threading.Thread(target=held.clear, daemon=True, name="pp-drop").start()
