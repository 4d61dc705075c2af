"""How a job's data-parallel replicas agree: the synchronisation mode and the compression of
what they send.

- ``every-step``: the gradient is all-reduced every iteration (data parallelism as usual).
- ``diloco:H``: each replica takes ``H`` inner optimizer steps, then the replicas all-reduce a
  pseudo-gradient (the change of the weights over the round, as large as a gradient) and take
  one outer step (Douillard et al. 2023, "DiLoCo").
- ``fedavg:H``, ``fedprox:H``: ``H`` local steps per round, then one average of the models
  (McMahan et al. 2017; Li et al. 2020 add a proximal term to the local steps): the same
  traffic as ``diloco:H``.

Compression of what travels (the forms the runtime's codecs take):
``none``, ``bf16``, ``int8[:BLOCK]`` (one int8 per element and an fp32 scale per block of
``BLOCK``, 256 by default), ``topk:F`` (the fraction ``F`` of the elements, each an int32 index
and an fp32 value) and ``powersgd:R`` (each weight matrix as two rank-``R`` fp32 factors).
What these cost is the cost model's business (:mod:`dmsc.netmodel.sync`); here they are parsed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SyncMode = Literal["every-step", "diloco", "fedavg", "fedprox"]
SYNC_MODES: tuple[SyncMode, ...] = ("every-step", "diloco", "fedavg", "fedprox")
SYNC_FORMS = "every-step, diloco:H, fedavg:H or fedprox:H (H inner steps per round, 1 or more)"
COMPRESS_FORMS = (
    "none, bf16, int8, int8:BLOCK (BLOCK elements per scale, 1 or more), "
    "topk:F (0 < F <= 1, the fraction of elements kept) or powersgd:R (rank R, 1 or more)"
)
MAX_INNER_STEPS = 100_000
MAX_RANK = 4096
MAX_BLOCK = 1_000_000
INT8_BLOCK = 256  # the runtime's int8 codec's default block


@dataclass(frozen=True)
class Compression:
    """A parsed compression form: its kind and its one parameter (block, fraction or rank)."""

    kind: Literal["none", "bf16", "int8", "topk", "powersgd"]
    block: int = INT8_BLOCK
    fraction: float = 1.0
    rank: int = 0


def _positive_int(text: str, most: int) -> int | None:
    if not text.isdigit():
        return None
    value = int(text)
    return value if 1 <= value <= most else None


def parse_compress(text: str) -> Compression:
    """``none``, ``bf16``, ``int8[:BLOCK]``, ``topk:F`` or ``powersgd:R``; ValueError naming the
    accepted forms otherwise."""
    kind, colon, arg = text.strip().partition(":")
    if not colon and kind in ("none", "bf16", "int8"):
        return Compression(kind)  # type: ignore[arg-type]
    if colon and kind == "int8" and (block := _positive_int(arg, MAX_BLOCK)) is not None:
        return Compression("int8", block=block)
    if colon and kind == "topk":
        try:
            fraction = float(arg)
        except ValueError:
            fraction = 0.0
        if 0 < fraction <= 1:  # also refuses nan
            return Compression("topk", fraction=fraction)
    if colon and kind == "powersgd" and (rank := _positive_int(arg, MAX_RANK)) is not None:
        return Compression("powersgd", rank=rank)
    raise ValueError(f"expected {COMPRESS_FORMS}, got {text!r}")


def parse_sync(text: str) -> SyncSpec:
    """``every-step`` or ``MODE:H`` (``diloco:50``) as a :class:`SyncSpec` without compression;
    ValueError naming the accepted forms otherwise."""
    mode, colon, arg = text.strip().partition(":")
    if mode == "every-step" and not colon:
        return SyncSpec()
    if mode in SYNC_MODES[1:] and colon:
        steps = _positive_int(arg, MAX_INNER_STEPS)
        if steps is not None:
            return SyncSpec(mode=mode, inner_steps=steps)
    raise ValueError(f"expected {SYNC_FORMS}, got {text!r}")


class SyncSpec(BaseModel):
    """How the data-parallel replicas of a training job agree, and what they send.

    In a spec file either a mapping (``{mode: diloco, inner_steps: 50, compress: int8}``) or the
    short form of the mode alone (``diloco:50``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: SyncMode = Field(
        default="every-step",
        description=(
            "every-step (all-reduce the gradient every iteration), diloco (inner steps, then an "
            "outer step on the averaged pseudo-gradient), fedavg or fedprox (local steps, then "
            "one model average per round)."
        ),
    )
    inner_steps: int = Field(
        default=1,
        ge=1,
        le=MAX_INNER_STEPS,
        description="Optimizer steps per replica between two synchronisations (1: every-step).",
    )
    compress: str = Field(
        default="none",
        description="What the replicas send: none, bf16, int8[:BLOCK], topk:F or powersgd:R.",
    )

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, data: Any) -> Any:
        if isinstance(data, str):
            short = parse_sync(data)
            return {"mode": short.mode, "inner_steps": short.inner_steps}
        return data

    @field_validator("compress")
    @classmethod
    def _compress(cls, value: str) -> str:
        parse_compress(value)
        return value.strip()

    @model_validator(mode="after")
    def _steps(self) -> Self:
        if self.mode == "every-step" and self.inner_steps != 1:
            raise ValueError(
                "inner_steps: every-step synchronises after every step; "
                f"use diloco:{self.inner_steps} for local steps"
            )
        return self

    @property
    def compression(self) -> Compression:
        return parse_compress(self.compress)

    @property
    def local_steps(self) -> bool:
        """Whether the replicas average once per round of inner steps (not every gradient)."""
        return self.mode != "every-step"

    @property
    def label(self) -> str:
        """The short form: ``every-step``, ``diloco:50``; with ``, int8`` when compressed."""
        mode = self.mode if self.mode == "every-step" else f"{self.mode}:{self.inner_steps}"
        return mode if self.compress == "none" else f"{mode}, {self.compress}"
