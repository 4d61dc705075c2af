"""Codecs for the replicas' vectors, each checked against an independent numpy reference, and
their decoders against hostile payloads."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from bytes_moved import BytesMoved

from dmsc.netmodel import codec_work
from dmsc.runtime.compute import compression
from dmsc.runtime.compute.compression import (
    Codec,
    CodecError,
    PowerSGD,
    downlink_codec,
    make_codec,
    wire_bytes,
)
from dmsc.spec.sync_forms import parse_compress


def _vector(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _codec(name: str, n: int) -> Codec:
    codec = make_codec(name, n)
    assert not isinstance(codec, PowerSGD)
    return codec


def test_none_round_trips_exactly_and_bf16_within_its_rounding() -> None:
    x = _vector(1000) * 1e3
    none = _codec("none", 1000)
    assert torch.equal(none.decode(none.encode(x), 1000), x)
    bf16 = _codec("bf16", 1000)
    payload = bf16.encode(x)
    assert payload.dtype == torch.bfloat16 and wire_bytes(payload) == 2000
    # Round to nearest with an 8-bit significand: relative error at most 2^-8.
    assert bool(((bf16.decode(payload, 1000) - x).abs() <= x.abs() * 2.0**-8).all())


def _reference_int8(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Absmax/127 scale per block and round-half-even quantization, in float32 numpy."""
    blocks = -(-len(x) // block)
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[: len(x)] = x
    grid = padded.reshape(blocks, block)
    scales = (np.abs(grid).max(axis=1) / np.float32(127)).astype(np.float32)
    divisor = np.where(scales > 0, scales, np.float32(1))
    q = np.clip(np.round(grid / divisor[:, None]), -127, 127).astype(np.int8)
    return scales, q.reshape(-1)[: len(x)]


@pytest.mark.parametrize(("name", "block", "n"), [("int8", 256, 1000), ("int8:7", 7, 100)])
def test_int8_matches_a_reference_quantizer_and_errs_at_most_half_a_step(
    name: str, block: int, n: int
) -> None:
    x = _vector(n, seed=3) * torch.linspace(0.01, 10, n)
    x[block : 2 * block] = 0  # an all-zero block
    codec = _codec(name, n)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8
    assert wire_bytes(payload) == 16 + 4 * math.ceil(n / block) + n
    scales, q = _reference_int8(x.numpy(), block)
    got_scales = payload[16 : 16 + 4 * len(scales)].numpy().view(np.float32)
    got_q = payload[16 + 4 * len(scales) :].numpy().view(np.int8)
    np.testing.assert_array_equal(got_scales, scales)
    np.testing.assert_array_equal(got_q, q)
    y = codec.decode(payload, n).numpy()
    per_element_scale = np.repeat(scales, block)[:n]
    assert np.all(np.abs(y - x.numpy()) <= per_element_scale / 2 * (1 + 1e-5))
    assert np.all(y[block : 2 * block] == 0)


def test_int8_blocks_of_subnormal_values_are_clamped_as_the_reference_never_wrapped() -> None:
    """A subnormal scale is rounded far more coarsely than 2^-24: a quotient can pass 127
    (2.5e-43 over its scale is 178), and int8 would wrap it to a negative value. Such blocks
    are clamped (the encoding leaves the clamp out where every scale is normal)."""
    n = 3 * 256 + 40  # a short last block too
    x = torch.zeros(n)
    x[:256] = torch.linspace(-2.5e-43, 2.5e-43, 256)
    x[256:512] = _vector(256, seed=5)  # a normal block beside them
    x[512:] = _vector(n - 512, seed=6) * 1e-41
    codec = _codec("int8", n)
    payload = codec.encode(x)
    scales, q = _reference_int8(x.numpy(), 256)
    got_q = payload[16 + 4 * len(scales) :].numpy().view(np.int8)
    np.testing.assert_array_equal(got_q, q)
    assert got_q[:256].min() == -127 and got_q[:256].max() == 127
    np.testing.assert_array_equal(codec.decode(payload, n).numpy(), np.repeat(scales, 256)[:n] * q)


def test_topk_sends_exactly_the_largest_magnitudes() -> None:
    n = 1000
    codec = _codec("topk:0.07", n)  # 0.07 * 1000 = 70; in floats ceil(0.07 * 100) would be 8
    x = _vector(n, seed=5)
    payload = codec.encode(x)
    sent = codec.decode(payload, n)
    expected = np.sort(np.argsort(-np.abs(x.numpy()), kind="stable")[:70])
    np.testing.assert_array_equal(np.flatnonzero(sent.numpy()), expected)
    np.testing.assert_array_equal(sent.numpy()[expected], x.numpy()[expected])
    assert wire_bytes(payload) == 16 + 8 * 70
    assert make_codec("topk:0.07", 100).k == 7  # type: ignore[union-attr]


def test_topk_error_feedback_loses_nothing() -> None:
    """What was sent over T steps plus the final residual is what went in."""
    n, steps = 500, 20
    codec = _codec("topk:0.03", n)
    sent_total = torch.zeros(n, dtype=torch.float64)
    input_total = torch.zeros(n, dtype=torch.float64)
    for t in range(steps):
        x = _vector(n, seed=100 + t) + 0.5
        input_total += x.double()
        sent_total += codec.decode(codec.encode(x), n).double()
    residual = codec.residual  # type: ignore[attr-defined]
    torch.testing.assert_close(sent_total + residual.double(), input_total, atol=1e-5, rtol=0)
    assert residual.abs().sum() > 0  # something really was held back


def test_sparse_downlink_is_exact_and_topk_comes_back_sparse() -> None:
    x = torch.zeros(300)
    x[[0, 17, 299]] = torch.tensor([1.5, -2.0, 3.25])
    down = downlink_codec("topk:0.01", 300)
    assert down.name == "sparse"
    payload = down.encode(x)
    assert wire_bytes(payload) == 16 + 8 * 3
    assert torch.equal(down.decode(payload, 300), x)
    assert torch.equal(down.decode(down.encode(torch.zeros(300)), 300), torch.zeros(300))


def test_downlink_codecs_are_the_stateless_counterparts() -> None:
    assert downlink_codec("none", 10).name == "none"
    assert downlink_codec("bf16", 10).name == "bf16"
    assert downlink_codec("int8:64", 10).name == "int8:64"
    with pytest.raises(ValueError, match="second round"):
        downlink_codec("powersgd:4", 10)
    with pytest.raises(ValueError, match="expected none, bf16"):
        downlink_codec("topk:2", 10)


@pytest.mark.parametrize(
    "name", ["zstd", "int8:0", "int8:x", "topk", "topk:0", "topk:1.5", "topk:nan", "bf16:2"]
)
def test_malformed_codec_names_list_the_accepted_forms(name: str) -> None:
    with pytest.raises(ValueError, match="expected none, bf16"):
        make_codec(name, 10)


def test_encoders_refuse_a_non_finite_vector_without_touching_their_residual() -> None:
    codec = _codec("topk:0.5", 4)
    codec.encode(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    before = codec.residual  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(torch.tensor([1.0, float("nan"), 3.0, 4.0]))
    assert torch.equal(codec.residual, before)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="1-D float32"):
        _codec("int8", 4).encode(torch.zeros(5))


# --- hostile payloads -------------------------------------------------------------------------


def _with_int64(payload: torch.Tensor, at: int, value: int) -> torch.Tensor:
    out = payload.clone()
    out[at : at + 8] = torch.tensor([value], dtype=torch.int64).view(torch.uint8)
    return out


def _with_float(payload: torch.Tensor, at: int, value: float) -> torch.Tensor:
    out = payload.clone()
    out[at : at + 4] = torch.tensor([value], dtype=torch.float32).view(torch.uint8)
    return out


def _hostile_cases() -> list[tuple[str, str, torch.Tensor, str]]:
    n = 600
    x = _vector(n, seed=9)
    int8 = _codec("int8", n).encode(x)
    topk = _codec("topk:0.01", n).encode(x)  # k = 6
    sparse = downlink_codec("topk:0.01", n).encode(torch.where(x > 2, x, 0))
    idx_at = 16  # the first int32 index
    return [
        ("none", "truncated", torch.zeros(n - 1), "599 elements"),
        ("none", "wrong dtype", torch.zeros(n, dtype=torch.float64), "float32"),
        ("none", "NaN value", torch.full((n,), float("nan")), "NaN"),
        ("none", "2-D", torch.zeros(1, n), "1-D"),
        ("bf16", "wrong dtype", torch.zeros(n, dtype=torch.float16), "bfloat16"),
        ("int8", "truncated", int8[:-1], "bytes"),
        ("int8", "header only part", int8[:10], "header"),
        ("int8", "wrong dtype", int8.view(torch.int8), "uint8"),
        ("int8", "bad magic", torch.cat([torch.zeros(1, dtype=torch.uint8), int8[1:]]), "start"),
        ("int8", "huge count", _with_int64(int8, 8, 2**62), "claims"),
        ("int8", "NaN scale", _with_float(int8, 16, float("nan")), "scales"),
        ("int8", "negative scale", _with_float(int8, 16, -1.0), "negative"),
        ("int8", "overflowing scale", _with_float(int8, 16, 3e38), "dequantized"),
        ("int8", "topk payload", topk, "encoded by topk"),
        ("topk:0.01", "truncated", topk[:-4], "bytes"),
        ("topk:0.01", "huge count", _with_int64(topk, 8, 2**62), "claims"),
        ("topk:0.01", "negative count", _with_int64(topk, 8, -1), "claims"),
        ("topk:0.01", "count not k", _with_int64(topk, 8, 5)[:-8], "expected 6"),
        ("topk:0.01", "index too big", _with_int32(topk, idx_at + 20, n), "outside"),
        ("topk:0.01", "negative index", _with_int32(topk, idx_at, -5), "outside"),
        ("topk:0.01", "repeated index", _with_int32(topk, idx_at + 4, 0), "increasing"),
        ("topk:0.01", "NaN value", _with_float(topk, 16 + 24, float("nan")), "values"),
        ("topk:0.01", "sparse payload", sparse, "encoded by sparse"),
        ("sparse", "huge count", _with_int64(sparse, 8, n + 1), "claims"),
        ("sparse", "not a tensor", b"dmc", "not a tensor"),  # type: ignore[list-item]
    ]


def _with_int32(payload: torch.Tensor, at: int, value: int) -> torch.Tensor:
    out = payload.clone()
    out[at : at + 4] = torch.tensor([value], dtype=torch.int32).view(torch.uint8)
    return out


@pytest.mark.parametrize(
    ("name", "why", "payload", "reason"), _hostile_cases(), ids=lambda v: str(v)[:20]
)
def test_hostile_payloads_raise_codec_error_with_a_reason(
    name: str, why: str, payload: torch.Tensor, reason: str
) -> None:
    codec = downlink_codec(name, 600) if name == "sparse" else _codec(name, 600)
    with pytest.raises(CodecError, match=reason):
        codec.decode(payload, 600)


def test_int8_refuses_a_payload_of_another_block_size() -> None:
    payload = _codec("int8:64", 100).encode(_vector(100))
    with pytest.raises(CodecError, match="blocks of 64"):
        _codec("int8", 100).decode(payload, 100)


# --- PowerSGD ---------------------------------------------------------------------------------


def _powersgd_step(
    replicas: list[PowerSGD], xs: list[torch.Tensor]
) -> tuple[list[torch.Tensor], int]:
    """One step by hand: the leader's averages are plain means here."""
    ps = [r.start(x) for r, x in zip(replicas, xs, strict=True)]
    p_mean = torch.stack(ps).mean(dim=0)
    qs = [r.middle(p_mean) for r in replicas]
    q_mean = torch.stack(qs).mean(dim=0)
    return [r.finish(q_mean) for r in replicas], wire_bytes(ps[0]) + wire_bytes(qs[0])


SHAPES = [torch.Size([6, 4]), torch.Size([5]), torch.Size([3, 2, 4]), torch.Size([])]


def test_powersgd_of_full_rank_recovers_the_mean_exactly() -> None:
    n = sum(s.numel() for s in SHAPES)
    replicas = [PowerSGD(SHAPES, rank=8, seed=1) for _ in range(3)]
    xs = [_vector(n, seed=i) for i in range(3)]
    outs, sent = _powersgd_step(replicas, xs)
    mean = torch.stack(xs).mean(dim=0)
    for out in outs:
        torch.testing.assert_close(out, mean, atol=1e-4, rtol=0)
        assert torch.equal(out, outs[0])  # every replica applies the same update
    assert sent == sum(replicas[0].bytes_per_round())
    # (6x4 at rank 4) + (3x8 at rank 3): P = 24 + 9 floats, Q = 16 + 24 + 5 + 1 floats.
    assert replicas[0].bytes_per_round() == (4 * 33, 4 * 46)


@pytest.mark.parametrize("seed", range(4))
def test_powersgd_of_low_rank_is_near_the_best_approximation(seed: int) -> None:
    """Against the truncated SVD of what this step compressed (x plus the carried error).

    The first step's random Q can be badly conditioned against the signal (up to ~4x the best
    error in these seeds); warm-started from the previous Q, one power iteration is enough."""
    g = torch.Generator().manual_seed(seed)
    rows, cols, rank = 60, 40, 3
    signal = torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g)
    x = (signal + 0.05 * torch.randn(rows, cols, generator=g)).reshape(-1)
    codec = PowerSGD([torch.Size([rows, cols])], rank=rank, seed=seed)
    for step in range(4):
        m = (x + codec.residual).view(rows, cols).double()
        (out,), _ = _powersgd_step([codec], [x])
        u, s, vh = torch.linalg.svd(m)
        best = torch.linalg.matrix_norm(m - (u[:, :rank] * s[:rank]) @ vh[:rank])
        got = torch.linalg.matrix_norm(m - out.view(rows, cols).double())
        assert best * (1 - 1e-5) <= got <= (10 if step == 0 else 1.05) * best


