"""A checkpoint of one cut of the model loads into another: a stage whose own file lacks some
of its layers (an interleaved stage's chunks lie in several files of a plain checkpoint, and
the other way round) finds them, weights and AdamW moments, in the checkpoint's other stage
files, each checked against its digest first (issue 31, point 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dmsc.runtime.compute.checkpoints import (
    CheckpointError,
    checkpoint_keys,
    checkpoint_sha256,
    load_state,
    read_states,
    write_checkpoint,
)
from dmsc.runtime.compute.models.chain import StageModule, build_stage
from dmsc.spec import TransformerSpec, resolve_model

SPEC = resolve_model("gpt-mini")
assert isinstance(SPEC, TransformerSpec)
CHUNKS = [
    [("embedding", "block_0"), ("block_2", "block_2")],
    [("block_1", "block_1"), ("block_3", "head")],
]


def _trained(module: StageModule) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def test_a_plain_stage_loads_from_an_interleaved_checkpoint(tmp_path: Path) -> None:
    files = {}
    saved = []
    for s, chunks in enumerate(CHUNKS):
        module = build_stage(SPEC, 0, *chunks[0], chunks=chunks)
        opt = _trained(module)
        path = tmp_path / f"stage{s}.safetensors"
        write_checkpoint(path, SPEC, module, opt, 3)
        files[str(path)] = checkpoint_sha256(path)
        saved.append((module, opt))
    plain = build_stage(SPEC, 1, "embedding", "block_1")
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    own = tmp_path / "stage0.safetensors"
    state = read_states(own, files, checkpoint_keys(SPEC, plain))
    assert load_state(state, SPEC, plain, opt) == 3
    held = {n: layer for m, _ in saved for n, layer in zip(m.names, m.layers, strict=True)}
    for name, layer in zip(plain.names, plain.layers, strict=True):
        for a, b in zip(layer.parameters(), held[name].parameters(), strict=True):
            assert torch.equal(a, b), name
    # block_1's moments came from stage 1's file
    src_opt = saved[1][1]
    block1 = next(iter(held["block_1"].parameters()))
    mine = next(iter(plain.layers[plain.names.index("block_1")].parameters()))
    assert torch.equal(opt.state[mine]["exp_avg"], src_opt.state[block1]["exp_avg"])
    # a file of the others that fails its digest is refused before anything is loaded
    tampered = {p: ("0" * 64 if p != str(own) else sha) for p, sha in files.items()}
    with pytest.raises(CheckpointError, match="fails its hash"):
        read_states(own, tampered, checkpoint_keys(SPEC, plain))
    # a stage whose own file holds all it needs reads no other file
    whole0 = build_stage(SPEC, 0, *CHUNKS[0][0], chunks=CHUNKS[0])
    state = read_states(own, tampered, checkpoint_keys(SPEC, whole0))
    assert checkpoint_keys(SPEC, whole0) == set(state.weights)
