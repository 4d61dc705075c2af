"""The int8 all-reduce the cost model prices for ``--compress int8[:BLOCK]``
(:mod:`dmsc.netmodel.sync`): a ring whose every hop carries int8 values with one float32 scale
per block, re-quantised where partial sums are added.

The vector is cut into one chunk per member on block boundaries (a block's scale belongs to
one chunk). The reduce-scatter sends a chunk to the next member as the int8 codec encodes it
(:mod:`.compression`), and the next member decodes it and adds its own part; after ``n - 1``
hops each member holds one chunk's sum, which it encodes once more and takes decoded itself;
the all-gather hands those encoded sums round unchanged. Every member ends with the same
values, and each sends ``2 (n - 1)`` chunks of about ``1 + 4 / BLOCK`` bytes an element: the
ring's bytes at the codec's size. gloo has no such collective (its all-reduce sums what it was
given, in the tensor's own type), so it is point-to-point ``send``/``recv`` on the group, as the
tree of :mod:`.allreduce`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dmsc.runtime.compute.compression import Codec, PowerSGD, int8_payload_bytes, make_codec


def chunks_of(numel: int, parts: int, block: int) -> list[tuple[int, int]]:
    """(offset, length) of ``parts`` chunks of ``numel`` elements on block boundaries: the
    blocks shared out as evenly as they go (the first chunks one block more), the last block
    short where ``block`` does not divide ``numel``; a chunk may be empty."""
    blocks = math.ceil(numel / block)
    base, extra = divmod(blocks, parts)
    out, start = [], 0
    for i in range(parts):
        count = base + (1 if i < extra else 0)
        end = min(numel, start + count * block)
        out.append((start, end - start))
        start = end
    return out


def sent_bytes(numel: int, parts: int, block: int, pos: int) -> int:
    """The bytes the member at ``pos`` of a ring of ``parts`` sends its successor in one
    all-reduce of ``numel`` elements."""
    sizes = [int8_payload_bytes(n, block) for _, n in chunks_of(numel, parts, block)]
    k = parts
    scatter = sum(sizes[(pos - s) % k] for s in range(k - 1))
    gather = sum(sizes[(pos + 1 - s) % k] for s in range(k - 1))
    return scatter + gather


def _int8(block: int, n: int) -> Codec:
    codec = make_codec(f"int8:{block}", n)
    assert not isinstance(codec, PowerSGD)
    return codec


def _swap(pg: Any, out: torch.Tensor, into: torch.Tensor, nxt: int, prv: int, tag: int) -> None:
    works = [pg.send([out], nxt, tag), pg.recv([into], prv, tag)]
    for w in works:
        w.wait()


def int8_ring_all_reduce(
    pg: Any, flat: torch.Tensor, ring: list[int], pos: int, tag: int, block: int
) -> None:
    """Sum the float32 ``flat`` over the members ``ring`` of ``pg`` (this one at ``pos``) in
    place, every hop in int8 with a scale per ``block``; tags from ``tag`` to ``tag + 2 k``."""
    k = len(ring)
    if k < 2:
        return
    pieces = [flat.narrow(0, o, n) for o, n in chunks_of(flat.numel(), k, block)]
    codecs = [_int8(block, p.numel()) for p in pieces]
    nxt, prv = ring[(pos + 1) % k], ring[(pos - 1) % k]

    def empty(i: int) -> torch.Tensor:
        return torch.empty(int8_payload_bytes(pieces[i].numel(), block), dtype=torch.uint8)

    for s in range(k - 1):  # reduce-scatter: decode, add, encode again at the next hop
        i, j = (pos - s) % k, (pos - s - 1) % k
        buf = empty(j)
        _swap(pg, codecs[i].encode(pieces[i]), buf, nxt, prv, tag + s)
        pieces[j] += codecs[j].decode(buf, pieces[j].numel())
    mine = (pos + 1) % k  # this member's chunk, whole: encoded once, taken decoded here too
    held = {mine: codecs[mine].encode(pieces[mine])}
    pieces[mine].copy_(codecs[mine].decode(held[mine], pieces[mine].numel()))
    for s in range(k - 1):  # all-gather of the encoded sums
        i, j = (pos + 1 - s) % k, (pos - s) % k
        held[j] = empty(j)
        _swap(pg, held[i], held[j], nxt, prv, tag + k + s)
        pieces[j].copy_(codecs[j].decode(held[j], pieces[j].numel()))
