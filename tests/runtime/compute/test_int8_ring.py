"""The int8 ring all-reduce over real gloo groups (ranks as threads of this process): every
member ends with the same values, within the codec's rounding of the exact sum at each hop, and
sends its successor the bytes the cost model prices (counted on the wire)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dmsc.runtime.compute.compression import int8_payload_bytes
from dmsc.runtime.compute.int8_ring import chunks_of, int8_ring_all_reduce, sent_bytes


class _Counting:
    """A group whose sends are counted by destination."""

    def __init__(self, pg: Any, rank: int) -> None:
        self.pg, self.rank = pg, rank
        self.sent: dict[int, int] = {}

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self.sent[dst] = self.sent.get(dst, 0) + tensors[0].numel()
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self.pg.recv(tensors, src, tag)


def _run(inputs: list[torch.Tensor], block: int) -> list[tuple[torch.Tensor, dict[int, int]]]:
    n = len(inputs)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]

    def rank(r: int) -> tuple[torch.Tensor, dict[int, int]]:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)  # type: ignore[attr-defined]
        pg = dist.ProcessGroupGloo(dist.PrefixStore("q", client), r, n, timedelta(seconds=20))  # type: ignore[attr-defined]
        counting = _Counting(pg, r)
        flat = inputs[r].clone()
        int8_ring_all_reduce(counting, flat, list(range(n)), r, 0, block)
        return flat, counting.sent

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(rank, range(n)))


@pytest.mark.parametrize(("n", "numel", "block"), [(2, 1000, 256), (3, 5000, 256), (4, 70, 32)])
def test_every_member_ends_with_the_same_sum_within_the_rounding(
    n: int, numel: int, block: int
) -> None:
    g = torch.Generator().manual_seed(n)
    inputs = [torch.randn(numel, generator=g) * (1 + r) for r in range(n)]
    out = _run(inputs, block)
    exact = torch.stack(inputs).sum(0)
    first = out[0][0]
    assert all(torch.equal(first, o) for o, _ in out)
    # each hop rounds a value to half a step of its block's scale (absmax / 127): at most n
    # roundings (n - 1 partial sums and the whole), each below the whole's absmax bound
    bound = n * torch.stack(inputs).abs().sum(0).max() / 254
    assert float((first - exact).abs().max()) <= float(bound)
    assert float((first - exact).abs().mean()) < float(exact.abs().mean()) / 20
    # what each member put on the wire to its successor, counted, is the priced ring's
    for r, (_, sent) in enumerate(out):
        assert sent == {(r + 1) % n: sent_bytes(numel, n, block, r)}
        whole = int8_payload_bytes(numel, block)
        assert abs(sent[(r + 1) % n] - 2 * (n - 1) / n * whole) <= 2 * (n - 1) * (block + 20)


def test_chunks_fall_on_block_boundaries_and_cover_the_vector() -> None:
    assert chunks_of(1000, 3, 256) == [(0, 512), (512, 256), (768, 232)]
    assert chunks_of(70, 4, 32) == [(0, 32), (32, 32), (64, 6), (70, 0)]
    for numel, parts, block in [(1, 2, 256), (4096, 4, 256), (4097, 3, 7)]:
        chunks = chunks_of(numel, parts, block)
        assert sum(n for _, n in chunks) == numel and len(chunks) == parts
        assert all(o % block == 0 or n == 0 for o, n in chunks)
