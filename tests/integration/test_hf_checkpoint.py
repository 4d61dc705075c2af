"""A Hugging Face checkpoint through the whole runtime as a user runs it: plan from ``hf:DIR``,
``dmsc up`` (each stage loads its own tensors), train, infer with the checkpoint's tokenizer,
export, and ``transformers`` continues the prompt as dmsc does."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from runtime_helpers import dmsc
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.integration


def _checkpoint(directory: Path) -> None:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
    tok.train_from_iterator([text], trainer)
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,  # as Llama 3.2 1B: the head in stage 1, its embedding in 0
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def test_a_hugging_face_checkpoint_plans_deploys_trains_infers_and_exports(tmp_path: Path) -> None:
    import transformers
    from tokenizers import Tokenizer

    ckpt = tmp_path / "tiny-llama"
    _checkpoint(ckpt)
    plan = tmp_path / "plan.json"
    cluster = str(ROOT / "examples/clusters/local-cpu.yaml")
    flags = ["--global-batch", "4", "--micro-batch", "2", "--tp", "1", "--pp", "2", "--dp", "1"]
    res = dmsc(tmp_path, "plan", "--cluster", cluster, "--model", f"hf:{ckpt}", *flags,
               "--out", str(plan))  # fmt: skip
    assert res.returncode == 0, res.stderr
    spec = json.loads(plan.read_text())["model_spec"]
    assert spec["checkpoint"]["path"] == str(ckpt) and len(spec["checkpoint"]["sha256"]) == 64
    res = dmsc(tmp_path, "up", "--plan", str(plan))
    assert res.returncode == 0, res.stderr
    try:
        res = dmsc(tmp_path, "train", "--steps", "2", "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout.splitlines()[-1])["steps"] == 2
        res = dmsc(tmp_path, "infer", "--prompt", "def ", "--tokens", "8", "--temperature", "0",
                   "--json")  # fmt: skip
        assert res.returncode == 0, res.stderr
        answer = json.loads(res.stdout)
        text, ids = answer["text"], answer["token_ids"]
        assert len(ids) == 8
        out = tmp_path / "exported"
        res = dmsc(tmp_path, "export", "--out", str(out))
        assert res.returncode == 0, res.stderr
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
    # The trained weights moved away from the checkpoint, and transformers runs them as dmsc did.
    before, after = (
        load_file(str(ckpt / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert not torch.equal(
        before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"]
    )
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = torch.tensor([tok.encode("def ").ids])
    want = model.generate(
        prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0
    )
    assert want[0, prompt.shape[1] :].tolist() == ids
    assert tok.decode(ids) == text
    # Training's own checkpoint folder is a sharded Hugging Face checkpoint too.
    saved = max(tmp_path.rglob("model.safetensors.index.json"), key=lambda p: p.stat().st_mtime)
    again = transformers.AutoModelForCausalLM.from_pretrained(saved.parent).eval()
    with torch.no_grad():
        assert torch.equal(again(prompt).logits, model(prompt).logits)
    # A checkpoint changed after planning is refused before anything starts.
    weights = load_file(str(ckpt / "model.safetensors"))
    weights["model.norm.weight"] += 1
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    res = dmsc(tmp_path, "up", "--plan", str(plan))
    assert res.returncode == 2 and "changed since the plan was made" in res.stderr
    assert "Traceback" not in res.stderr
