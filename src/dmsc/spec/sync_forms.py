"""The small language of data-parallel sync, parsed here once: the sync mode, the compression of
what the replicas send and the rule their stage leader combines them with.

Every place that reads one of these forms (a job spec's ``sync``, the runtime's control
messages, its codecs and aggregators, ``dmsc estimate|plan|simulate|train --sync``) calls the
functions below, so that they accept the same texts and refuse the rest in the same words.

- sync: ``every-step``, or ``MODE:H`` with MODE ``diloco``, ``fedavg`` or ``fedprox`` and H the
  inner steps per round (1 to 100,000); ``dmsc train --sync`` also takes ``MODE`` alone, its
  round length from ``--inner-steps`` or :data:`DEFAULT_ROUND`. ``every-step`` is one step a
  round (:func:`check_round`).
- compression: ``none``, ``bf16``, ``int8[:BLOCK]``, ``topk:F``, ``powersgd:RANK``.
- aggregator: ``mean``, ``median``, ``trimmed-mean[:TRIM]``, ``krum[:F]``, ``multi-krum[:F]``,
  and how many replicas each needs (:func:`check_replicas`).

Numbers are ASCII: integers are digits alone (no sign, no spaces), fractions are decimals
(``0.01``, ``.5``, ``1e-3``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Annotated, Literal, NamedTuple, TypedDict, get_args

from pydantic import AfterValidator, StringConstraints

# -- sync mode -----------------------------------------------------------------------------------
SyncMode = Literal["every-step", "diloco", "fedavg", "fedprox"]
SYNC_MODES: tuple[SyncMode, ...] = get_args(SyncMode)
SYNC_FORMS = "every-step, diloco:H, fedavg:H or fedprox:H (H inner steps per round, 1 or more)"
MAX_INNER_STEPS = 100_000
DEFAULT_ROUND = 50  # inner steps per round of a mode given without its length

# -- compression ---------------------------------------------------------------------------------
CompressKind = Literal["none", "bf16", "int8", "topk", "powersgd"]
MAX_BLOCK = 1_000_000
MAX_RANK = 4096
INT8_BLOCK = 256  # the int8 codec's block when the form names none
COMPRESS_FORMS = (
    "none, bf16, int8, int8:BLOCK (BLOCK elements per scale, 1 to 1000000), "
    "topk:F (0 < F <= 1, the fraction of elements kept) or powersgd:RANK (RANK 1 to 4096)"
)

# -- aggregator ----------------------------------------------------------------------------------
AggregatorName = Literal["mean", "median", "trimmed-mean", "krum", "multi-krum"]
AGGREGATORS: tuple[AggregatorName, ...] = get_args(AggregatorName)
MAX_BYZANTINE = 999
DEFAULT_BYZANTINE = 1  # bad replicas tolerated when the form names none
DEFAULT_TRIM = 0.2  # the fraction trimmed a side when the form names none
AGGREGATOR_FORMS = (
    "mean, median, trimmed-mean, trimmed-mean:TRIM (0 <= TRIM < 0.5), krum, krum:F, multi-krum "
    "or multi-krum:F (F bad replicas tolerated, 0 to 999)"
)

MAX_FORM_CHARS = 32  # the longest form a message or a spec may carry
_INT = re.compile(r"0*[0-9]{1,9}")  # digits alone, never so many that int() is slow
_DECIMAL = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


def _int(text: str, low: int, high: int) -> int | None:
    if not _INT.fullmatch(text):
        return None
    value = int(text)
    return value if low <= value <= high else None


def _decimal(text: str) -> float | None:
    # a float, not a Fraction: Fraction("1e-999999999") would compute 10**999999999
    return float(text) if _DECIMAL.fullmatch(text) else None


# -- sync mode -----------------------------------------------------------------------------------
def parse_sync_form(text: str) -> tuple[SyncMode, int | None]:
    """``every-step``, ``MODE`` or ``MODE:H`` as (mode, H), H None where the text gives none;
    ValueError naming the accepted forms otherwise."""
    mode, colon, arg = text.strip().partition(":")
    known = next((m for m in SYNC_MODES if m == mode), None)
    if known is not None and not colon:
        return known, None
    if known not in (None, "every-step") and (steps := _int(arg, 1, MAX_INNER_STEPS)):
        return known, steps
    raise ValueError(f"expected {SYNC_FORMS}, got {text!r}")


def default_inner_steps(mode: SyncMode) -> int:
    """The round length of a mode given without one: 1 for ``every-step``."""
    return 1 if mode == "every-step" else DEFAULT_ROUND


def check_round(mode: SyncMode, inner_steps: int) -> None:
    """``every-step`` synchronises after every step: any other round length is refused."""
    if mode == "every-step" and inner_steps != 1:
        raise ValueError(
            "inner_steps: every-step synchronises after every step, one step per round; "
            f"use diloco:{inner_steps} for local steps"
        )


# -- compression ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Compression:
    """A parsed compression form: its kind and its one parameter (block, fraction or rank)."""

    kind: CompressKind
    block: int = INT8_BLOCK
    fraction: float = 1.0
    rank: int = 0

    @property
    def exact_fraction(self) -> Fraction:
        """``fraction`` as the decimal it was written as (in floats ``ceil(0.07 * 100)`` is 8)."""
        return Fraction(repr(self.fraction))


def parse_compress(text: str) -> Compression:
    """``none``, ``bf16``, ``int8[:BLOCK]``, ``topk:F`` or ``powersgd:RANK``; ValueError naming
    the accepted forms otherwise."""
    kind, colon, arg = text.strip().partition(":")
    if not colon and kind in ("none", "bf16", "int8"):
        return Compression(kind)  # type: ignore[arg-type]
    if colon and kind == "int8" and (block := _int(arg, 1, MAX_BLOCK)) is not None:
        return Compression("int8", block=block)
    fraction = _decimal(arg) if colon and kind == "topk" else None
    if fraction is not None and 0 < fraction <= 1:
        return Compression("topk", fraction=fraction)
    if colon and kind == "powersgd" and (rank := _int(arg, 1, MAX_RANK)) is not None:
        return Compression("powersgd", rank=rank)
    raise ValueError(f"expected {COMPRESS_FORMS}, got {text!r}")


# -- aggregator ----------------------------------------------------------------------------------
class AggregatorOptions(TypedDict, total=False):
    """What an aggregator's form sets beside its name (left out: the defaults above)."""

    byzantine: int
    trim: float


