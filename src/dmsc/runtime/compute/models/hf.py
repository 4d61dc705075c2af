"""Hugging Face checkpoints: a stage reads only its own tensors from a directory of safetensors
(sharded or not), and a trained model is written back as a directory ``transformers`` loads.

Tensor names are those of ``transformers``' ``GPT2LMHeadModel`` (GPT-2 stores its linear layers
as ``Conv1D``, input by output: they are transposed on the way in and out), ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM`` and ``MixtralForCausalLM`` (the on-disk layout
``transformers`` 5 still writes: ``block_sparse_moe.experts.N.w1/w2/w3``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dmsc.runtime.compute.models.chain import StageModule, build_stage
from dmsc.spec import SpecError, TransformerSpec
from dmsc.spec.files import FileRefused, open_bounded
from dmsc.spec.hf import MAX_WEIGHT_BYTES, index_map, weight_roots

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files of a checkpoint directory that describe how to use it rather than hold weights.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)

_GPT2_BLOCK = {
    "ln1": "ln_1",
    "qkv": "attn.c_attn",
    "proj": "attn.c_proj",
    "ln2": "ln_2",
    "fc1": "mlp.c_fc",
    "fc2": "mlp.c_proj",
}
_GPT2_CONV1D = ("qkv", "proj", "fc1", "fc2")
_LLAMA_BLOCK = {
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.o": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
    "mlp.router": "block_sparse_moe.gate",
}
_MIXTRAL_EXPERT = {"gate": "w1", "down": "w2", "up": "w3"}


class CheckpointError(ValueError):
    """A checkpoint that does not hold what the model needs: one line naming file and tensor."""


def hf_key(spec: TransformerSpec, layer: str, param: str, prefix: str = "") -> tuple[str, bool]:
    """The checkpoint tensor of the runtime's ``layer``.``param`` and whether it is transposed.

    ``prefix`` is GPT-2's ``transformer.`` (``GPT2LMHeadModel``; the original GPT-2 files have
    none)."""
    module, _, leaf = param.rpartition(".")
    if spec.family == "gpt":
        if layer == "embedding":
            return f"{prefix}{'wte' if module == 'tok' else 'wpe'}.weight", False
        if layer == "head":
            if module == "ln":
                return f"{prefix}ln_f.{leaf}", False
            return ("lm_head.weight" if not spec.tied_embeddings else f"{prefix}wte.weight"), False
        i = layer.removeprefix("block_")
        return (
            f"{prefix}h.{i}.{_GPT2_BLOCK[module]}.{leaf}",
            module in _GPT2_CONV1D and leaf == "weight",
        )
    if layer == "embedding":
        return "model.embed_tokens.weight", False
    if layer == "head":
        if module == "norm":
            return "model.norm.weight", False
        return ("model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"), False
    i = layer.removeprefix("block_")
    if module.startswith("mlp.experts."):
        _, _, e, part = module.split(".")
        return (
            f"model.layers.{i}.block_sparse_moe.experts.{e}.{_MIXTRAL_EXPERT[part]}.{leaf}",
            False,
        )
    return f"model.layers.{i}.{_LLAMA_BLOCK[module]}.{leaf}", False


class SafetensorsDir:
    """The tensors of a checkpoint directory, by name, opened lazily (memory-mapped). The files
    are those :func:`dmsc.spec.hf.checkpoint_files` hashes: an index's entries are plain file
    names in the directory, and each file is a regular file that does not lead outside it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        try:
            mapped = index_map(directory)
        except SpecError as exc:
            raise CheckpointError(str(exc)) from None
        if mapped is not None:
            self.files: dict[str, Path] = mapped
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{directory}: no *.safetensors files")
            self.files = {}
            for path in files:
                with self._open(path) as fh:
                    self.files.update(dict.fromkeys(fh.keys(), path))
        self.prefix = (
            "transformer." if any(k.startswith("transformer.") for k in self.files) else ""
        )

    def read(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors ``keys``, each file opened once."""
        with ExitStack() as stack:
            handles: dict[Path, Any] = {}
            for key in keys:
                path = self.files.get(key)
                if path is None:
                    raise CheckpointError(f"{self.directory}: tensor {key!r} is missing")
                if path not in handles:
                    if not path.exists():
                        raise CheckpointError(f"{path}: missing (it holds tensor {key!r})")
                    handles[path] = stack.enter_context(self._open(path))
                yield key, handles[path].get_tensor(key)

    def _open(self, path: Path) -> Any:
        """``path`` opened by safetensors once it is known to be a regular file of bounded size
        inside the directory (or a hub snapshot's blobs)."""
        try:
            with open_bounded(path, MAX_WEIGHT_BYTES, weight_roots(self.directory)):
                pass
        except FileRefused as exc:
            raise CheckpointError(str(exc)) from None
        return safe_open(str(path.resolve()), "pt")


def load_stage(module: StageModule, spec: TransformerSpec, directory: Path) -> None:
    """Fill ``module``'s parameters from the checkpoint in ``directory``: only its own tensors are
    read. The weights are kept in float32 (the master copy of mixed-precision training)."""
    source = SafetensorsDir(directory)
    wanted: list[tuple[torch.Tensor, str, bool]] = []
    for name, layer in zip(module.names, module.layers, strict=True):
        for param, tensor in layer.state_dict(keep_vars=True).items():
            key, transpose = hf_key(spec, name, param, source.prefix)
            wanted.append((tensor, key, transpose))
    tensors = dict(source.read(sorted({key for _, key, _ in wanted})))
    with torch.no_grad():
        for target, key, transpose in wanted:
            value = tensors[key].t() if transpose else tensors[key]
            if value.shape != target.shape:
                raise CheckpointError(
                    f"{source.files[key]}: tensor {key!r} has shape {list(value.shape)}, "
                    f"the model's config.json gives {list(target.shape)}"
                )
            target.copy_(value.to(target.dtype))


def stage_module(
    spec: TransformerSpec,
    seed: int,
    first: str,
    last: str,
    chunks: list[tuple[str, str]] | None = None,
) -> StageModule:
    """The stage ``first`` .. ``last`` (or its ``chunks``, interleaved): loaded from the spec's
    checkpoint when it has one (only this stage's layers are built and read), else built from
    ``seed``."""
    if spec.checkpoint is None:
        return build_stage(spec, seed, first, last, chunks=chunks)
    module = build_stage(spec, seed, first, last, empty=True, chunks=chunks)
    load_stage(module, spec, Path(spec.checkpoint.path))
    return module


def hf_config(spec: TransformerSpec) -> dict[str, Any]:
    """``config.json`` of ``spec`` in ``transformers``' terms."""
    if spec.family == "gpt":
        # GPT-2's <|endoftext|> (transformers' default) where the vocabulary holds it; a
        # byte-level model (gpt-mini, 256) has no such token, and 50256 made transformers warn
        end_of_text = 50256 if spec.vocab > 50256 else None
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_layer": spec.layers,
            "n_embd": spec.hidden,
            "n_head": spec.heads,
            "n_inner": spec.ffn_size,
            "n_positions": spec.positions,
            "vocab_size": spec.vocab,
            "layer_norm_epsilon": spec.norm_eps,
            "activation_function": "gelu_new" if spec.gelu_approximate == "tanh" else "gelu",
            "tie_word_embeddings": spec.tied_embeddings,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "torch_dtype": "float32",
            "bos_token_id": end_of_text,
            "eos_token_id": end_of_text,
        }
    model_type = "mixtral" if spec.is_moe else ("qwen2" if spec.qkv_bias else "llama")
    arch = {"mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
        model_type, "LlamaForCausalLM"
    )
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "num_hidden_layers": spec.layers,
        "hidden_size": spec.hidden,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads_count,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.ffn_size,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.positions,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tied_embeddings,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    }
    if spec.rope_scaling is not None:
        s = spec.rope_scaling
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_positions,
        }
    if spec.is_moe:
        cfg |= {"num_local_experts": spec.experts, "num_experts_per_tok": spec.top_k}
    return cfg


