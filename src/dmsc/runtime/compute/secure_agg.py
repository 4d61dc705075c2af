"""Secure aggregation of the replicas' update vectors: the leader learns their sum, not each one.

Pairwise masking after Bonawitz et al. (CCS 2017), without its Shamir-share recovery. Every replica
``i`` of ``R`` makes a fresh X25519 key pair for the session and sends its public key to the leader,
which broadcasts all ``R`` keys back in index order (:func:`keys_to_tensor`). Each pair ``i < j``
then shares a seed, HKDF-SHA256 over their X25519 secret, salted with the hash of the whole key list
and bound to both indices, ``R`` and a session context. For one round, party ``i`` encodes its
update in fixed point in the ring Z_2^32, adds the keystream of every pair seed with a higher index
and subtracts that of every lower one. Each pair's masks cancel in the sum, so the leader's
:func:`unmask_sum` gets the exact ring sum of the encodings while every single payload is uniform
noise on Z_2^32 to anyone without the pair seeds.

Ring. Values of Z_2^32 are held in int64 tensors, always reduced to ``0 .. 2^32-1``: sums of up to
2^31 of them cannot overflow int64, whereas int32 arithmetic in torch wraps only by accident (signed
overflow). :func:`ring_to_payload` packs a ring vector into int32 for the wire (half the bytes).
An update is encoded as ``round(x * 2^scale_bits)`` with ``scale_bits = 16`` by default, so the
quantisation error is at most ``2^-17`` per party. So that the sum of ``R`` encodings still decodes
as a signed number, each encoded value must satisfy ``|round(x * 2^s)| <= (2^31 - 1) // R``;
:func:`max_abs_value` gives that bound in float units (about 16384 / R at 16 bits). An update beyond
it is refused (``ValueError``) unless the caller asks for ``clip=True``; NaN and inf are always
refused, since one would poison everybody's sum.

PRG. A round's mask for a pair is the ChaCha20 keystream under a key derived (HKDF-Expand) from the
pair seed and the round label, read as little-endian uint32. ChaCha20 is a cryptographic stream
cipher, so the masks are computationally indistinguishable from uniform; a statistical generator
(PCG64) seeded from the pair seed would be fast too but carries no such guarantee. A party refuses
to mask twice under one round label and one key agreement: two updates under the same masks would
hand the leader their difference.

Dropouts: a round whose set of parties changed is redone. When a replica does not answer, the
survivors' payloads still hold their masks with the missing party, so their sum is noise.
Bonawitz et al. recover by having every party secret-share its seeds t-of-n (Shamir) in an extra
round up front, and the survivors reveal the dropped party's shares afterwards. We do not, because
(1) the shares cost an extra round and O(R^2) messages in every session, dropouts or not; (2) a
party that was only late is then exposed: its payload may still arrive after its masks were
reconstructed (Bonawitz's double masking exists only to close this); and (3) with the few sites of a
cross-datacenter run, redoing the round over the live set costs one more round trip only when
someone actually drops. :class:`SecureRound` tells the leader whether to aggregate, redo over the
live set (re-indexed; every survivor calls :meth:`MaskingParty.rejoin` on the live keys) or abort.

Threat model and limits. The guarantee is against a leader that follows the protocol but reads
everything it receives (honest but curious), and against eavesdroppers on the links. The leader is
a participant: with ``R = 2`` it learns the other update from the sum and its own, which is why
:class:`SecureRound` wants 3 parties unless told otherwise. A redo has a gap of its own: should the
late party's payload of the abandoned round still arrive, the abandoned round's full sum minus the
redo's sum is that party's update, so the leader must drop payloads of a superseded agreement
unopened (closing this for a curious leader takes Bonawitz's self-masks and one more round).
Nothing here defends against a malicious leader that lies about who answered.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from dmsc.runtime.compute.frames import finite

KEY_BYTES = 32
"""Length of an X25519 public key."""
RING_BITS = 32
RING = 1 << RING_BITS
DEFAULT_SCALE_BITS = 16

_RING_MASK = RING - 1
_HALF_RING = 1 << (RING_BITS - 1)
_PAIR_INFO = b"dmsc secure-agg pair seed v1\x00"
_ROUND_INFO = b"dmsc secure-agg round mask v1\x00"
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def max_abs_value(parties: int, scale_bits: int = DEFAULT_SCALE_BITS) -> float:
    """Largest |x| one of ``parties`` may contribute so that the ring sum decodes unambiguously."""
    return _limit(parties, scale_bits) / (1 << scale_bits)


def encode_fixed(
    x: torch.Tensor, parties: int, *, scale_bits: int = DEFAULT_SCALE_BITS, clip: bool = False
) -> torch.Tensor:
    """``x`` in fixed point in Z_2^32 (int64 on the CPU, values 0 .. 2^32-1).

    Raises ``ValueError`` for a non-finite value, and for one beyond :func:`max_abs_value` unless
    ``clip`` (then it is clamped to that bound).
    """
    _check_float_vector(x, "update")
    limit = _limit(parties, scale_bits)
    if not finite(x):
        x64 = x.detach().to("cpu", torch.float64)
        bad = ~torch.isfinite(x64)
        first = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"update holds {int(bad.sum())} NaN/inf values (first at index {first}, "
            f"{float(x64[first])}); they would corrupt every party's sum"
        )
    # a copy of its own (x may be float64 already), scaled and rounded in place
    scaled = x.detach().to("cpu", torch.float64, copy=True).mul_(1 << scale_bits).round_()
    if clip:
        scaled.clamp_(-limit, limit)
    elif scaled.numel():
        low, high = torch.aminmax(scaled)
        if max(-float(low), float(high)) > limit:
            index = int(scaled.abs().argmax())
            raise ValueError(
                f"update value {float(x[index])} at index {index} is beyond the bound "
                f"±{max_abs_value(parties, scale_bits)} for {parties} parties at {scale_bits} "
                "fraction bits (the sum would wrap around the ring); clip it or lower scale_bits"
            )
    return scaled.to(torch.int64).bitwise_and_(_RING_MASK)


def decode_fixed(
    sum_ring: torch.Tensor, parties: int, *, scale_bits: int = DEFAULT_SCALE_BITS
) -> torch.Tensor:
    """The signed float32 value of a ring sum of ``parties`` encodings (:func:`encode_fixed`)."""
    _check_ring(sum_ring, "ring sum")
    limit = _limit(parties, scale_bits)
    signed = _signed(sum_ring)
    # Only values within R of ±2^31 can exceed the bound: a cheap check, not a detector of masks
    # that failed to cancel (those decode as uniform noise).
    if signed.numel():
        low, high = torch.aminmax(signed)
        if max(-int(low), int(high)) > parties * limit:
            raise ValueError(f"ring sum is beyond what {parties} bounded encodings can add up to")
    # int32 to float32 rounds once to 24 bits, as float64 to float32 did after an exact float64
    # division; scaling by a power of two changes no bit of the mantissa
    return signed.to(torch.float32).mul_(1.0 / (1 << scale_bits))


def ring_to_payload(ring: torch.Tensor) -> torch.Tensor:
    """A ring vector as int32 (two's complement) for the wire."""
    _check_ring(ring, "ring vector")
    return _signed(ring)


def ring_from_payload(payload: torch.Tensor) -> torch.Tensor:
    """The ring vector (int64, 0 .. 2^32-1) of an int32 payload from :func:`ring_to_payload`."""
    if payload.dtype != torch.int32 or payload.dim() != 1:
        raise ValueError(f"payload must be a 1-D int32 tensor, got {payload.dtype} {payload.shape}")
    return payload.to("cpu", torch.int64).bitwise_and_(_RING_MASK)


def _signed(ring: torch.Tensor) -> torch.Tensor:
    """Ring values (int64, 0 .. 2^32-1) as their two's complement int32: the narrowing keeps
    the low 32 bits (modular conversion; ``tests/runtime/compute/test_secure_agg.py`` checks it
    against the subtraction of 2^32 from the upper half)."""
    return ring.to(torch.int32)


def unmask_sum(
    masked: Sequence[torch.Tensor], *, scale_bits: int = DEFAULT_SCALE_BITS
) -> torch.Tensor:
    """The leader's step: the float32 sum of the updates behind every party's masked payload.

    ``masked`` must hold exactly one payload per party of the agreement (in any order); with one
    missing the masks do not cancel, see :class:`SecureRound`.
    """
    if not masked:
        raise ValueError("no masked payloads to sum")
    length = masked[0].numel()
    total = torch.zeros(length, dtype=torch.int64)
    for n, payload in enumerate(masked):
        _check_ring(payload, f"masked payload {n}")
        if payload.numel() != length:
            raise ValueError(f"masked payload {n} has {payload.numel()} values, payload 0 {length}")
        total += payload.cpu()
    return decode_fixed(total.bitwise_and_(_RING_MASK), len(masked), scale_bits=scale_bits)


class MaskingParty:
    """One replica's side of secure aggregation: its key pair, its pair seeds and its masking.

    ``private_key`` is for tests and reproducible rehearsals; a run leaves it out so that every
    session gets a fresh key pair.
    """

    def __init__(
        self, index: int, parties: int, *, private_key: X25519PrivateKey | None = None
    ) -> None:
        if parties < 1:
            raise ValueError(f"parties must be >= 1, got {parties}")
        if not 0 <= index < parties:
            raise ValueError(f"index {index} is outside 0 .. {parties - 1}")
        self._index = index
        self._parties = parties
        self._key = private_key if private_key is not None else X25519PrivateKey.generate()
        self._public = self._key.public_key().public_bytes_raw()
        self._seeds: dict[int, bytes] | None = None
        self._used_labels: set[bytes] = set()

    @property
    def index(self) -> int:
        return self._index

    @property
    def parties(self) -> int:
        return self._parties

    def public_bytes(self) -> bytes:
        """This party's 32-byte X25519 public key, to send to the leader."""
        return self._public

    def agree(self, public_keys: Sequence[bytes], context: str = "") -> None:
        """Derive a seed with every other party from all ``R`` public keys in index order.

        ``context`` (e.g. the run and stage) is bound into every seed, so that keys reused by
        mistake in another run still give other masks. A new agreement forgets used round labels.
        """
        keys = [bytes(k) for k in public_keys]
        if len(keys) != self._parties:
            raise ValueError(f"expected {self._parties} public keys, got {len(keys)}")
        for n, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise ValueError(f"public key {n} is {len(key)} bytes, not {KEY_BYTES}")
        if keys[self._index] != self._public:
            raise ValueError(f"the key at index {self._index} is not this party's own public key")
        first_seen: dict[bytes, int] = {}
        for n, key in enumerate(keys):
            if key in first_seen:
                raise ValueError(f"public keys {first_seen[key]} and {n} are the same key")
            first_seen[key] = n
        # Salting with the whole key list ties every seed to this exact set of parties, so a redo
        # over the live set never reuses a pair's masks from the abandoned round.
        salt = hashlib.sha256(b"".join(keys)).digest()
        seeds: dict[int, bytes] = {}
        for j, key in enumerate(keys):
            if j == self._index:
                continue
            try:
                shared = self._key.exchange(X25519PublicKey.from_public_bytes(key))
            except ValueError as err:
                raise ValueError(f"public key {j} is not usable (low-order point): {err}") from err
            low, high = sorted((self._index, j))
            info = (
                _PAIR_INFO + context.encode() + b"\x00" + struct.pack(">III", low, high, len(keys))
            )
            seeds[j] = HKDF(hashes.SHA256(), 32, salt=salt, info=info).derive(shared)
        self._seeds = seeds
        self._used_labels = set()

    def rejoin(self, live_keys: Sequence[bytes], context: str = "") -> MaskingParty:
        """This party re-indexed in a redo over ``live_keys`` (the survivors' keys, in order).

        The key pair stays: the new key list salts new seeds, so no mask is repeated.
        """
        keys = [bytes(k) for k in live_keys]
        if keys.count(self._public) != 1:
            raise ValueError("this party's public key is not (exactly once) among the live keys")
        party = MaskingParty(keys.index(self._public), len(keys), private_key=self._key)
        party.agree(keys, context)
        return party

    def mask(
        self,
        x: torch.Tensor,
        round_label: int | str,
        *,
        scale_bits: int = DEFAULT_SCALE_BITS,
        clip: bool = False,
    ) -> torch.Tensor:
        """``x`` encoded and masked for round ``round_label``: the int64 ring payload to send."""
        if self._seeds is None:
            raise ValueError("agree() on the parties' public keys must come before mask()")
        label = _label_bytes(round_label)
        if label in self._used_labels:
            raise ValueError(
                f"round label {round_label!r} was already used under this key agreement; "
                "masking a second update with the same masks reveals their difference"
            )
        payload = encode_fixed(x, self._parties, scale_bits=scale_bits, clip=clip)
        self._used_labels.add(label)
        for j, seed in self._seeds.items():
            stream = keystream(
                HKDFExpand(hashes.SHA256(), 32, _ROUND_INFO + label).derive(seed), payload.numel()
            )
            if j > self._index:
                payload += stream
            else:
                payload -= stream
        return payload.bitwise_and_(_RING_MASK)


def keys_to_tensor(keys: Sequence[bytes]) -> torch.Tensor:
    """Public keys as one uint8 tensor of ``len(keys) * 32`` bytes, for a message."""
    if not keys:
        raise ValueError("no public keys to pack")
    for n, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            raise ValueError(f"public key {n} is {len(key)} bytes, not {KEY_BYTES}")
    return torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8)


