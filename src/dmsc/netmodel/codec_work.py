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
- ``int8``: encode ``33`` (the check ``4``; each block's maximum and minimum, ``8``; the
  division ``8``; the rounding in place ``8``; the cast to int8 into the payload ``5``),
  decode ``17`` (the values widened ``5``, scaled in place ``8``, checked ``4``); and on each
  block's float32 scale, ``92`` more to encode (its extremes, the absolute maximum, the
  division by 127, the zero and subnormal tests and the safe divisor, its read by the
  division, its copy into the payload) and ``22`` to decode (its copy, check and read): a
  ``BLOCK``-th of that an element. Until 2026-12-04 the codec moved ``59`` and ``39``
  (a padded copy, the absolute values written, a clamp, a concatenation, a copy and a cut);
  leaving them out made it 1.8-3.7x faster to encode and 3.1-7.9x to decode on this
  project's CPU (``benchmarks/results/codec_work_cpu.json``), the same payload bit for bit. A
  block's maximum is its maximum and negated minimum (two reductions reading it; ``abs().amax()``
  also wrote the absolute values). A subnormal scale (below the least normal float) loses the
  bound that makes the clamp needless, and such a block is clamped.

Through the leader (a star) the path a replica waits on is its encode, the leader's decode of
all ``n`` updates, the leader's encode of the answer and the replica's decode of it (the rule's
own passes between are :mod:`.leader_work`'s). By collective, ``int8`` is a ring that
re-quantises at every hop (:mod:`dmsc.runtime.compute.int8_ring`): each member, on chunks of
``E / n``, encodes, decodes and adds (``12``) at each of the ``n - 1`` reduce-scatter hops,
encodes and decodes its own sum once, and decodes each of the ``n - 1`` chunks it is handed
into place (``8`` more each).

``topk:F`` encodes in ``31`` (the check; the residual added, ``12``; the magnitudes, ``8``;
their comparison with the sampled threshold, ``5``; the candidates' positions, read twice,
``2``: :mod:`dmsc.runtime.compute.top_select`, whose narrowed selection is passes over memory
where ``torch.topk`` over everything was 12-23 ns an element on this project's CPU); a payload
decodes into a zeroed vector (``4``). The leader's answer goes back ``sparse``: encoded in
``12`` (the check, the nonzero entries found: read twice), decoded in ``4``. By collective (an
all-gather) each member decodes every member's payload and averages them itself (the mean's
``12n + 4``, :mod:`.leader_work`). The work on the kept entries and the candidates (the
partial sort among about ``1.5 k`` candidates, the gathers, the payload's packing and
checks) is left out: ``k`` is at most a tenth of the update.

PowerSGD (rank ``r``) costs every replica, through the leader or not, ``16`` an element of
memory passes (the error added, ``12``, after the check's ``4``) and its four products with the
update's matrices (``P = M Q``, ``Q_i = M^T P_hat``, the answer ``P_hat Q^T`` written in place,
the error ``M - P_hat Q_i^T``), ``2 r`` FLOPs an element each, at the host's measured rate
(``lowrank_s`` an element at rank :data:`~dmsc.netmodel.constants.LOWRANK_RANK`, ``r / 4``
times it above: :func:`lowrank_s`; ``dmsc calibrate`` measures it, with each matrix's QR). Until
2026-12-04 the products were priced as memory passes alone (``20`` bytes an element: ``M`` read
twice, the answer written, the error read and written); at rank 4 they run at about twice a
memory pass, and the exchange measured 1.8-2.0 times its price (``benchmarks/codec_work.py``).
Left out: the kernels' launch overheads (about a dozen a matrix).

Central differential privacy's clip and noise and secure aggregation's masks are priced in
:mod:`.leader_work`.

Around the exchange, on the same path (:func:`around_bytes`, priced since 2026-12-04; a
``dp2-int8`` run measured 1.6-3.0 times its prediction before): an exchange with a codec or
through the leader is one call on the whole update, so every step's gradients are flattened
into one vector (``torch.cat``, ``8``); through the leader the answer is copied back into them
(``8``), by collective they become views of it (the answer is the replica's own vector, as
DDP's ``gradient_as_bucket_view``: nothing); a round forms its pseudo-gradient instead (the
parameters flattened, ``8``, and subtracted from the anchor, ``12``). By collective, the int8
ring sums into the flattened update itself and divides it by the members in place (``8``);
bf16's all-reduce sums into a copy in bfloat16 and divides it (``8``). Until 2026-12-05 the
int8 ring summed into a copy (``16``) and every step's answer was copied back (``8``): in a
``dp2-int8`` worker of gpt-mini the copy took 0.33 ms and the 53 gradients' copies 0.65 ms a
step, of an exposed exchange of 8.2 ms. Gradients that travel as they are by collective (no
codec) are left out: as the published systems, those are priced as NCCL runs them on the
devices (:mod:`dmsc.netmodel.sync`).
"""

from __future__ import annotations

from dmsc.netmodel.constants import LOWRANK_RANK, DeviceCalibration
from dmsc.netmodel.leader_work import bytes_per_element as rule_bytes
from dmsc.spec.sync_forms import Compression

ENCODE = {"none": 12.0, "bf16": 10.0, "int8": 33.0, "topk": 31.0}
DECODE = {"none": 12.0, "bf16": 10.0, "int8": 17.0, "topk": 4.0}
INT8_SCALE_ENCODE, INT8_SCALE_DECODE = 92.0, 22.0  # bytes a block's scale costs each way
SPARSE_ENCODE, SPARSE_DECODE = 12.0, 4.0  # the leader's answer to top-k payloads
POWERSGD = 16.0  # a replica's passes in one exchange besides its products (:func:`lowrank_s`)
# the bytes PowerSGD's products read and write an element (M twice, the answer, the error's M
# and its write): priced by the host's measured product rate, which moves them, not by these
POWERSGD_PRODUCT_BYTES = 20.0
ADD, PLACE = 12.0, 8.0  # a chunk added to a partial sum; a decoded chunk copied into place
CAST_AROUND_BF16 = 12.0  # fp32 -> bf16 before gloo's all-reduce, bf16 -> fp32 after
FLATTEN = 8.0  # every step's gradients into one vector (by collective: the answer's views)
FLATTEN_ASSIGN = 16.0  # the same and, through the leader, the answer copied back into them
ROUND_DELTA = 20.0  # a round's pseudo-gradient: the parameters flattened, less the anchor
OWN_SUM = 8.0  # by collective: the int8 ring's sum (the update itself) divided in place
BF16_SUM = 8.0  # by collective: bf16's update copied to be summed, divided after (bfloat16)


def encode_bytes(c: Compression) -> float:
    """Bytes an element one encoding by the codec ``c`` (not PowerSGD) reads and writes."""
    scales = INT8_SCALE_ENCODE / c.block if c.kind == "int8" else 0.0
    return ENCODE[c.kind] + scales


def decode_bytes(c: Compression) -> float:
    """Bytes an element one decoding of a payload of the codec ``c`` reads and writes."""
    scales = INT8_SCALE_DECODE / c.block if c.kind == "int8" else 0.0
    return DECODE[c.kind] + scales


def bytes_per_element(c: Compression, via: str, n: int) -> float:
    """Bytes the codec ``c`` reads and writes per element of the update on the path a replica
    waits on, in one exchange among ``n`` replicas ``via`` the collective or the leader
    (module docstring); 0 for one replica."""
    if n < 2:
        return 0.0
    if c.kind == "powersgd":
        return POWERSGD
    enc, dec = encode_bytes(c), decode_bytes(c)
    if via == "leader":
        if c.kind == "topk":
            return enc + n * dec + SPARSE_ENCODE + SPARSE_DECODE
        return enc + n * dec + enc + dec
    if c.kind == "bf16":
        return CAST_AROUND_BF16
    if c.kind == "int8":
        hops = n - 1
        return (hops * (enc + dec + ADD) + enc + dec + hops * (dec + PLACE)) / n
    if c.kind == "topk":  # gathered, then decoded and averaged by every member
        return enc + n * dec + rule_bytes("mean", n)
    return 0.0


def leader_bytes_per_element(c: Compression, via: str, n: int) -> float:
    """Of :func:`bytes_per_element`, the bytes the leader reads and writes alone, the followers
    waiting for its answer: its decoding of the ``n`` updates and its encoding of the answer
    (through the leader, not PowerSGD's; 0 otherwise)."""
    if n < 2 or via != "leader" or c.kind == "powersgd":
        return 0.0
    answer = SPARSE_ENCODE if c.kind == "topk" else encode_bytes(c)
    return n * decode_bytes(c) + answer


def around_bytes(c: Compression, via: str, n: int, rounds: bool) -> float:
    """Bytes an element of the runtime's passes around one exchange with the codec ``c``
    ``via`` the collective or the leader among ``n`` replicas (module docstring): every step's
    (``rounds`` False) or a round's; 0 for one replica and for gradients that travel as they
    are by collective."""
    if n < 2 or (c.kind == "none" and via == "collective"):
        return 0.0
    every_step = FLATTEN if via == "collective" else FLATTEN_ASSIGN
    out = ROUND_DELTA if rounds else every_step
    if via == "collective" and c.kind == "int8":
        out += OWN_SUM
    elif via == "collective" and c.kind == "bf16":
        out += BF16_SUM
    return out


def lowrank_s(c: Compression, per_element_s: float = DeviceCalibration.lowrank_s) -> float:
    """Seconds an element of PowerSGD's products at ``c``'s rank, from the host's
    ``per_element_s`` at :data:`~dmsc.netmodel.constants.LOWRANK_RANK` (their FLOPs grow with
    the rank; below it, the same passes over the matrix bound them); 0 for other codecs."""
    if c.kind != "powersgd":
        return 0.0
    return per_element_s * max(1.0, c.rank / LOWRANK_RANK)


def codec_work_s(
    c: Compression,
    via: str,
    n: int,
    elements: float,
    memory_bytes_s: float,
    lowrank_per_element_s: float = DeviceCalibration.lowrank_s,
) -> float:
    """Seconds of the codec's passes on ``elements`` fp32 elements an update at a memory
    bandwidth of ``memory_bytes_s`` (already times the calibration's efficiency), and of
    PowerSGD's products at the host's ``lowrank_per_element_s`` (:func:`lowrank_s`)."""
    if memory_bytes_s <= 0:
        raise ValueError(f"memory bandwidth must be > 0 bytes/s, got {memory_bytes_s}")
    if n < 2:
        return 0.0
    products = elements * lowrank_s(c, lowrank_per_element_s)
    return elements * bytes_per_element(c, via, n) / memory_bytes_s + products
