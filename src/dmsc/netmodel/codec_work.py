"""What a codec's own compute costs in one data-parallel exchange, besides the bytes it saves.

A codec shrinks what crosses the wire (:mod:`dmsc.netmodel.sync`) at the price of passes over
the update on each side: the runtime's codecs (:mod:`dmsc.runtime.compute.compression`) are
torch operations bound by memory bandwidth, priced like the leader's rules
(:mod:`dmsc.netmodel.leader_work`): the bytes they read and write over the device's memory
bandwidth at the calibration's efficiency. Bytes an element of the fp32 update, counted from the
runtime's code (each operation reading its inputs and writing its output once):

- ``none`` through the leader, encode ``12`` (the finite check's sum, a copy), decode ``12``;
  by collective nothing (the update goes as it is);
- ``bf16``: encode ``10`` (the check, the cast), decode ``10`` (the cast, the check); by
  collective the cast down and back up around gloo's bfloat16 all-reduce, ``12``;
- ``int8``: encode ``59`` (the check; the padded copy, the absolute values, their block maxima,
  the division, the rounding and clamping, the cast to int8, the payload's concatenation),
  decode ``39`` (the values' copy and widening, the padded copy, the scaling, the cut, the
  check).

Through the leader (a star) the path a replica waits on is its encode, the leader's decode of
all ``n`` updates, the leader's encode of the answer and the replica's decode of it (the rule's
own passes between are :mod:`.leader_work`'s). By collective, ``int8`` is a ring that
re-quantises at every hop (:mod:`dmsc.runtime.compute.int8_ring`): each member, on chunks of
``E / n``, encodes, decodes and adds (``12``) at each of the ``n - 1`` reduce-scatter hops,
encodes and decodes its own sum once, and decodes each of the ``n - 1`` chunks it is handed
into place (``8`` more each).

Not priced: ``topk`` (its selection and scatter) and PowerSGD (its products and
orthogonalisation), whose work is compute, not memory, bound.
"""

from __future__ import annotations

from dmsc.spec.sync_forms import Compression

ENCODE = {"none": 12.0, "bf16": 10.0, "int8": 59.0}
DECODE = {"none": 12.0, "bf16": 10.0, "int8": 39.0}
ADD, PLACE = 12.0, 8.0  # a chunk added to a partial sum; a decoded chunk copied into place
CAST_AROUND_BF16 = 12.0  # fp32 -> bf16 before gloo's all-reduce, bf16 -> fp32 after


def bytes_per_element(c: Compression, via: str, n: int) -> float:
    """Bytes the codec ``c`` reads and writes per element of the update on the path a replica
    waits on, in one exchange among ``n`` replicas ``via`` the collective or the leader
    (module docstring); 0 for one replica and for the codecs not priced."""
    if n < 2 or c.kind not in ENCODE:
        return 0.0
    enc, dec = ENCODE[c.kind], DECODE[c.kind]
    if via == "leader":
        return enc + n * dec + enc + dec
    if c.kind == "bf16":
        return CAST_AROUND_BF16
    if c.kind == "int8":
        hops = n - 1
        return (hops * (enc + dec + ADD) + enc + dec + hops * (dec + PLACE)) / n
    return 0.0


def codec_work_s(c: Compression, via: str, n: int, elements: float, memory_bytes_s: float) -> float:
    """Seconds of the codec's passes on ``elements`` fp32 elements an update at a memory
    bandwidth of ``memory_bytes_s`` (already times the calibration's efficiency)."""
    if memory_bytes_s <= 0:
        raise ValueError(f"memory bandwidth must be > 0 bytes/s, got {memory_bytes_s}")
    return elements * bytes_per_element(c, via, n) / memory_bytes_s
