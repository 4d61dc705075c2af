"""What ``dmsc up`` checks in a plan before it starts anything: that the runtime can run its
stages (one contiguous range of layers each) and its model (and the checkpoint is the one
planned from), and that every device the workers will run on is on this machine. Each failure
is a :class:`~dmsc.spec.SpecError` naming the plan's field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dmsc.spec import SpecError


def check_plan_stages(plan_path: str, plan: Any) -> None:
    """Before anything starts: every stage is one contiguous range of layers, the only thing
    the runtime runs. An interleaved plan's stage holds several chunks apart from one another
    (chunk ``c`` of stage ``s`` is the model's chunk ``c pp + s``); run as one range from its
    first layer to its last, it would take other stages' layers too."""
    for st in plan.stages:
        if len(st.chunks) > 1:
            raise SpecError(
                plan_path,
                f"stages[{st.index}].chunks",
                f"{len(st.chunks)} chunks (job.schedule {plan.job.schedule}, "
                f"interleave {plan.job.interleave}): the runtime runs one contiguous range of "
                "layers per stage, not an interleaved schedule; plan with --schedule 1f1b "
                "or gpipe",
            )


def check_plan_model(plan_path: str, plan: Any) -> None:
    """Before anything starts: the runtime can run the plan's stages
    (:func:`check_plan_stages`) and its model, and its checkpoint is the one the plan was made
    from."""
    from dmsc.data.tokenizer import tokenizer_for
    from dmsc.runtime.compute.models.support import check_runnable
    from dmsc.spec import TransformerSpec
    from dmsc.spec.hf import checkpoint_sha256

    check_plan_stages(plan_path, plan)
    model = plan.model_spec
    if model is None:
        return
    if not isinstance(model, TransformerSpec):
        raise SpecError(plan_path, "model_spec", "the runtime serves transformer models")
    try:
        check_runnable(model)
        tokenizer_for(model)
    except ValueError as exc:
        raise SpecError(plan_path, "model_spec", str(exc)) from None
    ref = model.checkpoint
    if ref is None:
        return
    directory = Path(ref.path)
    if not (directory / "config.json").is_file():
        raise SpecError(plan_path, "model_spec.checkpoint", f"{directory}: no checkpoint there")
    if ref.sha256 and checkpoint_sha256(directory) != ref.sha256:
        raise SpecError(
            plan_path,
            "model_spec.checkpoint",
            f"{directory} changed since the plan was made (SHA-256 differs): plan again",
        )


def check_plan_devices(plan_path: str, plan: Any, device: str) -> None:
    """Before anything starts: every device the workers will run on is on this machine (a plan
    for GPUs on a machine without them is refused, naming the replica and the way out)."""
    from dmsc.runtime.control.training.session import plan_devices

    wanted = plan_devices(plan, device)
    if all(name == "cpu" for name in wanted.values()):
        return  # no torch import for the usual CPU run
    from dmsc.runtime.compute.devices import stage_device

    for (stage, replica), name in sorted(wanted.items()):
        try:
            stage_device(name)
        except ValueError as exc:
            if device != "plan":
                raise SpecError("command line", "--device", str(exc)) from None
            where = f"stages[{stage}].replicas[{replica}].device"
            raise SpecError(plan_path, where, str(exc)) from None
