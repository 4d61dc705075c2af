"""What an estimate says about its calibration is true of the device it ran on (issue 29, 6)."""

from __future__ import annotations

from pathlib import Path

from runtime_helpers import MEASURED_CPU

from dmsc.cli.render import calibration_json, calibration_line
from dmsc.spec import ClusterSpec, load_spec

ROOT = Path(__file__).resolve().parents[2]


def test_a_cpu_estimate_claims_no_validation_it_does_not_have() -> None:
    """The generic constants borrow the A100's efficiencies, not its validation: a CPU cluster
    was said to be "validated on megatron-sc21 2.5%" while its JSON said "no validation"."""
    cluster = load_spec(ClusterSpec, ROOT / "examples" / "clusters" / "local-cpu.yaml")
    out = calibration_json(cluster)
    (dev,) = out["devices"]
    assert dev["generation"] == "generic"
    assert dev["validated"] == [] and "no validation" in dev["sources"]
    assert out["unvalidated_devices"] == ["cpu"]
    line = calibration_line(cluster)
    assert "cpu: generic constants, not validated on published data" in line
    assert "megatron" not in line


def test_a_calibrated_cpu_says_it_was_measured_and_how_steadily() -> None:
    from dmsc.runtime.compute.calibrate import calibrated_cluster

    template = load_spec(ClusterSpec, ROOT / "examples" / "clusters" / "local-cpu.yaml")
    figures = {**MEASURED_CPU, "block_s_spread": 0.34, "noisy": 1.0}
    cluster = ClusterSpec.model_validate(calibrated_cluster(template, figures))
    line = calibration_line(cluster)
    assert "cpu: measured (dmsc calibrate on this machine, 2027-01-15 08:00 UTC" in line
    assert "block ±17%" in line and "TOO NOISY" in line
    assert "not validated on published data" in line and "megatron" not in line


def test_calibrate_s_report_says_the_rates_it_wrote_and_how_a_job_shares_the_cores() -> None:
    """What ``dmsc calibrate`` prints of each device is the spec it wrote: one process's rate on
    a core of its own, and the share a job on more devices than cores gets, which the cost
    model applies (dmsc.netmodel.core_share)."""
    from dmsc.cli.calibration_report import calibration_report
    from dmsc.cli.render import human_flops
    from dmsc.netmodel.core_share import core_share
    from dmsc.runtime.compute.calibrate import calibrated_cluster

    template = load_spec(ClusterSpec, ROOT / "examples" / "clusters" / "local-cpu.yaml")
    spreads = {
        f"{k}_{x}": 0.01 if x == "spread" else 5
        for k in ("block_s", "matmul_flops", "op_overhead_s")
        for x in ("spread", "rounds")
    }
    figures = {**MEASURED_CPU, **spreads, "cores": 2.0, "block_flops": 30e9}
    written = calibrated_cluster(template, figures)
    lines = calibration_report(figures, written, Path("c.yaml"))
    (device,) = [line for line in lines if "device cpu:" in line]
    cluster = ClusterSpec.model_validate(written)
    peak = cluster.device_types["cpu"].peak_tflops["fp32"] * 1e12
    assert f"peak {human_flops(peak)} fp32" in device
    assert "2 cores for 3 devices: a job on k > 2 of them gets 2/k of this each" in device
    assert cluster.shared_cores == 2 and core_share(cluster, 3) == 2 / 3
