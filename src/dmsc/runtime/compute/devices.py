"""Where a stage replica computes: its device, its precision, and the host buffers its tensors
cross the wire through.

- :func:`stage_device` checks a device name (``cpu``, ``cuda``, ``cuda:N``) against this machine:
  a GPU that is not there is a one-line ``ValueError`` before anything is built.
- :func:`autocast_dtype`: on a GPU, a model whose spec says bf16, fp16 or fp8 computes under
  bf16 autocast, its weights, gradients and AdamW state kept in float32 (the master copy of
  mixed-precision training, Micikevicius et al., ICLR 2018). fp16 and fp8 also run in bf16: bf16
  needs no loss scaling, which a pipeline would have to agree on across stages, and fp8 matrix
  products need kernels PyTorch alone does not offer. On the CPU every model computes in float32.
- :class:`HostStaging`: frames are bytes on the host, so a tensor on a GPU is copied into a
  page-locked (pinned) host buffer before it is encoded, and a received one goes to the GPU from
  a pinned buffer, without blocking the host (``non_blocking``). Buffers are kept per shape and
  reused once their copy is over (a CUDA event says when).
"""

from __future__ import annotations

import torch

from dmsc.spec import TransformerSpec

MAX_BUFFERS = 64  # pinned buffers kept per worker (page-locked memory is the host's too)


def stage_device(name: str) -> torch.device:
    """The device ``name`` on this machine; ValueError when it is not a device or not here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device {name!r}: the runtime runs on cpu or cuda devices")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r}: this machine has no CUDA device (PyTorch {torch.__version__}); "
            "`dmsc up --device cpu` runs the plan on the CPU"
        )
    count = torch.cuda.device_count()
    index = 0 if device.index is None else device.index
    if index >= count:
        raise ValueError(
            f"device {name!r}: this machine has {count} CUDA device(s); "
            "`dmsc up --device cuda` puts every stage on cuda:0"
        )
    return torch.device("cuda", index)


def autocast_dtype(spec: TransformerSpec, device: torch.device) -> torch.dtype | None:
    """The autocast precision of ``spec`` on ``device`` (None: float32 throughout)."""
    if device.type == "cuda" and spec.dtype in ("bf16", "fp16", "fp8"):
        return torch.bfloat16
    return None


class HostStaging:
    """Copies between a device and the host through reused pinned buffers (a no-op on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.gpu = device.type == "cuda"
        self._buffers: dict[tuple[tuple[int, ...], torch.dtype, str], torch.Tensor] = {}
        self._ready: dict[tuple[tuple[int, ...], torch.dtype, str], torch.cuda.Event] = {}

    def _buffer(self, t: torch.Tensor, way: str) -> torch.Tensor:
        key = (tuple(t.shape), t.dtype, way)
        buf = self._buffers.get(key)
        if buf is None and len(self._buffers) >= MAX_BUFFERS:  # prefill shapes vary: start over
            for event in self._ready.values():
                event.synchronize()
            self._buffers.clear()
            self._ready.clear()
        if buf is None:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._buffers[key] = buf
        elif key in self._ready:
            self._ready[key].synchronize()  # the last copy through it is over
        return buf

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in host memory: a pinned buffer, valid until the next call of the same shape
        (frames are encoded, and so copied, at once)."""
        if not self.gpu or t.device.type == "cpu":
            return t
        buf = self._buffer(t, "d2h")
        buf.copy_(t.detach(), non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()  # the bytes are read next
        return buf

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (on the host) on this device; the host is not blocked by the copy."""
        if not self.gpu:
            return t
        key = (tuple(t.shape), t.dtype, "h2d")
        buf = self._buffer(t, "h2d")
        buf.copy_(t)
        out = buf.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._ready[key] = event
        return out
