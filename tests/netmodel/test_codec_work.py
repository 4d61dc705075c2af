"""A codec's own passes over the update in one exchange, priced beside the bytes it saves.

References: the bytes counted by hand from the runtime's codecs and its int8 ring, and the
estimate's data-parallel time rebuilt from the exchange and those passes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dmsc.netmodel import CommModel, Topology, estimate_iteration
from dmsc.netmodel.codec_work import around_bytes, bytes_per_element, codec_work_s
from dmsc.netmodel.constants import DEFAULT_CALIBRATION
from dmsc.netmodel.layers import build_layer_costs
from dmsc.netmodel.sync import exchange, stage_payload, vocab_matrix
from dmsc.spec import ClusterSpec, JobSpec, parse_compress, resolve_model


def test_bytes_an_element_counted_from_the_runtimes_codecs() -> None:
    none, bf16, int8 = (parse_compress(f) for f in ("none", "bf16", "int8"))
    # by collective: nothing for the update as it is, the two casts around gloo for bf16
    assert bytes_per_element(none, "collective", 4) == 0.0
    assert bytes_per_element(bf16, "collective", 4) == 12.0
    # int8: the element's passes and a 256th of a block scale's (the default block)
    enc, dec = 33 + 92 / 256, 17 + 22 / 256
    # the int8 ring of 4 on chunks of E/4: 3 hops of encode, decode and add, its own sum
    # encoded and decoded, 3 chunks decoded into place
    assert bytes_per_element(int8, "collective", 4) == pytest.approx(
        (3 * (enc + dec + 12) + enc + dec + 3 * (dec + 8)) / 4
    )
    # through the leader: a replica's encode, the leader's 4 decodes and its encode, a decode
    assert bytes_per_element(int8, "leader", 4) == pytest.approx(enc + 4 * dec + enc + dec)
    int8_64 = parse_compress("int8:64")
    assert bytes_per_element(int8_64, "leader", 2) == pytest.approx(
        2 * (33 + 92 / 64) + 3 * (17 + 22 / 64)
    )
    assert bytes_per_element(none, "leader", 2) == 12 + 2 * 12 + 12 + 12
    # top-k: the selection's passes, the leader's 4 payloads into zeroed vectors, its answer
    # sparse; by collective (all-gathered) every member decodes the 4 and takes their mean
    topk = parse_compress("topk:0.01")
    assert bytes_per_element(topk, "leader", 4) == 31 + 4 * 4 + 12 + 4
    assert bytes_per_element(topk, "collective", 4) == 31 + 4 * 4 + (12 * 4 + 4)
    # PowerSGD: a replica's passes besides its products, whichever way the factors go
    for via in ("leader", "collective"):
        assert bytes_per_element(parse_compress("powersgd:4"), via, 4) == 16.0
    assert bytes_per_element(int8, "collective", 1) == 0.0
    per_element = enc + 2 * dec + enc + dec
    assert codec_work_s(int8, "leader", 2, 1e6, 1e10) == pytest.approx(1e6 * per_element / 1e10)
    with pytest.raises(ValueError, match="memory bandwidth must be > 0"):
        codec_work_s(int8, "leader", 2, 1e6, 0.0)


def test_powersgds_products_are_priced_at_the_hosts_measured_rate() -> None:
    """PowerSGD's four products with the update's matrices at the host's measured seconds an
    element (``lowrank_ns``, at rank 4): beside its 16 bytes of passes, the same whichever way
    the factors go, growing with the rank above 4 (their FLOPs) and not below it (the passes
    over the matrix bound them). Until 2026-12-04 they were priced as 20 bytes of memory passes,
    and the exchange measured 1.8-2.0 times its price."""
    from dmsc.netmodel.codec_work import lowrank_s
    from dmsc.netmodel.constants import LOWRANK_RANK, DeviceCalibration

    assert LOWRANK_RANK == 4
    elements, bw, per = 1e6, 1e10, 2e-9
    for rank, products in ((4, 2e-9), (8, 4e-9), (2, 2e-9), (1, 2e-9)):
        c = parse_compress(f"powersgd:{rank}")
        assert lowrank_s(c, per) == pytest.approx(products)
        for via in ("leader", "collective"):
            want = elements * 16 / bw + elements * products
            assert codec_work_s(c, via, 4, elements, bw, per) == pytest.approx(want)
        assert codec_work_s(c, "collective", 1, elements, bw, per) == 0.0  # no exchange
    assert lowrank_s(parse_compress("int8"), per) == 0.0
    default = codec_work_s(parse_compress("powersgd:4"), "leader", 2, elements, bw)
    assert default == pytest.approx(elements * (16 / bw + DeviceCalibration.lowrank_s))


def test_the_passes_around_an_exchange_by_path() -> None:
    """Every step's update flattened and, through the leader, the answer copied back (16; by
    collective the gradients become views of it: 8), a round's pseudo-gradient formed (20); by
    collective the int8 ring's division of the update in place (8) and bf16's copy and
    division (8); nothing for one replica or for gradients sent as they are by collective
    (priced as NCCL runs them)."""
    none, int8, bf16 = (parse_compress(f) for f in ("none", "int8", "bf16"))
    topk, psgd = parse_compress("topk:0.01"), parse_compress("powersgd:4")
    assert around_bytes(none, "collective", 4, rounds=False) == 0.0
    assert around_bytes(none, "collective", 4, rounds=True) == 0.0
    assert around_bytes(int8, "leader", 1, rounds=False) == 0.0
    assert around_bytes(none, "leader", 4, rounds=False) == 16.0
    assert around_bytes(none, "leader", 4, rounds=True) == 20.0
    assert around_bytes(int8, "collective", 2, rounds=False) == 16.0
    assert around_bytes(int8, "collective", 2, rounds=True) == 28.0
    assert around_bytes(bf16, "collective", 2, rounds=False) == 16.0
    assert around_bytes(topk, "collective", 2, rounds=False) == 8.0
    assert around_bytes(psgd, "collective", 2, rounds=False) == 8.0


@pytest.mark.parametrize("form", ["int8", "topk:0.01", "powersgd:4"])
@pytest.mark.parametrize("via", ["collective", "leader"])
def test_the_estimate_adds_the_codecs_passes_to_the_exchange(
    one_node: Callable[[int], ClusterSpec], via: str, form: str
) -> None:
    """Every step's compressed exchange (exposed whole) is the exchange of the payload plus the
    codec's passes over the stage's fp32 update at the device's memory bandwidth (and through
    the leader its mean, but for PowerSGD's, whose leader averages the small factors)."""
    cluster = one_node(4)
    model = resolve_model("gpt3-350m").model_copy(update={"dtype": "bf16"})
    job = JobSpec.model_validate(
        {"global_batch": 8, "dp": 4, "sync": {"compress": form, "via": via}}
    )
    est = estimate_iteration(cluster, model, job)
    layers = build_layer_costs(model, job)
    codec = parse_compress(form)
    payload, _ = stage_payload(layers, 2, codec, vocab_matrix(layers))
    comm = CommModel(Topology(cluster), DEFAULT_CALIBRATION)
    wire = exchange(comm, [(0, 1, 2, 3)], payload, codec, job.allreduce, via).time_s
    device = cluster.device_types["g"]
    bandwidth = device.memory_bw_gbyte_s * 1e9
    bandwidth *= DEFAULT_CALIBRATION.for_device(device).memory_efficiency
    elements = sum(lc.params_per_device for lc in layers)
    work = codec_work_s(codec, via, 4, elements, bandwidth)
    work += elements * around_bytes(codec, via, 4, rounds=False) / bandwidth
    if via == "leader" and codec.kind != "powersgd":  # and the leader's mean
        from dmsc.netmodel.leader_work import leader_work_s

        work += leader_work_s("mean", 4, elements, bandwidth)
    assert est.breakdown_s["dp_comm"] == pytest.approx(wire + work, rel=1e-9)
    assert work > 0


def test_the_leaders_own_bytes_are_its_decodes_and_its_answers_encoding() -> None:
    """Of the path through the leader, what the leader does alone (the followers waiting):
    the ``n`` decodes and the answer's encoding (top-k's sparse answer); nothing by collective,
    for one replica or for PowerSGD (its leader averages factors only)."""
    from dmsc.netmodel.codec_work import (
        SPARSE_ENCODE,
        decode_bytes,
        encode_bytes,
        leader_bytes_per_element,
    )

    for form in ("none", "bf16", "int8:64"):
        c = parse_compress(form)
        want = 4 * decode_bytes(c) + encode_bytes(c)
        assert leader_bytes_per_element(c, "leader", 4) == want
        assert leader_bytes_per_element(c, "leader", 4) < bytes_per_element(c, "leader", 4)
        assert leader_bytes_per_element(c, "collective", 4) == 0.0
    topk = parse_compress("topk:0.01")
    assert leader_bytes_per_element(topk, "leader", 3) == 3 * decode_bytes(topk) + SPARSE_ENCODE
    assert leader_bytes_per_element(parse_compress("powersgd:4"), "leader", 4) == 0.0
    assert leader_bytes_per_element(parse_compress("none"), "leader", 1) == 0.0
