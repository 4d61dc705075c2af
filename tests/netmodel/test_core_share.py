"""Devices that share one machine's cores: each job's share of them (``dmsc.netmodel.core_share``).

Reference: the same cluster written by hand with each device's rates already scaled by the
share (and no ``shared_cores``), which the cost model prices as it is."""

from __future__ import annotations

import pytest

from dmsc.netmodel import DEFAULT_CALIBRATION, estimate_iteration
from dmsc.netmodel.core_share import core_share, on_cores
from dmsc.planner.placement.from_specs import build_problem
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


def _cluster(devices: int = 4, cores: int | None = 2, scale: float = 1.0) -> ClusterSpec:
    return ClusterSpec.model_validate(
        {
            "device_types": {
                "cpu": {
                    "peak_tflops": {"fp32": 0.08 * scale},
                    "memory_gib": 4,
                    "memory_bw_gbyte_s": 12.0 * scale,
                    "op_overhead_us": 20.0,
                }
            },
            "node_types": {
                "host": {"device": "cpu", "devices": devices, "link": {"bandwidth_gbit_s": 40}}
            },
            "datacenters": [
                {"name": "dc", "nodes": [{"type": "host", "count": 1}],
                 "network": {"gbit_s_per_node": 10}}
            ],
            "shared_cores": cores,
        }
    )  # fmt: skip


def test_the_share_is_the_cores_over_the_busy_devices() -> None:
    assert core_share(_cluster(cores=None), 4) == 1.0
    assert core_share(_cluster(), 1) == core_share(_cluster(), 2) == 1.0
    assert core_share(_cluster(), 3) == pytest.approx(2 / 3)
    assert core_share(_cluster(), 4) == 0.5


def test_on_cores_scales_the_rates_once() -> None:
    c = _cluster()
    assert on_cores(c, 2) is c  # a core each: the cluster itself
    half = on_cores(c, 4)
    assert half.device_types["cpu"].peak_tflops["fp32"] == pytest.approx(0.04)
    assert half.device_types["cpu"].memory_bw_gbyte_s == pytest.approx(6.0)
    assert half.device_types["cpu"].op_overhead_us == 20.0  # a fixed cost per kernel: as it is
    assert half.device_types["cpu"].gaussian_ns == pytest.approx(12.0)  # the 6 ns default, shared
    assert half.device_types["cpu"].mask_ns == pytest.approx(2.8)  # the 1.4 ns default, shared
    lowrank = DEFAULT_CALIBRATION.generation("generic").lowrank_s * 1e9  # the default, shared
    assert half.device_types["cpu"].lowrank_ns == pytest.approx(2 * lowrank)
    assert half.device_types["cpu"].dispatch_ns is None  # unmeasured: memory passes, shared
    routed = c.model_copy(
        update={
            "device_types": {"cpu": c.device_types["cpu"].model_copy(update={"dispatch_ns": 6.0})}
        }
    )
    assert on_cores(routed, 4).device_types["cpu"].dispatch_ns == pytest.approx(12.0)
    assert half.shared_cores is None and on_cores(half, 4) is half  # never shared twice
    assert on_cores(c, 4) is half  # kept for the next ask
    assert c.device_types["cpu"].peak_tflops["fp32"] == 0.08  # the spec itself unchanged


@pytest.mark.parametrize("pp,dp", [(4, 1), (2, 2), (3, 1), (2, 1), (1, 1)])
def test_the_estimate_and_the_placement_price_the_job_s_share(pp: int, dp: int) -> None:
    """The estimate's every part and the placement problem's stage compute equal those on a
    hand-scaled cluster that shares nothing."""
    model = resolve_model("gpt-mini")
    job = JobSpec(global_batch=16, micro_batch=4, pp=pp, dp=dp)
    share = min(1.0, 2 / job.devices)
    got = estimate_iteration(_cluster(), model, job)
    ref = estimate_iteration(_cluster(cores=None, scale=share), model, job)
    for part, seconds in ref.breakdown_s.items():
        assert got.breakdown_s[part] == pytest.approx(seconds, rel=1e-9), part
    built = build_problem(_cluster(), model, job).problem.compute_us
    assert built == build_problem(_cluster(cores=None, scale=share), model, job).problem.compute_us