class Aggregator(NamedTuple):
    """A parsed aggregator form: ``("krum", {"byzantine": 1})``."""

    name: AggregatorName
    options: AggregatorOptions

    def check_replicas(self, count: int) -> None:
        """ValueError when ``count`` replicas are too few for this rule."""
        check_replicas(self.name, count, **self.options)


def _unknown_aggregator(text: str) -> ValueError:
    return ValueError(f"expected {AGGREGATOR_FORMS}, got {text!r}")


def parse_aggregator(text: str) -> Aggregator:
    """``"trimmed-mean:0.1"`` -> ``("trimmed-mean", {"trim": 0.1})``, ``"krum:1"`` ->
    ``("krum", {"byzantine": 1})``; ValueError naming the accepted forms otherwise."""
    name, colon, arg = text.strip().partition(":")
    known = next((a for a in AGGREGATORS if a == name), None)
    if known is not None and not colon:
        return Aggregator(known, {})
    trim = _decimal(arg) if known == "trimmed-mean" else None
    if known == "trimmed-mean" and trim is not None and 0 <= trim < 0.5:
        return Aggregator(known, {"trim": trim})
    byzantine = _int(arg, 0, MAX_BYZANTINE) if known in ("krum", "multi-krum") else None
    if known is not None and byzantine is not None:
        return Aggregator(known, {"byzantine": byzantine})
    raise _unknown_aggregator(text)


def check_aggregator(name: str, byzantine: int, trim: float) -> None:
    """ValueError unless ``name`` is a rule and its options are in range."""
    if name not in AGGREGATORS:
        raise _unknown_aggregator(name)
    if isinstance(byzantine, bool) or not isinstance(byzantine, int) or byzantine < 0:
        raise ValueError(f"byzantine must be an integer >= 0, got {byzantine!r}")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim!r}")


def check_replicas(
    name: str, count: int, *, byzantine: int = DEFAULT_BYZANTINE, trim: float = DEFAULT_TRIM
) -> None:
    """ValueError when rule ``name`` cannot combine ``count`` replicas: ``median`` needs
    ``2f + 1``, ``krum`` and ``multi-krum`` ``2f + 3``, and ``trimmed-mean`` enough that
    ``floor(trim * count)`` is not 0 (when it trims at all)."""
    check_aggregator(name, byzantine, trim)
    if name == "median" and count < 2 * byzantine + 1:
        raise ValueError(
            f"median with byzantine={byzantine} needs n >= 2f+1 = {2 * byzantine + 1} "
            f"replicas, got {count}"
        )
    if name == "trimmed-mean" and trim > 0 and math.floor(trim * count) == 0:
        raise ValueError(
            f"trimmed-mean:{trim} over {count} replicas trims nothing "
            f"(floor({trim} * {count}) = 0); needs n >= {math.ceil(1 / trim)} replicas"
        )
    if name in ("krum", "multi-krum") and count < 2 * byzantine + 3:
        raise ValueError(
            f"{name} with byzantine={byzantine} needs n >= 2f+3 = {2 * byzantine + 3} "
            f"replicas, got {count}"
        )


# -- as fields of a model ------------------------------------------------------------------------
def _form(parse: Callable[[str], object]) -> AfterValidator:
    def check(text: str) -> str:
        parse(text)
        return text.strip()

    return AfterValidator(check)


# a valid form, kept as written (trimmed); its length checked before it is parsed
CompressForm = Annotated[str, StringConstraints(max_length=MAX_FORM_CHARS), _form(parse_compress)]
AggregatorForm = Annotated[
    str, StringConstraints(max_length=MAX_FORM_CHARS), _form(parse_aggregator)
]


class SyncForms:
    """What a model with ``mode``, ``inner_steps`` and ``compress`` fields reads from them (the
    job spec's :class:`~dmsc.spec.sync.SyncSpec`, the runtime's ``SyncSettings``)."""

    if TYPE_CHECKING:
        mode: SyncMode
        inner_steps: int
        compress: str

    @property
    def compression(self) -> Compression:
        """The parsed ``compress`` form."""
        return parse_compress(self.compress)

    @property
    def local_steps(self) -> bool:
        """Whether the replicas average once per round of inner steps (not every gradient)."""
        return self.mode != "every-step"
