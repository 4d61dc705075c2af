"""``dmsc up``'s control-loop flags: the interval, the mode and the policy (a file, ``--slo``
flags over it, the webhook), checked here into the control plane's settings (errors name the
file or the flag, exit 2); and the loop's line in ``dmsc status`` (:func:`loop_line`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from dmsc.spec import SpecError

if TYPE_CHECKING:
    from dmsc.runtime.transport.replies import LoopState

IntervalOpt = Annotated[
    float,
    typer.Option(
        "--control-interval",
        help="Seconds between two ticks of the control loop (0 turns it off).",
    ),
]
ModeOpt = Annotated[
    str,
    typer.Option(
        "--control", help="act: apply the decisions the loop accepts; advise: only propose them."
    ),
]
PolicyOpt = Annotated[
    str | None,
    typer.Option("--policy", help="A policy file (YAML or JSON): objectives, actions, webhook."),
]
SloOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--slo",
        help="An objective NAME=MAX[:ACTION] over the policy file's (repeatable): step_time_s, "
        "infer_p99_s, queue_wait_s, error_rate, link_utilisation.",
    ),
]
WebhookOpt = Annotated[
    str | None, typer.Option("--alert-webhook", help="Post each alert to this URL (JSON).")
]

DEFAULT_INTERVAL_S = 5.0


def loop_settings(
    interval_s: float,
    mode: str,
    policy_file: str | None,
    slos: list[str] | None,
    webhook: str | None,
) -> dict[str, Any]:
    """The ``ControlSettings`` fields of the control loop, from the flags."""
    from dmsc.runtime.control.loop.objectives import Policy, load_policy, with_flags

    if not 0 <= interval_s <= 3600:
        raise SpecError("command line", "--control-interval", "must be between 0 and 3600")
    if mode not in ("act", "advise"):
        raise SpecError("command line", "--control", f"{mode!r}: expected act or advise")
    out: dict[str, Any] = {"control_interval_s": interval_s, "control": mode}
    if policy_file is None and not slos and webhook is None:
        return out  # no policy: the defaults, no objective (None in the settings)
    policy = load_policy(policy_file) if policy_file is not None else Policy()
    policy = with_flags(policy, slos or [], webhook)
    return {**out, "policy": policy.model_dump(mode="json", exclude_none=True)}


def loop_line(loop: LoopState) -> str:
    """``dmsc status``'s line on the control loop: its interval, mode, ticks, open alerts and
    newest decision."""
    alerts = f", {loop.open_alerts} open alert{'s' if loop.open_alerts != 1 else ''}"
    last = f"; last decision {loop.last_decision}" if loop.last_decision else "; no decision yet"
    return (
        f"control loop: every {loop.interval_s:g} s, {loop.mode} mode, {loop.ticks} ticks"
        f"{alerts if loop.open_alerts else ''}{last}"
    )
