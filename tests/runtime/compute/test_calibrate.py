"""``dmsc calibrate`` on this machine: figures from repeated rounds, and a cluster spec whose
block time is the one measured (issue 29, point 5)."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from dmsc.netmodel import DEFAULT_CALIBRATION, build_layer_costs
from dmsc.netmodel.compute import layer_time
from dmsc.runtime.compute import calibrate as cal
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

LOCAL = Path(__file__).resolve().parents[3] / "examples" / "clusters" / "local-cpu.yaml"
FIGURES = {
    "matmul_flops": 60e9,
    "memory_bytes_s": 12e9,
    "loopback_bytes_s": 1.2e9,
    "loopback_rtt_s": 400e-6,
    "op_overhead_s": 30e-6,
    "cores": 3.0,  # a core per device: the written rate is the measured one
}


def test_rounds_go_on_until_the_median_holds() -> None:
    """A steady figure stops at the minimum of rounds; a noisy one goes on to the maximum,
    its median and interquartile spread reported."""
    steady = cal.repeated(lambda: 1.0, min_rounds=5, max_rounds=15)
    assert steady.rounds == (1.0,) * 5 and steady.value == 1.0 and steady.spread == 0.0
    noisy_values = itertools.cycle([1.0, 2.0, 1.0, 3.0])
    noisy = cal.repeated(lambda: next(noisy_values), min_rounds=5, max_rounds=15)
    assert len(noisy.rounds) == 15
    assert noisy.value == statistics.median(noisy.rounds)
    q1, _, q3 = statistics.quantiles(noisy.rounds, n=4, method="inclusive")
    assert noisy.spread == pytest.approx((q3 - q1) / noisy.value) and noisy.spread > 0.5


def test_the_calibrated_spec_predicts_the_measured_block() -> None:
    """The cost model's forward and backward of a gpt-mini block at micro-batch 4 on the written
    device is the measured one: before, only the matrix products' rate was written, and the
    block (attention and GeLU run far below that rate on a CPU) was predicted 2-3x too fast."""
    template = load_spec(ClusterSpec, LOCAL)
    model = resolve_model("gpt-mini")
    block = build_layer_costs(model, JobSpec(global_batch=4, micro_batch=4))[1]
    for block_s in (0.012, 0.030, 0.045):
        cluster = ClusterSpec.model_validate(
            cal.calibrated_cluster(template, {**FIGURES, "block_s": block_s})
        )
        lt = layer_time(block, cluster.device_types["cpu"], "fp32", "none", DEFAULT_CALIBRATION)
        assert lt.forward + lt.backward == pytest.approx(block_s, rel=1e-6)


def test_calibrate_writes_its_figures_spread_and_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every repeated figure comes with its spread and rounds; a machine whose block time
    varies by more than NOISY_SPREAD is said too noisy, in the figures and in the spec."""
    block = itertools.cycle([0.02, 0.04, 0.03])
    monkeypatch.setattr(cal, "measure_block_seconds", lambda: next(block))
    monkeypatch.setattr(cal, "measure_matmul_flops", lambda: 50e9)
    monkeypatch.setattr(cal, "measure_op_overhead", lambda: 20e-6)
    monkeypatch.setattr(cal, "measure_memory_bandwidth", lambda: 10e9)
    monkeypatch.setattr(cal, "measure_loopback", lambda rounds=20: (1e9, 300e-6))
    gloo = {"gloo_allreduce_bytes_s": 0.5e9, "gloo_allreduce_latency_s": 400e-6}
    monkeypatch.setattr(cal, "measure_collectives", lambda: gloo)
    out = tmp_path / "c.yaml"
    got = cal.calibrate(LOCAL, out, rounds=(3, 6))
    assert got["block_s"] == 0.03 and got["block_s_rounds"] == 6
    assert got["block_s_spread"] > cal.NOISY_SPREAD and got["noisy"] == 1.0
    assert got["matmul_flops_spread"] == 0.0 and got["matmul_flops_rounds"] == 3
    assert got["block_flops"] == cal.block_rate(got)
    spec = load_spec(ClusterSpec, out)
    source = spec.device_types["cpu"].measured.source  # type: ignore[union-attr]
    assert "median of rounds" in source and "TOO NOISY" in source
    assert f"block ±{got['block_s_spread'] * 50:.0f}%" in source


