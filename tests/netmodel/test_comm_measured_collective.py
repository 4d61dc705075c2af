"""A node's measured collective (``dmsc calibrate``) prices its collectives; its sends keep the
link's figures."""

from __future__ import annotations

import pytest

from dmsc.netmodel import DEFAULT_CALIBRATION, CommModel, Topology
from dmsc.netmodel.topology import CALL_LINK_LATENCIES, IN_STEP_CALL
from dmsc.spec import ClusterSpec

C = DEFAULT_CALIBRATION


def _cluster(collective: dict[str, object] | None) -> ClusterSpec:
    node: dict[str, object] = {
        "device": "cpu",
        "devices": 2,
        "link": {"bandwidth_gbit_s": 8, "latency_us": 100},
    }
    if collective is not None:
        node["collective"] = collective
    return ClusterSpec.model_validate(
        {
            "device_types": {
                "cpu": {"peak_tflops": {"fp32": 0.1}, "memory_gib": 8, "memory_bw_gbyte_s": 10}
            },
            "node_types": {"box": node},
            "datacenters": [
                {
                    "name": "a",
                    "nodes": [{"type": "box", "count": 1}],
                    "network": {"gbit_s_per_node": 8, "latency_us": 100},
                }
            ],
        }
    )


def test_an_all_reduce_is_priced_at_the_measured_collective() -> None:
    gloo = {"backend": "gloo", "bandwidth_gbit_s": 2, "latency_us": 500, "source": "a test"}
    plain = CommModel(Topology(_cluster(None)), C)
    measured = CommModel(Topology(_cluster(gloo)), C)
    nbytes = 4e6
    # two devices, each on its own link into the node: a hop crosses two device links, so the
    # latency is two links' and the bandwidth one link's (the ring's hops share none)
    # a link's share of a measured call: the whole call's latency in a step over the links
    per_link = IN_STEP_CALL["gloo"] / CALL_LINK_LATENCIES
    for model, gbit, lat_us in ((plain, 8, 100), (measured, 2, 500 * per_link)):
        bw = gbit * 1e9 / 8 * C.intra_node_link_efficiency
        # ring all-reduce of 2: one step of reduce-scatter and one of all-gather, n/2 bytes each
        want = 2 * (2 * lat_us * 1e-6 + nbytes / 2 / bw) + C.collective_overhead_s
        got = model.collective("all_reduce", [(0, 1)], nbytes, "ring").time_s
        assert got == pytest.approx(want, rel=1e-9)
    # a point-to-point send (the pipeline's) keeps the link's figures
    assert measured.p2p([(0, 1)], nbytes).time_s == plain.p2p([(0, 1)], nbytes).time_s


def test_a_call_of_two_devices_is_priced_at_its_measured_call_times_what_a_step_meets() -> None:
    """``collective.latency_us`` is one idle call of two of the node's devices. A call of that
    shape is priced at it times the backend's in-step factor (``IN_STEP_CALL``): gloo's 3 (a
    step's calls, by their exposed time, measured about 3x an idle one on the CPU), NCCL's 1,
    exactly as measured. Until 2026-12-04 every backend was priced at four times its call,
    NCCL's too, by the link count alone (each link carried the whole call's latency)."""
    assert IN_STEP_CALL == {"gloo": 3.0, "nccl": 1.0}
    for backend, factor in IN_STEP_CALL.items():
        spec = {"backend": backend, "bandwidth_gbit_s": 2, "latency_us": 500, "source": "a test"}
        model = CommModel(Topology(_cluster(spec)), C)
        bw = 2 * 1e9 / 8 * C.intra_node_link_efficiency
        for size in (1.0, 4e3, 4e6):  # t = factor x a + s / b, as the calibration fitted it
            want = factor * 500e-6 + size / bw + C.collective_overhead_s
            got = model.collective("all_reduce", [(0, 1)], size, "ring").time_s
            assert got == pytest.approx(want, rel=1e-9), (backend, size)


