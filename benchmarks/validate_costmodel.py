"""Predicted vs published TFLOP/s per GPU for Megatron-LM SC'21 Table 1 (A100, 32-3072 GPUs).

Prints a table, or with --json one object: rows, mean_abs_error_pct, max_abs_error_pct, and the
same two figures with the GEMM efficiency moved by +-0.03 (how sensitive the fit is).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from rich.console import Console
from rich.table import Table

from dmsc.netmodel import DEFAULT_CALIBRATION
from dmsc.netmodel.validation import ValidationRow, validate_megatron


def _summary(rows: list[ValidationRow]) -> tuple[float, float]:
    errors = [abs(r.error_pct) for r in rows]
    return sum(errors) / len(errors), max(errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()

    rows = validate_megatron()
    mean, worst = _summary(rows)
    sensitivity = {}
    for delta in (-0.03, 0.03):
        eff = DEFAULT_CALIBRATION.gemm_efficiency + delta
        calib = dataclasses.replace(DEFAULT_CALIBRATION, gemm_efficiency=eff)
        m, w = _summary(validate_megatron(calib))
        sensitivity[f"{eff:.2f}"] = {"mean_abs_error_pct": m, "max_abs_error_pct": w}

    if args.json:
        print(
            json.dumps(
                {
                    "rows": [{**dataclasses.asdict(r), "error_pct": r.error_pct} for r in rows],
                    "mean_abs_error_pct": mean,
                    "max_abs_error_pct": worst,
                    "gemm_efficiency": DEFAULT_CALIBRATION.gemm_efficiency,
                    "sensitivity": sensitivity,
                }
            )
        )
        return
    table = Table(title="Megatron-LM SC'21 Table 1: TFLOP/s per GPU, predicted vs published")
    for col in ("B", "GPUs", "tp", "pp", "dp", "batch", "mb", "v", "pub", "pred", "error"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r.params_billion:g}",
            str(r.gpus),
            str(r.tp),
            str(r.pp),
            str(r.dp),
            str(r.global_batch),
            str(r.micro_batch),
            str(r.interleave),
            f"{r.published_tflops:.0f}",
            f"{r.predicted_tflops:.1f}",
            f"{r.error_pct:+.1f}%",
        )
    console = Console()
    console.print(table)
    console.print(
        f"mean absolute error {mean:.2f}%, max {worst:.2f}% "
        f"(gemm_efficiency {DEFAULT_CALIBRATION.gemm_efficiency})"
    )
    for eff, s in sensitivity.items():
        console.print(
            f"  with gemm_efficiency {eff}: mean {s['mean_abs_error_pct']:.2f}%, "
            f"max {s['max_abs_error_pct']:.2f}%"
        )


if __name__ == "__main__":
    main()