def test_powersgd_error_feedback_makes_the_running_sums_agree() -> None:
    shapes = [torch.Size([20, 16]), torch.Size([16])]
    n = 20 * 16 + 16
    replicas = [PowerSGD(shapes, rank=2, seed=7) for _ in range(3)]
    drift = _vector(n, seed=99)
    out_sum = torch.zeros(n, dtype=torch.float64)
    mean_sum = torch.zeros(n, dtype=torch.float64)
    gaps = []
    for t in range(60):
        xs = [drift + 0.5 * _vector(n, seed=1000 * t + i) for i in range(3)]
        outs, _ = _powersgd_step(replicas, xs)
        out_sum += outs[0].double()
        mean_sum += torch.stack(xs).double().mean(dim=0)
        # Telescoping: sum of outputs + mean of the replicas' errors = sum of means.
        errors = torch.stack([r.residual for r in replicas]).double().mean(dim=0)
        torch.testing.assert_close(out_sum + errors, mean_sum, atol=1e-3, rtol=1e-5)
        gaps.append(float((out_sum - mean_sum).norm() / mean_sum.norm()))
    # The error stays bounded while the sums grow: the relative gap shrinks like 1/T.
    assert gaps[-1] < 0.1 < gaps[0] and gaps[-1] < gaps[19] / 2


