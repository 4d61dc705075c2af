"""What ``dmsc up`` checks in a plan before it starts anything: that the runtime can run its
stages (one contiguous range of layers each, or in an interleaved plan one per chunk, in order
down the virtual stages, the whole model between them), its
parallelism (a stage replica is one worker per tensor-parallel rank, on the CPU; experts shared
out among ep replicas, on the CPU; no sequence parallelism with experts; the runtime's own
gradient buckets, not a priced framework's ``dp_bucket_bytes``)
and its model (and the checkpoint is the one planned from), that its stages, replicas and
devices add up to its job, and that every device the workers will run on is on this machine.
Each failure is a :class:`~dmsc.spec.SpecError` naming the plan's field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dmsc.spec import SpecError


def check_plan_stages(plan_path: str, plan: Any) -> None:
    """Before anything starts: every stage holds the chunks the runtime runs: one contiguous
    range of layers, or in an interleaved plan ``job.interleave`` of them (chunk ``c`` of stage
    ``s`` is the model's chunk ``c pp + s``, run by the interleaved 1F1B schedule); a stage
    holding any other number would be merged or take another stage's place."""
    want = plan.job.chunks
    for st in plan.stages:
        if len(st.chunks) != want:
            raise SpecError(
                plan_path,
                f"stages[{st.index}].chunks",
                f"{len(st.chunks)} chunks for job.schedule {plan.job.schedule} with "
                f"interleave {plan.job.interleave}: each stage runs {want}",
            )


def check_plan_parallelism(plan_path: str, plan: Any) -> None:
    """Before anything starts: the plan's parallelism is what the runtime deploys. It runs a
    stage replica as one worker process per tensor-parallel rank (heads and MLP split
    Megatron-style over a gloo group, the sequence too where the plan asks for sequence
    parallelism) and, at ep > 1, a stage's experts shared out among expert-parallel groups of
    ep replicas, each expert split over the replica's tp ranks at tp > 1
    (:mod:`dmsc.runtime.compute.ep_worker`); a plan with sequence parallelism for a mixture of
    experts or with an ep not dividing the experts would run another job than the one planned
    and predicted (an ep not dividing the replicas is no JobSpec; GPUs at tp > 1 or ep > 1:
    :func:`check_plan_devices`). Inference at ep > 1 runs each request on every replica of an
    expert-parallel group (:mod:`dmsc.runtime.control.launch.forwarding`)."""
    from dmsc.runtime.compute.models.support import check_tp_divisible
    from dmsc.spec import TransformerSpec

    job, model = plan.job, plan.model_spec
    if job.dp_bucket_bytes is not None and job.dp > 1:
        # a bucket of another framework's: the runtime cuts its own (dmsc.netmodel.dp_buckets),
        # so the plan's data-parallel prediction would not be of what runs
        raise SpecError(
            plan_path,
            "job.dp_bucket_bytes",
            f"{job.dp_bucket_bytes} prices another framework's gradient buckets; dmsc's runtime "
            "cuts its own (256 KiB first, then 4 MiB): plan without it to run here",
        )
    if not isinstance(model, TransformerSpec):
        model = None
    if model is not None:
        try:
            check_tp_divisible(model, job.tp)
        except ValueError as exc:
            raise SpecError(plan_path, "job.tp", str(exc)) from None
    if job.tp > 1 and job.sequence_parallel and model is not None and model.is_moe:
        raise SpecError(
            plan_path,
            "job.sequence_parallel",
            f"tp={job.tp} with sequence parallelism for a mixture of experts: each rank's "
            "router would pick experts for its own slice of the sequence only; plan with "
            "--no-sequence-parallel",
        )
    if model is not None and job.ep > 1:
        if not model.is_moe:
            raise SpecError(plan_path, "job.ep", f"ep={job.ep}: the model has no experts")
        if model.experts % job.ep:
            raise SpecError(
                plan_path,
                "job.ep",
                f"ep={job.ep} does not divide the model's experts ({model.experts})",
            )


def check_plan_shape(plan_path: str, plan: Any) -> None:
    """Before anything starts: the plan's stages, replicas and devices add up to its job, as
    ``training.layout_from_plan`` deploys them: ``job.pp`` stages in order, each the next
    contiguous range of the model's layers (the first from the embedding, the last to the
    head; interleaved, each chunk the next range after chunk ``c`` of the stage before, the
    last stage's followed by chunk ``c + 1`` of the first), ``job.dp`` replicas of each,
    ``job.tp`` devices for each replica and no device holding two of them (more ranks than
    devices)."""
    from dmsc.runtime.compute.models.support import layer_names
    from dmsc.spec import TransformerSpec

    job = plan.job
    if len(plan.stages) != job.pp:
        raise SpecError(plan_path, "stages", f"{len(plan.stages)} stages for job.pp {job.pp}")
    names = layer_names(plan.model_spec) if isinstance(plan.model_spec, TransformerSpec) else []
    holder: dict[int, str] = {}
    for s, st in enumerate(plan.stages):
        if st.index != s:
            raise SpecError(plan_path, f"stages[{s}].index", f"is {st.index}, expected {s}")
    after = ""  # the last layer of the chunk before, down the pipeline's virtual stages
    last_where = f"stages[{job.pp - 1}].chunks"
    for k in range(job.pp * job.chunks):
        s, c = k % job.pp, k // job.pp
        if c >= len(plan.stages[s].chunks):
            break  # the chunks' count: check_plan_stages
        first, last = plan.stages[s].chunks[c]
        where = f"stages[{s}].chunks" + (f"[{c}]" if job.chunks > 1 else "")
        if names:
            want = names[names.index(after) + 1] if after else names[0]
            if first != want or last not in names or names.index(last) < names.index(first):
                at = f"after {after}" if after else "the model's first layer"
                raise SpecError(
                    plan_path,
                    where,
                    f"starts at {first}, {at}: every layer from {names[0]} to {names[-1]} "
                    "runs in exactly one stage, in order",
                )
        after, last_where = last, where
    for s, st in enumerate(plan.stages):
        if len(st.replicas) != job.dp:
            raise SpecError(
                plan_path,
                f"stages[{s}].replicas",
                f"{len(st.replicas)} replicas for job.dp {job.dp}",
            )
        for r, rep in enumerate(st.replicas):
            where = f"stages[{s}].replicas[{r}].devices"
            if len(rep.devices) != job.tp:
                raise SpecError(plan_path, where, f"{len(rep.devices)} devices for job.tp {job.tp}")
            for d in rep.devices:
                if d in holder:
                    raise SpecError(
                        plan_path,
                        where,
                        f"device {d} also holds {holder[d]}: the plan puts more ranks than devices",
                    )
                holder[d] = f"stages[{s}].replicas[{r}]"
    if names and after != names[-1]:
        raise SpecError(plan_path, last_where, f"ends at {after}, not at {names[-1]}")


def check_plan_model(plan_path: str, plan: Any) -> None:
    """Before anything starts: the runtime can run the plan's stages
    (:func:`check_plan_stages`) and its model, and its checkpoint is the one the plan was made
    from."""
    from dmsc.data.tokenizer import tokenizer_for
    from dmsc.runtime.compute.models.support import check_runnable
    from dmsc.spec import TransformerSpec
    from dmsc.spec.hf import checkpoint_sha256

    check_plan_stages(plan_path, plan)
    check_plan_parallelism(plan_path, plan)
    check_plan_shape(plan_path, plan)
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
    from dmsc.runtime.control.training.placement import plan_devices

    wanted = plan_devices(plan, device)
    if all(name == "cpu" for name in wanted.values()):
        return  # no torch import for the usual CPU run
    if plan.job.tp > 1 or plan.job.ep > 1:
        (stage, replica), name = next((k, v) for k, v in sorted(wanted.items()) if v != "cpu")
        where = "--device" if device != "plan" else f"stages[{stage}].replicas[{replica}].device"
        why = (
            f"{name} at tp={plan.job.tp}: tensor-parallel ranks run on the CPU only (the plan "
            "names one GPU per replica, not one per rank)"
            if plan.job.tp > 1
            else f"{name} at ep={plan.job.ep}: the experts' tokens are exchanged by gloo on the "
            "CPU only"
        )
        raise SpecError(
            "command line" if device != "plan" else plan_path,
            where,
            f"{why}; run with --device cpu",
        )
    from dmsc.runtime.compute.devices import stage_device

    for (stage, replica), name in sorted(wanted.items()):
        try:
            stage_device(name)
        except ValueError as exc:
            if device != "plan":
                raise SpecError("command line", "--device", str(exc)) from None
            where = f"stages[{stage}].replicas[{replica}].device"
            raise SpecError(plan_path, where, str(exc)) from None
