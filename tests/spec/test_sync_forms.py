"""One language for the sync mode, the compression and the aggregator: every place that reads a
form (the spec, the control messages, the codecs, the aggregators, ``dmsc train``'s flags)
accepts and refuses the same texts, with the same words. The grammar below is the test's own
reference, written from the documented forms, not from the parser."""

from __future__ import annotations

import re

import pytest
import torch
from pydantic import ValidationError

from dmsc.cli.train_sync import sync_settings
from dmsc.runtime.compute.aggregators import aggregate, parse_aggregator
from dmsc.runtime.compute.compression import downlink_codec, make_codec
from dmsc.runtime.transport.messages import SyncSettings
from dmsc.spec import SpecError, SyncSpec, parse_compress, parse_sync

_INT = r"[0-9]+"
_DECIMAL = r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?"


def _in(text: str, low: float, high: float, *, high_open: bool = False) -> bool:
    value = float(text)
    return low <= value < high if high_open else low <= value <= high


def _reference_compress(text: str) -> bool:
    kind, colon, arg = text.strip().partition(":")
    if not colon:
        return kind in ("none", "bf16", "int8")
    if kind == "int8":
        return re.fullmatch(_INT, arg) is not None and _in(arg, 1, 1_000_000)
    if kind == "topk":
        return re.fullmatch(_DECIMAL, arg) is not None and 0 < float(arg) <= 1
    if kind == "powersgd":
        return re.fullmatch(_INT, arg) is not None and _in(arg, 1, 4096)
    return False


def _reference_aggregator(text: str) -> bool:
    name, colon, arg = text.strip().partition(":")
    if not colon:
        return name in ("mean", "median", "trimmed-mean", "krum", "multi-krum")
    if name == "trimmed-mean":
        return re.fullmatch(_DECIMAL, arg) is not None and _in(arg, 0, 0.5, high_open=True)
    if name in ("krum", "multi-krum"):
        return re.fullmatch(_INT, arg) is not None and _in(arg, 0, 999)
    return False


def _reference_sync(text: str, *, bare_mode: bool) -> bool:
    mode, colon, arg = text.strip().partition(":")
    if mode == "every-step":
        return not colon
    if mode not in ("diloco", "fedavg", "fedprox"):
        return False
    if not colon:
        return bare_mode
    return re.fullmatch(_INT, arg) is not None and _in(arg, 1, 100_000)


COMPRESS = [
    "none", "bf16", "int8", " int8 ", "int8:1", "int8:64", "int8:1000000", "int8:1000001",
    "int8:0", "int8:x", "int8:²", "int8:+64", "int8: 64", "int8:", "topk:0.01", "topk:1",
    "topk:1.0", "topk:.5", "topk:1e-3", "topk:1.", "topk", "topk:0", "topk:1.5", "topk:nan",
    "topk:inf", "topk:1/100", "topk:-0.1", "topk:0x1", "powersgd:1", "powersgd:4096",
    "powersgd:4097", "powersgd", "powersgd:0", "powersgd:٣", "bf16:2", "none:1", "fp8", "",
    "int8:0000000064", "topk:1e-400", "topk:1e-99999999999999999999999", "powersgd:1e3",
]  # fmt: skip
AGGREGATORS = [
    "mean", "median", " median ", "trimmed-mean", "trimmed-mean:0", "trimmed-mean:0.1",
    "trimmed-mean:.25", "trimmed-mean:0.5", "trimmed-mean:0.7", "trimmed-mean:x",
    "trimmed-mean:", "krum", "krum:0", "krum:999", "krum:1000", "krum:-1", "krum:x", "krum:+1",
    "krum:٣", "multi-krum:2", "mean:1", "median:1", "avg", "",
]  # fmt: skip
SYNCS = [
    "every-step", " diloco:50 ", "fedavg:1", "fedprox:100000", "diloco:100001", "diloco",
    "fedavg", "every-step:1", "every-step:5", "diloco:0", "diloco:x", "diloco:١٢", "diloco:+5",
    "diloco:2.5", "sgd:4", "",
]  # fmt: skip

_SHAPES = [torch.Size([4, 6]), torch.Size([5])]


def _accepts(check: object, *errors: type[Exception]) -> bool:
    try:
        check()  # type: ignore[operator]
    except errors:
        return False
    return True


