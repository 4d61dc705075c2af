"""Measure the runtime's mixture-of-experts routing, dispatch and combine on this device.

A mixture (:class:`~dmsc.runtime.compute.expert_parallel.ExpertParallelMoE`) does more than its
experts' and its router's products: it scores and picks each token's experts, orders the
(token, choice) pairs by expert, gathers each expert's tokens, writes each expert's answer back
into place, weights the answers and adds them up per token, and the backward runs the same
indexing in reverse. Each of those touches a token's hidden vector once per choice (a routed
element), in index operations that on this project's CPU cost far more than a pass over memory:
11-13 ns per routed element forward and backward together, where the memory passes they make
come to about 2 ns (moe-mini, micro-batches of 1 to 16 sequences, 2026-12-05). The cost model
priced none of it until then, and moe-mini's block measured 12.4 ms a micro-batch of four
against a predicted 10.1.

:func:`measure_dispatch_seconds` times the mixture's forward and backward, and, in the same
rounds, its experts alone on the rows the routing gave each and its router alone; what is left,
over the routed elements and the two directions, is the device's ``dispatch_ns``
(:mod:`dmsc.netmodel.compute`). Its fixed part (a few dozen small operations, 0.2-0.3 ms forward
and backward) is folded into the per-element figure at the calibration's micro-batch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

MIXTURE_MODEL = "moe-mini"  # the mixture timed (its experts' count and widths)
ROUNDS = 15


def _seconds(call: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def measure_dispatch_seconds(
    micro_batch: int = 4, model: str = MIXTURE_MODEL, rounds: int = ROUNDS, threads: int = 1
) -> float:
    """Seconds per routed element, each way, of the runtime's mixture less its experts' and
    router's work (module docstring), at ``micro_batch`` sequences of ``model`` on ``threads``
    threads; each part's median over ``rounds`` interleaved rounds."""
    from dmsc.runtime.compute.expert_parallel import ExpertParallelMoE
    from dmsc.runtime.compute.models.llama import MixtureOfExperts
    from dmsc.spec import TransformerSpec, resolve_model

    spec = resolve_model(model)
    if not isinstance(spec, TransformerSpec) or not spec.is_moe:
        raise ValueError(f"{model} is not a mixture of experts")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            whole = MixtureOfExperts(spec)
        mixture = ExpertParallelMoE(whole, None, 0, 1)
        x = torch.randn(micro_batch, spec.seq, spec.hidden, generator=gen, requires_grad=True)
        grad = torch.randn(micro_batch, spec.seq, spec.hidden, generator=gen)
        flat = x.detach().reshape(-1, spec.hidden)
        with torch.no_grad():  # the rows the routing gives each expert
            chosen = whole.router(flat).topk(spec.top_k, dim=-1).indices
        rows = [int((chosen == e).sum()) for e in range(spec.experts)]
        inputs = [torch.randn(n, spec.hidden, generator=gen, requires_grad=True) for n in rows]
        grads = [torch.randn(n, spec.hidden, generator=gen) for n in rows]
        routed = flat.shape[0] * spec.top_k * spec.hidden

        def experts() -> None:
            for expert, xe, ge in zip(whole.experts, inputs, grads, strict=True):
                if xe.shape[0]:
                    expert(xe).backward(ge)

        calls = {
            "mixture": lambda: mixture(x).backward(grad),
            "experts": experts,
            "router": lambda: whole.router(flat).backward(torch.ones(flat.shape[0], spec.experts)),
        }
        for call in calls.values():  # warm-up: the allocator, the kernels' first run
            call()
        took: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                took[name].append(_seconds(call))
        median = {name: statistics.median(t) for name, t in took.items()}
        rest = median["mixture"] - median["experts"] - median["router"]
        return max(rest, 0.0) / (2 * routed)
    finally:
        torch.set_num_threads(old)
