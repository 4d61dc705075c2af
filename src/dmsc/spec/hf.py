"""A Hugging Face checkpoint directory as a model spec: the shape from its ``config.json``.

``--model hf:DIR`` names a directory with ``config.json`` and ``*.safetensors`` (sharded or
not). The families the runtime computes exactly as ``transformers`` does:

- ``llama``, ``mistral``, ``qwen2`` (RMSNorm, rotary positions, SwiGLU, grouped-query attention;
  Qwen2 with biases on Q, K and V),
- ``mixtral`` (the same with a top-k mixture of experts in every layer),
- ``gpt2`` (LayerNorm, learned positions, tanh GeLU, tied embeddings).

Only ``config.json`` is read for the shape (the planner needs the shape, not the weights); the
runtime opens the safetensors of its own layers (:mod:`dmsc.runtime.compute.models.hf`). Field
names follow ``transformers`` 4.x configs and 5.x's ``rope_parameters``.

The plan pins the checkpoint by :func:`checkpoint_sha256`, over every file the runtime loads
(:func:`checkpoint_files`: ``config.json``, the shard index when there is one, and each weight
file), and ``dmsc up`` checks it again. The files are regular files of bounded size inside the
directory (a shard index naming ``../elsewhere`` is refused; a Hugging Face hub snapshot's links
into its ``blobs`` folder are followed), and each safetensors header is checked against its file
(dtypes known, every tensor's shape matching its bytes), so that a checkpoint the workers would
refuse is refused when planning and before ``dmsc up`` starts anything.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from dmsc.spec.errors import SpecError
from dmsc.spec.files import FileRefused, hash_bounded, open_bounded, read_bounded, resolve_within

PREFIX = "hf:"
LLAMA_TYPES = ("llama", "mistral", "qwen2", "mixtral")
SUPPORTED = (*LLAMA_TYPES, "gpt2")
DEFAULT_SEQ = 2048  # the training sequence when the model allows more (--seq overrides)
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
INDEX = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 << 20  # config.json, the shard index
MAX_WEIGHT_BYTES = 1 << 40  # one safetensors file
MAX_HEADER_BYTES = 100 << 20  # a safetensors header (the library's own limit)
# bytes per element of the dtypes safetensors stores
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def is_hf(name: str | None) -> bool:
    return name is not None and name.startswith(PREFIX)


def hf_dir(name: str) -> Path:
    return Path(name[len(PREFIX) :]).expanduser()


def read_config(directory: Path) -> dict[str, Any]:
    """The directory's ``config.json`` as a mapping; a one-line error when it is not one."""
    path = directory / "config.json"
    if not directory.is_dir():
        raise SpecError(str(directory), "", "not a directory (hf:DIR names a checkpoint directory)")
    if not path.exists() and not path.is_symlink():
        raise SpecError(str(directory), "config.json", "missing: not a Hugging Face checkpoint")
    return _json_file(path, directory)


