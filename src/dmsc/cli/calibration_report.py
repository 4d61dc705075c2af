"""What ``dmsc calibrate`` prints: the figures it measured on this machine, then those it wrote
into the calibrated cluster spec (the devices, each node's link and measured collective)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dmsc.cli.render import human_flops
from dmsc.runtime.compute.calibrate import collective_words, spread_lines


def calibration_report(measured: dict[str, float], written: dict[str, Any], dst: Path) -> list[str]:
    """What ``dmsc calibrate`` measured, then the figures it wrote (those the cost model reads):
    a device's peak is the measurement over the model's efficiency, so the written figures
    differ from the measured ones; a job on more devices than the machine's cores shares them
    (the cluster's ``shared_cores``)."""
    seen = (
        f"measured: matmul {human_flops(measured['matmul_flops'])} on one core, memory copy "
        f"{measured['memory_bytes_s'] / 1e9:.2f} GB/s, loopback "
        f"{measured['loopback_bytes_s'] * 8 / 1e9:.2f} Gbit/s, round trip "
        f"{measured['loopback_rtt_s'] * 1e6:.0f} us, per-kernel overhead "
        f"{measured['op_overhead_s'] * 1e6:.1f} us, {measured['cores']:.0f} cores"
    )
    lines = [seen, *spread_lines(measured)]
    devices = sum(
        g["count"] * written["node_types"][g["type"]]["devices"]
        for dc in written["datacenters"]
        for g in dc["nodes"]
    )
    n = measured["cores"]
    cores = (
        f"on a core of its own; {n:.0f} cores for {devices} devices: a job on k > {n:.0f} of "
        f"them gets {n:.0f}/k of this each"
        if n < devices
        else "a core per device"
    )
    for name, dev in written["device_types"].items():
        lines.append(
            f"wrote {dst}: device {name}: peak {human_flops(dev['peak_tflops']['fp32'] * 1e12)} "
            f"fp32, memory {dev['memory_bw_gbyte_s']:.2f} GB/s, kernel overhead "
            f"{dev['op_overhead_us']:.1f} us (peak and memory: measured / the cost model's "
            f"efficiency, {cores})"
        )
    for node_name, node in written["node_types"].items():
        link = node["link"]
        lines.append(
            f"  node {node_name}: link {link['bandwidth_gbit_s']:.2f} Gbit/s, "
            f"{link['latency_us']:.1f} us" + collective_words(node)
        )
    return lines
