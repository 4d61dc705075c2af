"""The pipeline's gloo group: frames arrive whole and checked, in any order of kinds and
micro-batches; a frame refused, a header that is not the awaited frame, an abandoned wait and
a wait past its time fail the step at once and leave the epoch's group dropped (a peer that
died is the chaos test's: gloo sees its sockets close).

Stages are threads of this process meeting in a TCPStore hosted here (port 0), as the workers
of a deployment meet in the control plane's.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dmsc.runtime.compute.inbox import Aborted
from dmsc.runtime.compute.pipe_group import PipeGroup, header_of, payload_of, tag_of
from dmsc.runtime.transport.wire import Kind

NEVER = lambda: False  # noqa: E731  (a wait nobody abandons)


def _groups(n: int = 2, timeout_s: float = 20.0) -> tuple[Any, list[PipeGroup]]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    checks: list[tuple[Kind, tuple[int, ...]]] = []

    def check(kind: Kind, t: torch.Tensor) -> None:
        if not bool(torch.isfinite(t).all()):
            raise ValueError("not finite")
        checks.append((kind, tuple(t.shape)))

    groups = [
        PipeGroup(f"127.0.0.1:{store.port}", s, n, 0, 0, timeout_s, check, 1 << 20)
        for s in range(n)
    ]
    end = time.monotonic() + 60
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda g: g.ready(0, NEVER, end), groups))
    return store, groups


def test_a_header_announces_its_payload_and_refuses_another_frame() -> None:
    t = torch.zeros(2, 5, 8)
    head = header_of(Kind.GRADIENT, 7, 3, t)
    got = payload_of(head, Kind.GRADIENT, 7, 3, 1 << 20)
    assert got.shape == t.shape and got.dtype == torch.float32
    with pytest.raises(ValueError, match="awaited activation of step 7"):
        payload_of(head, Kind.ACTIVATION, 7, 3, 1 << 20)
    with pytest.raises(ValueError, match="step 8"):
        payload_of(head, Kind.GRADIENT, 8, 3, 1 << 20)
    with pytest.raises(ValueError, match="at most 100 bytes"):  # larger than a message may be
        payload_of(head, Kind.GRADIENT, 7, 3, 100)
    with pytest.raises(ValueError, match="dimensions"):
        header_of(Kind.ACTIVATION, 0, 0, torch.zeros(1, 1, 1, 1))
    tags = {tag_of(k, mb, p) for k in Kind for mb in range(64) for p in (False, True)}
    assert len(tags) == len(Kind) * 64 * 2 and max(tags) < 1 << 32  # gloo's tags are 32-bit
    with pytest.raises(ValueError):
        tag_of(Kind.ACTIVATION, 1 << 19, True)


def test_frames_arrive_whole_in_another_order_than_sent_and_are_checked() -> None:
    _, (a, b) = _groups()
    end = time.monotonic() + 30
    xs = {mb: torch.randn(2, 4, 8) for mb in range(3)}
    for mb, x in xs.items():
        a.send(1, Kind.ACTIVATION, 5, mb, x)
    g = torch.randn(2, 4, 8, dtype=torch.float64)
    b.send(0, Kind.GRADIENT, 5, 1, g)
    for mb in (2, 0, 1):  # taken in another order: the tags keep them apart
        assert torch.equal(b.recv(0, Kind.ACTIVATION, 5, mb, NEVER, end), xs[mb])
    assert torch.equal(a.recv(1, Kind.GRADIENT, 5, 1, NEVER, end), g)
    a.flush(NEVER, end)
    b.flush(NEVER, end)
    for grp in (a, b):
        grp.drop(None)


def test_a_frame_refused_by_the_check_or_out_of_step_drops_the_epochs_group() -> None:
    _, (a, b) = _groups()
    end = time.monotonic() + 30
    a.send(1, Kind.ACTIVATION, 1, 0, torch.full((1, 2, 8), float("nan")))
    with pytest.raises(ValueError, match="not finite"):
        b.recv(0, Kind.ACTIVATION, 1, 0, NEVER, end)
    assert b.pg is None and b.broken
    with pytest.raises(RuntimeError, match="epoch 0 dropped"):  # not formed again this epoch
        b.ready(0, NEVER, end)
    _, (c, d) = _groups()
    c.send(1, Kind.ACTIVATION, 3, 0, torch.zeros(1, 2, 8))  # step 3 where step 2 is awaited
    with pytest.raises(ValueError, match="awaited activation of step 2"):
        d.recv(0, Kind.ACTIVATION, 2, 0, NEVER, end)
    for grp in (a, c, d):
        grp.drop(None)


def test_an_abandoned_wait_ends_at_once_and_a_wait_past_its_time_gives_up() -> None:
    _, (a, b) = _groups()
    moved = [False]
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:  # stage 1 waits for a frame that never comes
        waiting = pool.submit(
            b.recv, 0, Kind.ACTIVATION, 0, 0, lambda: moved[0], time.monotonic() + 30
        )
        time.sleep(0.2)
        moved[0] = True  # an Abort moved the worker to a newer epoch
        with pytest.raises(Aborted):
            waiting.result(timeout=5)
    assert time.monotonic() - t0 < 3 and b.pg is None
    with pytest.raises(TimeoutError, match="gradient of step 0 micro-batch 0 from stage 1"):
        a.recv(1, Kind.GRADIENT, 0, 0, NEVER, time.monotonic() + 0.3)
    assert a.pg is None and "timed out" in str(a.broken)