def test_the_measured_collective_goes_into_each_node_over_the_efficiency() -> None:
    """gloo's all-reduce as measured: the node's ``collective``, its bandwidth divided by the
    efficiency the cost model multiplies it by again; NCCL's instead where it was measured."""
    template = load_spec(ClusterSpec, LOCAL)
    gloo = {"gloo_allreduce_bytes_s": 0.5e9, "gloo_allreduce_latency_s": 400e-6}
    spec = ClusterSpec.model_validate(cal.calibrated_cluster(template, {**FIGURES, **gloo}))
    eff = DEFAULT_CALIBRATION.intra_node_link_efficiency
    for node in spec.node_types.values():
        c = node.collective
        assert c is not None and c.backend == "gloo" and c.latency_us == pytest.approx(400)
        assert c.bandwidth_gbit_s * eff == pytest.approx(4.0)  # 0.5 GB/s
    assert "gloo all-reduce, measured): " in cal.collective_words(
        cal.calibrated_cluster(template, {**FIGURES, **gloo})["node_types"]["host"]
    )
    nccl = {"nccl_allreduce_bytes_s": 100e9, "nccl_allreduce_latency_s": 20e-6}
    # both measured (two GPUs): gloo's, which the runtime's data-parallel average runs on the host
    spec = ClusterSpec.model_validate(cal.calibrated_cluster(template, {**FIGURES, **gloo, **nccl}))
    assert {n.collective.backend for n in spec.node_types.values() if n.collective} == {"gloo"}
    spec = ClusterSpec.model_validate(cal.calibrated_cluster(template, {**FIGURES, **nccl}))
    assert {n.collective.backend for n in spec.node_types.values() if n.collective} == {"nccl"}
    bare = ClusterSpec.model_validate(cal.calibrated_cluster(template, FIGURES))
    assert all(n.collective is None for n in bare.node_types.values())
    # the latency waited for awake, where measured, beside the blocked one
    awake = {
        **gloo,
        "gloo_allreduce_latency_awake_s": 150e-6,
        "gloo_allreduce_bytes_awake_s": 1e9,
    }
    data = cal.calibrated_cluster(template, {**FIGURES, **awake})
    spec = ClusterSpec.model_validate(data)
    got = [n.collective.latency_awake_us for n in spec.node_types.values() if n.collective]
    assert got and got == pytest.approx([150] * len(got))
    awake_bw = [
        n.collective.bandwidth_awake_gbit_s for n in spec.node_types.values() if n.collective
    ]
    assert [b * eff for b in awake_bw] == pytest.approx([8.0] * len(got))  # type: ignore[operator]
    assert " us waited for awake)" in cal.collective_words(data["node_types"]["host"])
    assert all(n.collective.quorum_us is None for n in spec.node_types.values() if n.collective)
    # the replicas' quorum, where measured
    data = cal.calibrated_cluster(template, {**FIGURES, **gloo, "gloo_quorum_s": 900e-6})
    spec = ClusterSpec.model_validate(data)
    got = [n.collective.quorum_us for n in spec.node_types.values() if n.collective]
    assert got and got == pytest.approx([900] * len(got))
    assert "; quorum 900 us" in cal.collective_words(data["node_types"]["host"])
    # the source says how it was measured: as many pairs as measure_allreduce medians
    from dmsc.runtime.compute.collective_calibration import PASSES

    assert f"median over {PASSES} pairs" in spec.node_types["host"].collective.source  # type: ignore[union-attr]


def test_a_job_on_fewer_devices_than_the_cores_gets_a_core_each() -> None:
    """A calibrated node of 4 devices on 2 cores: a pp = 2 job runs 2 processes, a core each,
    and is predicted as on a node of 2 devices on those cores; a pp = 4 job shares them, at
    half a core a stage (its stages' compute twice theirs). Before, the spec's rates were
    shared among all 4 devices once and for all: the pp = 2 job was predicted at half a core
    a stage too (benchmarks/parallel_modes.py: its pipeline waits predicted 57 ms, measured
    38)."""
    from dmsc.netmodel import estimate_iteration

    def node(devices: int) -> ClusterSpec:
        template = ClusterSpec.model_validate(
            {
                "device_types": {"cpu": {"peak_tflops": {"fp32": 0.05}, "memory_gib": 4,
                                         "memory_bw_gbyte_s": 10}},
                "node_types": {"host": {"device": "cpu", "devices": devices,
                                        "link": {"bandwidth_gbit_s": 40}}},
                "datacenters": [{"name": "dc", "nodes": [{"type": "host", "count": 1}],
                                 "network": {"gbit_s_per_node": 10}}],
            }
        )  # fmt: skip
        figures = {**FIGURES, "block_s": 0.03, "cores": 2.0, "gaussian_s": 5.5e-9, "mask_s": 2e-9}
        figures["lowrank_s"] = 3e-9
        figures["dispatch_s"] = 6e-9
        return ClusterSpec.model_validate(cal.calibrated_cluster(template, figures))

    four, two = node(4), node(2)
    assert four.shared_cores == two.shared_cores == 2
    assert four.device_types["cpu"].gaussian_ns == pytest.approx(5.5)  # the measured draw
    assert four.device_types["cpu"].mask_ns == pytest.approx(2.0)  # and mask
    assert four.device_types["cpu"].lowrank_ns == pytest.approx(3.0)  # and PowerSGD's products
    assert four.device_types["cpu"].dispatch_ns == pytest.approx(6.0)  # and a mixture's routing
    model = resolve_model("gpt-mini")
    pp2 = JobSpec(global_batch=8, micro_batch=4, pp=2)
    on_four = estimate_iteration(four, model, pp2).breakdown_s
    on_two = estimate_iteration(two, model, pp2).breakdown_s
    assert on_four["compute"] == pytest.approx(on_two["compute"], rel=1e-12)
    pp4 = JobSpec(global_batch=8, micro_batch=4, pp=4)
    shared = estimate_iteration(four, model, pp4).breakdown_s["compute"]
    alone = estimate_iteration(four.model_copy(update={"shared_cores": None}), model, pp4)
    assert shared == pytest.approx(2 * alone.breakdown_s["compute"], rel=0.02)
