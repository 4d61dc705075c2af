"""Strategy search: every valid (dp, pp, tp, ep, micro-batch, schedule, recompute), ranked.

Candidates that cannot run (shapes not divisible, memory) are pruned with their reason; the rest
are costed with the cost model on a shared topology and communication model, and the best comes
back with the top-k runners-up and why each lost (the largest term of its extra time).
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from dmsc.netmodel import (
    DEFAULT_CALIBRATION,
    Calibration,
    CommModel,
    DoesNotFit,
    Estimate,
    Topology,
    estimate_iteration,
)
from dmsc.netmodel.iteration import compute_bound
from dmsc.spec import ClusterSpec, JobSpec, LayerListSpec, TransformerSpec


@dataclass(frozen=True)
class Candidate:
    """A costed strategy."""

    job: JobSpec
    estimate: Estimate

    @property
    def time_s(self) -> float:
        return self.estimate.iteration_time_s


@dataclass(frozen=True)
class StrategySearch:
    """The outcome of a strategy search."""

    best: Candidate
    alternatives: tuple[tuple[Candidate, str], ...]  # runner-up and why it lost
    considered: int
    pruned: dict[str, int] = field(default_factory=dict)  # reason -> count
    seconds: float = 0.0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_jobs(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    base: JobSpec,
    devices: int,
    max_stage_devices: int | None = None,
) -> Iterator[JobSpec]:
    """Every parallel configuration of ``base`` on exactly ``devices`` devices.

    ``base`` fixes mode, global batch, ZeRO, sequence parallelism policy and what is not searched;
    its tp/pp/dp/ep/micro-batch/schedule/recompute are searched. Tensor parallelism stays inside a
    node (at most the smallest node's device count). ``max_stage_devices`` bounds what one
    datacenter must hold of a stage: its ``tp x dp`` devices, or, for a job that synchronises
    once per round (placed as islands: :mod:`dmsc.planner.islands`), an island's ``tp x ep``.
    """
    islands = base.sync.local_steps
    node_devices = min(nt.devices for nt in cluster.node_types.values())
    n_layers = model.layers if isinstance(model, TransformerSpec) else len(model.layer_list)
    if isinstance(model, TransformerSpec):
        tps = [t for t in _divisors(node_devices) if model.heads % t == 0]
    else:
        tps = [1]
    experts = model.experts if isinstance(model, TransformerSpec) else 1
    modes = ("none", "selective", "full") if base.mode == "train" else ("none",)
    for tp in tps:
        for pp in _divisors(devices // tp) if devices % tp == 0 else []:
            if pp > n_layers:
                continue
            dp = devices // (tp * pp)
            if max_stage_devices is not None and not islands and tp * dp > max_stage_devices:
                continue
            eps = [e for e in _divisors(dp) if experts % e == 0] if experts > 1 else [1]
            for ep in eps:
                if max_stage_devices is not None and islands and tp * ep > max_stage_devices:
                    continue
                for mb in (1, 2, 4, 8):
                    if base.global_batch % (mb * dp):
                        continue
                    schedules: list[tuple[str, int]] = [("1f1b", 1)]
                    if pp > 1:
                        per = n_layers // pp
                        schedules += [("interleaved", v) for v in _divisors(per) if 1 < v <= 8]
                    for schedule, v in schedules:
                        for rc in modes:
                            yield base.model_copy(
                                update={
                                    "tp": tp,
                                    "pp": pp,
                                    "dp": dp,
                                    "ep": ep,
                                    "micro_batch": mb,
                                    "schedule": schedule,
                                    "interleave": v,
                                    "recompute": rc,
                                    "sequence_parallel": tp > 1,  # as Megatron-LM advises
                                }
                            )


# Estimates closer than this are the same figure (floating-point noise, or what placement
# rounds to whole microseconds anyway).
EQUAL_S = 1e-6


def signed_seconds(x: float) -> str:
    """A difference of seconds with its sign, in a unit that keeps it readable: ``+1.38 s``,
    ``+3 ms``, ``+45 us`` (never ``+7.12e-07 s``)."""
    a = abs(x)
    if a >= 0.1 or a == 0:
        return f"{x:+.3g} s"
    if a >= 1e-4:
        return f"{x * 1e3:+.3g} ms"
    return f"{x * 1e6:+.3g} us"


def why_lost(
    best: Mapping[str, float], best_s: float, other: Mapping[str, float], other_s: float
) -> str:
    """Why a runner-up lost to the chosen strategy: its extra seconds per iteration and the term
    of the breakdown that grew most, both strategies as the cost model estimates them (before
    placement); ``equal`` when the two estimates are the same (the search kept the first)."""
    extra = other_s - best_s
    if abs(extra) < EQUAL_S:
        return "equal"
    diffs = {k: other.get(k, 0.0) - best.get(k, 0.0) for k in best}
    key = max(diffs, key=lambda k: diffs[k])
    return f"{signed_seconds(extra)}, mostly {key} ({signed_seconds(diffs[key])})"


def _why_lost(best: Estimate, other: Estimate) -> str:
    return why_lost(
        best.breakdown_s, best.iteration_time_s, other.breakdown_s, other.iteration_time_s
    )


def _needs_gib(reason: str) -> float:
    """The memory a stage needs, from a memory reason ("stage 0 needs 120.3 GiB per device")."""
    found = re.search(r"needs ([\d.]+) GiB", reason)
    return float(found[1]) if found else math.inf


def _none_fits(devices: int, tried: int, pruned: Counter[str], example: dict[str, str]) -> str:
    """Why no configuration fits, in words: how many each kind of reason ruled out, and one
    of each (the leanest for memory)."""
    if not tried:
        return f"no strategy fits on {devices} devices: no configuration to try"
    parts = [
        f"{n} need more memory than a device has, the leanest: {example[kind]}"
        if kind == "memory"
        else f"{n} ruled out as {example[kind]}"
        for kind, n in pruned.most_common(3)
    ]
    return (
        f"no strategy fits on {devices} devices: none of the {tried} configurations tried "
        f"fits ({'; '.join(parts)})"
    )


def search_strategies(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    base: JobSpec,
    devices: int,
    top_k: int = 5,
    calib: Calibration = DEFAULT_CALIBRATION,
    max_stage_devices: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> StrategySearch:
    """Cost every configuration and return the fastest with the top-k alternatives.

    Each configuration's memory and compute come first (:func:`compute_bound`: a lower bound of
    its iteration time); the full estimate, communication included, is made in increasing order
    of bound and stops once a bound exceeds the (top-k + 1)-th best time found: no configuration
    left can enter the result, which is what costing them all gives (ties kept in enumeration
    order). GPT-3 175B on 1,024 A100s: 993 configurations, 175 fit, 38 costed in full
    (``benchmarks/strategy_search.py``)."""
    t0 = time.perf_counter()
    topo = Topology(cluster)
    comm = CommModel(topo, calib)
    pruned: Counter[str] = Counter()
    example: dict[str, str] = {}  # a reason of each kind: for memory, the leanest
    bounded: list[tuple[float, int, JobSpec]] = []
    considered = 0
    for job in enumerate_jobs(cluster, model, base, devices, max_stage_devices):
        considered += 1
        if progress is not None:
            progress(considered)
        try:
            bounded.append((compute_bound(cluster, model, job, calib, topo), considered, job))
        except DoesNotFit as exc:
            _prune(exc.reasons[0], pruned, example)
    bounded.sort(key=lambda b: (b[0], b[1]))
    costed: list[tuple[Candidate, int]] = []
    for bound, order, job in bounded:
        if len(costed) > top_k and bound > costed[top_k][0].time_s + EQUAL_S:
            break
        try:
            est = estimate_iteration(cluster, model, job, calib, topology=topo, comm_model=comm)
        except DoesNotFit as exc:  # not from memory or compute: checked above
            _prune(exc.reasons[0], pruned, example)
            continue
        costed.append((Candidate(job, est), order))
        costed.sort(key=lambda c: (c[0].time_s, c[1]))
    if not costed:
        raise DoesNotFit([_none_fits(devices, considered, pruned, example)])
    best = costed[0][0]
    alternatives = tuple(
        (c, _why_lost(best.estimate, c.estimate)) for c, _ in costed[1 : 1 + top_k]
    )
    return StrategySearch(best, alternatives, considered, dict(pruned), time.perf_counter() - t0)


def _prune(reason: str, pruned: Counter[str], example: dict[str, str]) -> None:
    """Count a configuration that cannot run by the kind of its reason; keep one reason of each
    kind (for memory, the leanest)."""
    kind = "memory" if "GiB" in reason else reason.split(" is ")[0]
    pruned[kind] += 1
    if kind not in example or _needs_gib(reason) < _needs_gib(example[kind]):
        example[kind] = reason