def test_powersgd_replicas_with_one_seed_agree_and_refuse_bad_rounds() -> None:
    a, b = PowerSGD(SHAPES, seed=3), PowerSGD(SHAPES, seed=3)
    x = _vector(a.n)
    assert torch.equal(a.start(x), b.start(x))
    assert not torch.equal(a.start(x), PowerSGD(SHAPES, seed=4).start(x))
    p = a.start(x)
    with pytest.raises(CodecError, match="elements"):
        a.middle(p[:-1])
    with pytest.raises(CodecError, match="NaN"):
        a.middle(torch.full_like(p, float("nan")))
    q = a.middle(p)
    with pytest.raises(CodecError, match="float32"):
        a.finish(q.double())
    with pytest.raises(RuntimeError, match="before middle"):
        b.finish(q)
    assert a.finish(q).shape == (a.n,)


def test_make_codec_builds_powersgd_from_the_shapes() -> None:
    codec = make_codec("powersgd:2", 24 + 5, shapes=SHAPES[:2], seed=1)
    assert isinstance(codec, PowerSGD) and codec.rank == 2
    with pytest.raises(ValueError, match="shapes"):
        make_codec("powersgd:4", 24)
    with pytest.raises(ValueError, match="hold 29 elements"):
        make_codec("powersgd:4", 30, shapes=SHAPES[:2])


