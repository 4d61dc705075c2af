"""A codec's own passes over the update, measured against the cost model's figure.

For each codec the cost model prices the compute of (``none`` as the leader's frames carry it,
``bf16``, ``int8``, ``topk:0.01``) and each size, one fp32 update of ``--elements`` is encoded
and the payload decoded as dmsc's runtime does (:mod:`dmsc.runtime.compute.compression`), in one
thread, and timed (the median of ``--repeats``). The predictions are
:func:`dmsc.netmodel.codec_work.encode_bytes` and :func:`~dmsc.netmodel.codec_work.decode_bytes`
bytes an element at this machine's memory bandwidth as ``dmsc calibrate`` measures it (a
64 MiB copy).
Top-k's selection is also timed as it was before :mod:`dmsc.runtime.compute.top_select`
(``torch.topk`` over every magnitude: ``topk_torch_ms``, and ``topk_speedup``, side by side).
PowerSGD (``powersgd:4``, the update as ``1024``-column matrices) is one replica's three calls of
an exchange (``start``, ``middle``, ``finish``, each handed its own factors back) against
:data:`~dmsc.netmodel.codec_work.POWERSGD` bytes an element and its products at this machine's
rate as ``dmsc calibrate`` measures it (``lowrank_ns``,
:func:`dmsc.runtime.compute.host_rates.measure_lowrank_seconds`), in ``encode_ms``; the price of
its products as memory passes alone, until 2026-12-04, beside it (``encode_ratio_passes_only``).

Measured as a worker computes, its freed memory kept (:mod:`dmsc.runtime.compute.host_memory`);
the same rows are also measured in a fresh process left with glibc's default allocator, side by
side (``default_allocator``: its ratios, and each time with the defaults over the kept one's).

Prints a table, or with --json one object: ``memory_gbyte_s``, per codec and size
``encode_ms`` / ``decode_ms`` measured and predicted and their ratios (measured over
predicted), ``topk_speedup_range``, and ``default_allocator``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

import torch
from leader_work import copy_bandwidth, summary, timed

from dmsc.netmodel.codec_work import (
    POWERSGD,
    POWERSGD_PRODUCT_BYTES,
    decode_bytes,
    encode_bytes,
    lowrank_s,
)
from dmsc.runtime.compute.compression import PowerSGD, make_codec
from dmsc.runtime.compute.host_memory import keep_freed_memory
from dmsc.runtime.compute.host_rates import measure_lowrank_seconds
from dmsc.runtime.compute.top_select import top_indices
from dmsc.spec.sync_forms import parse_compress

FORMS = {"none": "none", "bf16": "bf16", "int8": "int8", "topk": "topk:0.01"}


def _powersgd(
    update: torch.Tensor, repeats: int, bandwidth: float, per_element_s: float
) -> dict[str, Any]:
    update = update[: update.numel() // 1024 * 1024]  # whole rows of 1024
    elements = update.numel()
    codec = PowerSGD([torch.Size([elements // 1024, 1024])], rank=4)

    def exchange() -> None:  # one replica's part, the averages being its own factors
        codec.finish(codec.middle(codec.start(update)))

    took = timed(exchange, repeats)
    products = lowrank_s(parse_compress("powersgd:4"), per_element_s)
    predicted = elements * (POWERSGD / bandwidth + products)
    passes_only = elements * (POWERSGD + POWERSGD_PRODUCT_BYTES) / bandwidth
    return {
        "codec": "powersgd:4",
        "elements": elements,
        "encode_ms": took * 1e3,
        "encode_predicted_ms": predicted * 1e3,
        "encode_ratio": took / predicted,
        "encode_ratio_passes_only": took / passes_only,
        "lowrank_ns": per_element_s * 1e9,
    }


def measure(sizes: list[int], repeats: int, keep: bool = True) -> dict[str, Any]:
    torch.set_num_threads(1)
    if keep:  # as a worker computes (dmsc.runtime.compute.host_memory)
        keep_freed_memory()
    bandwidth = copy_bandwidth(repeats)
    per_element_s = measure_lowrank_seconds()  # as dmsc calibrate measures it
    rows: list[dict[str, Any]] = []
    for elements in sizes:
        update = torch.randn(elements, generator=torch.Generator().manual_seed(elements))
        for kind, form in FORMS.items():
            codec = make_codec(form, elements)
            payload = codec.encode(update)
            enc = timed(lambda c=codec, x=update: c.encode(x), repeats)
            dec = timed(lambda c=codec, p=payload, n=elements: c.decode(p, n), repeats)
            form_ = parse_compress(form)
            enc_p, dec_p = (elements * f(form_) / bandwidth for f in (encode_bytes, decode_bytes))
            rows.append(
                {
                    "codec": form,
                    "elements": elements,
                    "encode_ms": enc * 1e3,
                    "encode_predicted_ms": enc_p * 1e3,
                    "encode_ratio": enc / enc_p,
                    "decode_ms": dec * 1e3,
                    "decode_predicted_ms": dec_p * 1e3,
                    "decode_ratio": dec / dec_p,
                }
            )
            if kind == "topk":  # the selection as it was: torch.topk over every magnitude
                k = codec.k  # type: ignore[attr-defined]
                old = timed(lambda x=update, k=k: torch.topk(x.abs(), k, sorted=False), repeats)
                new = timed(lambda x=update, k=k: top_indices(x.abs(), k), repeats)
                rows[-1] |= {"topk_torch_ms": old * 1e3, "topk_speedup": old / new}
        rows.append(_powersgd(update, repeats, bandwidth, per_element_s))
    ratios = [r[k] for r in rows for k in ("encode_ratio", "decode_ratio") if k in r]
    gains = [r["topk_speedup"] for r in rows if "topk_speedup" in r]
    return {
        "repeats": repeats,
        "memory_gbyte_s": bandwidth / 1e9,
        "topk_speedup_range": [min(gains), max(gains)],
    } | summary(rows, ratios)


def with_default_allocator(sizes: list[int], repeats: int) -> dict[str, Any]:
    """The same measurement in a fresh process left with glibc's defaults (the allocator's
    parameters cannot be put back in this one): medians of its ratios, and each row's time
    with the defaults over its time with freed memory kept."""
    argv = [sys.executable, __file__, "--json", "--default-allocator"]
    argv += ["--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    res: dict[str, Any] = json.loads(done.stdout)
    return res


def _compare(kept: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    slower = [
        d[f"{side}_ms"] / k[f"{side}_ms"]
        for k, d in zip(kept["rows"], default["rows"], strict=True)
        for side in ("encode", "decode")
        if f"{side}_ms" in k
    ]
    return {
        "ratio_median": default["ratio_median"],
        "ratio_range": default["ratio_range"],
        "rows": default["rows"],
        "slower_range": [min(slower), max(slower)],
        "slower_median": statistics.median(slower),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sizes", default="1000000,4000000", help="Elements, comma-separated.")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--default-allocator", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    res = measure(sizes, args.repeats, keep=not args.default_allocator)
    if not args.default_allocator:
        res["default_allocator"] = _compare(res, with_default_allocator(sizes, args.repeats))
    if args.json:
        print(json.dumps(res))
        return
    print(f"1 thread; memory {res['memory_gbyte_s']:.1f} GB/s (a 64 MiB copy)")
    print(f"{'codec':>10} {'elements':>9} | {'encode':>8} {'pred':>8} {'ratio':>5} | "
          f"{'decode':>8} {'pred':>8} {'ratio':>5}")  # fmt: skip
    for r in res["rows"]:
        decode = (
            f"{r['decode_ms']:5.2f} ms {r['decode_predicted_ms']:5.2f} ms {r['decode_ratio']:5.2f}"
            if "decode_ms" in r
            else "(the exchange's three calls, in encode)"
        )
        print(
            f"{r['codec']:>10} {r['elements']:>9} | {r['encode_ms']:5.2f} ms "
            f"{r['encode_predicted_ms']:5.2f} ms {r['encode_ratio']:5.2f} | {decode}"
        )
        if "topk_torch_ms" in r:
            old, gain = r["topk_torch_ms"], r["topk_speedup"]
            print(f"{'':>20} | the selection by torch.topk over all: {old:.2f} ms, {gain:.1f}x")
        if "encode_ratio_passes_only" in r:
            print(
                f"{'':>20} | products at {r['lowrank_ns']:.2f} ns an element; priced as "
                f"memory passes (until 2026-12-04): ratio {r['encode_ratio_passes_only']:.2f}"
            )
    lo, hi = res["ratio_range"]
    print(f"measured over predicted: {lo:.2f}-{hi:.2f} (median {res['ratio_median']:.2f})")
    d = res.get("default_allocator")
    if d:
        (lo, hi), (s_lo, s_hi) = d["ratio_range"], d["slower_range"]
        print(f"with glibc's default allocator (a fresh process): measured over predicted "
              f"{lo:.2f}-{hi:.2f} (median {d['ratio_median']:.2f}); each time "
              f"{s_lo:.2f}-{s_hi:.2f}x the kept memory's "
              f"(median {d['slower_median']:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
