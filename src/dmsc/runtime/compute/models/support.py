"""What the runtime's model families can compute, checked without importing torch (the CLI
checks a plan before it starts anything)."""

from __future__ import annotations

from dmsc.spec import TransformerSpec


def layer_names(spec: TransformerSpec) -> list[str]:
    """The chain of layers every family runs, by the names the cost model and the plan use."""
    return ["embedding", *[f"block_{i}" for i in range(spec.layers)], "head"]


def check_runnable(spec: TransformerSpec) -> None:
    """A ValueError naming what the runtime cannot compute for ``spec``."""
    if spec.dropout:
        raise ValueError("the runtime models have no dropout (dropout: 0)")
    if spec.family == "gpt" and (spec.is_moe or spec.kv_heads_count != spec.heads):
        raise ValueError(
            "a GPT model (mlp: gelu) runs with full attention and no experts; "
            "grouped-query attention and experts are the Llama family's (mlp: swiglu)"
        )


def check_tp_divisible(spec: TransformerSpec, tp: int) -> None:
    """A ValueError naming the model's shape that ``tp`` tensor-parallel ranks cannot share
    evenly (each rank holds whole attention heads and an equal part of the MLP)."""
    for what, value in (
        ("heads", spec.heads),
        ("kv_heads", spec.kv_heads_count),
        ("ffn", spec.ffn_size),
    ):
        if value % tp:
            raise ValueError(f"tp={tp} does not divide the model's {what} ({value})")
