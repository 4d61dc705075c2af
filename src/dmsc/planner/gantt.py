"""One iteration of a planned pipeline replayed in time: the blocks of a Gantt chart.

Pure: it returns the blocks (stage, kind, start, end); the CLI draws them (``dmsc plan --gantt``,
see :mod:`dmsc.cli.plan_render`). Each stage runs its micro-batches forward and backward in 1F1B
order (GPipe: all forwards, then all backwards); an operation starts when its stage is free and
its input has arrived.

A placed plan is replayed with the planner's own stage model (:mod:`.placement.problem`): a
micro-batch on stage ``s`` computes (a third forward, two thirds backward) and then exchanges
with its neighbours for ``max(c_in, c_out)`` per direction, the stage blocked meanwhile, so that a
stage spends ``t_s = compute + 2 max(c_in, c_out)`` per micro-batch. The replay's span is the
plan's pipeline time (:func:`dmsc.planner.plan.assemble_plan` takes it from here); the gradient
all-reduce and the optimizer step follow it on every stage (:func:`with_tail`), so the chart ends
at the plan's iteration time.

An interleaved plan (``v`` chunks per device) is replayed as Megatron-Core's interleaved 1F1B
(:func:`~dmsc.netmodel.schedule.stage_order`, the order the stage workers run): chunk ``c``
of stage ``s`` is virtual stage ``c p + s``, a micro-batch goes forward through the virtual
stages in turn (from the last stage back to the first between chunks) and backward the other
way, and each chunk's forward, backward and exchange take a ``v``-th of the stage's, so that
a stage still spends ``t_s`` per micro-batch. A uniform pipeline then takes
``(m + (p - 1) / v) t``, the closed form the cost model prices (:mod:`dmsc.netmodel.iteration`).

Kinds of block: ``F`` and ``B`` (compute), ``comm`` (a boundary exchange inside a datacenter),
``dci`` (an exchange over an inter-datacenter link), ``wait-dci`` (the stage idle, waiting for an
input that crosses an inter-datacenter link: a DCI-induced bubble), ``dp`` (gradient all-reduce
not hidden by the backward pass) and ``optimizer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dmsc.netmodel.schedule import stage_order
from dmsc.planner.placement.problem import Placement, PlacementProblem, boundary_us


@dataclass(frozen=True)
class Op:
    """One block on the chart."""

    stage: int
    kind: str  # see the module docstring
    microbatch: int
    start: float
    end: float
    in_flight: bool = False  # a message on its way while both stages go on (``comm_s``)
    chunk: int = 0  # the stage's model chunk (interleaved schedule), 0 otherwise


def replay(
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    comm_s: Sequence[float],
    microbatches: int,
    schedule: str,
    exchange_s: Sequence[float] | None = None,
    dci: Sequence[bool] | None = None,
    exchange_dci: Sequence[bool] | None = None,
    chunks: int = 1,
) -> list[Op]:
    """Start and end of every forward, backward and boundary transfer of one iteration.

    ``comm_s[b]``: the time a message takes over boundary ``b`` (stage ``b`` to ``b + 1``) while
    both stages go on working. ``exchange_s[s]``: the time stage ``s`` stays blocked after each
    forward and each backward, exchanging with its neighbours. ``dci[b]``: boundary ``b``
    crosses an inter-datacenter link; ``exchange_dci[s]``: stage ``s``'s exchange waits for
    one. Transfers over such links are ``dci`` blocks, and the time a stage idles while its input
    is on such a link a ``wait-dci`` block. ``chunks``: model chunks per stage (interleaved
    schedule, see the module docstring); each chunk's blocks take a ``chunks``-th of the
    stage's times, and the hop from the last stage back to the first has no ``comm_s``."""
    p, m, v = len(fwd_s), microbatches, chunks
    xs = list(exchange_s) if exchange_s is not None else [0.0] * p
    crossing = list(dci) if dci is not None else [False] * max(0, p - 1)
    x_dci = list(exchange_dci) if exchange_dci is not None else [False] * p
    orders = [stage_order(schedule, s, p, m, v) for s in range(p)]
    last = p * v - 1  # the last virtual stage
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end
    free = [0.0] * p
    pos = [0] * p
    ops: list[Op] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            if pos[s] >= len(orders[s]):
                continue
            kind, i, c = orders[s][pos[s]]
            k = c * p + s
            if kind == "F":
                dep = done.get(("F", k - 1, i)) if k > 0 else 0.0
                producer = (k - 1) % p if k > 0 else None
                boundary = s - 1 if k > 0 and s > 0 else None
            else:
                dep = done.get(("B", k + 1, i)) if k < last else done.get(("F", k, i))
                producer = (k + 1) % p if k < last else None
                boundary = s if k < last and s < p - 1 else None
            if dep is None:
                continue
            lag = comm_s[boundary] if boundary is not None else 0.0
            ready = dep + lag
            # What of the wait is an inter-DC transfer: the producer's exchange, the message.
            dci_from = ready
            if producer is not None and x_dci[producer]:
                dci_from = dep - xs[producer] / v
            if boundary is not None and crossing[boundary] and lag:
                dci_from = min(dci_from, dep)
            if lag:
                kind_lag = "dci" if boundary is not None and crossing[boundary] else "comm"
                ops.append(Op(s, kind_lag, i, dep, ready, in_flight=True, chunk=c))
            if ready > free[s] and dci_from < ready:
                ops.append(Op(s, "wait-dci", i, max(free[s], dci_from), ready, chunk=c))
            start = max(free[s], ready)
            end = start + (fwd_s[s] if kind == "F" else bwd_s[s]) / v
            ops.append(Op(s, kind, i, start, end, chunk=c))
            if xs[s]:
                kind_x = "dci" if x_dci[s] else "comm"
                ops.append(Op(s, kind_x, i, end, end + xs[s] / v, chunk=c))
                end += xs[s] / v
            done[(kind, k, i)] = end
            free[s] = end
            pos[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("pipeline replay deadlocked")
    return ops


def span(ops: Sequence[Op]) -> float:
    """When the last block ends."""
    return max((op.end for op in ops), default=0.0)


def replay_placement(problem: PlacementProblem, placement: Placement, schedule: str) -> list[Op]:
    """:func:`replay` of a placed pipeline as the planner costs it (see the module docstring):
    each stage's compute time in its datacenter and its blocking exchange with its neighbours,
    as long as the slower of its boundaries (``dci`` when that one crosses datacenters), with
    the problem's chunks per stage."""
    dcs = placement.dcs
    p = problem.n_stages
    comm = [c * 1e-6 for c in boundary_us(problem, dcs, placement.routes)]
    per_mb = [(problem.compute_us[s][dcs[s]] or 0) * 1e-6 for s in range(p)]
    crossing = [dcs[b] != dcs[b + 1] for b in range(p - 1)]
    exchange: list[float] = []
    exchange_dci: list[bool] = []
    for s in range(p):
        sides = [b for b in (s - 1, s) if 0 <= b < p - 1]
        slowest = max(sides, key=lambda b: (comm[b], crossing[b]), default=None)
        exchange.append(comm[slowest] if slowest is not None else 0.0)
        exchange_dci.append(slowest is not None and crossing[slowest])
    return replay(
        [t / 3 for t in per_mb],
        [2 * t / 3 for t in per_mb],
        [0.0] * (p - 1),
        problem.microbatches,
        schedule,
        exchange,
        crossing,
        exchange_dci,
        chunks=problem.chunks,
    )


def with_tail(ops: Sequence[Op], stages: int, dp_s: float, optimizer_s: float) -> list[Op]:
    """``ops`` followed, on every stage, by the gradient all-reduce the backward pass did not
    hide and the optimizer step: the whole iteration."""
    end = span(ops)
    out = list(ops)
    for s in range(stages):
        if dp_s > 0:
            out.append(Op(s, "dp", -1, end, end + dp_s))
        if optimizer_s > 0:
            out.append(Op(s, "optimizer", -1, end + dp_s, end + dp_s + optimizer_s))
    return out
