"""``--sync`` and ``--compress``: how data-parallel replicas agree, for ``dmsc estimate``,
``dmsc plan`` and ``dmsc simulate``; parsed where they enter, an error names the option and the
forms it accepts (exit 2)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from dmsc.spec import SpecError, parse_compress, parse_sync

if TYPE_CHECKING:
    from dmsc.sim.scenario import JobTypeSpec, ScenarioSpec

SyncOpt = Annotated[
    str | None,
    typer.Option(
        "--sync",
        help="Data-parallel sync: every-step (the default), diloco:H, fedavg:H or fedprox:H "
        "(H local steps per round, then one exchange).",
    ),
]
CompressOpt = Annotated[
    str | None,
    typer.Option(
        "--compress",
        help="What the replicas send: none (the default), bf16, int8[:BLOCK], topk:F "
        "or powersgd:R.",
    ),
]


def sync_fields(sync: str | None, compress: str | None) -> dict[str, Any] | None:
    """The fields of the job's ``sync`` the two options give (None: neither was given)."""
    if sync is None and compress is None:
        return None
    out: dict[str, Any] = {}
    if sync is not None:
        try:
            parsed = parse_sync(sync)
        except ValueError as exc:
            raise SpecError("command line", "--sync", str(exc)) from None
        out.update(mode=parsed.mode, inner_steps=parsed.inner_steps)
    if compress is not None:
        try:
            parse_compress(compress)
        except ValueError as exc:
            raise SpecError("command line", "--compress", str(exc)) from None
        out["compress"] = compress.strip()
    return out


def scenario_with_sync(
    scenario: ScenarioSpec, sync: str | None, compress: str | None
) -> ScenarioSpec:
    """The scenario with the options over every job type's sync (and the scenario's own)."""
    from pydantic import ValidationError

    from dmsc.sim.scenario import with_sync
    from dmsc.spec import SyncSpec

    update = sync_fields(sync, compress)
    if update is None:
        return scenario
    try:
        jobs = with_sync(scenario.jobs, update)
        default = SyncSpec.model_validate({**scenario.sync.model_dump(), **update})
    except ValidationError as exc:  # compress on a mode, or the mode, refused together
        flag = "--sync" if sync is not None else "--compress"
        reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise SpecError("command line", flag, reason) from None
    return scenario.model_copy(update={"jobs": jobs, "sync": default})


def job_entry(job: JobTypeSpec) -> dict[str, Any]:
    """A job type as ``dmsc simulate --json`` echoes it: its label and weight, and its sync when
    that is not every step uncompressed."""
    from dmsc.sim.scenario import job_label
    from dmsc.spec import SyncSpec

    out: dict[str, Any] = {"job": job_label(job), "weight": job.weight}
    if job.sync != SyncSpec():
        out["sync"] = job.sync.label
    return out
