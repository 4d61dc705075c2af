"""A stage's checkpoint: written, checked by its hash, read back into another module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dmsc.runtime.compute.checkpoints import (
    CheckpointError,
    file_sha256,
    load_state,
    read_checkpoint,
    read_state,
    verify_checkpoint,
    write_checkpoint,
)


def _stage(seed: int) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return module, optimizer


def test_a_checkpoint_round_trips_and_fails_a_wrong_hash(tmp_path: Path) -> None:
    module, optimizer = _stage(0)
    path = tmp_path / "deep" / "stage0.pt"
    write_checkpoint(path, module, optimizer, steps=7)
    digest = file_sha256(path)
    verify_checkpoint(path, digest)
    verify_checkpoint(path)  # no hash given: any file
    with pytest.raises(CheckpointError, match="hash"):
        verify_checkpoint(path, "0" * 64)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        verify_checkpoint(tmp_path / "missing.pt")
    other, other_opt = _stage(1)
    other.weight.grad = torch.ones_like(other.weight)
    assert read_checkpoint(path, other, other_opt) == 7
    assert torch.equal(other.weight, module.weight) and other.weight.grad is None
    assert other_opt.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]


def test_an_unreadable_or_misfit_checkpoint_fails_before_anything_loads(tmp_path: Path) -> None:
    module, optimizer = _stage(0)
    path = tmp_path / "stage0.pt"
    write_checkpoint(path, module, optimizer, steps=3)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError, match="cannot be read"):
        read_state(path)
    path.write_bytes(whole)
    wider = torch.nn.Linear(3, 5)  # not this stage's layers
    before = wider.weight.detach().clone()
    with pytest.raises(CheckpointError, match="does not fit"):
        load_state(read_state(path), wider, torch.optim.AdamW(wider.parameters()))
    assert torch.equal(wider.weight, before)
