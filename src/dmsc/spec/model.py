"""The model spec: a transformer given by its shape, or any model given as a list of layers."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dmsc.spec.cluster import Dtype, Name


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RopeScaling(_Spec):
    """Llama 3's rotary frequency scaling (Meta's ``rope_type: llama3``): wavelengths longer than
    ``original_max_positions / low_freq_factor`` are divided by ``factor``, those shorter than
    ``original_max_positions / high_freq_factor`` kept, the band between interpolated."""

    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_positions: int = Field(gt=0)


class CheckpointRef(_Spec):
    """A Hugging Face checkpoint directory and the SHA-256 of its files when the plan was made."""

    path: str
    sha256: str = ""


class TransformerSpec(_Spec):
    """A decoder-only transformer by its shape (GPT, Llama, Mixtral families).

    ``experts`` > 1 makes the MLP of every ``moe_every``-th layer a mixture of experts that sends
    each token to ``top_k`` of them.
    """

    kind: Literal["transformer"] = "transformer"
    name: Name = "transformer"
    layers: int = Field(gt=0, le=10_000)
    hidden: int = Field(gt=0, le=1_000_000)
    heads: int = Field(gt=0, le=100_000)
    kv_heads: int | None = Field(default=None, gt=0, description="Grouped-query attention.")
    ffn: int | None = Field(default=None, gt=0, description="MLP width (default 4 x hidden).")
    seq: int = Field(gt=0, le=10_000_000)
    vocab: int = Field(gt=0, le=100_000_000)
    dtype: Dtype = "bf16"
    mlp: Literal["gelu", "swiglu"] = "gelu"
    experts: int = Field(default=1, gt=0, le=100_000)
    top_k: int = Field(default=1, gt=0)
    moe_every: int = Field(default=1, gt=0)
    tied_embeddings: bool = False
    dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Dropout rate (0: no dropout masks kept, as in Llama; GPT-3 used 0.1).",
    )
    # What the runtime needs beyond the shape to compute the same function as a published
    # checkpoint; the cost model ignores these.
    norm_eps: float = Field(default=1e-5, gt=0, lt=1, description="LayerNorm / RMSNorm epsilon.")
    rope_theta: float = Field(default=10000.0, gt=0, description="Rotary base (Llama family).")
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = Field(default=False, description="Biases on Q, K, V (Qwen2; Llama family).")
    gelu_approximate: Literal["none", "tanh"] = Field(
        default="none", description="GeLU as torch's F.gelu(approximate=...); GPT-2 uses tanh."
    )
    max_positions: int | None = Field(
        default=None, gt=0, description="Rows of the learned position table (default: seq)."
    )
    checkpoint: CheckpointRef | None = Field(
        default=None, description="The Hugging Face directory the weights come from."
    )

    @model_validator(mode="after")
    def _shape(self) -> Self:
        if self.hidden % self.heads:
            raise ValueError(f"hidden: {self.hidden} is not divisible by heads={self.heads}")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: heads={self.heads} is not divisible by {self.kv_heads}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k: {self.top_k} is more than experts={self.experts}")
        if self.max_positions is not None and self.max_positions < self.seq:
            raise ValueError(
                f"max_positions: {self.max_positions} positions cannot hold seq={self.seq}"
            )
        return self

    @property
    def ffn_size(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def family(self) -> Literal["gpt", "llama"]:
        """GPT (LayerNorm, GeLU, learned positions) or Llama (RMSNorm, SwiGLU, rotary)."""
        return "gpt" if self.mlp == "gelu" else "llama"

    @property
    def positions(self) -> int:
        return self.max_positions if self.max_positions is not None else self.seq

    @property
    def kv_heads_count(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        return self.experts > 1

    def is_moe_layer(self, index: int) -> bool:
        return self.is_moe and (index % self.moe_every == self.moe_every - 1)


class LayerSpec(_Spec):
    """One layer of an arbitrary model, per sample (one sequence or one image)."""

    name: Name = "layer"
    forward_gflop: float = Field(ge=0, description="Forward FLOPs per sample, in GFLOP.")
    params: int = Field(ge=0)
    activation_bytes: int = Field(ge=0, description="Bytes kept for backward, per sample.")
    output_bytes: int = Field(ge=0, description="Bytes sent to the next layer, per sample.")


class LayerListSpec(_Spec):
    """Any model as a chain of layers with their costs (CNNs, encoders, custom blocks)."""

    kind: Literal["layers"] = "layers"
    name: Name = "model"
    dtype: Dtype = "fp32"
    tokens_per_sample: int = Field(default=1, gt=0, description="For tokens/s figures.")
    layer_list: list[LayerSpec] = Field(min_length=1)


class BlockSpec(LayerSpec):
    """A block of a model given as a graph; ``task`` marks it as part of a task head."""

    task: Name | None = None


class BlockGraphSpec(_Spec):
    """A model as a directed graph of blocks (branches, shared backbone with task heads).

    ``edges`` are ``[source, target]`` pairs of block names; a block's ``output_bytes`` is what
    each of its out-edges carries per sample.
    """

    kind: Literal["blocks"] = "blocks"
    name: Name = "model"
    dtype: Dtype = "fp32"
    blocks: list[BlockSpec] = Field(min_length=1)
    edges: list[tuple[Name, Name]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _graph(self) -> Self:
        names = [b.name for b in self.blocks]
        seen: set[str] = set()
        for i, n in enumerate(names):
            if n in seen:
                raise ValueError(f"blocks[{i}].name: duplicate block {n!r}")
            seen.add(n)
        for i, (a, b) in enumerate(self.edges):
            for end in (a, b):
                if end not in seen:
                    raise ValueError(f"edges[{i}]: unknown block {end!r}")
            if a == b:
                raise ValueError(f"edges[{i}]: block {a!r} feeds itself")
        return self


ModelSpec = Annotated[TransformerSpec | LayerListSpec | BlockGraphSpec, Field(discriminator="kind")]
