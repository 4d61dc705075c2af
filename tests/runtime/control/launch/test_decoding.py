"""Decoding a request: a token a call, or runs of tokens drawn at the first stage
(:mod:`dmsc.runtime.compute.drawing`), which must draw the same tokens. A fake pipeline stands in
for the stages here (its logits a function of the whole context, its sessions the positions they
hold); tests/integration/test_pipeline.py runs the real ones."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch

from dmsc.runtime.compute import drawing
from dmsc.runtime.compute.executor import logits_reply
from dmsc.runtime.compute.sampling import shipped_top
from dmsc.runtime.control.launch import decoding
from dmsc.runtime.transport.drawing import Draw
from dmsc.runtime.transport.messages import RunStep, Sampling

VOCAB, SEQ = 40, 24


class Pipeline:
    """Logits of a context drawn from a generator seeded by the context itself; a session holds
    the positions it ran, and a step must start where it ends (as a stage's does)."""

    def __init__(self, sampling: Sampling, delay_s: float = 0.0) -> None:
        self.sessions: dict[str, list[int]] = {}
        self.sampling = sampling
        self.top = shipped_top(sampling, VOCAB)
        self.delay_s = delay_s
        self.calls: list[str] = []

    def logits(self, ctx: torch.Tensor, session: str | None, start: int) -> torch.Tensor:
        new = ctx[0].tolist()
        if session is None:
            whole = new
        else:
            held = self.sessions.setdefault(session, [])
            assert len(held) == start, (len(held), start)
            whole = held + new
            held[:] = whole
        time.sleep(self.delay_s)
        g = torch.Generator().manual_seed(hash(tuple(whole)) % (1 << 62))
        return torch.randn(VOCAB, generator=g)

    def forward(
        self, step: int, ctx: torch.Tensor, timeout_s: float, session: str | None, start: int
    ) -> torch.Tensor:
        self.calls.append("RunStep")
        return self.logits(ctx, session, start)

    def step(self, m: RunStep) -> dict[str, object]:
        """The first stage's RunStep as a Draw runs it: the last stage's reply."""
        assert m.tokens is not None
        out = self.logits(torch.tensor(m.tokens), m.session, m.start)
        return logits_reply(out[None], self.top)

    def runs(
        self, step: int, ctx: torch.Tensor, wait_s: float, session: str, start: int, count: int,
        g: torch.Generator,
    ) -> list[int]:  # fmt: skip
        """What ForwardRequests.drawn does, with the worker's side run here."""
        self.calls.append(f"Draw {count}")
        run = RunStep(
            step=step, microbatches=1, train=False, budget_s=wait_s, session=session,
            start=start, tokens=ctx.tolist(), top=self.top,
        )  # fmt: skip
        rng = None if self.sampling.temperature == 0 else drawing.state(g)
        m = Draw(step=run, count=count, sampling=self.sampling, rng=rng)
        reply = drawing.run(self.step, Draw.model_validate_json(m.model_dump_json()), VOCAB)
        if rng is not None:
            g.set_state(drawing.generator(str(reply["rng"]), None).get_state())
        return list(reply["drawn"])


def _decode(
    sampling: Sampling, tokens: int, runs: bool, **kw: object
) -> tuple[list[int], list[str]]:
    p = Pipeline(sampling)
    out = decoding.decode(
        p.forward, SEQ, [1, 2, 3], tokens, sampling, session="s",
        runs=p.runs if runs else None, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return out, p.calls


@pytest.mark.parametrize(
    "sampling",
    [Sampling(temperature=0), Sampling(temperature=0.9, top_k=8, seed=5), Sampling(seed=11)],
)
def test_runs_draw_the_tokens_one_call_a_token_draws(
    sampling: Sampling, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decoding, "RUN_S", 60.0)  # runs as long as the limits allow
    one, calls = _decode(sampling, 30, runs=False)
    assert calls == ["RunStep"] * 30
    ran, calls = _decode(sampling, 30, runs=True)
    assert ran == one
    # the prompt's token alone; then runs up to the session's window (SEQ positions: 21 more
    # tokens, the last of them drawn from the 24th position), then the context slides and
    # every token runs it whole, a call each
    assert calls == ["RunStep", "Draw 21"] + ["RunStep"] * 8, calls


def test_a_run_takes_one_turn_and_none_while_another_request_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decoding, "RUN_S", 60.0)
    sampling = Sampling(temperature=0)
    turns: list[int] = []

    @contextlib.contextmanager
    def turn(until: float | None) -> Iterator[None]:
        turns.append(1)
        yield

    one, _ = _decode(sampling, 10, runs=False)
    ran, calls = _decode(sampling, 10, runs=True, turn=turn, alone=lambda: True)
    assert ran == one and calls == ["RunStep", "Draw 9"] and len(turns) == 2
    waited = iter([False, False, True])  # another request waits at the 2nd and 3rd turns
    ran, calls = _decode(sampling, 10, runs=True, alone=lambda: next(waited, True))
    assert ran == one and calls == ["RunStep", "RunStep", "RunStep", "Draw 7"], calls


def test_a_run_is_as_long_as_its_time_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 20 ms a token at least, a run of 0.1 s draws 5 tokens a call at most."""
    monkeypatch.setattr(decoding, "RUN_S", 0.1)
    sampling = Sampling(temperature=0)
    p = Pipeline(sampling, delay_s=0.02)
    decoding.decode(p.forward, 100, [1], 16, sampling, session="s", runs=p.runs)
    counts = [int(c.split()[1]) if c.startswith("Draw") else 1 for c in p.calls]
    # (how many calls depends on the machine's speed; that runs are taken at all, on the test
    # above, does not)
    assert p.calls[0] == "RunStep" and sum(counts) == 16 and max(counts) <= 5, p.calls


def test_a_run_stops_where_its_budget_would_not_hold_another_token() -> None:
    sampling = Sampling(temperature=0)
    p = Pipeline(sampling, delay_s=0.05)
    p.logits(torch.tensor([[1, 2, 3]]), "s", 0)
    run = RunStep(
        step=1, microbatches=1, train=False, budget_s=0.3, session="s", start=3, tokens=[[4]],
        top=1,
    )  # fmt: skip
    t0 = time.monotonic()
    reply = drawing.run(p.step, Draw(step=run, count=50, sampling=sampling), VOCAB)
    # 0.3 s less the answer's margin (0.25 s) at 50 ms a token or more: 4 tokens at most, the
    # fifth would end past it; one at least
    assert 1 <= len(reply["drawn"]) <= 4, reply
    assert time.monotonic() - t0 < 5.0


def test_a_draw_is_of_one_session_row_and_a_state_torch_takes() -> None:
    from dmsc.runtime.transport.rpc import BadRequest, parse

    base = {"step": 1, "microbatches": 1, "train": False, "session": "s", "tokens": [[1]]}
    ok = {"step": base, "count": 3, "sampling": {"temperature": 0}}
    assert parse(Draw, ok).count == 3
    for bad, why in (
        ({**ok, "count": 0}, "count"),
        ({**ok, "step": {**base, "session": None}}, "one session's row"),
        ({**ok, "step": {**base, "tokens": [[1], [2]]}}, "one session's row"),
        ({**ok, "step": {**base, "train": True, "tokens": None}}, "one session's row"),
        ({**ok, "rng": "x" * 20_000}, "rng"),
    ):
        with pytest.raises(BadRequest, match=why):
            parse(Draw, bad)
    m = parse(Draw, {**ok, "rng": "AAAA"})  # base64 of 3 bytes: no generator's state
    with pytest.raises(ValueError, match="Draw: rng"):
        drawing.run(lambda _: {}, m, VOCAB)
