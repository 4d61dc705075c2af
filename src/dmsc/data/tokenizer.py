"""Text to token ids and back: bytes for the models dmsc makes (a 256-symbol vocabulary), the
checkpoint's own ``tokenizer.json`` (the ``tokenizers`` library) for a Hugging Face model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from dmsc.spec import TransformerSpec


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json``; prompts get the special tokens its post-processor adds (Llama's
    begin-of-text), as ``transformers``' tokenizers do by default."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self.name = str(path)
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type
            raise ValueError(f"{path}: not a tokenizer ({exc})") from None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def encode_corpus(self, text: str | bytes) -> list[int]:
        """A training text: no special tokens around it. Encoded in pieces of whole lines by the
        library's batch call, which runs on every core and lets other threads run meanwhile
        (one call on 4 MB of text holds the interpreter for seconds: 5.6 s here, 3.2 s as a
        batch)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        pieces = ["".join(lines[i : i + 512]) for i in range(0, len(lines), 512)]
        out: list[int] = []
        for enc in self._tok.encode_batch(pieces, add_special_tokens=False):
            out.extend(enc.ids)
        return out

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


def tokenizer_for(spec: TransformerSpec) -> Tokenizer:
    """The checkpoint's ``tokenizer.json`` when it has one, bytes otherwise; ValueError when
    neither fits the model's vocabulary."""
    if spec.checkpoint is not None:
        path = Path(spec.checkpoint.path) / "tokenizer.json"
        if path.is_file():
            return HFTokenizer(path)
    if spec.vocab < 256:
        raise ValueError(
            f"{spec.name}: no tokenizer.json and a vocabulary of {spec.vocab} (bytes need 256)"
        )
    return ByteTokenizer()


def text_stream(tok: Tokenizer, on_bytes: Callable[[int], None]) -> Callable[[int], None]:
    """A per-token callback that hands ``on_bytes`` the UTF-8 bytes of the text as it grows:
    a token that ends inside a character waits for the token that completes it."""
    if isinstance(tok, ByteTokenizer):
        return on_bytes
    ids: list[int] = []
    sent = [""]

    def on_token(token: int) -> None:
        ids.append(token)
        text = tok.decode(ids)
        if text.endswith("\ufffd") or not text.startswith(sent[0]):
            return
        for b in text[len(sent[0]) :].encode():
            on_bytes(b)
        sent[0] = text

    return on_token
