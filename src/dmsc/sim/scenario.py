"""The scenario of a simulation: the network, the job mix, the load and the schedulers' knobs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dmsc.spec import ClusterSpec, SpecError, SyncSpec, load_spec, read_document, validate_document


class JobTypeSpec(BaseModel):
    """One kind of training job of the mix."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="A model preset name.")
    weight: float = Field(default=1.0, gt=0, description="Share of the arrivals.")
    pp: int = Field(gt=0, le=64, description="Pipeline stages.")
    tp: int = Field(default=8, gt=0)
    dp: int = Field(default=1, gt=0)
    global_batch: int = Field(gt=0)
    micro_batch: int = Field(default=1, gt=0)
    recompute: Literal["none", "selective", "full"] = "selective"
    attention: Literal["flash", "standard"] = Field(
        default="flash", description="Attention kernel (see the job spec)."
    )
    precision: Literal["mixed", "autocast", "pure", "fp8"] = Field(
        default="mixed", description="Training recipe (see the job spec)."
    )
    iterations: int = Field(gt=0, description="Iterations until the job completes.")
    sync: SyncSpec = Field(
        default_factory=SyncSpec,
        description=(
            "How its data-parallel replicas agree (see the job spec; default: the scenario's). "
            "With local steps the job runs as islands of whole pipelines (dmsc.sim.profile)."
        ),
    )

    @field_validator("sync")
    @classmethod
    def _by_collective(cls, sync: SyncSpec) -> SyncSpec:
        if sync.via != "collective":
            raise ValueError(
                "via: leader is not simulated: the simulator's replicas exchange by collective "
                "(the leader's star is priced by dmsc estimate and dmsc plan)"
            )
        return sync

    @property
    def stage_gpus(self) -> int:
        return self.tp * self.dp


class ScenarioSpec(BaseModel):
    """Many training jobs arriving over a multi-datacenter optical network."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "scenario"
    cluster: str = Field(description="Cluster spec file, relative to the scenario file.")
    jobs: list[JobTypeSpec] = Field(min_length=1)
    load_erlang: Annotated[float, Field(gt=0)] = Field(
        description="Offered load: arrival rate x mean nominal job duration."
    )
    arrivals: int = Field(default=1000, gt=0, le=10_000_000)
    seed: int = 0
    k_paths: int = Field(default=3, gt=0, le=10)
    fit: Literal["first", "best", "last", "random", "exact"] = "first"
    guard_band: int = Field(
        default=1, ge=0, le=64, description="Slots held above every lightpath (flex grid)."
    )
    modulations: str = Field(
        default="dmsc",
        min_length=1,
        description="Modulation table: dmsc, optical-rl-gym, or a file beside the scenario.",
    )
    baseline_slots: int = Field(default=4, gt=0, description="Fixed slots per transfer (baseline).")
    max_slots: int = Field(default=32, gt=0, description="Most slots one transfer may take.")
    warmup_fraction: float = Field(default=0.1, ge=0, lt=1, description="Arrivals not counted.")
    sync: SyncSpec = Field(
        default_factory=SyncSpec,
        description="Sync mode and compression of every job type that does not give its own.",
    )

    @model_validator(mode="before")
    @classmethod
    def _sync_of_jobs(cls, data: Any) -> Any:
        """The scenario's ``sync`` given to each job type that names none of its own."""
        if not isinstance(data, dict) or data.get("sync") is None:
            return data
        jobs = data.get("jobs")
        if not isinstance(jobs, list):
            return data
        out = []
        for job in jobs:
            if isinstance(job, dict) and "sync" not in job:
                job = {**job, "sync": data["sync"]}
            elif isinstance(job, JobTypeSpec) and "sync" not in job.model_fields_set:
                job = job.model_copy(update={"sync": SyncSpec.model_validate(data["sync"])})
            out.append(job)
        return {**data, "jobs": out}

    @model_validator(mode="after")
    def _slots(self) -> Self:
        if self.baseline_slots > self.max_slots:
            raise ValueError("baseline_slots: more than max_slots")
        return self


def load_scenario(path: str | Path) -> tuple[ScenarioSpec, ClusterSpec]:
    """The scenario and its cluster; errors name the file and field."""
    scenario = validate_document(ScenarioSpec, read_document(path), str(path))
    cluster_path = Path(path).parent / scenario.cluster
    if not cluster_path.exists():
        raise SpecError(str(path), "cluster", f"no such file {cluster_path}")
    cluster = load_spec(ClusterSpec, cluster_path)
    from dmsc.spec import MODEL_PRESETS

    for i, job in enumerate(scenario.jobs):
        if job.model not in MODEL_PRESETS:
            raise SpecError(str(path), f"jobs[{i}].model", f"unknown model preset {job.model!r}")
    from dmsc.netmodel.optical import MODULATION_TABLES

    if scenario.modulations not in MODULATION_TABLES:
        table = Path(path).parent / scenario.modulations
        if not table.is_file():
            raise SpecError(
                str(path),
                "modulations",
                f"neither a table ({', '.join(MODULATION_TABLES)}) nor a file ({table})",
            )
        scenario = scenario.model_copy(update={"modulations": str(table)})
    return scenario, cluster


def job_label(job: JobTypeSpec) -> str:
    """How a job type is named on the command line and in results: ``model/ppN``."""
    return f"{job.model}/pp{job.pp}"


def with_sync(jobs: Sequence[JobTypeSpec], update: dict[str, Any]) -> list[JobTypeSpec]:
    """The job types with ``update`` (fields of :class:`SyncSpec`) over each one's sync;
    ValueError (pydantic's) when the result is no valid sync."""
    return [
        job.model_copy(
            update={"sync": SyncSpec.model_validate({**job.sync.model_dump(), **update})}
        )
        for job in jobs
    ]


def mix_jobs(
    jobs: Sequence[JobTypeSpec], picks: Sequence[tuple[str, float | None]]
) -> list[JobTypeSpec]:
    """The job types named in ``picks``, in that order, each with the weight given (None: its
    weight in the scenario). A name is a model preset, or ``model/ppN`` where a preset comes in
    several shapes; ValueError naming the pick otherwise."""
    labels = [job_label(j) for j in jobs]
    out: list[JobTypeSpec] = []
    chosen: set[int] = set()
    for name, weight in picks:
        hits = [i for i, j in enumerate(jobs) if name in (j.model, labels[i])]
        if not hits:
            raise ValueError(
                f"no job type {name!r} in the scenario (job types: {', '.join(labels)})"
            )
        if len(hits) > 1:
            raise ValueError(
                f"{name!r} names {len(hits)} job types: use one of "
                + ", ".join(labels[i] for i in hits)
            )
        if hits[0] in chosen:
            raise ValueError(f"job type {labels[hits[0]]} named twice")
        if weight is not None and not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"the weight of {name!r} must be a positive number")
        chosen.add(hits[0])
        job = jobs[hits[0]]
        out.append(job if weight is None else job.model_copy(update={"weight": weight}))
    if not out:
        raise ValueError("names no job type")
    return out
