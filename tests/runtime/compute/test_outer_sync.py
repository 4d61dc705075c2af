"""Which path a sync mode's round takes (the replicas' all-reduce or the leader's star), and
that both give the same agreed update: two replicas in threads of this process, the collective
and the star stood in for by a meeting point that sums or combines what both brought (the real
paths run in tests/integration/test_sync_modes.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dmsc.runtime.compute.outer_sync import ReplicaSync, by_collective
from dmsc.runtime.transport.messages import SyncSettings

Decode = Callable[[torch.Tensor], torch.Tensor]


class Meeting:
    """Both replicas bring a tensor; each leaves with what ``combine`` makes of the two."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.parts: dict[int, torch.Tensor] = {}
        self.calls: list[tuple[str, int]] = []

    def meet(self, replica: int, x: torch.Tensor) -> dict[int, torch.Tensor]:
        self.parts[replica] = x.clone()
        self.barrier.wait()
        parts = dict(self.parts)
        self.barrier.wait()
        return parts


class Collective:
    def __init__(self, meeting: Meeting, replica: int) -> None:
        self.meeting, self.replica = meeting, replica

    def mean(
        self, step: int, round_: int, mb: int, vector: torch.Tensor, policy: str, wait_s: float
    ) -> tuple[torch.Tensor, list[int]]:
        self.meeting.calls.append(("all-reduce", round_))
        parts = self.meeting.meet(self.replica, vector)
        return (parts[0] + parts[1]) / 2, []

    def int8_mean(
        self, step: int, round_: int, vector: torch.Tensor, block: int, *_: Any
    ) -> tuple[torch.Tensor, list[int]]:
        """(The ring's rounding is tested over gloo in test_int8_ring.py.)"""
        self.meeting.calls.append((f"int8 ring of {block}", round_))
        parts = self.meeting.meet(self.replica, vector)
        return (parts[0] + parts[1]) / 2, []

    def gathered_mean(
        self, step: int, round_: int, payload: torch.Tensor, decode: Decode, *_: Any
    ) -> tuple[torch.Tensor, list[int]]:
        self.meeting.calls.append(("all-gather", round_))
        parts = self.meeting.meet(self.replica, payload)
        return torch.stack([decode(parts[r]) for r in (0, 1)]).sum(0) / 2, []


class Star:
    def __init__(self, meeting: Meeting, replica: int, collective: Collective | None) -> None:
        self.cfg = SimpleNamespace(stage=0, faults={}, replica=replica, replicas=2)
        self.meeting, self.collective = meeting, collective

    def exchange(
        self,
        step: int,
        round_: int,
        payload: torch.Tensor,
        combine: Callable[[dict[int, torch.Tensor]], torch.Tensor],
        policy: str,
        wait_s: float,
    ) -> tuple[torch.Tensor, list[int]]:
        self.meeting.calls.append(("leader", round_))
        return combine(self.meeting.meet(self.cfg.replica, payload)), []


