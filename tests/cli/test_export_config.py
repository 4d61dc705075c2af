"""The ``config.json`` that ``dmsc export`` writes loads in ``transformers`` without a warning
(issue 29, point 9): a byte-level gpt-mini's config inherited GPT-2's bos/eos token 50256, outside
its vocabulary of 256, and ``transformers`` warned on every load. Checked with ``transformers``
itself: the ids it reads, and what it logs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import transformers

from dmsc.runtime.compute.models.hf import hf_config
from dmsc.spec import TransformerSpec, resolve_model


@pytest.mark.parametrize("preset", ["gpt-mini", "gpt3-125m", "llama-mini", "moe-mini"])
def test_special_tokens_are_in_the_vocabulary(
    preset: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = resolve_model(preset)
    assert isinstance(spec, TransformerSpec)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(spec)))
    transformers.utils.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            config = transformers.AutoConfig.from_pretrained(tmp_path)
    finally:
        transformers.utils.logging.disable_propagation()
    assert not [r for r in caplog.records if "within the vocabulary" in r.getMessage()]
    for token in (config.bos_token_id, config.eos_token_id):
        assert token is None or 0 <= token < spec.vocab
    if preset == "gpt3-125m":  # GPT-2's tokenizer: <|endoftext|> is its bos and eos
        assert config.bos_token_id == config.eos_token_id == 50256
