"""The memory layout of a CPU stage's weights while it decodes, chosen by measurement.

Decoding a token multiplies one row by every weight matrix of the stage, so a token's time is
mostly the time to read the weights. How fast the CPU BLAS reads them depends on how they lie:
``F.linear(x, W)`` with ``W`` (out x in) stored row by row computes one dot product per output,
while the same ``W`` stored column by column (``W.t().contiguous().t()``: the same tensor, other
strides) is a sum of the input's scaled columns, read in one stream. On this project's 2-core
machine (torch 2.13, MKL), one row by each of 60 to 6 matrices of a shape (about 16-100 MB,
read from memory as a decoding token reads them), per matrix:

==============  ===========  ==============
weight          row-major    column-major
==============  ===========  ==============
512 x 512       137 us       107 us
256 x 512        84 us        98 us
1408 x 512      411 us       232 us
512 x 1408      268 us       343 us
8192 x 512     2227 us       966 us
==============  ===========  ==============

so neither layout is the faster one for every shape, and training (many rows, forward and
backward) is best left as built (the head's 8192 x 512 took 12% longer column-major, 512 rows).
Hence :class:`DecodeLayout`: at a stage's first decoding step it times one row by each of its
``nn.Linear`` weights of a shape, in both layouts (the weights themselves, interleaved, the best
of a few passes), lays out column by column the shapes where that is faster by :data:`MARGIN` or
more, and puts them back as built before the next training step (a stage that trained in the
last :data:`QUIET_S` seconds decodes as built: no copies back and forth while a task trains).
The values never change, only their strides: outputs agree to float32 rounding, every holder of
a parameter (the optimizer, a tied head) keeps the same ``Parameter``, and checkpoints and
exports write ``contiguous()`` copies, row-major as always.

CPU only (a GPU's BLAS chooses its own kernels), and not for DTensor (tensor-parallel) weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

MARGIN = 0.10  # column-major is taken where a one-row product is at least this much faster
ROUNDS = 3  # timed passes of each layout per measurement; the best of each is compared
# The weights of a shape timed: the first ones, up to this many bytes (past the CPU's caches, so
# that they are read from memory as a decoding token reads them; the rest are not timed, so the
# measurement costs the same whatever the model's size: about 0.2 s at the first decoding step
# of a stage of benchmarks/inference.py's model).
SAMPLE_BYTES = 64 * 2**20
# A stage that trained this recently decodes as built: inference served between a task's training
# steps would otherwise copy the chosen weights twice a request (both ways), which on a large
# model costs more than the layout saves.
QUIET_S = 30.0

Shape = tuple[int, int]


def column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) with the same values, stored column by column."""
    return t.t().contiguous().t()


def is_column_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride() == (1, t.shape[0])


def pass_s(weights: list[torch.Tensor], rounds: int = ROUNDS) -> float:
    """The best of ``rounds`` timings of one row multiplied by each of ``weights`` in turn (one
    shape), as a decoding token does: together they outgrow the CPU's caches as a model's
    weights do, where one matrix timed alone would be read from the cache."""
    x = torch.randn(1, 1, weights[0].shape[1], dtype=weights[0].dtype)
    best = float("inf")
    with torch.no_grad():
        for w in weights:  # warm: the first calls allocate
            F.linear(x, w)
        for _ in range(rounds):
            t0 = time.perf_counter()
            for w in weights:
                F.linear(x, w)
            best = min(best, time.perf_counter() - t0)
    return best


def choose(timings: dict[Shape, tuple[float, float]], margin: float = MARGIN) -> dict[Shape, bool]:
    """For each shape, whether to lay it out column by column: its (row-major, column-major)
    seconds of a pass, column-major taken where it is faster by ``margin`` or more."""
    return {s: col <= row * (1.0 - margin) for s, (row, col) in timings.items()}


@dataclass
class DecodeLayout:
    """The decoding layout of one stage module's linear weights, switched on and off."""

    module: nn.Module
    timer: Callable[[list[torch.Tensor]], float] = pass_s
    columns: dict[Shape, bool] | None = None  # per shape, once measured
    timings: dict[Shape, tuple[float, float]] = field(default_factory=dict)
    on: bool = False
    clock: Callable[[], float] = time.monotonic
    trained: float | None = None  # when the last training step asked for the weights as built

    def _weights(self) -> Iterable[torch.Tensor]:  # nn.Linear weights: Parameters
        for m in self.module.modules():
            if isinstance(m, nn.Linear) and type(m.weight.data) is torch.Tensor:
                yield m.weight

    @property
    def applicable(self) -> bool:
        """CPU weights only; an empty stage or a tensor-parallel one has nothing to lay out."""
        ws = list(self._weights())
        return bool(ws) and all(w.device.type == "cpu" and w.dim() == 2 for w in ws)

    def measure(self) -> dict[Shape, bool]:
        """Time each shape's weights (up to :data:`SAMPLE_BYTES` of them) in both layouts, twice
        each, interleaved (drift on a shared machine hits both alike), and choose; the weights
        are left as built."""
        shapes: dict[Shape, list[torch.Tensor]] = {}
        for w in self._weights():
            group = shapes.setdefault((w.shape[0], w.shape[1]), [])
            if sum(g.nbytes for g in group) < SAMPLE_BYTES and all(g is not w for g in group):
                group.append(w)
        with torch.no_grad():
            for shape, group in shapes.items():
                rows, cols = [], []
                for _ in range(2):
                    rows.append(self.timer([w.data for w in group]))
                    _lay_out(group, column=True)
                    cols.append(self.timer([w.data for w in group]))
                    _lay_out(group, column=False)
                self.timings[shape] = (min(rows), min(cols))
        self.columns = choose(self.timings)
        return self.columns

    def use(self, decode: bool) -> bool:
        """Lay the weights out for decoding (``decode``: not within :data:`QUIET_S` of a training
        step) or back as built (for a training step); True when it changed anything."""
        if not decode:
            self.trained = self.clock()
        elif self.trained is not None and self.clock() - self.trained < QUIET_S:
            return False
        if decode == self.on or not self.applicable:
            return False
        columns = self.columns if self.columns is not None else self.measure()
        chosen = [w for w in self._weights() if columns.get((w.shape[0], w.shape[1]), False)]
        with torch.no_grad():
            changed = _lay_out(chosen, column=decode)
        self.on = decode
        return changed

    def describe(self) -> str:
        """The layout now: each shape's, with its timings (the worker's log)."""
        if not self.on:
            return "as built (row-major)"
        parts = [
            f"{o}x{i} {'column' if self.columns and self.columns.get((o, i)) else 'row'}-major "
            f"(one row by each: {row * 1e6:.0f} us row-major, {col * 1e6:.0f} us column-major)"
            for (o, i), (row, col) in sorted(self.timings.items())
        ]
        return "; ".join(parts) or "no linear weights"


def _lay_out(weights: Iterable[torch.Tensor], column: bool) -> bool:
    """Lay ``weights`` out column by column (``column``) or row by row, each parameter kept (its
    ``data`` replaced); True when one changed. A weight held twice (tied) is laid out once."""
    changed = False
    for w in weights:
        if column and not is_column_major(w.data):
            w.data = column_major(w.data)
            changed = True
        elif not column and not w.data.is_contiguous():
            w.data = w.data.contiguous()
            changed = True
    return changed
