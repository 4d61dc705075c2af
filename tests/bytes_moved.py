"""The bytes a piece of torch code reads and writes, counted operation by operation: the
reference the cost model's memory-bound passes (:mod:`dmsc.netmodel.leader_work`,
:mod:`dmsc.netmodel.codec_work`) are checked against.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every ATen operation the code
dispatches. An operation reads its tensor inputs once and writes its output once; then by kind:

- a view (``view``, ``narrow``, slicing) moves nothing, nor does an allocation that leaves
  its memory as it is (``empty``, ``empty_like``, ``empty_strided``); a filled one
  (``zeros_like``, ``ones_like``) writes its output and reads nothing;
- an in-place operation (``add_``) reads and writes its first argument; ``copy_``, ``zero_``
  and ``fill_`` only write it;
- an ``out=`` tensor is written, not read;
- ``index`` (a gather) reads the indices and as many entries as it returns, ``index_put_``
  reads the indices and the values and writes as many entries as there are indices;
- ``nonzero`` reads its input twice, as PyTorch's CPU kernel does (a count, then a fill).

What a kernel does inside (a sort's passes, a reduction's partial sums kept in registers) is
not seen: these are the passes a memory-bound operation cannot do without.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_ALLOCATES = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty"}
_WRITE_ONLY = {"aten::copy_", "aten::zero_", "aten::fill_"}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class BytesMoved(TorchDispatchMode):
    """Counts the bytes the operations dispatched inside ``with BytesMoved() as m:`` read and
    write (``m.bytes``), and by operation (``m.by_op``), by the rules of the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.by_op: Counter[str] = Counter()

    def _moved(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
        name = func._schema.name
        if func.is_view or name in _ALLOCATES:
            return 0
        outs = _tensors(out)
        if name.endswith("_like"):
            return sum(t.nbytes for t in outs)
        if name == "aten::index":
            return sum(t.nbytes for t in _tensors(args[1])) + 2 * sum(t.nbytes for t in outs)
        if name == "aten::index_put_":
            indices = _tensors(args[1])
            hits = max(t.numel() for t in indices)
            element = args[0].element_size()
            return sum(t.nbytes for t in indices) + 2 * hits * element
        if name == "aten::nonzero":
            return 2 * args[0].nbytes + sum(t.nbytes for t in outs)
        ins = _tensors((args, kwargs))
        if name in _WRITE_ONLY:
            return sum(t.nbytes for t in ins[1:]) + args[0].nbytes
        in_place = name.endswith("_")
        written = [t for t in outs if in_place or all(t is not i for i in ins)]
        return sum(t.nbytes for t in ins) + sum(t.nbytes for t in written)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        moved = self._moved(func, args, kwargs, out)
        self.bytes += moved
        self.by_op[str(func)] += moved
        return out

    def per_element(self, elements: int) -> float:
        """The bytes counted so far over ``elements``."""
        return self.bytes / elements
