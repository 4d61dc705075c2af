"""A run of an inference session's next tokens drawn at its first stage (``Draw``,
:class:`dmsc.runtime.transport.drawing.Draw`): the control plane makes one call for the run
instead of one a token.

Each token is the inference step the control plane would have sent for it, chained through the
later stages by :mod:`.relay` (its ``RunStep``, run by the worker as one from the control plane
is), and the next token is drawn from the last stage's answer with :func:`.sampling.draw` and the
generator the control plane handed over (its state in the call, back in the answer): the tokens
are those that one call per token draws, token for token. What it saves is the control plane's
round trip a token (2.5 of 24.5 ms a token at two stages, benchmarks/inference.py, measured
inside the workers).

The run ends early, with the tokens drawn so far, when what is left of the step's budget would
not hold another token as long as the last one took: the control plane then has its tokens
before its own wait ends, and decides (its deadline passed, or the next run).

At tp > 1 every rank of the first stage runs the run (the control plane sends each the same
``Draw``, generator state included), each chaining its tokens' steps to its own rank of the next
stage, and the ranks must take the same steps: a rank that stopped early would leave the others
waiting in their next step's collectives. Before each token after the first they agree
(:func:`agreement`, one all-gather of two numbers over the stage's tensor-parallel group): all
stop when one would, and the token each drew last must be the same on all (it is: every rank
reads the same gathered logits with the same generator), else the run fails on every rank."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dmsc.runtime.compute.relay import MARGIN_S
from dmsc.runtime.compute.sampling import draw, reply_logits
from dmsc.runtime.compute.waiting import finish
from dmsc.runtime.transport.drawing import Draw
from dmsc.runtime.transport.messages import RunStep

Step = Callable[[RunStep], dict[str, Any]]
Agree = Callable[[bool, int], bool]  # (this rank would stop, its last token) -> all stop


def agreement(tp: int, device: torch.device) -> Agree | None:
    """How the ``tp`` ranks of this process's tensor-parallel group (its default process group:
    a stage worker serves one stage) agree before each token of a run; None at tp = 1. Its
    numbers go on ``device``, the stage's (NCCL gathers tensors of the rank's own GPU only)."""
    if tp == 1:
        return None
    if not dist.is_initialized() or dist.get_world_size() != tp:
        raise RuntimeError(f"Draw: no tensor-parallel group of {tp} ranks in this process")
    if dist.get_backend() != "nccl":
        device = torch.device("cpu")  # gloo gathers host tensors

    def agree(stop: bool, token: int) -> bool:
        mine = torch.tensor([int(stop), token], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        finish(dist.all_gather(every, mine, async_op=True), cpu=device.type == "cpu")
        got = torch.stack(every).cpu()
        if bool((got[:, 1] != got[0, 1]).any()):
            raise RuntimeError(f"Draw: the tensor-parallel ranks drew {got[:, 1].tolist()}")
        return bool(got[:, 0].any())

    return agree


def generator(rng: str | None, seed: int | None) -> torch.Generator:
    """The generator of a run: from the state ``rng`` (base64), else seeded with ``seed``."""
    g = torch.Generator()
    if rng is None:
        return g.manual_seed(seed or 0)
    g.set_state(torch.frombuffer(bytearray(base64.b64decode(rng)), dtype=torch.uint8))
    return g


def state(g: torch.Generator) -> str:
    """``g``'s state in base64 (:func:`generator` takes it back)."""
    return base64.b64encode(g.get_state().numpy().tobytes()).decode()


def run(step: Step, m: Draw, vocab: int, agree: Agree | None = None) -> dict[str, Any]:
    """Draw ``m.count`` tokens (fewer when the budget runs short) running each token's step
    with ``step`` (the worker's ``RunStep``), the ranks of a tensor-parallel stage agreeing
    with ``agree`` before each token after the first; the answer: ``drawn`` and the
    generator's ``rng`` after them."""
    try:
        g = generator(m.rng, m.sampling.seed)
    except (ValueError, RuntimeError) as exc:  # not a state torch's CPU generator takes
        raise ValueError(f"Draw: rng: {exc}") from None
    s = m.step
    # what is left of the budget at each token, less the margin its answer needs to travel
    deadline = None if s.budget_s is None else time.monotonic() + s.budget_s - MARGIN_S
    drawn: list[int] = []
    took = 0.0
    for _ in range(m.count):
        t0 = time.monotonic()
        stop = deadline is not None and bool(drawn) and t0 + took >= deadline
        if agree is not None and drawn:
            stop = agree(stop, drawn[-1])
        if stop:
            break  # another token would not fit in what is left (on this rank or another)
        if deadline is not None:
            s = s.model_copy(update={"budget_s": max(deadline - t0, 1e-3)})
        token = draw(reply_logits(step(s), vocab)[0], m.sampling, g)
        drawn.append(token)
        took = time.monotonic() - t0
        assert s.tokens is not None  # a Draw's step carries its tokens
        s = s.model_copy(
            update={"step": s.step + 1, "start": s.start + len(s.tokens[0]), "tokens": [[token]]}
        )
    return {"drawn": drawn, "rng": state(g)}