def _agree(settings: SyncSettings, collective: bool) -> tuple[list[torch.Tensor], Meeting]:
    """One round of two replicas (their updates differ): each one's agreed update."""
    meeting = Meeting()
    out: list[Any] = [None, None]

    def replica(r: int) -> None:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 8))
        dp = Collective(meeting, r) if collective else None
        sync = ReplicaSync(settings, module, Star(meeting, r, dp), seed=3)  # type: ignore[arg-type]
        update = torch.randn(sync.n, generator=torch.Generator().manual_seed(10 + r))
        out[r], _ = sync.agree(0, update, "wait", 5.0)

    threads = [threading.Thread(target=replica, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(x, torch.Tensor) for x in out), out
    return out, meeting


@pytest.mark.parametrize(
    ("settings", "rounds"),
    [
        (SyncSettings(compress="powersgd:2"), [("all-reduce", 0), ("all-reduce", 1)]),
        (SyncSettings(mode="fedprox", inner_steps=2, compress="bf16"), [("all-reduce", 0)]),
        (SyncSettings(compress="topk:0.3"), [("all-gather", 0)]),
    ],
    ids=["powersgd", "bf16", "topk"],
)
def test_what_sums_on_the_way_is_all_reduced_as_priced_and_agrees_with_the_leader(
    settings: SyncSettings, rounds: list[tuple[str, int]]
) -> None:
    """PowerSGD's P and Q are means of fp32 factors, bf16 updates sum in bfloat16, top-k
    payloads are gathered: with a collective they are all-reduced (PowerSGD in two rounds) or
    all-gathered, as the cost model prices them, never sent to the leader, and the replicas
    agree on the update the leader's star gives (two replicas: the same sums, exactly)."""
    assert by_collective(settings)
    (a, b), meeting = _agree(settings, collective=True)
    assert sorted(set(meeting.calls)) == rounds
    (want, _), star = _agree(settings, collective=False)
    assert {kind for kind, _ in star.calls} == {"leader"}
    assert torch.equal(a, b) and torch.equal(a, want)


@pytest.mark.parametrize(
    "settings",
    [
        SyncSettings(compress="int8", privacy_clip=1.0),
        SyncSettings(compress="powersgd:2", privacy_clip=1.0),
    ],
    ids=["int8-privacy", "powersgd-privacy"],
)
def test_what_no_collective_runs_goes_to_the_leader(settings: SyncSettings) -> None:
    assert not by_collective(settings)
    _, meeting = _agree(settings, collective=True)
    assert {kind for kind, _ in meeting.calls} == {"leader"}


def test_secure_aggregation_and_robust_aggregators_go_to_the_leader() -> None:
    """(They need more than two replicas or the workers' keys to run here.)"""
    assert not by_collective(SyncSettings(secure=True))
    assert not by_collective(SyncSettings(aggregator="median"))
    assert not by_collective(SyncSettings(aggregator="krum"))


def test_int8_goes_by_the_int8_ring_with_its_block() -> None:
    assert by_collective(SyncSettings(compress="int8:64"))
    (a, b), meeting = _agree(SyncSettings(compress="int8:64"), collective=True)
    assert set(meeting.calls) == {("int8 ring of 64", 0)} and torch.equal(a, b)


def test_a_plain_mean_is_all_reduced() -> None:
    (a, b), meeting = _agree(SyncSettings(mode="diloco", inner_steps=2), collective=True)
    assert {kind for kind, _ in meeting.calls} == {"all-reduce"} and torch.equal(a, b)


def test_the_rounds_exchange_is_metered_as_data_parallel() -> None:
    """A DiLoCo round's exchange ran unmetered: the step traces of a `--sync diloco:4` task had
    no data-parallel time at all, and `dmsc status` no data-parallel row."""
    from dmsc.runtime.compute.comm_meter import METER

    meeting = Meeting()
    METER.take()
    done: list[bool] = []

    def replica(r: int) -> None:
        torch.manual_seed(0)
        module = torch.nn.Linear(8, 4)
        star = Star(meeting, r, Collective(meeting, r))
        sync = ReplicaSync(SyncSettings(mode="diloco", inner_steps=4), module, star)  # type: ignore[arg-type]
        with torch.no_grad():
            module.weight.add_(0.1 * (r + 1))  # the inner steps moved each replica apart
        sync.outer_step(3, "wait", 5.0)
        done.append(True)

    threads = [threading.Thread(target=replica, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(done) == 2
    got = METER.take()
    assert got["dp"]["calls"] == 2 and got["dp"]["s"] > 0  # each replica's round


@pytest.mark.parametrize("collective", [True, False], ids=["by-collective", "through-leader"])
def test_every_steps_gradients_are_views_of_a_collectives_answer_and_copies_of_the_leaders(
    collective: bool,
) -> None:
    """int8 every step: by collective the answer is the replica's own vector (the ring summed
    into it), so the gradients become views of it (no pass over them: the cost model prices
    none, codec_work.around_bytes); through the leader they are copies. Until 2026-12-05 they
    were copies either way (0.65 ms a step of gpt-mini's 53 gradients)."""
    meeting = Meeting()
    grads: list[Any] = [None, None]

    def replica(r: int) -> None:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 8))
        module(torch.randn(2, 16) * (r + 1)).sum().backward()
        dp = Collective(meeting, r) if collective else None
        sync = ReplicaSync(SyncSettings(compress="int8"), module, Star(meeting, r, dp))  # type: ignore[arg-type]
        sync.sync_gradients(1, "wait", 5.0)
        grads[r] = [p.grad for p in module.parameters()]

    threads = [threading.Thread(target=replica, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g is not None for g in grads)
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)  # the replicas agree
    storages = {g.untyped_storage().data_ptr() for g in grads[0]}
    assert len(storages) == (1 if collective else len(grads[0]))


def test_a_stages_adamw_is_pytorchs_fused_one_and_steps_as_the_default_does() -> None:
    """PyTorch's default AdamW made about ten passes a step: gpt-mini's took 3.08 ms on one core
    against 0.60 fused, priced 1.2 (the cost model's one pass, 28 bytes a parameter). The
    runtime's is the fused kernel; ten steps land where the default's do, up to rounding."""
    from dmsc.runtime.compute.outer_sync import make_optimizer

    def trained(fused: bool) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
        )
        opt = (
            make_optimizer("adamw", model, 1e-2)
            if fused
            else torch.optim.AdamW(model.parameters(), lr=1e-2)
        )
        assert bool(opt.defaults["fused"]) is fused
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(10):
            loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    assert trained(True) == pytest.approx(trained(False), rel=1e-5, abs=1e-7)
    # a device without the fused kernel keeps PyTorch's default; SGD stays plain
    meta = torch.nn.Linear(4, 4, device="meta")
    assert not make_optimizer("adamw", meta, 1e-3).defaults["fused"]
    assert isinstance(make_optimizer("sgd", meta, 1e-3), torch.optim.SGD)
