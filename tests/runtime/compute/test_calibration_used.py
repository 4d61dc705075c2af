"""benchmarks/parallel_modes.py names the calibration its predictions stand on: where
``dmsc calibrate`` could not measure the gloo all-reduce (under load), its predictions were
printed as if calibrated, priced silently from the node link's figures."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dmsc.spec import ClusterSpec

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH))
try:
    from _calibration_used import calibration_used
finally:
    sys.path.remove(str(BENCH))


def _cluster(collective: dict[str, Any] | None) -> ClusterSpec:
    node: dict[str, Any] = {
        "device": "cpu",
        "devices": 4,
        "link": {"bandwidth_gbit_s": 40, "latency_us": 5.0},
    }
    if collective is not None:
        node["collective"] = collective
    return ClusterSpec.model_validate(
        {
            "name": "bench-cpu",
            "device_types": {
                "cpu": {"peak_tflops": {"fp32": 0.05}, "memory_gib": 4, "memory_bw_gbyte_s": 10}
            },
            "node_types": {"host": node},
            "datacenters": [
                {
                    "name": "dc-0",
                    "nodes": [{"type": "host", "count": 1}],
                    "network": {"gbit_s_per_node": 10, "latency_us": 20.0},
                }
            ],
        }
    )


def test_a_failed_collective_measurement_is_named() -> None:
    used = calibration_used(_cluster(None))
    assert used["collective_measured"] is False
    assert "UNCALIBRATED" in used["label"]
    assert "not measured" in used["priced_from"]


def test_a_measured_collective_is_named_with_its_source() -> None:
    source = "dmsc calibrate: a 2-process gloo all-reduce on this machine"
    got = {"backend": "gloo", "bandwidth_gbit_s": 6.2, "latency_us": 645.0, "source": source}
    used = calibration_used(_cluster(got))
    assert used["collective_measured"] is True
    assert used["label"] == "measured gloo"
    assert source in used["priced_from"]