def test_collectives_waited_for_awake_are_priced_at_the_awake_latency() -> None:
    """The tp and ep calls' view (``awake_view``) takes the measured awake latency; the plain
    model (the data-parallel exchanges run whole) the blocked one; without an awake figure the
    view is the model itself. Checked through the estimate too: a tp = 2 job's tp time falls, a
    dp = 2 job's dp time by the tree (on Python threads, waited blocked) does not."""
    from dmsc.netmodel import estimate_iteration
    from dmsc.spec import JobSpec, resolve_model

    blocked = {"backend": "gloo", "bandwidth_gbit_s": 2, "latency_us": 3000, "source": "a test"}
    awake = {**blocked, "latency_awake_us": 300, "bandwidth_awake_gbit_s": 4}
    model = CommModel(Topology(_cluster(awake)), C)
    view = model.awake_view()
    assert view is not model and view.awake_view() is view
    nbytes = 4e3
    per_link = IN_STEP_CALL["gloo"] / CALL_LINK_LATENCIES
    for m, lat_us, gbit in ((model, 3000 * per_link, 2), (view, 300 * per_link, 4)):
        bw = gbit * 1e9 / 8 * C.intra_node_link_efficiency
        want = 2 * (2 * lat_us * 1e-6 + nbytes / 2 / bw) + C.collective_overhead_s
        got = m.collective("all_reduce", [(0, 1)], nbytes, "ring").time_s
        assert got == pytest.approx(want, rel=1e-9)
    plain = CommModel(Topology(_cluster(blocked)), C)
    assert plain.awake_view() is plain

    gpt = resolve_model("gpt-mini")
    tp_job = JobSpec.model_validate({"global_batch": 8, "micro_batch": 4, "tp": 2})
    dp_job = JobSpec.model_validate(
        {"global_batch": 8, "micro_batch": 4, "dp": 2, "allreduce": "tree"}
    )
    for job, mode, falls in ((tp_job, "tp_comm", True), (dp_job, "dp_comm", False)):
        slow = estimate_iteration(_cluster(blocked), gpt, job).breakdown_s[mode]
        fast = estimate_iteration(_cluster(awake), gpt, job).breakdown_s[mode]
        assert slow > 0 and (fast < slow if falls else fast == slow), (mode, slow, fast)


def test_the_quorum_before_a_whole_exchange_is_priced_where_measured() -> None:
    """``collective.quorum_us``: the replicas' agreement before an exchange the runtime runs
    whole (the leader's, a round's) adds to its time, once an exchange; the bucketed
    every-step all-reduce and every step's codec by collective (agreed while the backward
    runs: dmsc.runtime.compute.dp_collective.DataParallel.agreed) and a cluster without the
    figure do not change, but for what of the quorum outlasts the last backward. The quorum
    was measured at 0.6-1.9 ms a step in a dp = 2 int8 run, unpriced."""
    from dmsc.netmodel import estimate_iteration
    from dmsc.spec import JobSpec, resolve_model

    gloo = {"backend": "gloo", "bandwidth_gbit_s": 2, "latency_us": 500, "source": "a test"}
    agreed = {**gloo, "quorum_us": 900}
    model = CommModel(Topology(_cluster(agreed)), C)
    assert model.quorum_s([(0, 1)]) == pytest.approx(900e-6)
    assert model.quorum_s([(0,)]) == 0.0  # one replica agrees with nobody
    assert CommModel(Topology(_cluster(gloo)), C).quorum_s([(0, 1)]) == 0.0

    gpt = resolve_model("gpt-mini")
    base = {"global_batch": 8, "micro_batch": 4, "dp": 2}
    for sync, whole in (
        ({"compress": "int8"}, False),  # every step by collective: agreed in the backward
        ({"via": "leader"}, True),
        ({"mode": "diloco", "inner_steps": 4}, True),
        ({}, False),  # every step, as it is, in buckets behind the backward
    ):
        job = JobSpec.model_validate({**base, "sync": sync})
        without = estimate_iteration(_cluster(gloo), gpt, job).breakdown_s["dp_comm"]
        with_ = estimate_iteration(_cluster(agreed), gpt, job).breakdown_s["dp_comm"]
        per = job.sync.inner_steps
        assert with_ - without == pytest.approx(900e-6 / per if whole else 0.0, abs=1e-12), sync
    # a quorum longer than the last backward: the rest of it is exposed
    job = JobSpec.model_validate({**base, "sync": {"compress": "int8"}})
    slow = _cluster({**gloo, "quorum_us": 2e6})
    got = estimate_iteration(slow, gpt, job).breakdown_s
    window = got["compute"] / job.microbatches * 2 / 3
    without = estimate_iteration(_cluster(gloo), gpt, job).breakdown_s["dp_comm"]
    assert got["dp_comm"] - without == pytest.approx(2.0 - window, rel=1e-9)