def keys_from_tensor(payload: torch.Tensor, parties: int | None = None) -> list[bytes]:
    """The public keys packed by :func:`keys_to_tensor`; ``parties``, when given, is checked."""
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(
            f"a key payload is a 1-D uint8 tensor, got {payload.dtype} {payload.shape}"
        )
    size = payload.numel()
    if size == 0 or size % KEY_BYTES:
        raise ValueError(f"a key payload of {size} bytes is not a whole number of 32-byte keys")
    if parties is not None and size != parties * KEY_BYTES:
        raise ValueError(f"expected {parties} keys ({parties * KEY_BYTES} bytes), got {size} bytes")
    raw = payload.cpu().numpy().tobytes()
    return [raw[k : k + KEY_BYTES] for k in range(0, size, KEY_BYTES)]


Action = Literal["aggregate", "redo", "abort"]


@dataclass(frozen=True)
class RoundDecision:
    """What the leader does with a round once the answers are in."""

    action: Action
    members: tuple[int, ...]
    """Who takes part next, in (new) index order: everyone for ``aggregate``, the survivors for
    ``redo``, those who answered for ``abort``."""
    public_keys: tuple[bytes, ...]
    """Their public keys, in the same order: broadcast them (``keys_to_tensor``) for a redo."""
    reason: str


