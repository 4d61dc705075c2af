"""Models by name, and the command line's shape overrides.

Shapes from the papers that introduced them: GPT-3 (Brown et al. 2020, Table 2.1; the 13B model is
listed with d_model 5140 there, we use 5120 = 40 heads x 128 as public re-implementations do),
Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, Table 3), Mixtral (Jiang et al. 2024, Table 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from dmsc.spec.errors import SpecError, spec_error_from_validation
from dmsc.spec.hf import hf_document, is_hf
from dmsc.spec.loader import read_document
from dmsc.spec.model import BlockGraphSpec, LayerListSpec, ModelSpec, TransformerSpec
from dmsc.spec.suggest import close_field

_GPT3 = {"seq": 2048, "vocab": 50257, "dtype": "fp16", "mlp": "gelu", "tied_embeddings": True}
_LLAMA3 = {"seq": 8192, "vocab": 128256, "dtype": "bf16", "mlp": "swiglu", "kv_heads": 8}

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "gpt3-125m": {**_GPT3, "layers": 12, "hidden": 768, "heads": 12},
    "gpt3-350m": {**_GPT3, "layers": 24, "hidden": 1024, "heads": 16},
    "gpt3-760m": {**_GPT3, "layers": 24, "hidden": 1536, "heads": 16},
    "gpt3-1.3b": {**_GPT3, "layers": 24, "hidden": 2048, "heads": 16},
    "gpt3-2.7b": {**_GPT3, "layers": 32, "hidden": 2560, "heads": 32},
    "gpt3-6.7b": {**_GPT3, "layers": 32, "hidden": 4096, "heads": 32},
    "gpt3-13b": {**_GPT3, "layers": 40, "hidden": 5120, "heads": 40},
    "gpt3-175b": {**_GPT3, "layers": 96, "hidden": 12288, "heads": 96},
    "llama3-8b": {**_LLAMA3, "layers": 32, "hidden": 4096, "heads": 32, "ffn": 14336},
    "llama3-70b": {**_LLAMA3, "layers": 80, "hidden": 8192, "heads": 64, "ffn": 28672},
    # Mixtral's context is 32k tokens; 4096 is a common training sequence length for it.
    "mixtral-8x7b": {
        **_LLAMA3,
        "vocab": 32000,
        "seq": 4096,
        "layers": 32,
        "hidden": 4096,
        "heads": 32,
        "ffn": 14336,
        "experts": 8,
        "top_k": 2,
    },
    # Small enough to train on a laptop CPU in minutes: byte-level vocabulary, fp32. One per
    # family the runtime runs: GPT, Llama (grouped-query attention) and a Mixtral-style MoE.
    "gpt-mini": {
        "layers": 4,
        "hidden": 128,
        "heads": 4,
        "seq": 128,
        "vocab": 256,
        "dtype": "fp32",
        "mlp": "gelu",
    },
    "llama-mini": {
        "layers": 4,
        "hidden": 128,
        "heads": 4,
        "kv_heads": 2,
        "ffn": 352,
        "seq": 128,
        "vocab": 256,
        "dtype": "fp32",
        "mlp": "swiglu",
    },
    "moe-mini": {
        "layers": 4,
        "hidden": 128,
        "heads": 4,
        "kv_heads": 2,
        "ffn": 176,
        "seq": 128,
        "vocab": 256,
        "dtype": "fp32",
        "mlp": "swiglu",
        "experts": 4,
        "top_k": 2,
    },
}

SHAPE_FIELDS = ("layers", "hidden", "heads", "ffn", "seq", "vocab")
AnyModel = TransformerSpec | LayerListSpec | BlockGraphSpec
_MODEL_ADAPTER: TypeAdapter[AnyModel] = TypeAdapter(ModelSpec)


def parse_any_model(data: Any, source: str) -> AnyModel:
    """Validate a model document of any kind (``kind`` defaults to ``transformer``)."""
    if not isinstance(data, dict):
        raise SpecError(source, "<root>", "expected a mapping of fields at the top level")
    data = {"kind": "transformer", **data}
    try:
        return _MODEL_ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise spec_error_from_validation(
            source, exc, ("transformer", "layers", "blocks"), model=ModelSpec
        ) from None


def parse_model(data: Any, source: str) -> TransformerSpec | LayerListSpec:
    """Validate a model document (``kind`` defaults to ``transformer``)."""
    if not isinstance(data, dict):
        raise SpecError(source, "<root>", "expected a mapping of fields at the top level")
    model = parse_any_model(data, source)
    if isinstance(model, BlockGraphSpec):
        raise SpecError(
            source, "kind", "a block graph is segmented with `dmsc segment`, not costed"
        )
    return model


def resolve_model(
    name_or_path: str | None, overrides: dict[str, int | None] | None = None
) -> TransformerSpec | LayerListSpec:
    """A preset name or a spec file, with the non-None ``overrides`` (shape flags) applied.

    Without a name, the overrides alone define a transformer (they must then give every shape
    field but ``ffn``).
    """
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    data, source = _document(name_or_path, given)
    try:
        return parse_model(data, source)
    except SpecError as err:
        # A bad value that a shape flag gave is the flag's fault, not the preset's or the file's,
        # also where it only clashes with a value the preset or file gave (--heads 7 on a
        # preset whose hidden size 7 does not divide).
        if given and isinstance(data, dict):
            clash = _shape_flag_clash(data, given, source)
            if clash is not None:
                raise clash from None
        field = err.field.split(".")[0]
        if field in given:
            raise SpecError("command line", f"--{field}", err.reason) from None
        raise


def _document(name_or_path: str | None, given: dict[str, int]) -> tuple[Any, str]:
    """The model document (with the shape flags applied) and the source its errors name."""
    if name_or_path is None:
        missing = [f"--{k}" for k in SHAPE_FIELDS if k != "ffn" and k not in given]
        if missing:
            raise SpecError(
                "--model", "", f"no model given; name a preset or give {', '.join(missing)}"
            )
        return {"name": "custom", **given}, "command line"
    if is_hf(name_or_path):
        doc, source = hf_document(name_or_path, given.get("seq"))
        return {**doc, **given}, source
    if name_or_path in MODEL_PRESETS:
        base: dict[str, Any] = {"name": name_or_path, **MODEL_PRESETS[name_or_path]}
        return {**base, **given}, f"preset {name_or_path}"
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        guess = close_field(name_or_path, list(MODEL_PRESETS))
        raise SpecError(
            "--model",
            "",
            f"unknown model {name_or_path!r}; did you mean {guess}?"
            if guess
            else f"unknown model {name_or_path!r} (presets: {', '.join(MODEL_PRESETS)}; or a file)",
        )
    data = read_document(path)
    if given:
        if not isinstance(data, dict) or data.get("kind", "transformer") != "transformer":
            raise SpecError(str(path), "kind", "shape flags apply only to transformer models")
        data = {**data, **given}
    return data, str(path)


def _shape_flag_clash(data: dict[str, Any], given: dict[str, int], source: str) -> SpecError | None:
    """The check across shape fields (heads divide hidden, kv_heads divide heads) that a shape
    flag fails, as an error that names the flag and where the other value came from; None where
    no flag is involved (or a value is not a positive whole number: its own check reports it)."""

    def number(field: str) -> int | None:
        value = data.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        return None

    def origin(field: str) -> str:
        return f"given by --{field}" if field in given else f"of {source}"

    hidden, heads, kv_heads = number("hidden"), number("heads"), number("kv_heads")
    if hidden is not None and heads is not None and hidden % heads:
        if "heads" in given:
            reason = f"{heads} does not divide the hidden size {hidden} {origin('hidden')}"
            return SpecError("command line", "--heads", reason)
        if "hidden" in given:
            reason = f"{hidden} is not divisible by the {heads} heads {origin('heads')}"
            return SpecError("command line", "--hidden", reason)
    if heads is not None and kv_heads is not None and heads % kv_heads and "heads" in given:
        reason = f"{heads} is not a multiple of the {kv_heads} kv_heads {origin('kv_heads')}"
        return SpecError("command line", "--heads", reason)
    return None
