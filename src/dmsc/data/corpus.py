"""Training text present on every machine with no download: the Python standard library's own
source files, as bytes (a 256-symbol vocabulary). The last files (by path) are held out."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_text(max_bytes: int = 4_000_000) -> tuple[bytes, bytes]:
    """(train, validation) bytes from the standard library's ``.py`` files, deterministic."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(f"no Python sources under {root}")
    cut = max(1, int(len(files) * 0.9))
    train = b"".join(p.read_bytes() for p in files[:cut])[:max_bytes]
    valid = b"".join(p.read_bytes() for p in files[cut:])[: max_bytes // 10]
    return train, valid


class Corpus:
    """Seeded batches of (tokens, next-token targets) windows."""

    def __init__(self, data: bytes, seq: int, seed: int = 0) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        if self.data.numel() <= seq + 1:
            raise ValueError("corpus shorter than one sequence")
        self.seq = seq
        self.seed = seed

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.data.numel() - self.seq - 1, (size,), generator=g)
        x = torch.stack([self.data[s : s + self.seq] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1 : s + self.seq + 1] for s in starts.tolist()])
        return x, y