@pytest.mark.parametrize("text", COMPRESS)
def test_every_reader_of_a_compression_form_agrees_with_the_grammar(text: str) -> None:
    want = _reference_compress(text)
    assert _accepts(lambda: parse_compress(text), ValueError) == want
    assert _accepts(lambda: SyncSettings(compress=text), ValidationError) == want
    assert _accepts(lambda: make_codec(text, 29, shapes=_SHAPES), ValueError) == want
    uplink_only = text.strip().startswith("powersgd")
    if want and not uplink_only:
        downlink_codec(text, 29)
    if not want:
        with pytest.raises(ValueError, match=r"^expected none, bf16, int8, int8:BLOCK"):
            make_codec(text, 29, shapes=_SHAPES)


@pytest.mark.parametrize("text", AGGREGATORS)
def test_every_reader_of_an_aggregator_form_agrees_with_the_grammar(text: str) -> None:
    want = _reference_aggregator(text)
    assert _accepts(lambda: parse_aggregator(text), ValueError) == want
    assert _accepts(lambda: SyncSettings(aggregator=text), ValidationError) == want
    if not want:
        with pytest.raises(ValueError, match=r"^expected mean, median, trimmed-mean"):
            parse_aggregator(text)


@pytest.mark.parametrize("text", SYNCS)
def test_every_reader_of_a_sync_form_agrees_with_the_grammar(text: str) -> None:
    want = _reference_sync(text, bare_mode=False)
    assert _accepts(lambda: parse_sync(text), ValueError) == want
    assert _accepts(lambda: SyncSpec.model_validate(text), ValidationError) == want
    # dmsc train takes a mode alone too (its round length from --inner-steps or the default),
    # and an empty --sync as none at all
    trained = _reference_sync(text or "every-step", bare_mode=True)
    assert _accepts(lambda: sync_settings(text, None, None), SpecError) == trained
    if not trained:
        with pytest.raises(SpecError, match="expected every-step, diloco:H") as info:
            sync_settings(text, None, None)
        assert info.value.field == "--sync"


def test_every_step_means_one_step_per_round_in_the_same_words_everywhere() -> None:
    with pytest.raises(ValidationError) as spec_error:
        SyncSpec(inner_steps=4)
    with pytest.raises(ValidationError) as message_error:
        SyncSettings(inner_steps=4)
    assert spec_error.value.errors()[0]["msg"] == message_error.value.errors()[0]["msg"]
    with pytest.raises(SpecError) as flag_error:
        sync_settings("every-step", 4, None)
    said = spec_error.value.errors()[0]["msg"].removeprefix("Value error, ")
    assert said.startswith("inner_steps: every-step synchronises after every step")
    assert flag_error.value.field == "--inner-steps"
    assert flag_error.value.reason == said.removeprefix("inner_steps: ")


@pytest.mark.parametrize(
    "text",
    ["mean", "median", "trimmed-mean", "trimmed-mean:0", "trimmed-mean:0.1", "trimmed-mean:0.45",
     "krum", "krum:0", "multi-krum:2", "krum:3"],
)  # fmt: skip
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 5, 7, 10])
def test_the_replica_rule_is_the_one_aggregate_applies(text: str, replicas: int) -> None:
    """The check a task is refused by before it queues is what aggregating would say."""
    rule = parse_aggregator(text)
    try:
        aggregate(rule.name, [torch.zeros(3)] * replicas, **rule.options)
    except ValueError as exc:
        with pytest.raises(ValueError, match=re.escape(str(exc))):
            rule.check_replicas(replicas)
    else:
        rule.check_replicas(replicas)


@pytest.mark.parametrize(
    ("field", "form"), [("compress", "topk:"), ("aggregator", "trimmed-mean:")]
)
def test_a_hostile_form_is_refused_by_its_length_before_it_is_parsed(field: str, form: str) -> None:
    with pytest.raises(ValidationError, match="at most 32 characters"):
        SyncSettings(**{field: form + "9" * 100_000})  # type: ignore[arg-type]
    # an exponent is read as a float: Fraction("1e9999...") would compute 10**9999...
    longest = (form + "1e" + "9" * 32)[:32]
    with pytest.raises(ValidationError, match="expected"):
        SyncSettings(**{field: longest})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected"):
        parse_compress("int8:" + "1" * 100_000)  # no int() of a hundred thousand digits
