"""A GPU stage's linear weights in its autocast precision while it decodes, cast once a weight
update rather than once a token.

On a GPU a stage computes under bf16 autocast over float32 weights (:mod:`.devices`: the master
copy of mixed-precision training). Autocast casts a linear layer's weight (and bias) to bf16 at
every call and forgets the cast when its context ends, so a decoding token, one forward of one
row, paid one cast kernel more per linear layer (7 a Llama block beside its products) and read
each weight three times (the float32 read and the bf16 write of the cast, the product's read)
where a model held in bf16, as ``transformers`` serves one, reads it once.
``benchmarks/gpu_check.py`` measured dmsc's decoding at 0.49 of ``transformers``' on an H200
(``benchmarks/results/gpu_check_h200.json``, ``earlier_run``), both host-bound there. Measured
with these casts the ratio stayed at 0.46: most of a token's time was cuDNN's attention
building a graph for each new key length (:func:`.models.attention.inference_attention`), and
without that the casts leave a token's forward on par with the model held in bf16
(``benchmarks/gpu_decode.py``: 15.9 against 16.4 ms, and 15.2 against 26.5 on another host).

:class:`DecodeCasts` keeps the casts: inside :meth:`DecodeCasts.applied` (one decoding step, run
under the worker's step lock, which training steps, Save and Load also hold) each such weight's
``data`` is its cached cast, and afterwards its float32 master again, the same ``Parameter``
object throughout (the optimizer and a tied head keep theirs). A cast is made again when its
master changed since (the parameter's version counter: an optimizer step, a load). Values do not
change: autocast rounds a float32 weight to bf16 the same way (round to nearest even) whether it
casts it per call or once, so a token's outputs are bit for bit those of the per-call casts
(``tests/runtime/compute/test_decode_weights.py``, on the CPU's autocast).

Only plain tensors of ``nn.Linear`` modules held by no other kind of module: an embedding table
tied to the head stays float32 (the lookup is no autocast op: a bf16 table would change the
embedding's output), and tensor-parallel (DTensor) weights are left alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class DecodeCasts:
    """One stage module's linear weights cast to ``dtype`` for its decoding steps."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        self.module = module
        self.dtype = dtype
        self._cache: dict[int, tuple[int, torch.Tensor]] = {}  # id(param) -> (version, cast)
        self._params: list[torch.Tensor] | None = None  # found at the first decoding step

    def params(self) -> list[torch.Tensor]:
        """The parameters cast: each ``nn.Linear``'s weight and bias that is a plain tensor in
        floating point and is held by no module of another kind."""
        held_elsewhere = {
            id(p)
            for m in self.module.modules()
            if not isinstance(m, nn.Linear)
            for p in m.parameters(recurse=False)
        }
        out: list[torch.Tensor] = []
        seen: set[int] = set()
        for m in self.module.modules():
            if not isinstance(m, nn.Linear):
                continue
            for p in (m.weight, m.bias):
                if (
                    p is None
                    or id(p) in seen
                    or id(p) in held_elsewhere
                    or type(p.data) is not torch.Tensor
                    or not p.is_floating_point()
                    or p.dtype == self.dtype
                ):
                    continue
                seen.add(id(p))
                out.append(p)
        return out

    def _cast(self, p: torch.Tensor) -> torch.Tensor:
        version = p._version
        hit = self._cache.get(id(p))
        if hit is None or hit[0] != version:
            with torch.no_grad():
                hit = (version, p.data.to(self.dtype))
            self._cache[id(p)] = hit
        return hit[1]

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The cast weights in place of their masters meanwhile; the masters back after, also
        when the step fails."""
        if self._params is None:
            self._params = self.params()
        params = self._params
        masters = [p.data for p in params]
        try:
            for p in params:
                p.data = self._cast(p)
            yield
        finally:
            for p, master in zip(params, masters, strict=True):
                p.data = master

    def clear(self) -> None:
        """Forget the casts (their memory: a training step needs it for its own)."""
        self._cache.clear()
