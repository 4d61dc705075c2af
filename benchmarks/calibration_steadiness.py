"""How steady ``dmsc calibrate``'s all-reduce fit is from one calibration to the next.

Runs the collective part of ``dmsc calibrate`` (:func:`dmsc.runtime.compute.collective_calibration.
measure_allreduce`: two spawned processes, a gloo group, sizes timed in interleaved rounds, the
median over ``--pairs`` such pairs started one after another, as ``dmsc calibrate`` does)
``--passes`` times in a row and reports each pass's fit (latency and bandwidth, waited for
blocked and awake) and, for each figure, the least, the median and the largest over the passes
and their spread (largest over least). The cost model prices every tp, ep and dp collective with
these figures, so their spread bounds how near a prediction can come to a measurement on this
machine.

Prints a table, or with --json one object: ``passes`` (each pass's ``latency_us``,
``bandwidth_gbit_s``, ``latency_awake_us``, ``bandwidth_awake_gbit_s``; a figure whose fit
failed is left out), ``summary`` (figure -> least, median, largest, spread), ``rounds``,
``pairs``,
``load_average`` (1, 5, 15 min, at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from dmsc.runtime.compute.collective_calibration import PASSES, ROUNDS, measure_allreduce

FIGURES = {
    "latency_us": ("latency_s", 1e6),
    "bandwidth_gbit_s": ("bytes_s", 8e-9),
    "latency_awake_us": ("latency_awake_s", 1e6),
    "bandwidth_awake_gbit_s": ("bytes_awake_s", 8e-9),
}


def one_pass(rounds: int, pairs: int) -> dict[str, float]:
    got = measure_allreduce("gloo", rounds=rounds, passes=pairs)
    return {name: round(got[k] * f, 2) for name, (k, f) in FIGURES.items() if k in got}


def summary(passes: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    out = {}
    for name in FIGURES:
        xs = [p[name] for p in passes if name in p]
        if xs:
            lo, hi = min(xs), max(xs)
            out[name] = {
                "least": lo,
                "median": round(statistics.median(xs), 2),
                "largest": hi,
                "spread": round(hi / lo, 3) if lo > 0 else float("inf"),
                "passes": len(xs),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--pairs", type=int, default=PASSES, help="pairs a calibration medians")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    passes = [one_pass(args.rounds, args.pairs) for _ in range(args.passes)]
    out: dict[str, Any] = {"passes": passes, "summary": summary(passes), "rounds": args.rounds}
    out["pairs"] = args.pairs
    out["load_average"] = list(os.getloadavg())
    if args.json:
        print(json.dumps(out))
        return
    print(f"{'pass':>4s} " + " ".join(f"{n:>23s}" for n in FIGURES))
    for i, p in enumerate(passes):
        print(f"{i + 1:4d} " + " ".join(f"{p.get(n, float('nan')):23.2f}" for n in FIGURES))
    for n, s in out["summary"].items():
        print(f"{n}: {s['least']:.2f} .. {s['largest']:.2f} (median {s['median']:.2f}, "
              f"spread {s['spread']:.2f}x over {s['passes']} passes)")  # fmt: skip


if __name__ == "__main__":
    main()
