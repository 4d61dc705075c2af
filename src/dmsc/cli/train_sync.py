"""``dmsc train``'s data-parallel sync flags, turned into the task's ``SyncSettings``.

``--sync`` takes a mode (``every-step``, ``diloco``, ``fedavg``, ``fedprox``), optionally with its
round length (``diloco:50``, as ``dmsc plan --sync`` takes it; both read by
:func:`dmsc.spec.sync_forms.parse_sync_form`); ``--inner-steps`` and its
federated name ``--local-steps`` set the length too, and ``--rounds`` the task's steps as rounds
of it. An error names the flag and the reason (exit 2) before anything is sent.
"""

from __future__ import annotations

from typing import Any

from dmsc.cli.options import message_from_flags
from dmsc.runtime.transport.messages import SyncSettings
from dmsc.spec import SpecError
from dmsc.spec.sync_forms import default_inner_steps, parse_sync_form

SYNC_FLAGS = {
    "mode": "--sync",
    "inner_steps": "--inner-steps",
    "outer_lr": "--outer-lr",
    "outer_momentum": "--outer-momentum",
    "prox_mu": "--prox-mu",
    "inner_optimizer": "--inner-optimizer",
    "compress": "--compress",
    "aggregator": "--aggregator",
    "privacy_clip": "--privacy-clip",
    "privacy_noise": "--privacy-noise",
    "privacy_delta": "--privacy-delta",
    "secure": "--secure-aggregation",
    "local_data": "--local-data",
    "skew": "--skew",
    "task_heads": "--task-heads",
}


def sync_settings(
    sync: str | None, inner_steps: int | None, local_steps: int | None, **values: Any
) -> SyncSettings | None:
    """The settings of the flags (None when no flag says anything: the plan's then); SpecError
    names the flag that is wrong."""
    defaults = SyncSettings()
    if (sync, inner_steps, local_steps) == (None, None, None) and all(
        getattr(defaults, k) == v for k, v in values.items()
    ):
        return None
    try:
        mode, length = parse_sync_form(sync or "every-step")
    except ValueError as exc:
        raise SpecError("command line", "--sync", str(exc)) from None
    given = [v for v in (inner_steps, local_steps) if v is not None]
    if length is not None:
        given.append(length)
    if len(set(given)) > 1:
        raise SpecError(
            "command line", "--inner-steps", f"round lengths disagree: {sorted(set(given))}"
        )
    steps = given[0] if given else default_inner_steps(mode)
    try:
        return message_from_flags(SyncSettings, SYNC_FLAGS, mode=mode, inner_steps=steps, **values)
    except SpecError as exc:
        if exc.field in SYNC_FLAGS.values():
            raise
        # a rule across fields (SyncSettings' own check): its reason names the field first
        named = next((f for k, f in SYNC_FLAGS.items() if f" {k}:" in f" {exc.reason}"), "--sync")
        raise SpecError("command line", named, exc.reason.removeprefix("Value error, ")) from None


def task_steps(steps: int, rounds: int | None, settings: SyncSettings | None) -> int:
    """The task's steps: ``--rounds`` rounds of the round length when given."""
    if rounds is None:
        return steps
    if settings is None:
        raise SpecError("command line", "--rounds", "rounds of what: give --sync and its length")
    return rounds * settings.inner_steps
