"""The tensor-parallel ranks past the first, as the control plane's request threads read them
while a recovery changes them (dmsc.runtime.control.launch.tp_ranks)."""

from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Any

import pytest

from dmsc.runtime.control.launch.tp_ranks import GroupFuture, TensorRanks


class _Rank:
    """A rank's client whose Health call runs ``meanwhile`` first: what a recovery on another
    thread does between two of the calls."""

    def __init__(self, meanwhile: Any = None, closed: bool = False) -> None:
        self.meanwhile, self.closed = meanwhile, closed

    def send_future(self, method: str, msg: Any, timeout_s: float) -> Future[bytes]:
        if self.meanwhile is not None:
            self.meanwhile()
        if self.closed:
            raise ValueError("Channel closed!")  # what grpc raises on a closed channel
        done: Future[bytes] = Future()
        done.set_result(b'{"ok": true}')
        return done

    def close(self) -> None:
        self.closed = True


def test_a_probe_survives_a_recovery_that_drops_and_adopts_ranks_meanwhile() -> None:
    """``dmsc chaos`` on a tp = 2 plan: ``dmsc status`` asked every rank for Health while the
    recovery dropped the killed replica's rank and adopted its replacement, and the request
    failed with "dictionary changed size during iteration" (CI, stop 40)."""
    ranks = TensorRanks(tp=1)
    dropped = _Rank()

    def recovery() -> None:
        ranks.by_sid.pop("s1r0t1")  # what drop() does to the replaced replica's rank ...
        dropped.close()
        ranks.by_sid["s1r0t1-new"] = _Rank()  # ... and adopt() to its replacement

    ranks.by_sid.update({"s0r0t1": _Rank(meanwhile=recovery), "s1r0t1": dropped})
    answers, silent = ranks.probe(1.0)
    assert answers == {"s0r0t1": {"ok": True}}
    assert silent == {"s1r0t1"}  # its channel closed by the drop: no answer, not an error


def test_a_probe_asks_every_rank_and_reads_what_each_said() -> None:
    ranks = TensorRanks(tp=1)
    ranks.by_sid.update({"a": _Rank(), "b": _Rank(closed=True)})
    assert ranks.probe(1.0) == ({"a": {"ok": True}}, {"b"})


def _done(reply: bytes) -> Future[bytes]:
    f: Future[bytes] = Future()
    f.set_result(reply)
    return f


def test_a_replicas_step_reply_carries_its_ranks_exposed_tensor_parallel_time() -> None:
    """Rank 0's reply stands for the replica's; its tp figure is the group's, from both ranks'
    calls (comm_meter.group_exposed), and no walls reach the trace."""
    rank0 = {"loss": 1.0, "comm": {"tp": {"s": 0.01, "calls": 1, "walls": [[0.0, 0.01]]},
                                   "pp": {"s": 0.5}}}  # fmt: skip
    rank1 = {"comm": {"tp": {"s": 0.004, "calls": 1, "walls": [[0.006, 0.01]]}}}
    group = GroupFuture([_done(json.dumps(r).encode()) for r in (rank0, rank1)])
    got = group.reply()
    assert got["loss"] == 1.0 and got["comm"]["pp"] == {"s": 0.5}
    assert got["comm"]["tp"]["s"] == pytest.approx(0.004) and got["comm"]["tp"]["wait_s"] == 0.01
    assert "walls" not in got["comm"]["tp"]
    health = GroupFuture([_done(b'{"ok": true}'), _done(b'{"ok": false}')])
    assert health.reply() == {"ok": True} and health.result() == b'{"ok": true}'
