"""A run of tokens drawn at the first stage (dmsc.runtime.compute.drawing): at tp > 1 the ranks of
the stage agree before each token after the first, so that none stops while another goes on
(the others would wait in their next step's collectives) and a rank that drew another token
fails the run on every rank."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tp_helpers import two_ranks

from dmsc.runtime.compute import drawing
from dmsc.runtime.transport.drawing import Draw
from dmsc.runtime.transport.messages import RunStep, Sampling

VOCAB = 8


def _reply(token: int) -> dict[str, Any]:
    """A last stage's answer whose logits make ``token`` the greedy draw."""
    logits = torch.zeros(1, VOCAB)
    logits[0, token] = 5.0
    return {"logits": base64.b64encode(logits.numpy().tobytes()).decode(), "logits_shape": [1, 8]}


def _draw(count: int, budget_s: float | None = None) -> Draw:
    step = RunStep(
        step=1, microbatches=1, train=False, epoch=0, budget_s=budget_s, session="s", tokens=[[1]]
    )
    return Draw(step=step, count=count, sampling=Sampling(temperature=0))


def test_the_ranks_agree_before_each_token_after_the_first() -> None:
    asked: list[tuple[bool, int]] = []

    def agree(stop: bool, token: int) -> bool:
        asked.append((stop, token))
        return len(asked) == 3  # another rank would stop before the fourth token

    tokens = iter([3, 4, 5, 6, 7])
    got = drawing.run(lambda _m: _reply(next(tokens)), _draw(5), VOCAB, agree)
    assert got["drawn"] == [3, 4, 5]  # this rank alone would have drawn all five
    assert asked == [(False, 3), (False, 4), (False, 5)]


def test_a_rank_alone_asks_no_one() -> None:
    tokens = iter([3, 4, 5])
    assert drawing.run(lambda _m: _reply(next(tokens)), _draw(3), VOCAB)["drawn"] == [3, 4, 5]
    assert drawing.agreement(1, torch.device("cpu")) is None


def test_a_rank_out_of_budget_tells_the_others() -> None:
    """The budget left would not hold another token: this rank says stop."""
    asked: list[tuple[bool, int]] = []

    def agree(stop: bool, token: int) -> bool:
        asked.append((stop, token))
        return stop

    def slow(_m: RunStep) -> dict[str, Any]:
        import time

        time.sleep(0.03)
        return _reply(2)

    # 0.05 s of budget after the margin's 0.05 s: one 30 ms token, and not a second
    got = drawing.run(slow, _draw(4, budget_s=0.1), VOCAB, agree)
    assert got["drawn"] == [2] and asked == [(True, 2)]


CASES = {"go": [(False, 5), (False, 5)], "one_stops": [(True, 5), (False, 5)]}
CASES["differ"] = [(False, 5), (False, 6)]


def _rank(rank: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        agree = drawing.agreement(2, torch.device("cpu"))
        assert agree is not None
        for name, votes in CASES.items():
            try:
                record: dict[str, Any] = {"stop": agree(*votes[rank])}
            except RuntimeError as exc:
                record = {"error": str(exc)}
            torch.save(record, f"{out}/{name}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.integration  # a pair of rank processes
def test_two_gloo_ranks_stop_together_and_refuse_different_tokens(tmp_path: Path) -> None:
    got = two_ranks(_rank, tmp_path, tuple(CASES))
    assert [r["stop"] for r in got["go"]] == [False, False]
    assert [r["stop"] for r in got["one_stops"]] == [True, True]
    for r in got["differ"]:
        assert r["error"] == "Draw: the tensor-parallel ranks drew [5, 6]"
