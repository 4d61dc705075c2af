"""Fixtures of the cost model's tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dmsc.spec import ClusterSpec


@pytest.fixture
def one_node() -> Callable[[int], ClusterSpec]:
    """``one_node(devices)``: a datacenter of one node of ``devices`` 100-TFLOP devices on
    800 Gbit/s links."""

    def build(devices: int) -> ClusterSpec:
        return ClusterSpec.model_validate(
            {
                "device_types": {
                    "g": {
                        "peak_tflops": {"bf16": 100},
                        "memory_gib": 80,
                        "memory_bw_gbyte_s": 2000,
                    }
                },
                "node_types": {
                    "n": {"device": "g", "devices": devices, "link": {"bandwidth_gbit_s": 800}}
                },
                "datacenters": [
                    {
                        "name": "a",
                        "nodes": [{"type": "n", "count": 1}],
                        "network": {"gbit_s_per_node": 400, "latency_us": 2},
                    }
                ],
            }
        )

    return build