def stage_tensors(
    spec: TransformerSpec, names: list[str], state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A stage's state dict (``layers.N.param`` of a :class:`StageModule`), checkpoint names."""
    out: dict[str, torch.Tensor] = {}
    prefix = "transformer." if spec.family == "gpt" else ""
    for key, value in state.items():
        _, index, param = key.split(".", 2)
        hf, transpose = hf_key(spec, names[int(index)], param, prefix)
        if names[int(index)] == "head" and spec.tied_embeddings and param.startswith("out."):
            continue  # the embedding's tensor is the head's
        out[hf] = (value.t() if transpose else value).detach().to("cpu", torch.float32).contiguous()
    return out


def export(
    spec: TransformerSpec,
    stages: list[tuple[list[str], dict[str, torch.Tensor]]],
    out: Path,
    source: Path | None = None,
) -> Path:
    """Write the model of ``stages`` (layer names and state dict of each) as a Hugging Face
    directory: ``config.json``, ``model.safetensors`` and, from ``source``, the tokenizer."""
    tensors: dict[str, torch.Tensor] = {}
    for names, state in stages:
        tensors.update(stage_tensors(spec, names, state))
    return write_model_dir(spec, tensors, out, source)


def write_side_files(spec: TransformerSpec, out: Path, source: Path | None = None) -> None:
    """``config.json`` of ``spec`` and, from the checkpoint directory ``source``, the
    tokenizer's files."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=2) + "\n")
    if source is not None:
        for name in SIDE_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)


def write_model_dir(
    spec: TransformerSpec, tensors: dict[str, torch.Tensor], out: Path, source: Path | None = None
) -> Path:
    """A Hugging Face directory of ``tensors`` (checkpoint names): ``model.safetensors``,
    ``config.json`` and the tokenizer of ``source``."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / SINGLE), metadata={"format": "pt"})
    write_side_files(spec, out, source)
    return out


def write_index(spec: TransformerSpec, folder: Path, files: dict[str, list[str]]) -> None:
    """Make the stage files of one checkpoint (file name -> the tensors it holds) a sharded
    Hugging Face checkpoint: ``model.safetensors.index.json``, ``config.json`` and the
    tokenizer of the model's own checkpoint. A tensor two stages hold (a tied embedding) is read
    from the first."""
    weight_map: dict[str, str] = {}
    for name in sorted(files):
        for key in files[name]:
            weight_map.setdefault(key, name)
    index = {"metadata": {"format": "pt"}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    source = Path(spec.checkpoint.path) if spec.checkpoint is not None else None
    write_side_files(spec, folder, source)
