"""Data-parallel sync modes and compression in the cost model: bytes and exposed time.

References: every-step's own estimate (a mode of one inner step is it, exactly), the bytes per
element each codec is defined by, and PowerSGD's factor sizes counted from the model's shape.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dmsc.netmodel import build_layer_costs, estimate_iteration
from dmsc.netmodel.layers import padded_vocab
from dmsc.netmodel.sync import stage_payload, vocab_matrix
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, parse_compress, resolve_model
from dmsc.spec.sync import SyncSpec

# dp groups of 64 x tp 8 span two datacenters of NSFNET: the all-reduce crosses a thin link
CROSSING = {"global_batch": 512, "tp": 8, "pp": 2, "dp": 64}


def _job(sync: object = None, **kw: object) -> JobSpec:
    data = {**CROSSING, **kw}
    if sync is not None:
        data["sync"] = sync
    return JobSpec.model_validate(data)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"overlap_dp_comm": False},
        {"allreduce": "ring"},
        {"tp": 4, "pp": 4, "dp": 16, "global_batch": 256},
    ],
)
def test_one_inner_step_uncompressed_is_every_step_exactly(nsfnet: ClusterSpec, kw: dict) -> None:
    model = resolve_model("gpt3-6.7b")
    every = estimate_iteration(nsfnet, model, _job(**kw))
    for mode in ("diloco", "fedavg", "fedprox"):
        one = estimate_iteration(nsfnet, model, _job({"mode": mode, "inner_steps": 1}, **kw))
        assert one.breakdown_s == every.breakdown_s
        assert one.iteration_time_s == every.iteration_time_s
        assert one.traffic_bytes == every.traffic_bytes
        assert one.traffic_by_link == every.traffic_by_link


@pytest.mark.parametrize("mode", ["diloco", "fedavg", "fedprox"])
@pytest.mark.parametrize("steps", [2, 50])
def test_dp_bytes_per_iteration_are_one_round_over_h(
    nsfnet: ClusterSpec, mode: str, steps: int
) -> None:
    model = resolve_model("gpt3-6.7b")
    every = estimate_iteration(nsfnet, model, _job())
    local = estimate_iteration(nsfnet, model, _job({"mode": mode, "inner_steps": steps}))
    assert local.traffic_bytes["dp"] == pytest.approx(every.traffic_bytes["dp"] / steps, rel=1e-12)
    for lid, modes in every.traffic_by_link.items():
        assert local.traffic_by_link[lid]["dp"] == pytest.approx(modes["dp"] / steps, rel=1e-12)
    for other in ("pp", "tp", "ep"):
        assert local.traffic_bytes[other] == every.traffic_bytes[other]
    assert local.breakdown_s["compute"] == every.breakdown_s["compute"]


def test_exposed_time_without_overlap_is_a_round_over_h(nsfnet: ClusterSpec) -> None:
    model = resolve_model("gpt3-6.7b")
    every = estimate_iteration(nsfnet, model, _job(overlap_dp_comm=False))
    local = estimate_iteration(nsfnet, model, _job("diloco:8", overlap_dp_comm=False))
    assert every.breakdown_s["dp_comm"] > 0
    assert local.breakdown_s["dp_comm"] == pytest.approx(every.breakdown_s["dp_comm"] / 8)


def test_a_round_is_exposed_whole_as_the_runtime_runs_it(nsfnet: ClusterSpec) -> None:
    """dmsc's runtime runs a round's exchange after the round's last step is applied, under no
    compute: with overlap the cost model priced it hidden under the last backward and the next
    H - 1 steps (streaming DiLoCo, which the runtime does not run), and predicted 0.0 ms of
    exposed exchange a step for a `diloco:4` task measured at 12.0 ms a step."""
    model = resolve_model("llama3-8b")
    job = {"global_batch": 512, "tp": 8, "pp": 1, "dp": 128}
    raw = estimate_iteration(nsfnet, model, _job(overlap_dp_comm=False, **job))
    assert raw.breakdown_s["dp_comm"] > 0.1  # one all-reduce across four datacenters
    for h in (2, 4, 50):
        for overlap in (True, False):
            local = estimate_iteration(
                nsfnet, model, _job(f"diloco:{h}", overlap_dp_comm=overlap, **job)
            )
            want = raw.breakdown_s["dp_comm"] / h
            assert local.breakdown_s["dp_comm"] == pytest.approx(want, rel=1e-12)
    # every step keeps its buckets behind the backward
    every = estimate_iteration(nsfnet, model, _job(**job))
    assert every.breakdown_s["dp_comm"] != raw.breakdown_s["dp_comm"]


@pytest.mark.parametrize(
    ("compress", "dtype", "ratio"),
    [
        ("bf16", "bf16", 1.0),
        ("bf16", "fp32", 0.5),
        ("int8", "bf16", (1 + 4 / 256) / 2),
        ("int8", "fp32", (1 + 4 / 256) / 4),
        ("int8:64", "bf16", (1 + 4 / 64) / 2),
        ("topk:0.01", "bf16", 0.01 * 8 / 2),
        ("topk:0.01", "fp32", 0.01 * 8 / 4),
    ],
)
def test_compression_ratios_are_the_codecs_bytes_per_element(
    nsfnet: ClusterSpec, compress: str, dtype: str, ratio: float
) -> None:
    model = TransformerSpec(
        name="small", layers=4, hidden=1024, heads=16, seq=1024, vocab=32000, dtype=dtype
    )
    # two replicas: top-k's all-gather moves the bytes of an all-reduce there
    job = {"global_batch": 8, "tp": 4, "dp": 2, "allreduce": "ring"}
    every = estimate_iteration(nsfnet, model, _job(**job))
    packed = estimate_iteration(nsfnet, model, _job({"compress": compress}, **job))
    assert packed.traffic_bytes["dp"] == pytest.approx(every.traffic_bytes["dp"] * ratio, rel=1e-12)
    both = estimate_iteration(
        nsfnet, model, _job({"mode": "diloco", "inner_steps": 10, "compress": compress}, **job)
    )
    assert both.traffic_bytes["dp"] == pytest.approx(packed.traffic_bytes["dp"] / 10, rel=1e-12)


def test_topk_gathers_every_replica_s_entries(nsfnet: ClusterSpec) -> None:
    """With n replicas, an all-gather of n payloads: n / 2 times the all-reduce's share."""
    model = resolve_model("gpt3-1.3b")
    job = {"global_batch": 64, "dp": 16, "allreduce": "ring"}
    every = estimate_iteration(nsfnet, model, _job(**job))
    topk = estimate_iteration(nsfnet, model, _job({"compress": "topk:0.01"}, **job))
    want = every.traffic_bytes["dp"] * (0.01 * 8 / 2) * 16 / 2
    assert topk.traffic_bytes["dp"] == pytest.approx(want, rel=1e-12)