def test_a_nodes_measured_collective_runs_at_the_share_too() -> None:
    """Four workers on two cores: the node's gloo all-reduce at half its bandwidth and twice its
    latency, both ways of waiting; its quorum and the link (the point-to-point sends) as they
    were. Priced without the share, moe-mini's collectives at tp = 2 x ep = 2 measured 1.8-2.6
    times their prediction (parallel_modes_cpu.json, reruns_2026_12_05_in_step_3). A tp = 2 x
    dp = 2 job's tensor-parallel time rises with it; the same job on a core each does not."""
    data = _cluster().model_dump(mode="json", exclude_none=True)
    data["node_types"]["host"]["collective"] = {
        "backend": "gloo", "bandwidth_gbit_s": 16.0, "latency_us": 400.0,
        "bandwidth_awake_gbit_s": 14.0, "latency_awake_us": 350.0, "quorum_us": 600.0,
        "source": "a test",
    }  # fmt: skip
    c = ClusterSpec.model_validate(data)
    half = on_cores(c, 4).node_types["host"].collective
    assert half is not None
    assert (half.bandwidth_gbit_s, half.latency_us) == pytest.approx((8.0, 800.0))
    assert (half.bandwidth_awake_gbit_s, half.latency_awake_us) == pytest.approx((7.0, 700.0))
    assert half.quorum_us == 600.0 and half.backend == "gloo"
    assert on_cores(c, 4).node_types["host"].link == c.node_types["host"].link
    assert on_cores(c, 2) is c
    gpt = resolve_model("gpt-mini")
    job = JobSpec.model_validate({"global_batch": 8, "micro_batch": 4, "tp": 2, "dp": 2})
    shared = estimate_iteration(c, gpt, job).breakdown_s["tp_comm"]
    own = estimate_iteration(c.model_copy(update={"shared_cores": None}), gpt, job)
    assert shared > 1.5 * own.breakdown_s["tp_comm"]


def test_the_leaders_own_passes_run_at_the_leaders_share_not_the_jobs() -> None:
    """Through the leader (a star) the followers wait while the leader decodes their updates,
    applies its rule and encodes its answer: four replicas on two cores, those passes are
    priced at a whole core (one leader busy), the rest of the exchange at half. Priced again at
    half, gpt-mini's dp = 4 star measured 0.76-1.03 of its prediction in 24 stored rounds, 16
    within 15%; at a whole core, 0.89-1.21, 21 within (benchmarks/repredict_modes.py)."""
    from dmsc.netmodel import build_layer_costs
    from dmsc.netmodel.codec_work import leader_bytes_per_element
    from dmsc.netmodel.leader_work import bytes_per_element as rule_bytes
    from dmsc.netmodel.sync import memory_bytes_s
    from dmsc.spec.sync_forms import parse_compress

    model = resolve_model("gpt-mini")
    job = JobSpec.model_validate(
        {"global_batch": 16, "micro_batch": 4, "dp": 4, "sync": {"via": "leader"}}
    )
    got = estimate_iteration(_cluster(), model, job).breakdown_s["dp_comm"]
    half = estimate_iteration(_cluster(cores=None, scale=0.5), model, job).breakdown_s["dp_comm"]
    elements = sum(lc.params_per_device for lc in build_layer_costs(model, job))
    alone = elements * (leader_bytes_per_element(parse_compress("none"), "leader", 4))
    alone += elements * rule_bytes("mean", 4)
    bw = memory_bytes_s(_cluster().device_types["cpu"], DEFAULT_CALIBRATION)
    assert half - got == pytest.approx(alone / (bw / 2) - alone / bw, rel=1e-6)
    # by collective nothing runs alone: priced at the job's share, as before
    ring = JobSpec.model_validate({"global_batch": 16, "micro_batch": 4, "dp": 4})
    assert estimate_iteration(_cluster(), model, ring).breakdown_s["dp_comm"] == pytest.approx(
        estimate_iteration(_cluster(cores=None, scale=0.5), model, ring).breakdown_s["dp_comm"]
    )
