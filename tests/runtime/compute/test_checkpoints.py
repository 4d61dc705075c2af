"""A stage's checkpoint: written in the Hugging Face format, checked by its hash, read back into
another module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dmsc.runtime.compute.checkpoints import (
    CheckpointError,
    checkpoint_sha256,
    load_state,
    optimizer_path,
    read_checkpoint,
    read_state,
    stage_file,
    verify_checkpoint,
    write_checkpoint,
)
from dmsc.runtime.compute.models.chain import StageModule, build_stage
from dmsc.runtime.compute.models.hf import write_index
from dmsc.spec import TransformerSpec, resolve_model

SPEC = resolve_model("gpt-mini")
assert isinstance(SPEC, TransformerSpec)


def _stage(
    seed: int, spec: TransformerSpec = SPEC, first: str = "block_3", last: str = "head"
) -> tuple[StageModule, torch.optim.Optimizer]:
    module = build_stage(spec, seed, first, last)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(torch.randn(2, 8, spec.hidden)).sum().backward()
    optimizer.step()
    return module, optimizer


def test_a_checkpoint_round_trips_and_fails_a_wrong_hash(tmp_path: Path) -> None:
    module, optimizer = _stage(0)
    path = tmp_path / "deep" / "stage1.safetensors"
    names = write_checkpoint(path, SPEC, module, optimizer, steps=7)
    assert "transformer.h.3.attn.c_attn.weight" in names and "lm_head.weight" in names
    digest = checkpoint_sha256(path)
    verify_checkpoint(path, digest)
    verify_checkpoint(path)  # no hash given: any file
    with pytest.raises(CheckpointError, match="hash"):
        verify_checkpoint(path, "0" * 64)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        verify_checkpoint(tmp_path / "missing.safetensors")
    other, other_opt = _stage(1)
    first = next(other.parameters())
    first.grad = torch.ones_like(first)
    assert read_checkpoint(path, SPEC, other, other_opt) == 7
    for mine, theirs in zip(module.parameters(), other.parameters(), strict=True):
        assert torch.equal(mine, theirs) and theirs.grad is None
    want, got = optimizer.state_dict(), other_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for n, slots in want["state"].items():
        for slot, value in slots.items():
            assert torch.equal(value, got["state"][n][slot]), (n, slot)
    # the optimizer file counts: a changed moment fails the hash
    moments = load_file(str(optimizer_path(path)))
    assert any(k.endswith(".exp_avg_sq") for k in moments)


def test_the_weights_file_holds_the_hugging_face_tensors(tmp_path: Path) -> None:
    """GPT-2's linear layers are stored input by output (``Conv1D``), the layout
    ``transformers`` reads; the stage files and the index load in ``transformers``."""
    transformers = pytest.importorskip("transformers")
    whole = build_stage(SPEC, 0, "embedding", "head")
    head, tail = (
        build_stage(SPEC, 0, "embedding", "block_1"),
        build_stage(SPEC, 0, "block_2", "head"),
    )
    files = {}
    for n, part in enumerate((head, tail)):
        path = stage_file(tmp_path, n)
        opt = torch.optim.AdamW(part.parameters())
        files[path.name] = write_checkpoint(path, SPEC, part, opt, steps=0)
    stored = load_file(str(tmp_path / "stage0.safetensors"))
    assert torch.equal(stored["transformer.h.0.attn.c_attn.weight"], head.layers[1].qkv.weight.t())
    write_index(SPEC, tmp_path, files)
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, SPEC.vocab, (2, 16))
    with torch.no_grad():
        assert (theirs(x).logits - whole(x)).abs().max().item() < 1e-4


def test_an_unreadable_or_misfit_checkpoint_fails_before_anything_loads(tmp_path: Path) -> None:
    module, optimizer = _stage(0)
    path = tmp_path / "stage0.safetensors"
    write_checkpoint(path, SPEC, module, optimizer, steps=3)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError, match="cannot be read"):
        read_state(path)
    path.write_bytes(whole)
    wider_spec = SPEC.model_copy(update={"hidden": 64})
    wider, wider_opt = _stage(0, wider_spec)  # not this stage's layers
    before = [p.detach().clone() for p in wider.parameters()]
    with pytest.raises(CheckpointError, match=r"does not fit.*transformer\.h\.3"):
        load_state(read_state(path), wider_spec, wider, wider_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, wider.parameters(), strict=True))
    optimizer_path(path).unlink()
    with pytest.raises(CheckpointError, match=r"optim\.safetensors cannot be read"):
        read_state(path)


def test_a_torch_save_checkpoint_of_earlier_dmsc_still_loads(tmp_path: Path) -> None:
    module, optimizer = _stage(0)
    path = tmp_path / "stage1.pt"
    torch.save(
        {"model": module.state_dict(), "optimizer": optimizer.state_dict(), "steps": 4}, path
    )
    assert stage_file(tmp_path, 1) == path
    assert checkpoint_sha256(path) == __import__("hashlib").sha256(path.read_bytes()).hexdigest()
    other, other_opt = _stage(1)
    assert read_checkpoint(path, SPEC, other, other_opt) == 4
    assert all(
        torch.equal(a, b) for a, b in zip(module.parameters(), other.parameters(), strict=True)
    )


def test_a_stages_fused_adamw_resumes_from_its_checkpoint_as_if_never_stopped(
    tmp_path: Path,
) -> None:
    """A checkpoint keeps a transposed weight's moments transposed (the Hugging Face layout),
    and they came back as transposed views; PyTorch's fused AdamW (the stages' optimizer,
    make_optimizer) steps such a moment wrongly without a word: a dp resize's first step after
    its reload went 0.09 off the run that never stopped. They are loaded contiguous."""
    from dmsc.runtime.compute.outer_sync import make_optimizer

    def trained(module: StageModule, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
        out = []
        for step in steps:
            g = torch.Generator().manual_seed(step)
            loss = module(torch.randn(2, 8, SPEC.hidden, generator=g)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            out.append(loss.item())
        return out

    module = build_stage(SPEC, 0, "block_3", "head")
    optimizer = make_optimizer("adamw", module, 1e-2)
    trained(module, optimizer, range(2))
    path = tmp_path / "stage1.safetensors"
    write_checkpoint(path, SPEC, module, optimizer, steps=2)
    again = build_stage(SPEC, 1, "block_3", "head")
    resumed = make_optimizer("adamw", again, 1e-2)
    read_checkpoint(path, SPEC, again, resumed)
    assert resumed.defaults["fused"]
    assert all(t.is_contiguous() for slots in resumed.state.values() for t in slots.values())
    assert trained(again, resumed, range(2, 5)) == trained(module, optimizer, range(2, 5))