@dataclass(frozen=True)
class SecureRound:
    """The leader's record of one masked aggregation: its members and their keys, in index order.

    ``members`` are the callers' ids (e.g. replica ranks). ``min_parties`` is 3 by default
    because the leader takes part: with 2, it learns the other update from the sum and its own.
    """

    members: tuple[int, ...]
    public_keys: tuple[bytes, ...]
    min_parties: int = 3

    def __post_init__(self) -> None:
        if self.min_parties < 2:
            raise ValueError(
                f"min_parties must be >= 2 (one party's sum is its update), got {self.min_parties}"
            )
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"members repeat: {self.members}")
        if len(self.public_keys) != len(self.members):
            raise ValueError(f"{len(self.members)} members but {len(self.public_keys)} public keys")
        if any(len(key) != KEY_BYTES for key in self.public_keys):
            raise ValueError(f"every public key must be {KEY_BYTES} bytes")
        if len(self.members) < self.min_parties:
            raise ValueError(f"{len(self.members)} members is below min_parties={self.min_parties}")

    def decide(self, answered: Collection[int]) -> RoundDecision:
        """Aggregate if every member answered, else redo over the live set (or abort if too few)."""
        unknown = set(answered) - set(self.members)
        if unknown:
            raise ValueError(f"answers from non-members {sorted(unknown)}")
        live = tuple(m for m in self.members if m in answered)
        keys = tuple(
            k for m, k in zip(self.members, self.public_keys, strict=True) if m in answered
        )
        if len(live) == len(self.members):
            return RoundDecision("aggregate", live, keys, "every member answered")
        missing = sorted(set(self.members) - set(live))
        if len(live) < self.min_parties:
            return RoundDecision(
                "abort",
                live,
                keys,
                f"members {missing} did not answer and {len(live)} left is below "
                f"min_parties={self.min_parties}",
            )
        return RoundDecision(
            "redo",
            live,
            keys,
            f"members {missing} did not answer: their masks do not cancel; redo over {live}",
        )

    def next_round(self, decision: RoundDecision) -> SecureRound:
        """The round that redoes this one over the survivors of ``decision``."""
        if decision.action != "redo":
            raise ValueError(f"only a redo has a next round, this decision is {decision.action!r}")
        return SecureRound(decision.members, decision.public_keys, self.min_parties)