def _powersgd_reference(model: TransformerSpec, rank: int, grad_bytes: int) -> float:
    """PowerSGD's bytes for a GPT-style model on one device, counted from its shape: every
    weight matrix as rank x (rows + cols) fp32 values, everything else as it is."""
    h, f, s = model.hidden, model.ffn_size, model.seq
    v = padded_vocab(model.vocab, 1)
    mats = [(h, 3 * h), (h, h), (h, f), (f, h)] * model.layers + [(v, h), (h, v)]
    norms_biases = model.layers * (2 * 2 * h + 3 * h + h + f + h) + 2 * h
    positions = s * h
    factors = sum(min(a * b * grad_bytes, rank * (a + b) * 4) for a, b in mats)
    return factors + (norms_biases + positions) * grad_bytes


@pytest.mark.parametrize("rank", [1, 4, 64])
def test_powersgd_bytes_from_the_layer_shapes(rank: int) -> None:
    model = TransformerSpec(name="g", layers=3, hidden=256, heads=4, seq=128, vocab=1000)
    job = JobSpec(global_batch=1)
    layers = build_layer_costs(model, job)
    dense, expert = stage_payload(
        layers, 2, parse_compress(f"powersgd:{rank}"), vocab_matrix(layers)
    )
    assert expert == 0
    assert dense == pytest.approx(_powersgd_reference(model, rank, 2), rel=1e-12)
    assert dense < sum(lc.params_per_device for lc in layers) * 2


def test_powersgd_shrinks_the_dp_all_reduce(nsfnet: ClusterSpec) -> None:
    model = resolve_model("gpt3-6.7b")
    every = estimate_iteration(nsfnet, model, _job(allreduce="ring"))
    low = estimate_iteration(nsfnet, model, _job({"compress": "powersgd:4"}, allreduce="ring"))
    assert low.traffic_bytes["dp"] < every.traffic_bytes["dp"] / 20
    assert low.breakdown_s["dp_comm"] <= every.breakdown_s["dp_comm"]


