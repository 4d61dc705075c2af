"""The cost model against published measurements, set by set (dmsc.netmodel.validation).

``--list`` prints the sets and their devices; ``--set NAME`` predicts one set row by row (several
``--set`` for several; default: all), and prints a table per set, or with ``--json`` one object:
per set its ``device``, ``rows``, ``mean_abs_error_pct`` and ``max_abs_error_pct``, and how
sensitive the fit is (the same two figures with the generation's GEMM efficiency moved by
+-0.03). Every set uses the default calibration: one set of constants per device generation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from dmsc.netmodel import DEFAULT_CALIBRATION
from dmsc.netmodel.validation import VALIDATION_SETS, summary, validate

CALCULON_MEAN_PCT = 3.65  # Isaev et al., "Calculon", SC'23: mean error on its A100 validation


def run_set(name: str, sensitivity: bool) -> dict[str, Any]:
    vs = VALIDATION_SETS[name]
    rows = validate(name)
    mean, worst = summary(rows)
    out: dict[str, Any] = {
        "set": name,
        "source": vs.source,
        "device": vs.device,
        "generation": vs.generation,
        "metric": vs.metric,
        "rows": [{**dataclasses.asdict(r), "error_pct": r.error_pct} for r in rows],
        "mean_abs_error_pct": mean,
        "max_abs_error_pct": worst,
        "beats_calculon": mean < CALCULON_MEAN_PCT,
    }
    if sensitivity:
        base = DEFAULT_CALIBRATION.generation(vs.generation).gemm_efficiency
        out["gemm_efficiency"] = base
        out["sensitivity"] = {}
        for delta in (-0.03, 0.03):
            calib = DEFAULT_CALIBRATION.with_generation(vs.generation, gemm_efficiency=base + delta)
            m, w = summary(validate(name, calib))
            out["sensitivity"][f"{base + delta:.2f}"] = {
                "mean_abs_error_pct": m,
                "max_abs_error_pct": w,
            }
    return out


def print_set(console: Console, res: dict[str, Any]) -> None:
    unit = "iteration s" if res["metric"] == "iteration_s" else "TFLOP/s per GPU"
    table = Table(title=f"{res['set']}: {res['source']} ({res['device']}), {unit}")
    for col in ("row", "GPUs", "tp", "pp", "dp", "batch", "mb", "v", "recompute"):
        table.add_column(col, justify="right")
    for col in ("published", "predicted", "error"):
        table.add_column(col, justify="right")
    for r in res["rows"]:
        table.add_row(
            r["label"],
            str(r["gpus"]),
            str(r["tp"]),
            str(r["pp"]),
            str(r["dp"]),
            str(r["global_batch"]),
            str(r["micro_batch"]),
            str(r["interleave"]),
            r["recompute"],
            f"{r['published']:g}",
            f"{r['predicted']:.2f}",
            f"{r['error_pct']:+.1f}%",
        )
    console.print(table)
    console.print(
        f"mean absolute error {res['mean_abs_error_pct']:.2f}%, "
        f"max {res['max_abs_error_pct']:.2f}% (Calculon's A100 mean: {CALCULON_MEAN_PCT}%)"
    )
    for eff, s in res.get("sensitivity", {}).items():
        console.print(
            f"  with gemm_efficiency {eff}: mean {s['mean_abs_error_pct']:.2f}%, "
            f"max {s['max_abs_error_pct']:.2f}%"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--set", action="append", dest="sets", metavar="NAME", help="a set")
    parser.add_argument("--list", action="store_true", help="the sets and their devices")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument(
        "--no-sensitivity", action="store_true", help="skip the +-0.03 efficiency runs"
    )
    args = parser.parse_args()
    if args.list:
        sets = [
            {"set": s.name, "device": s.device, "generation": s.generation, "source": s.source}
            for s in VALIDATION_SETS.values()
        ]
        if args.json:
            print(json.dumps({"sets": sets}))
        else:
            for s in sets:
                print(f"{s['set']:22s} {s['device']:10s} {s['source']}")
        return
    names = args.sets or list(VALIDATION_SETS)
    unknown = [n for n in names if n not in VALIDATION_SETS]
    if unknown:
        print(
            f"error: unknown set {', '.join(unknown)} (known: {', '.join(VALIDATION_SETS)})",
            file=sys.stderr,
        )
        sys.exit(2)
    results = [run_set(n, not args.no_sensitivity) for n in names]
    if args.json:
        if len(results) == 1:
            print(json.dumps(results[0]))
        else:
            print(json.dumps({"sets": results}))
        return
    console = Console()
    for res in results:
        print_set(console, res)


if __name__ == "__main__":
    main()
