"""The policy a user sets for the control loop: service-level objectives, the action each breach
asks for, the webhook alerts go to, and the decision rule's settings.

A policy file (YAML or JSON, ``dmsc up --policy FILE``) is validated here, at the boundary: a
wrong file names the file, the field and the reason (:class:`~dmsc.spec.SpecError`, exit 2).
``dmsc up --slo NAME=MAX[:ACTION]`` sets or overrides one objective, ``--alert-webhook URL`` the
webhook. An example::

    slos:
      step_time_s: 0.5                      # a number alone: the limit, action "alert"
      infer_p99_s: {max: 2.0, action: scale-out}
      queue_wait_s: 120
      error_rate: 0.05                      # a share of the tasks finished in the window
      link_utilisation: {max: 0.8, action: move}
    window_s: 300
    webhook: http://127.0.0.1:9000/hook
    threshold: 0.05                         # the decision rule: gain over 5% of the step
    horizon_steps: 1000                     # and its cost paid back within 1000 steps
    confirm_ticks: 3                        # a move holds on 3 ticks in a row before it applies
    cooldown_s: 600                         # a stage moved is not moved again for 10 minutes
    busy: {cpu_percent: 90, ticks: 3}       # a stage's node this busy 3 ticks in a row (loop.busy)
    replan_interval_s: 30                   # the modules re-plan on new steps at most this often
    elastic:                                # the loop resizes training dp (loop.resizing)
      dp_min: 1
      dp_max: 4                             # grows while step_time_s is broken, up to 4
      cost_s: 10                            # one resize's checkpoint, restart and load

Every breach raises an alert; the action adds to it: ``scale-out`` adds a serving replica
(``dmsc up --autoscale`` makes the pool), ``move`` applies the move path optimisation proposes
even below the rule's threshold (within its horizon still). With ``elastic`` set, a broken
``step_time_s`` also grows the training task's data-parallel degree by one replica while free
devices allow, within ``dp_min``..``dp_max`` (:mod:`.resizing`, through the same decision rule
and hysteresis). With ``busy`` set, a stage's node over ``cpu_percent`` on ``ticks`` ticks in a
row lets path optimisation move the stage to an idle datacenter (:mod:`.busy`).
``replan_interval_s`` bounds how often the modules re-plan on new steps (:mod:`.tick`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dmsc.spec import SpecError
from dmsc.spec.errors import spec_error_from_validation
from dmsc.spec.loader import load_spec, validate_document

Action = Literal["alert", "scale-out", "move"]
# each objective, what it measures, and the actions that can serve it
SLO_NAMES = ("step_time_s", "infer_p99_s", "queue_wait_s", "error_rate", "link_utilisation")
ACTIONS: dict[str, tuple[str, ...]] = {
    "step_time_s": ("alert", "move"),
    "infer_p99_s": ("alert", "scale-out"),
    "queue_wait_s": ("alert", "scale-out"),
    "error_rate": ("alert",),
    "link_utilisation": ("alert", "move"),
}
SHARES = ("error_rate", "link_utilisation")  # limits that are shares, at most 1


class Objective(BaseModel):
    """One objective: the most the measurement may be, and the action a breach asks for."""

    model_config = ConfigDict(extra="forbid")

    max: Annotated[float, Field(gt=0, le=1e9)]
    action: Action = "alert"


def _shorthand(v: Any) -> Any:
    return {"max": v} if isinstance(v, int | float) and not isinstance(v, bool) else v


class Objectives(BaseModel):
    """The objectives checked every tick (none set: none checked)."""

    model_config = ConfigDict(extra="forbid")

    step_time_s: Objective | None = None  # median step time of the running training task
    infer_p99_s: Objective | None = None  # p99 of inference requests finished in the window
    queue_wait_s: Objective | None = None  # how long a training task waits in the queue
    error_rate: Objective | None = None  # failed / finished tasks in the window
    link_utilisation: Objective | None = None  # measured rate / a reserved path's capacity

    @model_validator(mode="before")
    @classmethod
    def _numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: _shorthand(v) for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _fits(self) -> Objectives:
        for name in SLO_NAMES:
            obj = getattr(self, name)
            if obj is None:
                continue
            if name in SHARES and obj.max > 1:
                raise ValueError(f"{name}: max is a share, at most 1 (got {obj.max:g})")
            if obj.action not in ACTIONS[name]:
                raise ValueError(
                    f"{name}: action {obj.action!r} does not serve it "
                    f"(one of: {', '.join(ACTIONS[name])})"
                )
        return self

    def set(self) -> dict[str, Objective]:
        return {n: o for n in SLO_NAMES if (o := getattr(self, n)) is not None}


class Elastic(BaseModel):
    """How the loop may resize training's data-parallel degree (:mod:`.resizing`): the range
    it keeps dp in, and the one-off cost a resize is charged in the decision rule."""

    model_config = ConfigDict(extra="forbid")

    dp_min: Annotated[int, Field(ge=1, le=4096)] = 1
    dp_max: Annotated[int, Field(ge=1, le=4096)]
    # a checkpoint, the workers' restart and the load: 0.8 s for gpt-mini in two stages from
    # dp 1 to 2 on the 2-core CPU machine (tests/integration/test_loop_resize.py logs it);
    # 10 s leaves room for larger models and workers that are not forked
    cost_s: Annotated[float, Field(ge=0, le=3600)] = 10.0

    @model_validator(mode="after")
    def _range(self) -> Elastic:
        if self.dp_min > self.dp_max:
            raise ValueError(f"dp_min {self.dp_min} is above dp_max {self.dp_max}")
        return self


class BusyNode(BaseModel):
    """When a stage's node counts as busy (:mod:`.busy`): its CPU % (all cores, as the steps'
    telemetry measured it) over ``cpu_percent`` on ``ticks`` ticks in a row."""

    model_config = ConfigDict(extra="forbid")

    cpu_percent: Annotated[float, Field(gt=0, le=100)] = 90.0
    ticks: Annotated[int, Field(ge=1, le=1000)] = 3


class Policy(BaseModel):
    """A policy file (module docstring)."""

    model_config = ConfigDict(extra="forbid")

    slos: Objectives = Objectives()
    window_s: Annotated[float, Field(gt=0, le=86400)] = 300.0
    webhook: Annotated[str, Field(pattern=r"^https?://[^\s]+$", max_length=2048)] | None = None
    threshold: Annotated[float, Field(ge=0, le=10)] = 0.05
    horizon_steps: Annotated[int, Field(ge=0, le=10**9)] = 1000
    # the moves' hysteresis (loop.hysteresis): ticks in a row a move must hold, and how long a
    # stage just moved stays where it is
    confirm_ticks: Annotated[int, Field(ge=1, le=100)] = 3
    cooldown_s: Annotated[float, Field(ge=0, le=86400)] = 600.0
    elastic: Elastic | None = None  # None: the loop never resizes dp for the policy
    busy: BusyNode | None = None  # a busy node: path optimisation may move its stage away
    # the least seconds between two runs of the modules on new steps (path optimisation's
    # re-plan, tens of ms of CPU); a new task, a breach or a busy node runs them at once
    replan_interval_s: Annotated[float, Field(ge=0, le=86400)] = 30.0


def load_policy(path: str | Path) -> Policy:
    """A policy file validated (:class:`SpecError` naming the file, field and reason)."""
    return load_spec(Policy, path)


def with_flags(policy: Policy, slos: list[str], webhook: str | None) -> Policy:
    """``policy`` with ``--slo NAME=MAX[:ACTION]`` flags and ``--alert-webhook`` over it
    (:class:`SpecError` naming the flag)."""
    data = policy.model_dump(exclude_none=True)
    for text in slos:
        name, eq, rest = text.partition("=")
        if not eq or name.strip() not in SLO_NAMES:
            raise SpecError(
                "command line", "--slo", f"{text!r}: expected NAME=MAX[:ACTION], NAME one of "
                + ", ".join(SLO_NAMES),
            )  # fmt: skip
        limit, _, action = rest.partition(":")
        try:
            value = float(limit)
        except ValueError:
            why = f"{text!r}: {limit!r} is not a number"
            raise SpecError("command line", "--slo", why) from None
        data.setdefault("slos", {})[name.strip()] = {"max": value, "action": action or "alert"}
    if webhook is not None:
        data["webhook"] = webhook
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        err = spec_error_from_validation("command line", exc, model=Policy)
        flag = "--alert-webhook" if err.field.startswith("webhook") else "--slo"
        raise SpecError("command line", flag, f"{err.field}: {err.reason}") from None


def policy_from(data: dict[str, Any] | None) -> Policy:
    """The policy the daemon was handed (already checked by ``dmsc up``)."""
    return validate_document(Policy, data or {}, "policy")
