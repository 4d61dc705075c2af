"""How a job's data-parallel replicas agree: the synchronisation mode and the compression of
what they send.

- ``every-step``: the gradient is all-reduced every iteration (data parallelism as usual).
- ``diloco:H``: each replica takes ``H`` inner optimizer steps, then the replicas all-reduce a
  pseudo-gradient (the change of the weights over the round, as large as a gradient) and take
  one outer step (Douillard et al. 2023, "DiLoCo").
- ``fedavg:H``, ``fedprox:H``: ``H`` local steps per round, then one average of the models
  (McMahan et al. 2017; Li et al. 2020 add a proximal term to the local steps): the same
  traffic as ``diloco:H``.

How they combine it (``via``): ``collective``, among themselves (an all-reduce; an all-gather for
top-k), or ``leader``, a star through the stage's first replica, which sees every update: what a
robust aggregator, central differential privacy and secure aggregation need. Through the
leader, ``aggregator`` names its rule (``mean``, ``median``, ``trimmed-mean[:TRIM]``,
``krum[:F]``, ``multi-krum[:F]``, the runtime's forms), whose passes over the updates the cost
model prices.

Compression of what travels (the forms the runtime's codecs take):
``none``, ``bf16``, ``int8[:BLOCK]`` (one int8 per element and an fp32 scale per block of
``BLOCK``, 256 by default), ``topk:F`` (the fraction ``F`` of the elements, each an int32 index
and an fp32 value) and ``powersgd:R`` (each weight matrix as two rank-``R`` fp32 factors).
What these cost is the cost model's business (:mod:`dmsc.netmodel.sync`); the forms are parsed
by :mod:`dmsc.spec.sync_forms`, the one parser of them.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dmsc.spec.sync_forms import (
    COMPRESS_FORMS,
    MAX_INNER_STEPS,
    SYNC_FORMS,
    SYNC_MODES,
    AggregatorForm,
    CompressForm,
    Compression,
    SyncForms,
    SyncMode,
    check_round,
    parse_aggregator,
    parse_compress,
    parse_sync_form,
)

__all__ = [
    "COMPRESS_FORMS",
    "SYNC_FORMS",
    "SYNC_MODES",
    "Compression",
    "SyncMode",
    "SyncSpec",
    "parse_compress",
    "parse_sync",
]


def parse_sync(text: str) -> SyncSpec:
    """``every-step`` or ``MODE:H`` (``diloco:50``) as a :class:`SyncSpec` without compression;
    ValueError naming the accepted forms otherwise (a spec names the round length)."""
    mode, steps = parse_sync_form(text)
    if steps is None and mode != "every-step":
        raise ValueError(f"expected {SYNC_FORMS}, got {text!r}")
    return SyncSpec(mode=mode, inner_steps=steps or 1)


class SyncSpec(SyncForms, BaseModel):
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
    compress: CompressForm = Field(
        default="none",
        description="What the replicas send: none, bf16, int8[:BLOCK], topk:F or powersgd:R.",
    )

    via: Literal["collective", "leader"] = Field(
        default="collective",
        description=(
            "How the replicas combine what they send: collective (an all-reduce among them, "
            "or an all-gather for topk) or leader (each sends it to the stage's first replica, "
            "which combines them and sends the result back: what a robust aggregator, central "
            "differential privacy and secure aggregation need, and what dmsc's runtime runs "
            "for them)."
        ),
    )

    aggregator: AggregatorForm = Field(
        default="mean",
        description=(
            "How the leader combines the updates (via: leader): mean, median, "
            "trimmed-mean[:TRIM], krum[:F] or multi-krum[:F], as dmsc's runtime does; the cost "
            "model prices the leader's passes over them. Any rule but mean needs via: leader."
        ),
    )

    privacy: Literal["none", "clip", "noise"] = Field(
        default="none",
        description=(
            "Central differential privacy as dmsc's runtime runs it (via: leader): clip (each "
            "replica clips its update to a norm before sending it) or noise (clipped, and the "
            "leader adds Gaussian noise to the sum); the cost model prices the clip's passes "
            "and the noise's draws."
        ),
    )

    secure: bool = Field(
        default=False,
        description=(
            "Secure aggregation as dmsc's runtime runs it (via: leader, the mean, no "
            "compression): each replica masks its update in fixed point with a keystream per "
            "pair of replicas, so that the leader learns only the sum; the cost model prices "
            "the masking and the leader's unmasking."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, data: Any) -> Any:
        if isinstance(data, str):
            short = parse_sync(data)
            return {"mode": short.mode, "inner_steps": short.inner_steps}
        return data

    @model_validator(mode="after")
    def _steps(self) -> Self:
        check_round(self.mode, self.inner_steps)
        rule = parse_aggregator(self.aggregator).name
        if rule != "mean" and self.via != "leader":
            raise ValueError(
                f"aggregator {self.aggregator!r} combines the updates at the stage leader: "
                "set via: leader"
            )
        if self.privacy != "none" and self.via != "leader":
            raise ValueError(
                f"privacy {self.privacy!r}: the noise is added to the sum at the stage leader: "
                "set via: leader"
            )
        if self.secure:
            if self.via != "leader":
                raise ValueError(
                    "secure: the masked updates are summed at the stage leader: set via: leader"
                )
            if rule != "mean":
                raise ValueError(
                    "secure: secure aggregation reveals only the sum, not what "
                    f"{self.aggregator!r} needs: only aggregator mean"
                )
            if self.compress != "none":
                raise ValueError(
                    f"secure: secure aggregation masks fixed-point values, not {self.compress!r}: "
                    "only compress none"
                )
        if rule != "mean" and self.compression.kind == "powersgd":
            raise ValueError("aggregator: PowerSGD averages low-rank factors: only mean")
        return self

    @property
    def label(self) -> str:
        """The short form: ``every-step``, ``diloco:50``; with ``, int8`` when compressed and
        ``, through the leader`` when the replicas agree through it."""
        mode = self.mode if self.mode == "every-step" else f"{self.mode}:{self.inner_steps}"
        mode = mode if self.compress == "none" else f"{mode}, {self.compress}"
        if self.via == "collective":
            return mode
        rule = "" if self.aggregator == "mean" else f" ({self.aggregator})"
        private = {"none": "", "clip": ", clipped", "noise": ", with DP noise"}[self.privacy]
        masked = ", securely aggregated" if self.secure else ""
        return f"{mode}, through the leader{rule}{masked}{private}"