def test_through_the_leader_a_job_pays_the_star_exposed_whole(nsfnet: ClusterSpec) -> None:
    """``via: leader`` (how dmsc's runtime runs robust aggregators, privacy and secure
    aggregation): the exchange is the leader's star, not the all-reduce: the same bytes in all,
    but ``n - 1`` payloads each way on the leader's link, and none of it hidden under the
    backward (a replica sends its update once its backward is done). It used to be unpriced:
    such a task was "not comparable"."""
    model = resolve_model("gpt3-6.7b")
    job = {"global_batch": 64, "tp": 8, "pp": 1, "dp": 4}
    ring = estimate_iteration(nsfnet, model, _job(**job))
    star = estimate_iteration(nsfnet, model, _job({"via": "leader"}, **job))
    assert star.breakdown_s["dp_comm"] > ring.breakdown_s["dp_comm"]
    for part in ("compute", "tp_comm", "pp_comm", "optimizer"):
        assert star.breakdown_s[part] == ring.breakdown_s[part]
    assert star.traffic_bytes["dp"] == pytest.approx(ring.traffic_bytes["dp"], rel=1e-9)
    busiest = max(modes.get("dp", 0.0) for modes in star.traffic_by_link.values())
    assert busiest > max(modes.get("dp", 0.0) for modes in ring.traffic_by_link.values())
    # exposed whole: overlap hides nothing of it
    bare = estimate_iteration(nsfnet, model, _job({"via": "leader"}, overlap_dp_comm=False, **job))
    assert star.breakdown_s["dp_comm"] == bare.breakdown_s["dp_comm"]
    assert _job({"via": "leader"}).sync.label == "every-step, through the leader"


def test_the_leaders_star_and_its_sparse_answer(one_node: Callable[[int], ClusterSpec]) -> None:
    """The exchange through the leader is :meth:`CommModel.star` of the payload; top-k comes
    back as the leader's sparse sum, up to every replica's entries."""
    from dmsc.netmodel import CommModel, Topology
    from dmsc.netmodel.constants import DEFAULT_CALIBRATION
    from dmsc.netmodel.sync import exchange

    cluster = one_node(4)
    comm = CommModel(Topology(cluster), DEFAULT_CALIBRATION)
    groups, m = [(0, 1, 2, 3)], 1e8
    none, topk = parse_compress("none"), parse_compress("topk:0.01")
    assert exchange(comm, groups, m, none, "ring", "leader") == comm.star(groups, m, m)
    assert exchange(comm, groups, m, topk, "ring", "leader") == comm.star(groups, m, 4 * m)
    assert exchange(comm, groups, m, none, "ring") == comm.collective("all_reduce", groups, m)


def test_a_compressed_every_step_exchange_is_exposed_whole(nsfnet: ClusterSpec) -> None:
    """dmsc's runtime buckets every step's all-reduce behind the backward only for gradients
    sent as they are; with a codec it encodes the whole flattened gradient once the backward is
    done and exchanges it in one call (``outer_sync.sync_gradients``). The estimate says so:
    overlap hides nothing of a compressed exchange (it hid some, priced in buckets, before)."""
    from dmsc.netmodel.sync import bucketed

    model = resolve_model("gpt3-6.7b")
    job = {"global_batch": 64, "tp": 8, "pp": 1, "dp": 4}
    for codec in ("bf16", "int8", "topk:0.01", "powersgd:4"):
        hidden = estimate_iteration(nsfnet, model, _job({"compress": codec}, **job))
        bare = estimate_iteration(
            nsfnet, model, _job({"compress": codec}, overlap_dp_comm=False, **job)
        )
        assert hidden.breakdown_s["dp_comm"] == bare.breakdown_s["dp_comm"] > 0, codec
        assert not bucketed(_job({"compress": codec}).sync, True), codec
    plain = estimate_iteration(nsfnet, model, _job(**job))
    plain_bare = estimate_iteration(nsfnet, model, _job(overlap_dp_comm=False, **job))
    assert plain.breakdown_s["dp_comm"] < plain_bare.breakdown_s["dp_comm"]
    assert bucketed(_job().sync, True) and not bucketed(_job().sync, False)