def _json_file(path: Path, directory: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_bounded(path, MAX_JSON_BYTES, within=weight_roots(directory)))
    except FileRefused as exc:
        raise SpecError(str(directory), path.name, str(exc)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
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

    def integer(key: str, default: Any = None, *, required: bool = False) -> int:
        value = get(key, default, required=required)
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise refuse(key, f"{value!r} is not a whole number")
        if value < 1:
            raise refuse(key, f"{value!r} must be at least 1")
        return int(value)

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
        positions = integer("n_positions", 1024)
        hidden = integer("n_embd", required=True)
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
    hidden, heads = integer("hidden_size", required=True), integer("num_attention_heads", 1)
    head_dim = get("head_dim")
    if head_dim is not None and integer("head_dim") * heads != hidden:
        raise refuse("head_dim", f"{head_dim} x {heads} heads is not the hidden size {hidden}")
    positions = integer("max_position_embeddings", DEFAULT_SEQ)
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
    if window is not None and windowed and integer("sliding_window") < doc["seq"]:
        raise refuse("sliding_window", f"{window} tokens is shorter than seq={doc['seq']}")
    if model_type == "mixtral":
        doc |= {"experts": get("num_local_experts", required=True)}
        doc |= {"top_k": get("num_experts_per_tok", required=True)}
    rope = get("rope_parameters", {}) or {}
    if not isinstance(rope, dict):
        raise refuse("rope_parameters", f"{rope!r} is not a mapping")
    scaling = get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    theta = rope.get("rope_theta", get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise refuse("rope_theta", f"{theta!r} is not a positive number")
    doc["rope_theta"] = float(theta)
    if scaling:
        if not isinstance(scaling, dict):
            raise refuse("rope_scaling", f"{scaling!r} is not a mapping")
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise refuse("rope_scaling", f"rope type {kind!r} is not supported (default, llama3)")
        fields = {
            "factor": "factor",
            "low_freq_factor": "low_freq_factor",
            "high_freq_factor": "high_freq_factor",
            "original_max_positions": "original_max_position_embeddings",
        }
        doc["rope_scaling"] = {}
        for ours, theirs in fields.items():
            value = scaling.get(theirs)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                reason = "missing" if value is None else f"{value!r} is not a positive number"
                raise refuse(f"rope_scaling.{theirs}", reason)
            doc["rope_scaling"][ours] = value
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


def weight_roots(directory: Path) -> tuple[Path, ...]:
    """Where a checkpoint's files may lead: its directory, and for a Hugging Face hub snapshot
    (``models--ORG--NAME/snapshots/REV``, whose files link to ``../../blobs``) its blobs."""
    if directory.parent.name == "snapshots":
        return (directory, directory.parent.parent / "blobs")
    return (directory,)


def index_map(directory: Path) -> dict[str, Path] | None:
    """The shard index of ``directory`` (``model.safetensors.index.json``): tensor name -> the
    file holding it, each a plain file name in the directory; None when there is no index.
    SpecError names the index and the entry that is not."""
    index = directory / INDEX
    if not index.exists() and not index.is_symlink():
        return None
    weight_map = _json_file(index, directory).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise SpecError(str(index), "weight_map", "missing: expected tensor name -> file name")
    out: dict[str, Path] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or not re.fullmatch(r"[^/\\\0]+\.safetensors", name):
            raise SpecError(
                str(index), f"weight_map.{key}", f"{name!r} is not a .safetensors file name here"
            )
        out[key] = directory / name
    return out


def checkpoint_files(directory: Path) -> list[Path]:
    """Every file the runtime loads from the checkpoint ``directory``: ``config.json``, then the
    shard index and the files it names (once each), or every ``*.safetensors`` file, in name
    order. SpecError when there are no safetensors (a pickle-only ``*.bin`` checkpoint is not
    loaded: it could run code) or a file leads outside the directory."""
    files = [directory / "config.json"]
    mapped = index_map(directory)
    if mapped is not None:
        weights = sorted(set(mapped.values()))
        files.append(directory / INDEX)
    else:
        weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(
            p.name for p in directory.glob("*.pt*")
        )
        reason = "no *.safetensors files"
        if pickles:
            reason += f" (only {', '.join(pickles[:3])}: pickle checkpoints are not loaded)"
        raise SpecError(str(directory), "*.safetensors", reason)
    for path in files + weights:
        try:
            resolve_within(path, weight_roots(directory))
        except FileRefused as exc:
            raise SpecError(str(directory), path.name, str(exc)) from None
    return files + weights


def check_safetensors(path: Path, directory: Path) -> None:
    """The header of the safetensors file ``path``: JSON of bounded size whose every tensor has
    a known dtype and a shape whose bytes are its span of the file, within the file."""
    try:
        with open_bounded(path, MAX_WEIGHT_BYTES, weight_roots(directory)) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
                raise SpecError(str(path), "<header>", "not a safetensors file (bad header size)")
            header = json.loads(fh.read(n))
    except FileRefused as exc:
        raise SpecError(str(directory), path.name, str(exc)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(str(path), "<header>", f"not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SpecError(str(path), "<header>", "expected a JSON object")
    room = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"<header>.{name}"
        if not isinstance(entry, dict):
            raise SpecError(str(path), where, "expected dtype, shape and data_offsets")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _ITEMSIZE:
            raise SpecError(str(path), where, f"dtype {dtype!r} is not one safetensors stores")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise SpecError(str(path), where, f"shape {shape!r} is not a list of sizes")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= room
        ):
            raise SpecError(str(path), where, f"data_offsets {offsets!r} lie outside the file")
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        if nbytes != offsets[1] - offsets[0]:
            raise SpecError(
                str(path),
                where,
                f"shape {shape} of {dtype} needs {nbytes:,} bytes, "
                f"the file holds {offsets[1] - offsets[0]:,}",
            )


def checkpoint_sha256(directory: Path) -> str:
    """SHA-256 over every file the runtime loads (:func:`checkpoint_files`), each by name and
    content, after checking each safetensors header (:func:`check_safetensors`). SpecError
    names a file that is refused."""
    digest = hashlib.sha256()
    for path in checkpoint_files(directory):
        if path.suffix == ".safetensors":
            check_safetensors(path, directory)
        limit = MAX_WEIGHT_BYTES if path.suffix == ".safetensors" else MAX_JSON_BYTES
        digest.update(path.name.encode() + b"\0")
        try:
            hash_bounded(digest, path, limit, weight_roots(directory))
        except FileRefused as exc:
            raise SpecError(str(directory), path.name, str(exc)) from None
    return digest.hexdigest()
