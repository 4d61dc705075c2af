"""The compute model against measurements made on a GPU by ``gpu_measure.py``.

Reads the measurement JSON (default: results/gpu_h200.json, measured on an NVIDIA H200 with
PyTorch 2.11 / CUDA 13) and prints, per case, measured and predicted milliseconds and their ratio;
with --json one object with the same figures. The device is described as a dmsc device type from
its preset (dmsc.spec.devices: H200 SXM, 989 dense bf16 TFLOP/s, 4.8 TB/s HBM3e, 132 SMs) and
costed with that generation's calibration.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from dmsc.netmodel import DEFAULT_CALIBRATION, Gemm, build_layer_costs
from dmsc.netmodel.compute import gemm_time, layer_time
from dmsc.spec import DeviceTypeSpec, JobSpec, TransformerSpec

HERE = Path(__file__).resolve().parent
DEVICES = {
    "NVIDIA H200": DeviceTypeSpec(preset="h200-sxm"),
    "NVIDIA H100 80GB HBM3": DeviceTypeSpec(preset="h100-sxm"),
}


def compare(measured: dict) -> dict:
    device = DEVICES[measured["device"]]
    calib = DEFAULT_CALIBRATION
    dc = calib.for_device(device)
    rows = []
    for g in measured["gemms"]:
        gemm = Gemm(g["m"], g["n"], g["k"], g["batch"])
        pred = gemm_time(gemm, device, "bf16", dc) * 1e3
        rows.append({"case": f"GEMM {g['name']}", "measured_ms": g["ms"], "predicted_ms": pred})
    copy = measured["copy"]
    pred = copy["bytes_moved"] / (device.memory_bw_gbyte_s * 1e9 * dc.memory_efficiency) * 1e3
    rows.append({"case": "copy 1 GiB", "measured_ms": copy["ms"], "predicted_ms": pred})
    for b in measured["blocks"]:
        model = TransformerSpec(
            layers=1, hidden=b["h"], heads=b["heads"], seq=b["seq"], vocab=256, dtype="bf16"
        )
        block = build_layer_costs(model, JobSpec(global_batch=b["batch"]))[1]
        lt = layer_time(block, device, "bf16", "none", calib)
        rows.append(
            {
                "case": f"block h={b['h']} forward",
                "measured_ms": b["forward_ms"],
                "predicted_ms": lt.forward * 1e3,
            }
        )
        rows.append(
            {
                "case": f"block h={b['h']} fwd+bwd",
                "measured_ms": b["forward_backward_ms"],
                "predicted_ms": (lt.forward + lt.backward) * 1e3,
            }
        )
    for r in rows:
        r["measured_over_predicted"] = r["measured_ms"] / r["predicted_ms"]
    big = [
        r["measured_over_predicted"]
        for r in rows
        if r["case"].startswith("GEMM") and "square 1024" not in r["case"]
    ]
    blocks = [r["measured_over_predicted"] for r in rows if r["case"].startswith("block")]
    return {
        "device": measured["device"],
        "torch": measured["torch"],
        "rows": rows,
        "median_ratio_gemms": statistics.median(big),
        "median_ratio_blocks": statistics.median(blocks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("measurements", nargs="?", default=str(HERE / "results" / "gpu_h200.json"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = compare(json.loads(Path(args.measurements).read_text()))
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['device']} (torch {out['torch']}), default calibration")
    print(f"{'case':32s} {'measured':>10s} {'predicted':>10s} {'ratio':>7s}")
    for r in out["rows"]:
        print(
            f"{r['case']:32s} {r['measured_ms']:8.3f}ms {r['predicted_ms']:8.3f}ms "
            f"{r['measured_over_predicted']:7.2f}"
        )
    print(
        f"median measured/predicted: GEMMs {out['median_ratio_gemms']:.2f}, "
        f"blocks {out['median_ratio_blocks']:.2f}"
    )


if __name__ == "__main__":
    main()