def keystream(key: bytes, count: int) -> torch.Tensor:
    """``count`` uniform values of Z_2^32 (int64) from the ChaCha20 keystream under ``key``.

    A zero nonce is safe: every key is used for one stream only (fresh per pair and round label).
    """
    encryptor = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    raw = encryptor.update(bytes(4 * count))
    return torch.from_numpy(np.frombuffer(raw, dtype="<u4").astype(np.int64))


def _label_bytes(label: int | str) -> bytes:
    # Typed so that round 1 and round "1" get different masks.
    if isinstance(label, bool) or not isinstance(label, int | str):
        raise ValueError(f"a round label is an int or a str, got {type(label).__name__}")
    return (b"i:" if isinstance(label, int) else b"s:") + str(label).encode()


def _limit(parties: int, scale_bits: int) -> int:
    if not 1 <= parties < _HALF_RING:
        raise ValueError(f"parties must be in 1 .. 2^31-1, got {parties}")
    if not 0 <= scale_bits <= 30:
        raise ValueError(f"scale_bits must be in 0 .. 30, got {scale_bits}")
    return (_HALF_RING - 1) // parties


def _check_float_vector(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{what} must be a 1-D floating tensor, got {getattr(x, 'dtype', type(x))} "
            f"{tuple(getattr(x, 'shape', ()))}"
        )


def _check_ring(ring: torch.Tensor, what: str) -> None:
    if not isinstance(ring, torch.Tensor) or ring.dtype != torch.int64 or ring.dim() != 1:
        raise ValueError(f"{what} must be a 1-D int64 tensor of ring values")
    if ring.numel():
        low, high = torch.aminmax(ring)
        if int(low) < 0 or int(high) >= RING:
            raise ValueError(f"{what} holds values outside 0 .. 2^32-1")
