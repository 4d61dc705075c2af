"""Training text as bytes (a 256-symbol vocabulary). By default the text present on every machine
with no download: the Python standard library's own source files, the last files (by path) held
out for validation. A user's own text comes from a file or a directory (:func:`text_from`)."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch

from dmsc.spec.files import FileRefused, read_bounded, resolve_within


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


MAX_DATA_BYTES = 1 << 30  # what a training task reads into memory at most (1 GiB)


def text_files(path: Path) -> list[Path]:
    """``path`` itself, or the files below a directory (hidden ones skipped) in path order;
    ValueError names the path when there are none, and a file below the directory that is not
    a regular file (a device, a FIFO, a symlink to one) or whose symlink leads outside it.
    Sizes are checked when the files are read (:func:`dmsc.spec.files.read_bounded`)."""
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if not path.is_dir():
        return [path]
    files = []
    for p in sorted(path.rglob("*")):
        if any(part.startswith(".") for part in p.relative_to(path).parts) or p.is_dir():
            continue
        real = resolve_within(p, path)
        if not real.is_file():
            raise FileRefused(f"{p}: not a regular file")
        files.append(p)
    if not files:
        raise ValueError(f"{path}: the directory holds no files")
    return files


def text_from(path: Path, max_bytes: int = MAX_DATA_BYTES) -> tuple[bytes, bytes]:
    """(train, validation) bytes from ``path``: a file, whose last tenth is held out, or a
    directory, whose regular files below it (hidden ones skipped) are read in path order and
    the last tenth of them held out (at least one; the last tenth of the bytes when it holds
    one file). Each file must be a regular file, and they hold ``max_bytes`` at most together,
    checked before each read. ValueError names the path and what is wrong with it."""
    files = text_files(path)
    total = sum(p.stat().st_size for p in files)
    if total > max_bytes:
        raise ValueError(f"{path}: {total:,} bytes, more than the {max_bytes:,} a task reads")
    texts: list[bytes] = []
    for p in files:
        texts.append(read_bounded(p, max_bytes - sum(len(t) for t in texts)))
    if len(texts) >= 2:
        cut = min(len(texts) - 1, max(1, round(len(texts) * 0.9)))
        return b"".join(texts[:cut]), b"".join(texts[cut:])
    data = texts[0]
    cut = len(data) - len(data) // 10
    return data[:cut], data[cut:]


class Corpus:
    """Seeded batches of (tokens, next-token targets) windows."""

    def __init__(self, data: bytes | list[int], seq: int, seed: int = 0) -> None:
        # bytes as they are (a quarter of the memory int64 would take), widened per batch;
        # token ids of a larger vocabulary as int32
        if isinstance(data, bytes):
            self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            self.data = torch.tensor(data, dtype=torch.int32)
        if self.data.numel() <= seq + 1:
            unit = "bytes" if isinstance(data, bytes) else "tokens"
            raise ValueError(
                f"{self.data.numel():,} {unit} of text: a sequence needs {seq + 2:,} at least"
            )
        self.seq = seq
        self.seed = seed

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.data.numel() - self.seq - 1, (size,), generator=g)
        x = torch.stack([self.data[s : s + self.seq] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1 : s + self.seq + 1] for s in starts.tolist()])
        return x.to(torch.int64), y.to(torch.int64)


def task_corpora(
    data: str | None,
    seq: int,
    seed: int,
    default: tuple[bytes | list[int], bytes | list[int]],
    encode: Callable[[str], list[int]] | None = None,
) -> tuple[Corpus, Corpus]:
    """The (training, validation) corpora of a training task: the text of ``data`` (a file or
    a directory, :func:`text_from`), as bytes or as the tokens ``encode`` makes of it, or the
    ``default`` ones (already tokens), training batches drawn by ``seed``. ValueError names
    the data and what is wrong with it."""

    def tokens(text: bytes) -> bytes | list[int]:
        return text if encode is None else encode(text.decode("utf-8", errors="replace"))

    if data is None:
        train_tokens, valid_tokens = default
        return Corpus(train_tokens, seq, seed=seed), Corpus(valid_tokens, seq, seed=1)
    train, valid = text_from(Path(data))
    corpus = Corpus(tokens(train), seq, seed=seed)
    try:
        return corpus, Corpus(tokens(valid), seq, seed=1)
    except ValueError as exc:
        raise ValueError(f"{data}: the held-out tenth for validation: {exc}") from None
