"""The cost model against ``gpu_train_measure.py``'s single-GPU training runs (issue 13).

For every measured configuration: ``dmsc estimate`` of the same model and micro-batch on a
one-GPU cluster of that device (its preset: H100, H200, A100, B200), with the plain-PyTorch recipe
(``precision: autocast``, flash attention); measured against predicted step time and peak memory
(``torch.cuda.max_memory_allocated`` against the predicted tensor memory), and whether every
configuration that ran is predicted to fit (and every one that ran out of memory is not).
Prints a table, or with ``--json`` one object with the same figures.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from dmsc.netmodel import DoesNotFit, estimate_iteration
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec

GIB = 2**30
PRESETS = {"H100": "h100-sxm", "H200": "h200-sxm", "A100": "a100-sxm-80gb", "B200": "b200"}


def one_gpu(device_name: str) -> ClusterSpec:
    preset = next((p for key, p in PRESETS.items() if key in device_name), None)
    if preset is None:
        raise SystemExit(f"error: no device preset for {device_name!r} ({', '.join(PRESETS)})")
    return ClusterSpec.model_validate(
        {
            "name": "one-gpu",
            "device_types": {"gpu": {"preset": preset}},
            "node_types": {
                "server": {"device": "gpu", "devices": 1, "link": {"bandwidth_gbit_s": 3600}}
            },
            "datacenters": [
                {
                    "name": "lab",
                    "nodes": [{"type": "server", "count": 1}],
                    "network": {"gbit_s_per_node": 400},
                }
            ],
        }
    )


def compare(measured: dict[str, Any]) -> dict[str, Any]:
    cluster = one_gpu(measured["device"])
    rows = []
    for r in measured["rows"]:
        model = TransformerSpec(
            name=r["model"],
            layers=r["layers"],
            hidden=r["hidden"],
            heads=r["heads"],
            seq=r["seq"],
            vocab=r["vocab"],
            dtype="bf16",
            tied_embeddings=True,
        )
        job = JobSpec(global_batch=r["micro_batch"], micro_batch=r["micro_batch"])
        job = job.model_copy(update={"precision": "autocast", "attention": "flash"})
        row: dict[str, Any] = {k: r[k] for k in ("model", "micro_batch", "status")}
        try:
            est = estimate_iteration(cluster, model, job)
            fullest = max(est.stages, key=lambda s: s.memory.total)
            row |= {
                "predicted_fits": True,
                "predicted_ms": est.iteration_time_s * 1e3,
                "predicted_tensor_gib": fullest.memory.tensors / GIB,
                "predicted_total_gib": fullest.memory.total / GIB,
            }
        except DoesNotFit:
            row["predicted_fits"] = False
        if r["status"] == "ok":
            row |= {"measured_ms": r["step_ms"], "measured_peak_gib": r.get("peak_allocated_gib")}
            if row["predicted_fits"]:
                row["time_ratio"] = row["predicted_ms"] / r["step_ms"]
                if r.get("peak_allocated_gib"):
                    row["memory_ratio"] = row["predicted_tensor_gib"] / r["peak_allocated_gib"]
        rows.append(row)
    ran = [r for r in rows if r["status"] == "ok"]
    return {
        "device": measured["device"],
        "rows": rows,
        "every_run_predicted_to_fit": all(r["predicted_fits"] for r in ran),
        "every_oom_predicted_not_to_fit": all(
            not r["predicted_fits"] for r in rows if r["status"] == "oom"
        ),
        "mean_abs_time_error_pct": (
            sum(abs(r["time_ratio"] - 1) for r in ran if "time_ratio" in r)
            / max(1, sum(1 for r in ran if "time_ratio" in r))
            * 100
        ),
        "mean_abs_memory_error_pct": (
            sum(abs(r["memory_ratio"] - 1) for r in ran if "memory_ratio" in r)
            / max(1, sum(1 for r in ran if "memory_ratio" in r))
            * 100
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("measured", help="the JSON gpu_train_measure.py wrote")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    with open(args.measured) as f:
        res = compare(json.load(f))
    if args.json:
        print(json.dumps(res))
        return
    table = Table(title=f"one {res['device']}: measured vs dmsc estimate (autocast, flash)")
    for col in ("model", "mb", "status", "ms", "pred ms", "peak GiB", "pred GiB", "fits?"):
        table.add_column(col, justify="right")
    for r in res["rows"]:

        def f(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]:.1f}" if r.get(key) is not None else "-"

        table.add_row(
            r["model"],
            str(r["micro_batch"]),
            r["status"],
            f("measured_ms"),
            f("predicted_ms"),
            f("measured_peak_gib"),
            f("predicted_tensor_gib"),
            "yes" if r["predicted_fits"] else "no",
        )
    console = Console()
    console.print(table)
    console.print(
        f"every run predicted to fit: {res['every_run_predicted_to_fit']}; "
        f"mean |time error| {res['mean_abs_time_error_pct']:.1f}%, "
        f"mean |memory error| {res['mean_abs_memory_error_pct']:.1f}%"
    )


if __name__ == "__main__":
    main()
