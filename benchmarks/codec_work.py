"""A codec's own passes over the update, measured against the cost model's figure.

For each codec the cost model prices the compute of (``none`` as the leader's frames carry it,
``bf16``, ``int8``) and each size, one fp32 update of ``--elements`` is encoded and the payload
decoded as dmsc's runtime does (:mod:`dmsc.runtime.compute.compression`), in one thread, and
timed (the median of ``--repeats``). The predictions are
:data:`dmsc.netmodel.codec_work.ENCODE` and :data:`~dmsc.netmodel.codec_work.DECODE` bytes an
element at this machine's memory bandwidth as ``dmsc calibrate`` measures it (a 64 MiB copy).

Prints a table, or with --json one object: ``memory_gbyte_s``, and per codec and size
``encode_ms`` / ``decode_ms`` measured and predicted and their ratios (measured over
predicted).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from leader_work import copy_bandwidth, summary, timed

from dmsc.netmodel.codec_work import DECODE, ENCODE
from dmsc.runtime.compute.compression import make_codec


def measure(sizes: list[int], repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    bandwidth = copy_bandwidth(repeats)
    rows: list[dict[str, Any]] = []
    for elements in sizes:
        update = torch.randn(elements, generator=torch.Generator().manual_seed(elements))
        for form in ENCODE:
            codec = make_codec(form, elements)
            payload = codec.encode(update)
            enc = timed(lambda c=codec, x=update: c.encode(x), repeats)
            dec = timed(lambda c=codec, p=payload, n=elements: c.decode(p, n), repeats)
            enc_p, dec_p = (elements * b / bandwidth for b in (ENCODE[form], DECODE[form]))
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
    ratios = [r[k] for r in rows for k in ("encode_ratio", "decode_ratio")]
    return {"repeats": repeats, "memory_gbyte_s": bandwidth / 1e9} | summary(rows, ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sizes", default="1000000,4000000", help="Elements, comma-separated.")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    res = measure([int(s) for s in args.sizes.split(",")], args.repeats)
    if args.json:
        print(json.dumps(res))
        return
    print(f"1 thread; memory {res['memory_gbyte_s']:.1f} GB/s (a 64 MiB copy)")
    print(f"{'codec':>5} {'elements':>9} | {'encode':>8} {'pred':>8} {'ratio':>5} | "
          f"{'decode':>8} {'pred':>8} {'ratio':>5}")  # fmt: skip
    for r in res["rows"]:
        print(
            f"{r['codec']:>5} {r['elements']:>9} | {r['encode_ms']:5.2f} ms "
            f"{r['encode_predicted_ms']:5.2f} ms {r['encode_ratio']:5.2f} | "
            f"{r['decode_ms']:5.2f} ms {r['decode_predicted_ms']:5.2f} ms {r['decode_ratio']:5.2f}"
        )
    lo, hi = res["ratio_range"]
    print(f"measured over predicted: {lo:.2f}-{hi:.2f} (median {res['ratio_median']:.2f})")


if __name__ == "__main__":
    main()
