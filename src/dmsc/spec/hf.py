"""A Hugging Face checkpoint directory as a model spec: the shape from its ``config.json``.

``--model hf:DIR`` names a directory with ``config.json`` and ``*.safetensors`` (sharded or
not). The families the runtime computes exactly as ``transformers`` does:

- ``llama``, ``mistral``, ``qwen2`` (RMSNorm, rotary positions, SwiGLU, grouped-query attention;
  Qwen2 with biases on Q, K and V),
- ``mixtral`` (the same with a top-k mixture of experts in every layer),
- ``gpt2`` (LayerNorm, learned positions, tanh GeLU, tied embeddings).

Only ``config.json`` is read here (the planner needs the shape, not the weights); the runtime
opens the safetensors of its own layers (:mod:`dmsc.runtime.compute.models.hf`). Field names
follow ``transformers`` 4.x configs and 5.x's ``rope_parameters``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from dmsc.spec.errors import SpecError

PREFIX = "hf:"
LLAMA_TYPES = ("llama", "mistral", "qwen2", "mixtral")
SUPPORTED = (*LLAMA_TYPES, "gpt2")
DEFAULT_SEQ = 2048  # the training sequence when the model allows more (--seq overrides)
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def is_hf(name: str | None) -> bool:
    return name is not None and name.startswith(PREFIX)


def hf_dir(name: str) -> Path:
    return Path(name[len(PREFIX) :]).expanduser()


def read_config(directory: Path) -> dict[str, Any]:
    """The directory's ``config.json`` as a mapping; a one-line error when it is not one."""
    path = directory / "config.json"
    if not directory.is_dir():
        raise SpecError(str(directory), "", "not a directory (hf:DIR names a checkpoint directory)")
    if not path.is_file():
        raise SpecError(str(directory), "config.json", "missing: not a Hugging Face checkpoint")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(str(path), "<root>", f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(str(path), "<root>", "expected a JSON object")
    return data


def hf_document(name: str, seq: int | None = None) -> tuple[dict[str, Any], str]:
    """The model document of ``hf:DIR`` (``seq`` from ``--seq``) and the source its errors name."""
    directory = hf_dir(name).resolve()
    cfg = read_config(directory)
    source = str(directory / "config.json")

    def get(key: str, default: Any = None, *, required: bool = False) -> Any:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
        if required:
            raise SpecError(source, key, "missing")
        return default

    def refuse(key: str, reason: str) -> SpecError:
        return SpecError(source, key, reason)

    model_type = get("model_type", required=True)
    if model_type not in SUPPORTED:
        raise refuse("model_type", f"{model_type!r} is not supported (supported: {SUPPORTED})")
    doc: dict[str, Any] = {
        "name": re.sub(r"[^A-Za-z0-9._-]+", "-", directory.name) or "hf-model",
        "checkpoint": {"path": str(directory)},
        "dtype": _DTYPES.get(str(get("torch_dtype", get("dtype", "float32"))), "fp32"),
    }
    if model_type == "gpt2":
        act = get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise refuse("activation_function", f"{act!r} is not supported (gelu, gelu_new)")
        if get("scale_attn_by_inverse_layer_idx", False) or get("reorder_and_upcast_attn", False):
            raise refuse("scale_attn_by_inverse_layer_idx", "attention variants are not supported")
        positions = int(get("n_positions", 1024))
        hidden = int(get("n_embd", required=True))
        doc |= {
            "layers": get("n_layer", required=True),
            "hidden": hidden,
            "heads": get("n_head", required=True),
            "ffn": get("n_inner", 4 * hidden),
            "vocab": get("vocab_size", required=True),
            "mlp": "gelu",
            "tied_embeddings": True,
            "norm_eps": get("layer_norm_epsilon", 1e-5),
            "gelu_approximate": "none" if act == "gelu" else "tanh",
            "max_positions": positions,
            "seq": _seq(seq, positions, source),
        }
        return doc, source
    # The Llama family.
    if get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", f"{get('hidden_act')!r} is not supported (silu)")
    if get("attention_bias", False) or get("mlp_bias", False):
        raise refuse("attention_bias", "biases on the output projection or MLP are not supported")
    hidden, heads = int(get("hidden_size", required=True)), int(get("num_attention_heads", 1))
    head_dim = get("head_dim")
    if head_dim is not None and heads and int(head_dim) * heads != hidden:
        raise refuse("head_dim", f"{head_dim} x {heads} heads is not the hidden size {hidden}")
    positions = int(get("max_position_embeddings", DEFAULT_SEQ))
    doc |= {
        "layers": get("num_hidden_layers", required=True),
        "hidden": hidden,
        "heads": get("num_attention_heads", required=True),
        "kv_heads": get("num_key_value_heads", heads),
        "ffn": get("intermediate_size", required=True),
        "vocab": get("vocab_size", required=True),
        "mlp": "swiglu",
        "tied_embeddings": bool(get("tie_word_embeddings", False)),
        "norm_eps": get("rms_norm_eps", 1e-6),
        "qkv_bias": model_type == "qwen2",
        "seq": _seq(seq, positions, source),
    }
    window = get("sliding_window")
    windowed = model_type != "qwen2" or get("use_sliding_window", False)
    if window is not None and windowed and int(window) < doc["seq"]:
        raise refuse("sliding_window", f"{window} tokens is shorter than seq={doc['seq']}")
    if model_type == "mixtral":
        doc |= {"experts": get("num_local_experts", required=True)}
        doc |= {"top_k": get("num_experts_per_tok", required=True)}
    rope = dict(get("rope_parameters", {}) or {})
    scaling = get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    doc["rope_theta"] = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise refuse("rope_scaling", f"rope type {kind!r} is not supported (default, llama3)")
        doc["rope_scaling"] = {
            "factor": scaling["factor"],
            "low_freq_factor": scaling["low_freq_factor"],
            "high_freq_factor": scaling["high_freq_factor"],
            "original_max_positions": scaling["original_max_position_embeddings"],
        }
    return doc, source


def _seq(seq: int | None, positions: int, source: str) -> int:
    """The training sequence: ``--seq``, else the model's context up to :data:`DEFAULT_SEQ`."""
    if seq is None:
        return min(positions, DEFAULT_SEQ)
    if seq > positions:
        raise SpecError(
            "command line", "--seq", f"{seq} is longer than the {positions} positions of {source}"
        )
    return seq


def checkpoint_sha256(directory: Path) -> str:
    """SHA-256 over the directory's ``config.json`` and safetensors files, in name order."""
    digest = hashlib.sha256()
    files = [directory / "config.json", *sorted(directory.glob("*.safetensors"))]
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()
