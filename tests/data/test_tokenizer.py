from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dmsc.data.tokenizer import ByteTokenizer, HFTokenizer, text_stream, tokenizer_for
from dmsc.spec import resolve_model

TEXT = "naïve café, déjà vu: ünïcödé " * 20


def _trained(directory: Path, vocab: int) -> HFTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        [TEXT], trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=alphabet)
    )
    tok.save(str(directory / "tokenizer.json"))
    return HFTokenizer(directory / "tokenizer.json")


@pytest.fixture
def hf(tmp_path: Path) -> HFTokenizer:
    return _trained(tmp_path, 280)


def test_round_trip(hf: HFTokenizer) -> None:
    for tok in (ByteTokenizer(), hf):
        assert tok.decode(tok.encode(TEXT)) == TEXT
    assert hf.decode(hf.encode_corpus(TEXT.encode())) == TEXT


def test_streamed_text_is_whole_characters(tmp_path: Path) -> None:
    """Byte-level tokens that end inside a character wait for the one that completes it."""
    hf = _trained(tmp_path, 256)  # no merges: a token per byte, two for "é"
    ids = hf.encode("déjà")
    assert len(ids) == 6
    got: list[bytes] = []
    stream = text_stream(hf, lambda b: got.append(bytes([b])))
    sizes = []
    for i in ids:
        stream(i)
        sizes.append(len(got))
    assert b"".join(got).decode() == "déjà"
    assert sizes == [1, 1, 3, 4, 4, 6]  # "d", then nothing until "é" is whole, ...


def test_a_model_without_tokenizer_needs_the_byte_vocabulary() -> None:
    spec = resolve_model("gpt-mini")
    assert isinstance(tokenizer_for(spec), ByteTokenizer)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no tokenizer\.json and a vocabulary of 100"):
        tokenizer_for(spec.model_copy(update={"vocab": 100}))  # type: ignore[union-attr]
