"""Checkpoints encrypted at rest (issue 33, item 4): a sealed checkpoint holds none of its
tensors or names in clear, reads back the same, keeps its SHA-256 check on the bytes on disk,
and is refused without its key or with another; the key lies outside the checkpoint folder."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dmsc.runtime.compute import sealing
from dmsc.runtime.compute.checkpoints import (
    CheckpointError,
    checkpoint_sha256,
    optimizer_path,
    read_state,
    verify_checkpoint,
    write_checkpoint,
)
from dmsc.runtime.compute.models.chain import build_stage
from dmsc.spec import TransformerSpec, resolve_model

SPEC = resolve_model("gpt-mini")
assert isinstance(SPEC, TransformerSpec)


@pytest.fixture
def key(tmp_path: Path) -> Iterator[bytes]:
    made = sealing.home_key(tmp_path / "home")
    sealing.install(made)
    yield made
    sealing.install(None)


def test_a_sealed_checkpoint_reads_back_and_keeps_its_hash_check(
    tmp_path: Path, key: bytes
) -> None:
    module = build_stage(SPEC, 0, "block_3", "head")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(torch.randn(2, 8, SPEC.hidden)).sum().backward()
    optimizer.step()
    path = tmp_path / "ckpt" / "step7" / "stage1.safetensors"
    names = write_checkpoint(path, SPEC, module, optimizer, steps=7)
    # the key is the home's, outside the checkpoint folder, owner-only
    key_path = sealing.key_file(tmp_path / "home")
    assert key_path.read_bytes() == key and stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert not list((tmp_path / "ckpt").rglob("*.key"))
    for file in (path, optimizer_path(path)):
        raw = file.read_bytes()
        assert raw.startswith(sealing.MAGIC)
        assert b"lm_head.weight" not in raw and b"__metadata__" not in raw
        # no tensor's bytes in clear: the first parameter's opening bytes are not found
        first = next(iter(module.parameters())).detach().float().numpy().tobytes()[:32]
        assert first not in raw
    digest = checkpoint_sha256(path)
    verify_checkpoint(path, digest)  # the check on the sealed bytes, unchanged
    state = read_state(path)
    assert state.steps == 7 and sorted(state.weights) == names
    sealing.install(None)  # a plain reader of the same file: weights equal the module's
    with pytest.raises(CheckpointError, match="encrypted"):
        read_state(path)
    sealing.install(key)
    plain = tmp_path / "plain" / "stage1.safetensors"
    sealing.install(None)
    write_checkpoint(plain, SPEC, module, optimizer, steps=7)
    sealing.install(key)
    reference = load_file(str(plain))  # an independent reader of the plain file
    assert all(torch.equal(state.weights[k], reference[k]) for k in reference)
    assert read_state(plain).steps == 7  # a plain checkpoint still reads with the key on
    # another key, or one flipped byte: refused (the hash first, then the tag)
    sealing.install(bytes(32))
    with pytest.raises(CheckpointError, match="another key, or altered"):
        read_state(path)
    sealing.install(key)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="hash"):
        verify_checkpoint(path, digest)
    with pytest.raises(CheckpointError, match="altered"):
        read_state(path)
