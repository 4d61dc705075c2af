"""dmsc's stages on Hugging Face checkpoints against ``transformers`` itself: tiny random models
of every supported family, saved with ``save_pretrained``, split into 2 and 3 stages."""

from __future__ import annotations

import importlib
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dmsc.runtime.compute.models.chain import build_stage, layer_names
from dmsc.runtime.compute.models.hf import CheckpointError, export, load_stage
from dmsc.spec import SpecError, TransformerSpec, resolve_model

SEQ = 24


class _Lazy:
    """``transformers``, imported on first use: it takes seconds, and every test process
    collects this module."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("transformers"), name)


transformers = _Lazy()
_LLAMA: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA),
    "llama3-rope-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            **_LLAMA,
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_LLAMA, "sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _LLAMA),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"vocab_size": 97, "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 64},
    ),
}


def _make(name: str, directory: Path, **save: Any) -> Any:
    config_cls, model_cls, kwargs = FAMILIES[name]
    torch.manual_seed(7)
    config = getattr(transformers, config_cls)(**kwargs)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # visible biases and norms: zeros and ones would hide a mapping error
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory, **save)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp(request.param)
    # one family stored as several shards, as large checkpoints are
    save = {"max_shard_size": "100KB"} if request.param == "llama" else {}
    model = _make(request.param, directory, **save)
    return request.param, directory, model


def _stages(spec: TransformerSpec, directory: Path, pp: int) -> list[torch.nn.Module]:
    names = layer_names(spec)
    cuts = [round(i * len(names) / pp) for i in range(pp + 1)]
    out = []
    for lo, hi in itertools.pairwise(cuts):
        stage = build_stage(spec, 0, names[lo], names[hi - 1], empty=True)
        load_stage(stage, spec, directory)
        out.append(stage.eval())
    return out


def _run(stages: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for stage in stages:
            x = stage(x)
    return x


@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_logits_equal_transformers(checkpoint: Any, pp: int) -> None:
    name, directory, model = checkpoint
    spec = resolve_model(f"hf:{directory}", {"seq": SEQ})
    assert isinstance(spec, TransformerSpec)
    x = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x).logits
    got = _run(_stages(spec, directory, pp), x)
    assert (got - want).abs().max().item() < 1e-4, name


def test_greedy_continuation_equals_transformers(checkpoint: Any) -> None:
    name, directory, model = checkpoint
    spec = resolve_model(f"hf:{directory}", {"seq": SEQ})
    assert isinstance(spec, TransformerSpec)
    stages = _stages(spec, directory, 2)
    prompt = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    want = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    ids = prompt
    for _ in range(10):
        nxt = _run(stages, ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    assert ids.tolist() == want.tolist(), name


def test_a_stage_reads_only_its_own_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dmsc.runtime.compute.models import hf

    _make("llama", tmp_path)
    spec = resolve_model(f"hf:{tmp_path}", {"seq": SEQ})
    assert isinstance(spec, TransformerSpec)
    read: list[str] = []
    original = hf.SafetensorsDir.read

    def spy(self: Any, keys: list[str]) -> Any:
        read.extend(keys)
        return original(self, keys)

    monkeypatch.setattr(hf.SafetensorsDir, "read", spy)
    stage = build_stage(spec, 0, "block_1", "block_1", empty=True)
    load_stage(stage, spec, tmp_path)
    assert read and all(k.startswith("model.layers.1.") for k in read)


def test_export_loads_in_transformers(checkpoint: Any, tmp_path: Path) -> None:
    name, directory, model = checkpoint
    spec = resolve_model(f"hf:{directory}", {"seq": SEQ})
    assert isinstance(spec, TransformerSpec)
    stages = _stages(spec, directory, 2)
    out = export(
        spec,
        [(s.names, s.state_dict()) for s in stages],  # type: ignore[attr-defined]
        tmp_path / "out",
        directory,
    )
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 97, (1, SEQ))
    with torch.no_grad():
        assert (again(x).logits - model(x).logits).abs().max().item() < 1e-5, name


def test_export_of_a_preset_loads_in_transformers(tmp_path: Path) -> None:
    for preset in ("gpt-mini", "llama-mini", "moe-mini"):
        spec = resolve_model(preset)
        assert isinstance(spec, TransformerSpec)
        names = layer_names(spec)
        whole = build_stage(spec, 3, names[0], names[-1]).eval()
        out = export(spec, [(whole.names, whole.state_dict())], tmp_path / preset)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        x = torch.randint(0, spec.vocab, (2, 32))
        with torch.no_grad():
            assert (theirs(x).logits - whole(x)).abs().max().item() < 1e-4, preset


def test_missing_tensor_and_wrong_shape_name_the_file_and_tensor(tmp_path: Path) -> None:
    _make("llama", tmp_path)
    spec = resolve_model(f"hf:{tmp_path}", {"seq": SEQ})
    assert isinstance(spec, TransformerSpec)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.2.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.2.mlp.up_proj.weight'"):
        load_stage(build_stage(spec, 0, "block_2", "head", empty=True), spec, tmp_path)
    wide = spec.model_copy(update={"ffn": 128})
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.0.mlp"):
        load_stage(build_stage(wide, 0, "block_0", "block_0", empty=True), wide, tmp_path)


def test_unsupported_architecture_is_a_spec_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(SpecError, match="model_type: 'bert' is not supported"):
        resolve_model(f"hf:{tmp_path}")
    with pytest.raises(SpecError, match="nowhere: not a directory"):
        resolve_model(f"hf:{tmp_path / 'nowhere'}")
    (tmp_path / "config.json").unlink()
    with pytest.raises(SpecError, match=r"config\.json: missing"):
        resolve_model(f"hf:{tmp_path}")
