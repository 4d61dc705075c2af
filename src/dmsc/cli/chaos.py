"""``dmsc chaos``: rehearse a failure on the running deployment. Kill -9 (or freeze) one stage
worker, then watch the control plane detect the fault and repair it, and report how long each
took and how many training steps were run again."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console

from dmsc.cli.app import console
from dmsc.cli.options import JsonOpt
from dmsc.cli.runtime import control_client
from dmsc.runtime.transport.messages import InjectRequest
from dmsc.spec import SpecError


def chaos(
    kill_worker: Annotated[
        str, typer.Option("--kill-worker", help="The worker: stage=N[,replica=R].")
    ],
    after: Annotated[float, typer.Option(help="Seconds to wait before the fault.")] = 0.0,
    freeze: Annotated[
        bool, typer.Option(help="SIGSTOP (a hung worker) instead of kill -9.")
    ] = False,
    watch: Annotated[float, typer.Option(help="Seconds to watch for the recovery.")] = 120.0,
    as_json: JsonOpt = False,
) -> None:
    """Rehearse a failure: kill (or freeze) a stage worker of the running deployment and report
    how long the control plane took to detect and repair it."""
    do_chaos(kill_worker, after, freeze, watch, console, as_json)


def parse_target(text: str) -> tuple[int, int]:
    """``stage=N[,replica=R]`` -> (stage, replica)."""
    fields: dict[str, int] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in ("stage", "replica") or not value.strip().isdigit():
            raise SpecError(
                "command line", "--kill-worker", f"expected stage=N[,replica=R], got {text!r}"
            )
        fields[name.strip()] = int(value)
    if "stage" not in fields:
        raise SpecError("command line", "--kill-worker", "names no stage (stage=N)")
    return fields["stage"], fields.get("replica", 0)


def do_chaos(
    target: str, after_s: float, freeze: bool, watch_s: float, console: Console, as_json: bool
) -> dict[str, Any]:
    """Kill -9 (or freeze) one stage worker of the running deployment after ``after_s`` seconds,
    then watch the control plane detect and repair it."""
    stage, replica = parse_target(target)
    if after_s < 0 or watch_s <= 0:
        raise SpecError("command line", "--after", "must be 0 or positive (and --watch positive)")
    control = control_client()
    before = control.status()
    victim = next((s for s in before.services if (s.stage, s.replica) == (stage, replica)), None)
    if victim is None:
        raise SpecError(
            "command line", "--kill-worker", f"no worker at stage {stage} replica {replica}"
        )
    seen = {f.id for f in before.faults}
    time.sleep(after_s)
    # through the control plane's launcher: the worker may run on another machine (Ray)
    injected = control.inject(
        InjectRequest(sid=victim.sid, fault="freeze" if freeze else "kill")
    ).at
    fault = None
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        fresh = [
            f
            for f in control.status().faults
            if f.id not in seen and f.kind == "worker" and victim.sid in f.services.split(",")
        ]
        if fresh and fresh[-1].recovered_at:
            fault = fresh[-1]
            break
        time.sleep(0.2)
    if freeze:  # let the frozen instance run again: fencing must keep it out
        control.inject(InjectRequest(sid=victim.sid, fault="thaw"))
    out = {
        "fault": "freeze" if freeze else "kill -9",
        "target": victim.sid,
        "pid": victim.pid,
        "recovered": fault is not None,
        "detected_after_s": fault.detected_at - injected if fault else None,
        "recovered_after_s": fault.recovered_at - injected
        if fault and fault.recovered_at
        else None,
        "checkpoint_step": fault.checkpoint_step if fault else None,
        "steps_lost": fault.steps_lost if fault else None,
    }
    if as_json:
        print(json.dumps(out))
    elif fault is None:
        console.print(
            f"{out['fault']} {victim.sid} (pid {victim.pid}): "
            f"no recovery seen within {watch_s:g} s",
            highlight=False,
        )
    else:
        console.print(
            f"{out['fault']} {victim.sid} (pid {victim.pid}): detected after "
            f"{out['detected_after_s']:.2f} s, recovered after {out['recovered_after_s']:.2f} s, "
            f"back to the checkpoint of step {out['checkpoint_step']} "
            f"({out['steps_lost']} steps run again)",
            highlight=False,
        )
    if fault is None:
        raise SystemExit(1)
    return out
