"""Secure aggregation checked against the plain float sum and against uniform noise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bytes_moved import BytesMoved
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from scipy import stats

from dmsc.runtime.compute.secure_agg import (
    RING,
    MaskingParty,
    SecureRound,
    decode_fixed,
    encode_fixed,
    keys_from_tensor,
    keys_to_tensor,
    max_abs_value,
    ring_from_payload,
    ring_to_payload,
    unmask_sum,
)


def _parties(count: int, seed: int = 0) -> list[MaskingParty]:
    """Parties with fixed keys (so that statistical tests do not flake) that have agreed."""
    rng = np.random.default_rng(seed)
    parties = [
        MaskingParty(i, count, private_key=X25519PrivateKey.from_private_bytes(rng.bytes(32)))
        for i in range(count)
    ]
    keys = [p.public_bytes() for p in parties]
    for p in parties:
        p.agree(keys, context="test")
    return parties


@pytest.mark.parametrize("count", [2, 3, 5])
def test_unmasked_sum_is_the_float_sum_to_fixed_point_precision(count: int) -> None:
    rng = np.random.default_rng(count)
    updates = [rng.normal(0.0, 10.0, 10_000).astype(np.float32) for _ in range(count)]
    parties = _parties(count, seed=count)
    masked = [
        p.mask(torch.from_numpy(u), round_label=7) for p, u in zip(parties, updates, strict=True)
    ]
    total = unmask_sum(masked[::-1])  # the leader's order does not matter
    reference = np.sum(np.stack(updates).astype(np.float64), axis=0)
    # each party rounds to 2^-16 (error <= 2^-17), and the result is rounded once more to float32
    np.testing.assert_allclose(total.numpy(), reference, rtol=0, atol=(count + 1) * 2.0**-17)
    assert total.dtype == torch.float32


def test_the_masks_sum_to_zero_mod_2_to_the_32() -> None:
    parties = _parties(4)
    masks = [p.mask(torch.zeros(50_000), round_label="r0") for p in parties]
    assert all(int((m != 0).sum()) > 49_000 for m in masks)  # each mask alone is not zero
    assert not int((torch.stack(masks).sum(0) % RING).abs().sum())


def test_a_masked_update_looks_uniform_on_the_ring_and_uncorrelated_with_the_update() -> None:
    n = 100_000
    x = torch.from_numpy(np.random.default_rng(1).normal(0.0, 1.0, n).astype(np.float32))
    encoded = encode_fixed(x, 3).numpy().astype(np.float64)
    masked = _parties(3, seed=2)[1].mask(x, round_label=0).numpy().astype(np.float64)
    assert stats.kstest(masked / RING, "uniform").pvalue > 1e-3
    assert abs(np.corrcoef(masked, encoded)[0, 1]) < 0.02  # 1/sqrt(n) ~ 0.003
    assert abs(np.corrcoef(masked, x.numpy())[0, 1]) < 0.02
    # the same test sees through the bare encoding: it sits near 0 and near 2^32
    assert stats.kstest(encoded / RING, "uniform").pvalue < 1e-10


def test_masks_are_fresh_per_round_label_and_a_label_is_used_once() -> None:
    party = _parties(3)[0]
    zeros = torch.zeros(10_000)
    one, two, one_text = (party.mask(zeros, label) for label in (1, 2, "1"))
    assert float((one == two).float().mean()) < 1e-3
    assert float((one == one_text).float().mean()) < 1e-3
    with pytest.raises(ValueError, match="already used"):
        party.mask(zeros, 1)


def test_a_party_refuses_bad_key_lists() -> None:
    parties = _parties(3)
    keys = [p.public_bytes() for p in parties]
    party = MaskingParty(1, 3)
    own = party.public_bytes()
    with pytest.raises(ValueError, match="not this party's own"):
        party.agree(keys)  # someone else's key at index 1
    with pytest.raises(ValueError, match="same key"):
        party.agree([own, own, keys[2]])
    with pytest.raises(ValueError, match="31 bytes"):
        party.agree([keys[0][:31], own, keys[2]])
    with pytest.raises(ValueError, match="expected 3"):
        party.agree([keys[0], own])
    with pytest.raises(ValueError, match="low-order"):
        party.agree([bytes(32), own, keys[2]])
    with pytest.raises(ValueError, match="agree"):
        party.mask(torch.zeros(3), 0)
    with pytest.raises(ValueError, match="outside"):
        MaskingParty(3, 3)


def test_a_dropped_party_means_a_redo_over_the_live_set_that_gives_the_survivors_sum() -> None:
    rng = np.random.default_rng(5)
    parties = _parties(4, seed=5)
    updates = [torch.from_numpy(rng.normal(0.0, 1.0, 2_000).astype(np.float32)) for _ in range(4)]
    round_ = SecureRound((0, 1, 2, 3), tuple(p.public_bytes() for p in parties))
    masked = {i: parties[i].mask(updates[i], "step-9") for i in (0, 1, 3)}  # party 2 is silent
    survivors_sum = (updates[0] + updates[1] + updates[3]).double()
    # the abandoned round's payloads still carry masks with party 2: their sum is noise
    assert float((unmask_sum(list(masked.values())).double() - survivors_sum).abs().max()) > 1e3

    decision = round_.decide(masked.keys())
    assert decision.action == "redo" and decision.members == (0, 1, 3)
    redo = round_.next_round(decision)
    live_keys = keys_from_tensor(keys_to_tensor(decision.public_keys), parties=3)
    rejoined = {i: parties[i].rejoin(live_keys, context="test") for i in decision.members}
    assert [rejoined[i].index for i in decision.members] == [0, 1, 2]
    payloads = [rejoined[i].mask(updates[i], "step-9") for i in decision.members]
    assert redo.decide(decision.members).action == "aggregate"
    total = unmask_sum(payloads)
    np.testing.assert_allclose(total.double().numpy(), survivors_sum.numpy(), atol=4 * 2.0**-17)


def test_a_round_with_too_few_survivors_is_aborted_and_strangers_are_refused() -> None:
    keys = tuple(p.public_bytes() for p in _parties(3))
    round_ = SecureRound((10, 11, 12), keys)
    assert round_.decide({10, 11, 12}).action == "aggregate"
    abort = round_.decide({10, 12})
    assert abort.action == "abort" and "min_parties" in abort.reason
    assert SecureRound((10, 11, 12), keys, min_parties=2).decide({10, 12}).action == "redo"
    with pytest.raises(ValueError, match="non-members"):
        round_.decide({10, 13})
    with pytest.raises(ValueError, match="only a redo"):
        round_.next_round(abort)
    with pytest.raises(ValueError, match="below min_parties"):
        SecureRound((10, 11), keys[:2])


@pytest.mark.parametrize(
    ("value", "reason"),
    [(float("nan"), "NaN/inf"), (float("inf"), "NaN/inf"), (1e6, "beyond the bound")],
)
def test_hostile_updates_are_refused_with_a_reason(value: float, reason: str) -> None:
    party = _parties(3)[2]
    x = torch.zeros(8)
    x[5] = value
    with pytest.raises(ValueError, match=reason):
        party.mask(x, 0)
    with pytest.raises(ValueError, match="1-D floating"):
        party.mask(torch.zeros(2, 2), 1)
    with pytest.raises(ValueError, match="1-D floating"):
        party.mask(torch.zeros(4, dtype=torch.int64), 2)


def test_the_bound_is_what_the_ring_holds_and_clip_clamps_to_it() -> None:
    for count in (2, 3, 5):
        bound = max_abs_value(count)
        assert count * bound * 2**16 < 2**31
        x = torch.tensor([bound, -bound, 2 * bound, -1e9], dtype=torch.float64)
        clipped = decode_fixed(encode_fixed(x, count, clip=True), 1)
        assert torch.equal(clipped, torch.tensor([bound, -bound, bound, -bound]).float())
        # the worst case, every party at the bound, still decodes with the right sign
        worst = encode_fixed(torch.tensor([-bound], dtype=torch.float64), count) * count
        assert float(decode_fixed(worst % RING, count)) == pytest.approx(-count * bound)


def test_encoding_matches_python_integer_arithmetic() -> None:
    values = [0.0, 1.0, -1.0, 2.0**-17 * 3, -(2.0**-17) * 3, 1234.5678, -0.1]
    encoded = encode_fixed(torch.tensor(values, dtype=torch.float64), 2).tolist()
    assert encoded == [round(v * 2**16) % 2**32 for v in values]


def test_ring_payloads_and_key_payloads_round_trip_and_reject_bad_shapes() -> None:
    ring = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1], dtype=torch.int64)
    payload = ring_to_payload(ring)
    assert payload.dtype == torch.int32 and torch.equal(ring_from_payload(payload), ring)
    keys = [p.public_bytes() for p in _parties(3)]
    packed = keys_to_tensor(keys)
    assert packed.dtype == torch.uint8 and packed.numel() == 96
    assert keys_from_tensor(packed) == keys == keys_from_tensor(packed, parties=3)
    assert keys_from_tensor(keys_to_tensor(keys[:1]), parties=1) == keys[:1]
    with pytest.raises(ValueError, match="whole number"):
        keys_from_tensor(packed[:95])
    with pytest.raises(ValueError, match="expected 2"):
        keys_from_tensor(packed, parties=2)
    with pytest.raises(ValueError, match="uint8"):
        keys_from_tensor(packed.to(torch.int32))
    with pytest.raises(ValueError, match="outside"):
        unmask_sum([torch.tensor([RING], dtype=torch.int64)])
    with pytest.raises(ValueError, match="values, payload 0"):
        unmask_sum([ring, ring[:2]])


def test_the_wire_form_and_the_decoding_are_the_signed_ring_values() -> None:
    """The narrowing to int32 is the two's complement of a ring value, and the decoding its
    float32, checked against Python's integers: 2^32 taken from the upper half, the quotient by
    2^16 in float64 rounded once to float32 (what both did before 2026-12-04, in 62 and 134
    bytes an element, where they now move 20 and 40)."""
    rng = np.random.default_rng(7)
    edges = [0, 1, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, RING - 1]
    values = np.concatenate([edges, rng.integers(0, RING, 4096)]).astype(np.int64)
    signed = np.where(values >= 1 << 31, values - RING, values)
    ring = torch.from_numpy(values)
    assert ring_to_payload(ring).numpy().tolist() == signed.tolist()
    # values a sum of 3 bounded encodings can reach: |x| <= 3 * ((2^31 - 1) // 3)
    small = signed[np.abs(signed) <= 3 * ((2**31 - 1) // 3)]
    decoded = decode_fixed(torch.from_numpy(small % RING), 3)
    assert decoded.numpy().tolist() == (small / 65536.0).astype(np.float32).tolist()


def test_an_update_in_float64_is_not_changed_by_its_encoding() -> None:
    """The encoding scales and rounds a copy in place: a float64 update is its own dtype
    already, and ``to`` without a copy would have handed it back to be overwritten."""
    x = torch.linspace(-0.5, 0.5, 101, dtype=torch.float64)
    before = x.clone()
    encode_fixed(x, 3)
    assert torch.equal(x, before)


@pytest.mark.parametrize("count", [3, 5, 8])
def test_the_bytes_the_runtime_moves_are_the_ones_the_cost_model_prices(count: int) -> None:
    """``dmsc.netmodel.leader_work`` prices secure aggregation by the bytes its torch operations
    read and write: here every operation the runtime's masking and unmasking dispatch is
    counted (``tests/bytes_moved.py``) against the cost model's figures. The keystreams (numpy,
    OpenSSL) are priced apart."""
    from dmsc.netmodel import leader_work as lw

    elements = 1 << 14
    parties = _parties(count)
    x = torch.randn(elements, generator=torch.Generator().manual_seed(count)) * 0.01
    with BytesMoved() as replica:
        ring_to_payload(parties[1].mask(x, "counted"))
    payloads = [ring_to_payload(p.mask(x, "summed")) for p in parties]
    with BytesMoved() as leader:
        unmask_sum([ring_from_payload(q) for q in payloads]) / count
    # scalars read back (the checks' extremes and sum) are a few bytes, not an element's
    assert replica.bytes / elements == pytest.approx(
        lw.MASK_ENCODE + lw.MASK_PAIR * (count - 1) + lw.MASK_PAYLOAD, abs=0.05
    )
    assert leader.bytes / elements == pytest.approx(
        lw.UNMASK_PARTY * count + lw.UNMASK_SUM, abs=0.05
    )
    assert lw.secure_bytes_per_element(count) * elements == pytest.approx(
        replica.bytes + leader.bytes, rel=1e-4
    )