def test_a_gpu_s_exchange_work_runs_on_its_host(one_node: Callable[[int], ClusterSpec]) -> None:
    """The runtime's codecs and the leader's rules run on host tensors (the gradient copied
    down from the GPU, the answer back): their passes go at the host's memory bandwidth, not
    the device's, and the two copies at the host link's rate. Before, the estimate priced them
    at the GPU's HBM bandwidth (2 TB/s here, about 100 times one host thread's) and left the
    copies out; a spec's measured host figures changed nothing."""
    from dmsc.netmodel.codec_work import around_bytes
    from dmsc.netmodel.codec_work import bytes_per_element as codec_bytes
    from dmsc.netmodel.constants import DEFAULT_CALIBRATION
    from dmsc.netmodel.sync import HostSide, host_side, memory_bytes_s, work_s

    gpu = one_node(4).device_types["g"]
    assert gpu.runtime_device == "cpu"  # generic: the runtime computes on the CPU
    cpu_side = host_side(gpu, DEFAULT_CALIBRATION)
    assert cpu_side == HostSide(memory_bytes_s(gpu, DEFAULT_CALIBRATION), None)
    cuda = gpu.model_copy(update={"accelerator": "cuda"})
    assert host_side(cuda, DEFAULT_CALIBRATION) == HostSide(20e9, 27e9)  # the defaults
    a100 = gpu.model_copy(update={"accelerator": "cuda", "generation": "a100"})
    assert host_side(a100, DEFAULT_CALIBRATION) == HostSide(20e9, 27e9)
    h100 = gpu.model_copy(update={"accelerator": "cuda", "generation": "h100"})
    assert host_side(h100, DEFAULT_CALIBRATION) == HostSide(20e9, 54e9)
    measured = cuda.model_copy(update={"host_memory_bw_gbyte_s": 12.5, "host_copy_gbyte_s": 9.0})
    side = host_side(measured, DEFAULT_CALIBRATION)
    assert side == HostSide(12.5e9, 9.0e9)

    elements = 3e8
    int8 = SyncSpec.model_validate({"compress": "int8"})
    passes = elements * codec_bytes(int8.compression, "collective", 4)
    passes += elements * around_bytes(int8.compression, "collective", 4, rounds=False)
    assert work_s(int8, 4, elements, side) == pytest.approx(
        passes / 12.5e9 + 2 * 4 * elements / 9.0e9, rel=1e-12
    )
    assert work_s(int8, 4, elements, cpu_side) == pytest.approx(
        passes / cpu_side.memory_bytes_s, rel=1e-12
    )
    plain = SyncSpec()  # sent as it is, by collective: no work, no copy
    assert work_s(plain, 4, elements, side) == 0.0
    assert work_s(int8, 1, elements, side) == 0.0  # one replica exchanges nothing


def test_the_estimate_prices_a_gpu_s_codec_on_its_measured_host(nsfnet: ClusterSpec) -> None:
    """The spec's measured host figures reach the estimate: halving the host's memory
    bandwidth adds the codec's passes once more, exactly; the plain all-reduce is unchanged."""
    from dmsc.netmodel.codec_work import around_bytes
    from dmsc.netmodel.codec_work import bytes_per_element as codec_bytes
    from dmsc.netmodel.constants import DEFAULT_CALIBRATION
    from dmsc.netmodel.sync import host_side

    model = resolve_model("gpt3-6.7b")
    job = {"global_batch": 64, "tp": 8, "pp": 1, "dp": 4}
    name = next(iter(nsfnet.device_types))
    device = nsfnet.device_types[name]
    assert device.runtime_device == "cuda"

    def with_host(gbyte_s: float) -> ClusterSpec:
        data = nsfnet.model_dump(mode="json", exclude_none=True)
        data["device_types"][name]["host_memory_bw_gbyte_s"] = gbyte_s
        return ClusterSpec.model_validate(data)

    fast, slow = with_host(20.0), with_host(10.0)
    assert host_side(fast.device_types[name], DEFAULT_CALIBRATION).memory_bytes_s == 20e9
    int8 = _job({"compress": "int8"}, **job)
    a = estimate_iteration(fast, model, int8).breakdown_s["dp_comm"]
    b = estimate_iteration(slow, model, int8).breakdown_s["dp_comm"]
    elements = sum(lc.params_per_device for lc in build_layer_costs(model, int8))
    passes = elements * codec_bytes(int8.sync.compression, "collective", 4)
    passes += elements * around_bytes(int8.sync.compression, "collective", 4, rounds=False)
    assert b - a == pytest.approx(passes / 10e9 - passes / 20e9, rel=1e-9)
    plain = _job(**job)
    assert estimate_iteration(fast, model, plain).breakdown_s == (
        estimate_iteration(slow, model, plain).breakdown_s
    )
