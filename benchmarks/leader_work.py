"""The stage leader's own work through the star, measured against the cost model's figure.

For each rule the leader can combine its replicas' updates with (``mean``, ``median``,
``trimmed-mean``, ``krum:1``, ``multi-krum:1``) and each count of replicas, ``n`` fp32 updates
of ``--elements`` elements are combined as dmsc's runtime combines them (the mean as the leader
of a plain round sums and divides, :mod:`dmsc.runtime.compute.outer_sync`; the others by
:func:`dmsc.runtime.compute.aggregators.aggregate`), in one thread, and timed (the median of
``--repeats``). The prediction is :func:`dmsc.netmodel.leader_work.leader_work_s` at this
machine's memory bandwidth as ``dmsc calibrate`` measures it (a 64 MiB copy; its efficiency is
then 1). Beside the median and the trimmed mean, ``torch.sort`` along the replicas (what the
runtime ranked with before its sorting network) is timed on the same updates.

Prints a table, or with --json one object: ``memory_gbyte_s``, and per rule and count
``measured_ms``, ``predicted_ms``, ``ratio`` (measured over predicted), and for the sorting
rules ``torch_sort_ms`` and ``network_speedup``; ``privacy``: central differential
privacy's clip and noise (:func:`privacy_row`) against their price; ``secure``: secure
aggregation's masking and unmasking at each count (:func:`secure_rows`) against theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dmsc.netmodel.leader_work import leader_work_s, privacy_work_s, secure_work_s
from dmsc.runtime.compute.aggregators import aggregate, parse_aggregator, summed
from dmsc.runtime.compute.host_memory import keep_freed_memory
from dmsc.runtime.compute.host_rates import measure_gaussian_seconds, measure_mask_seconds
from dmsc.runtime.compute.privacy import add_noise, clip_update
from dmsc.runtime.compute.secure_agg import (
    MaskingParty,
    ring_from_payload,
    ring_to_payload,
    unmask_sum,
)

RULES = ("mean", "median", "trimmed-mean", "krum:1", "multi-krum:1")


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(repeats: int) -> float:
    """Bytes a second of a 64 MiB copy, read and written (``dmsc calibrate``'s figure)."""
    src = torch.empty(64 * 1024 * 1024, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() / timed(lambda: dst.copy_(src), repeats)


def combine(rule: str, parts: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    if rule == "mean":  # the leader's sum and division of a plain round (outer_sync)
        return lambda: summed(parts) / len(parts)
    name, options = parse_aggregator(rule)
    return lambda: aggregate(name, parts, **options)  # type: ignore[arg-type]


def measure(elements: int, counts: list[int], repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    keep_freed_memory()  # as a worker computes (dmsc.runtime.compute.host_memory)
    bandwidth = copy_bandwidth(repeats)
    rows: list[dict[str, Any]] = []
    for n in counts:
        g = torch.Generator().manual_seed(n)
        parts = [torch.randn(elements, generator=g) for _ in range(n)]
        for rule in RULES:
            try:
                fn = combine(rule, parts)
                fn()
            except ValueError:  # too few replicas for the rule
                continue
            measured = timed(fn, repeats)
            predicted = leader_work_s(rule, n, elements, bandwidth)
            row = {"rule": rule, "n": n, "measured_ms": measured * 1e3}
            row |= {"predicted_ms": predicted * 1e3, "ratio": measured / predicted}
            if rule in ("median", "trimmed-mean"):
                sort = timed(lambda p=parts: torch.stack(p).sort(dim=0), repeats)
                row |= {"torch_sort_ms": sort * 1e3, "network_speedup": sort / measured}
            rows.append(row)
    head = {"elements": elements, "repeats": repeats, "memory_gbyte_s": bandwidth / 1e9}
    head["privacy"] = privacy_row(elements, repeats, bandwidth)
    head["secure"] = secure_rows(elements, counts, repeats, bandwidth)
    return head | summary(rows, [r["ratio"] for r in rows])


def privacy_row(elements: int, repeats: int, bandwidth: float) -> dict[str, Any]:
    """Central privacy's work on the path a replica waits on, as the runtime does it: one
    replica's update clipped, and the leader's noise drawn and added to the sum
    (:mod:`dmsc.runtime.compute.privacy`), against
    :func:`dmsc.netmodel.leader_work.privacy_work_s` at the copy's bandwidth and at this
    machine's Gaussian draw as ``dmsc calibrate`` measures it."""
    gen = torch.Generator().manual_seed(0)
    update = torch.randn(elements, generator=gen)
    clip = float(torch.linalg.vector_norm(update)) / 2  # the clip scales it down
    clipped = timed(lambda: clip_update(update, clip), repeats)
    noised = timed(lambda: add_noise(update, 1.0, clip, gen), repeats)
    gaussian_s = measure_gaussian_seconds(elements)
    predicted = privacy_work_s("noise", elements, bandwidth, gaussian_s)
    measured = clipped + noised
    return {
        "gaussian_ns": gaussian_s * 1e9,
        "clip_ms": clipped * 1e3,
        "noise_ms": noised * 1e3,
        "measured_ms": measured * 1e3,
        "predicted_ms": predicted * 1e3,
        "ratio": measured / predicted,
    }


def secure_rows(elements: int, counts: list[int], repeats: int, bandwidth: float) -> dict[str, Any]:
    """Secure aggregation's work on the path a replica waits on, as the runtime does it
    (:meth:`dmsc.runtime.compute.outer_sync.ReplicaSync._secure`): one replica's update masked
    for a fresh round and packed for the wire, and the leader's sum of the ``n`` payloads
    unmasked and divided, against :func:`dmsc.netmodel.leader_work.secure_work_s` at the copy's
    bandwidth and this machine's mask rate as ``dmsc calibrate`` measures it."""
    mask_s = measure_mask_seconds(elements)
    rows = []
    for n in counts:
        gen = torch.Generator().manual_seed(n)
        parties = [MaskingParty(i, n) for i in range(n)]
        keys = [p.public_bytes() for p in parties]
        for p in parties:
            p.agree(keys, "benchmark")
        update = torch.randn(elements, generator=gen) * 0.01
        labels = iter(range(1 << 30))  # a party masks under each round label once
        masked = timed(
            lambda p=parties[n // 2], x=update, it=labels: ring_to_payload(p.mask(x, next(it))),
            repeats,
        )
        payloads = [ring_to_payload(p.mask(update, "sum")) for p in parties]
        summed_s = timed(
            lambda q=payloads, k=n: unmask_sum([ring_from_payload(x) for x in q]) / k, repeats
        )
        predicted = secure_work_s(n, elements, bandwidth, mask_s)
        measured = masked + summed_s
        rows.append(
            {
                "n": n,
                "mask_ms": masked * 1e3,
                "unmask_ms": summed_s * 1e3,
                "measured_ms": measured * 1e3,
                "predicted_ms": predicted * 1e3,
                "ratio": measured / predicted,
            }
        )
    ratios = [r["ratio"] for r in rows]
    return {"mask_ns": mask_s * 1e9, "rows": rows, "ratio_range": [min(ratios), max(ratios)]}


def summary(rows: list[dict[str, Any]], ratios: list[float]) -> dict[str, Any]:
    """The rows, the range and median of their measured-over-predicted ratios, the load."""
    return {
        "rows": rows,
        "ratio_range": [min(ratios), max(ratios)],
        "ratio_median": statistics.median(ratios),
        "load_average": list(os.getloadavg()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--elements", type=int, default=1_000_000, help="Elements an update.")
    parser.add_argument("--counts", default="3,5,8,16", help="Replica counts, comma-separated.")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    res = measure(args.elements, counts, args.repeats)
    if args.json:
        print(json.dumps(res))
        return
    print(
        f"{res['elements']} fp32 elements an update, 1 thread; memory "
        f"{res['memory_gbyte_s']:.1f} GB/s (a 64 MiB copy)"
    )
    print(f"{'rule':>13} {'n':>3} | {'measured':>9} {'predicted':>9} {'ratio':>5} | torch.sort")
    for r in res["rows"]:
        sort = f"{r['torch_sort_ms']:7.1f} ms" if "torch_sort_ms" in r else ""
        print(
            f"{r['rule']:>13} {r['n']:>3} | {r['measured_ms']:6.1f} ms {r['predicted_ms']:6.1f} ms "
            f"{r['ratio']:5.2f} | {sort}"
        )
    lo, hi = res["ratio_range"]
    print(f"measured over predicted: {lo:.2f}-{hi:.2f} (median {res['ratio_median']:.2f})")
    pv = res["privacy"]
    print(
        f"central privacy (clip {pv['clip_ms']:.1f} ms + noise {pv['noise_ms']:.1f} ms, a draw "
        f"{pv['gaussian_ns']:.1f} ns): {pv['measured_ms']:.1f} ms against "
        f"{pv['predicted_ms']:.1f} ms predicted ({pv['ratio']:.2f})"
    )
    sa = res["secure"]
    print(f"secure aggregation (a pair's mask {sa['mask_ns']:.2f} ns an element):")
    for r in sa["rows"]:
        print(
            f"{'':>13} {r['n']:>3} | {r['measured_ms']:6.1f} ms {r['predicted_ms']:6.1f} ms "
            f"{r['ratio']:5.2f} | mask {r['mask_ms']:.1f} ms, unmask {r['unmask_ms']:.1f} ms"
        )


if __name__ == "__main__":
    main()