def _shared(collective: dict[str, object], devices: int) -> ClusterSpec:
    """:func:`_cluster` with ``devices`` devices a node, processes on 2 cores."""
    spec = _cluster(collective).model_dump(mode="json", exclude_none=True)
    spec["node_types"]["box"]["devices"] = devices
    spec["shared_cores"] = 2
    return ClusterSpec.model_validate(spec)


def test_the_data_parallel_buckets_the_step_spins_for_on_its_own_cores_are_priced_so() -> None:
    """The step spins for gloo's own ring after the backward (DP_SPIN_S): on cores of their
    own its buckets are priced at the measured awake call times SPUN_CALL (2), not at the
    blocked call times IN_STEP_CALL (3), which a dp = 2 ring of gpt-mini measured 0.71-1.20
    of (median 0.82, eight rounds; 0.81-1.58, median 0.95, priced so). Four replicas on two
    cores (the spinning wait takes a peer's core) and the tree are priced as before."""
    from dmsc.netmodel import estimate_iteration
    from dmsc.netmodel.topology import SPUN_CALL
    from dmsc.spec import JobSpec, resolve_model

    gloo = {"backend": "gloo", "bandwidth_gbit_s": 2, "latency_us": 500, "source": "a test"}
    awake = {**gloo, "latency_awake_us": 400, "bandwidth_awake_gbit_s": 2}
    model = CommModel(Topology(_cluster(awake)), C)
    spun = model.spun_view()
    assert spun is not model and spun.spun_view() is spun
    plain = CommModel(Topology(_cluster(gloo)), C)
    assert plain.spun_view() is plain  # no awake figures: priced as measured blocked
    nbytes = 4e6
    for m, lat_us in ((model, 500 * IN_STEP_CALL["gloo"]), (spun, 400 * SPUN_CALL["gloo"])):
        want = lat_us * 1e-6 + nbytes / (2e9 / 8 * C.intra_node_link_efficiency)
        got = m.collective("all_reduce", [(0, 1)], nbytes, "ring").time_s
        assert got == pytest.approx(want + C.collective_overhead_s, rel=1e-9)

    gpt = resolve_model("gpt-mini")

    def dp_comm(collective: dict[str, object], dp: int, allreduce: str) -> float:
        job = JobSpec.model_validate(
            {"global_batch": 8, "micro_batch": 8 // dp, "dp": dp, "allreduce": allreduce}
        )
        cluster = _shared(collective, 4)
        return estimate_iteration(cluster, gpt, job).breakdown_s["dp_comm"]

    assert dp_comm(awake, 2, "ring") < dp_comm(gloo, 2, "ring")  # on a core each: spun
    assert dp_comm(awake, 2, "auto") < dp_comm(gloo, 2, "auto")  # auto comes to the ring
    assert dp_comm(awake, 2, "tree") == dp_comm(gloo, 2, "tree")  # Python threads: blocked
    assert dp_comm(awake, 4, "ring") == dp_comm(gloo, 4, "ring")  # 4 on 2 cores: blocked