# --- the documented table ---------------------------------------------------------------------


def test_the_module_docstring_table_of_wire_bytes_is_what_the_codecs_send() -> None:
    n = 1_000_000
    doc = compression.__doc__ or ""
    rows = re.findall(r"^ {4}(\S+)(?: \([^)]*\))?\s+([\d,]+)\s+([\d.]+)x$", doc, re.MULTILINE)
    assert len(rows) == 7
    x = _vector(n)
    for name, nbytes, ratio in rows:
        if name.startswith("powersgd"):
            codec = make_codec(name, n, shapes=[torch.Size([1000, 1000])])
            assert isinstance(codec, PowerSGD)
            got = sum(codec.bytes_per_round())
        else:
            got = wire_bytes(_codec(name, n).encode(x))
        assert got == int(nbytes.replace(",", "")), name
        assert f"{4 * n / got:.1f}" == ratio, name


@pytest.mark.parametrize("form", ["none", "bf16", "int8", "int8:64"])
def test_the_bytes_a_codec_moves_are_the_ones_the_cost_model_prices(form: str) -> None:
    """``dmsc.netmodel.codec_work`` prices a codec by the bytes its torch operations read and
    write: counted here operation by operation (``tests/bytes_moved.py``) as the runtime
    encodes and decodes, against its figures (int8's with its scales, a block's share)."""
    elements = 1 << 16
    codec, x = _codec(form, elements), _vector(elements)
    with BytesMoved() as enc:
        payload = codec.encode(x)
    with BytesMoved() as dec:
        codec.decode(payload, elements)
    c = parse_compress(form)
    # the header and the scalars read back are a few bytes, not an element's
    assert enc.per_element(elements) == pytest.approx(codec_work.encode_bytes(c), abs=0.01)
    assert dec.per_element(elements) == pytest.approx(codec_work.decode_bytes(c), abs=0.01)


