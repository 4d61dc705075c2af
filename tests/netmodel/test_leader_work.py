"""The stage leader's own work through the star: its rules' bytes an element, the sorting
network the median and the trimmed mean sort with, and the estimate that adds it.

References: the 0-1 principle (a comparator network sorts every input if and only if it sorts
every sequence of zeros and ones, Knuth TAOCP 5.3.4), Batcher's comparator counts for powers of
two (n/4 log2(n) (log2(n) - 1) + n - 1: 19 at 8, 63 at 16), and the bytes counted by hand from
the runtime's operations."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dmsc.netmodel import estimate_iteration
from dmsc.netmodel.leader_work import bytes_per_element, leader_work_s, sorting_network
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


@pytest.mark.parametrize("n", range(1, 13))
def test_the_network_sorts_every_zero_one_input(n: int) -> None:
    network = sorting_network(n)
    assert all(0 <= i < j < n for i, j in network)
    for bits in range(1 << n):
        values = [(bits >> k) & 1 for k in range(n)]
        for i, j in network:
            if values[i] > values[j]:
                values[i], values[j] = values[j], values[i]
        assert values == sorted(values), (n, bits)


def test_batchers_counts_for_powers_of_two() -> None:
    assert [len(sorting_network(n)) for n in (2, 4, 8, 16, 32)] == [1, 5, 19, 63, 191]


def test_bytes_an_element_counted_from_the_runtimes_operations() -> None:
    # mean: the first copied (8), each other added (12), the sum divided (8)
    assert bytes_per_element("mean", 4) == 8 + 3 * 12 + 8
    # median of 3: the checks (4n), the stack (8n), 3 compare-exchanges of 24, the middle (8)
    assert bytes_per_element("median", 3) == 12 * 3 + 3 * 24 + 8
    # trimmed-mean:0.2 of 5 cuts 1 a side: 3 rows kept, 20k + 20 for their float64 mean
    assert bytes_per_element("trimmed-mean", 5) == 12 * 5 + 9 * 24 + 20 * 3 + 20
    # krum of 5: the checks, 10 pairs of 16, the copy; multi-krum:1 the mean of the best 4
    assert bytes_per_element("krum:1", 5) == 4 * 5 + 10 * 16 + 8
    assert bytes_per_element("multi-krum:1", 5) == 4 * 5 + 10 * 16 + 20 * 4 + 20
    assert bytes_per_element("median", 1) == 0.0
    assert leader_work_s("mean", 4, 1e6, 6e9) == pytest.approx(1e6 * 52 / 6e9)
    with pytest.raises(ValueError, match="memory bandwidth must be > 0"):
        leader_work_s("mean", 4, 1e6, 0.0)


def test_the_estimate_adds_the_leaders_work_to_the_star(
    one_node: Callable[[int], ClusterSpec],
) -> None:
    """Through the leader, dp_comm is the star plus the rule's passes over the stage's updates
    (every parameter a device holds, fp32, at the device's memory bandwidth times the
    calibration's efficiency); by collective nothing is added."""
    from dmsc.netmodel.constants import DEFAULT_CALIBRATION
    from dmsc.netmodel.layers import build_layer_costs

    cluster = one_node(8)
    model = resolve_model("gpt3-350m").model_copy(update={"dtype": "bf16"})

    def job(overlap: bool = True, **sync: object) -> JobSpec:
        data = {"global_batch": 8, "dp": 8, "sync": sync, "overlap_dp_comm": overlap}
        return JobSpec.model_validate(data)

    mean = estimate_iteration(cluster, model, job(via="leader"))
    median = estimate_iteration(cluster, model, job(via="leader", aggregator="median"))
    params = sum(lc.params_per_device for lc in build_layer_costs(model, job()))
    device = cluster.device_types["g"]
    bandwidth = device.memory_bw_gbyte_s * 1e9
    bandwidth *= DEFAULT_CALIBRATION.for_device(device).memory_efficiency
    extra = (bytes_per_element("median", 8) - bytes_per_element("mean", 8)) * params / bandwidth
    got = median.breakdown_s["dp_comm"] - mean.breakdown_s["dp_comm"]
    assert got == pytest.approx(extra, rel=1e-9)
    assert median.traffic_bytes == mean.traffic_bytes  # the same star, more work at its leader
    ring = estimate_iteration(cluster, model, job(False))
    plain = estimate_iteration(cluster, model, job(False, via="leader"))
    assert plain.breakdown_s["dp_comm"] > ring.breakdown_s["dp_comm"]


MODEL = resolve_model("gpt3-350m").model_copy(update={"dtype": "bf16"})


def job(**sync: object) -> JobSpec:
    """gpt3-350m at dp 8 on one node with ``sync``."""
    return JobSpec.model_validate({"global_batch": 8, "dp": 8, "sync": sync})


def _star(
    one_node: Callable[[int], ClusterSpec], field: str, value: float
) -> tuple[ClusterSpec, ClusterSpec, float, float]:
    """One node of 8 devices, and a copy whose device type measured ``field``; the parameters a
    device holds of gpt3-350m at dp 8 and the bandwidth its passes are priced at."""
    from dmsc.netmodel.constants import DEFAULT_CALIBRATION
    from dmsc.netmodel.layers import build_layer_costs

    cluster = one_node(8)
    data = cluster.model_dump(mode="json", exclude_none=True)
    data["device_types"]["g"][field] = value  # measured: replaces the default
    params = sum(lc.params_per_device for lc in build_layer_costs(MODEL, job()))
    device = cluster.device_types["g"]
    bandwidth = device.memory_bw_gbyte_s * 1e9
    bandwidth *= DEFAULT_CALIBRATION.for_device(device).memory_efficiency
    return cluster, ClusterSpec.model_validate(data), params, bandwidth


def test_central_privacy_s_clip_and_noise_are_priced(
    one_node: Callable[[int], ClusterSpec],
) -> None:
    """Central differential privacy was unpriced: a task clipping its replicas' updates and
    noising their sum at the leader was predicted as the plain star. Now each replica's clip is
    32 bytes an element (counted from dmsc.runtime.compute.privacy's operations), and the
    noise a Gaussian draw an element at the device's measured ``gaussian_ns`` (the default 6 ns
    where none was measured) plus 24 bytes; at tp ranks each draws the whole replica's."""
    from dmsc.netmodel.leader_work import privacy_work_s

    assert privacy_work_s("none", 1e6, 1e10, 6e-9) == 0.0
    assert privacy_work_s("clip", 1e6, 1e10, 6e-9) == pytest.approx(1e6 * 32 / 1e10)
    assert privacy_work_s("noise", 1e6, 1e10, 6e-9, tp=2) == pytest.approx(
        1e6 * 32 / 1e10 + 1e6 * (2 * 6e-9 + 24 / 1e10)
    )
    cluster, measured, params, bandwidth = _star(one_node, "gaussian_ns", 9.0)
    plain = estimate_iteration(measured, MODEL, job(via="leader")).breakdown_s["dp_comm"]
    for privacy, per_element in (("clip", 32 / bandwidth), ("noise", 9e-9 + 56 / bandwidth)):
        got = estimate_iteration(measured, MODEL, job(via="leader", privacy=privacy))
        assert got.breakdown_s["dp_comm"] - plain == pytest.approx(params * per_element, rel=1e-9)
    default = estimate_iteration(cluster, MODEL, job(via="leader", privacy="noise"))
    noise = default.breakdown_s["dp_comm"] - plain
    assert noise == pytest.approx(params * (6e-9 + 56 / bandwidth), rel=1e-9)
    with pytest.raises(ValueError, match=r"privacy 'noise'.*set via: leader"):
        job(privacy="noise")
    assert (
        job(via="leader", privacy="noise").sync.label
        == "every-step, through the leader, with DP noise"
    )


def test_secure_aggregations_masks_are_priced(one_node: Callable[[int], ClusterSpec]) -> None:
    """Secure aggregation was unpriced: a task masking its replicas' updates was predicted as
    the plain mean through the leader. Now one replica's masking (its fixed-point encoding,
    ``n - 1`` pair masks at the device's measured ``mask_ns``, 1.4 ns where none was measured)
    and the leader's unmasking replace the mean's passes; the wire is the star's as before."""
    from dmsc.netmodel.leader_work import secure_bytes_per_element, secure_work_s

    assert secure_work_s(1, 1e6, 1e10, 1e-9) == 0.0
    # one replica: 88 + 24 (n - 1) + 36; the leader: 60 n + 72
    assert secure_bytes_per_element(4) == 88 + 24 * 3 + 36 + 60 * 4 + 72
    assert secure_work_s(4, 1e6, 1e10, 2e-9) == pytest.approx(1e6 * (508 / 1e10 + 3 * 2e-9))
    cluster, measured, params, bandwidth = _star(one_node, "mask_ns", 3.0)
    star = estimate_iteration(measured, MODEL, job(via="leader"))
    for spec, mask_s in ((measured, 3e-9), (cluster, 1.4e-9)):
        secure = estimate_iteration(spec, MODEL, job(via="leader", secure=True))
        extra = secure.breakdown_s["dp_comm"] - star.breakdown_s["dp_comm"]
        masks = (secure_bytes_per_element(8) - bytes_per_element("mean", 8)) / bandwidth
        assert extra == pytest.approx(params * (masks + 7 * mask_s), rel=1e-9)
        assert secure.traffic_bytes == star.traffic_bytes  # int32 as large as fp32
    assert job(via="leader", secure=True, privacy="noise").sync.label == (
        "every-step, through the leader, securely aggregated, with DP noise"
    )
    for bad, reason in (
        ({"secure": True}, "set via: leader"),
        ({"secure": True, "via": "leader", "aggregator": "median"}, "only aggregator mean"),
        ({"secure": True, "via": "leader", "compress": "int8"}, "only compress none"),
    ):
        with pytest.raises(ValueError, match=reason):
            job(**bad)