def test_the_bytes_topk_moves_are_priced_but_for_its_kept_entries() -> None:
    """Top-k's price is its passes over the whole update; its work on the ``k`` kept entries
    and their candidates is left out (``dmsc.netmodel.codec_work``), counted here at under 70
    bytes a kept entry each way: under 0.7 an element at ``F = 0.01``. The narrowing's
    comparison and positions are numpy's, which a dispatch mode does not see: priced at ``5 + 2``
    (``dmsc.runtime.compute.top_select``), they are added to the count."""
    elements = 1 << 18
    codec, x = _codec("topk:0.01", elements), _vector(elements)
    codec.encode(x)  # the residual and the magnitudes' buffers are kept from the first step
    with BytesMoved() as enc:
        payload = codec.encode(x)
    with BytesMoved() as dec:
        aggregate = codec.decode(payload, elements)
    down = downlink_codec("topk:0.01", elements)
    with BytesMoved() as sparse_enc:
        answer = down.encode(aggregate)
    with BytesMoved() as sparse_dec:
        down.decode(answer, elements)
    k = codec.k
    numpy_passes = 5 + 2
    for moved, price in (
        (enc.bytes + numpy_passes * elements, codec_work.ENCODE["topk"]),
        (dec.bytes, codec_work.DECODE["topk"]),
        (sparse_enc.bytes, codec_work.SPARSE_ENCODE),
        (sparse_dec.bytes, codec_work.SPARSE_DECODE),
    ):
        assert 0 <= moved - price * elements < 70 * k


def test_the_bytes_powersgd_moves_are_the_ones_the_cost_model_prices() -> None:
    """One replica's three calls of a PowerSGD exchange, counted operation by operation
    (``tests/bytes_moved.py``), against ``dmsc.netmodel.codec_work.POWERSGD`` (the passes
    priced by the memory bandwidth) and ``POWERSGD_PRODUCT_BYTES`` (what its products move,
    priced by the host's measured product rate since 2026-12-04); the factors
    (``r (rows + cols)`` a matrix) are a few hundredths of it."""
    shapes = [torch.Size([1024, 1024]), torch.Size([1024])]
    elements = 1024 * 1024 + 1024
    codec = make_codec("powersgd:4", elements, shapes=shapes)
    assert isinstance(codec, PowerSGD)
    x = _vector(elements)
    with BytesMoved() as moved:
        codec.finish(codec.middle(codec.start(x)))
    total = codec_work.POWERSGD + codec_work.POWERSGD_PRODUCT_BYTES
    assert moved.per_element(elements) == pytest.approx(total, abs=0.5)
