"""Model storage: every checkpoint a version; promote, gray release (canary) and rollback.

State lives in ``model_versions`` (status: candidate, production, canary, retired, failed). The
status says which version should serve; what a replica does serve is what it has loaded
(:mod:`.held`). A version whose files do not verify is not promoted; one that a replica could
not load anyway goes to ``failed`` (:func:`refuse`) and production back to the version before.
Which version serves a request is the gateway's business
(:func:`dmsc.runtime.business.router.pick_version`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from dmsc.data.db import CheckpointRecord, Database, ModelVersionRecord, RunRecord
from dmsc.spec.residency import ResidencySpec, check_model_store

if TYPE_CHECKING:
    from dmsc.runtime.control.launch.deployment import Deployment


def versions(db: Database) -> list[ModelVersionRecord]:
    """Every version, oldest first."""
    return db.model_versions()


def _get(s: Session, version_id: int) -> ModelVersionRecord:
    v = s.get(ModelVersionRecord, version_id)
    if v is None:
        raise KeyError(f"no model version {version_id}")
    return v


def check_files(version: ModelVersionRecord) -> None:
    """ValueError, naming the file and why, unless every file of ``version`` is there and has
    the SHA-256 recorded when it was saved."""
    from dmsc.runtime.compute.checkpoints import CheckpointError, verify_checkpoint

    for path, sha in json.loads(version.metrics_json or "{}").items():
        try:
            verify_checkpoint(Path(path), sha)
        except CheckpointError as exc:
            raise ValueError(f"version {version.id} cannot serve: {exc} ({path})") from None


def promote(db: Database, version_id: int, verify: bool = True) -> None:
    """``version_id`` serves all traffic; the previous production version is retired. A version
    whose files do not verify is refused (ValueError) and nothing changes."""
    with db.sessions() as s, s.begin():
        target = _get(s, version_id)
        if verify:
            check_files(target)
        for v in s.scalars(
            select(ModelVersionRecord).where(
                ModelVersionRecord.status.in_(("production", "canary"))
            )
        ):
            v.status, v.canary_percent = (
                ("retired" if v.status == "production" else "candidate"),
                0.0,
            )
        target.status, target.canary_percent = "production", 0.0


def promote_if_first(db: Database, version_id: int) -> bool:
    """Promote ``version_id`` when no version is in production yet: a deployment's first
    trained model serves without a manual promote. True if it did."""
    with db.sessions() as s:
        serving = s.scalar(
            select(ModelVersionRecord.id).where(ModelVersionRecord.status == "production")
        )
    if serving is not None:
        return False
    promote(db, version_id)
    return True


def save_version(
    dep: Deployment,
    db: Database,
    run_id: int,
    folder: Path,
    step: int,
    every: bool,
    task_id: int | None,
) -> tuple[int, bool]:
    """Save the deployment's model (``every`` replica's stages: task heads differ) at ``step``
    into ``folder`` as a new version of ``task_id`` and as the run's latest checkpoint; the
    version's id, and whether it went into production (the first does)."""
    ckpt = dep.checkpoint(step, folder, every=every)
    digests = {path: sha for path, sha in [*ckpt.files.values(), *ckpt.replicas.values()]}
    db.add(CheckpointRecord(run_id=run_id, step=ckpt.step, files_json=ckpt.files_json()))
    record = db.add(
        ModelVersionRecord(
            run_id=run_id,
            step=step,
            path=str(folder),
            sha256=next(iter(digests.values())),
            metrics_json=json.dumps(digests),
            task_id=task_id,
        )
    )
    return record.id, promote_if_first(db, record.id)


def stop_canary(db: Database) -> int | None:
    """Withdraw the canary (it goes back to candidate, production takes all traffic); the id
    of the withdrawn version, None when there was none."""
    with db.sessions() as s, s.begin():
        withdrawn = None
        for v in s.scalars(select(ModelVersionRecord).where(ModelVersionRecord.status == "canary")):
            v.status, v.canary_percent, withdrawn = "candidate", 0.0, v.id
        return withdrawn


def canary(db: Database, version_id: int, percent: float) -> None:
    """Send ``percent`` of inference traffic to ``version_id`` (one canary at a time);
    ``percent`` 0 withdraws the canary (no traffic)."""
    if not 0 <= percent < 100:
        raise ValueError("percent must be at least 0 and below 100")
    if percent == 0:
        stop_canary(db)
        return
    with db.sessions() as s, s.begin():
        target = _get(s, version_id)
        if target.status == "production":
            raise ValueError(f"version {version_id} is already in production")
        check_files(target)
        for v in s.scalars(select(ModelVersionRecord).where(ModelVersionRecord.status == "canary")):
            v.status, v.canary_percent = "candidate", 0.0
        target.status, target.canary_percent = "canary", percent


def rollback(db: Database) -> int:
    """Back to the most recently retired version; the current one is retired. Returns its id."""
    with db.sessions() as s, s.begin():
        retired = list(
            s.scalars(
                select(ModelVersionRecord)
                .where(ModelVersionRecord.status == "retired")
                .order_by(ModelVersionRecord.id.desc())
            )
        )
        if not retired:
            raise KeyError("no earlier version to roll back to")
        for v in s.scalars(
            select(ModelVersionRecord).where(
                ModelVersionRecord.status.in_(("production", "canary"))
            )
        ):
            v.status, v.canary_percent = (
                ("retired" if v.status == "production" else "candidate"),
                0.0,
            )
        retired[0].status = "production"
        return retired[0].id


def refuse(db: Database, version_id: int, back_to: int | None) -> int | None:
    """Version ``version_id`` did not load on every replica: it is ``failed`` and, if it was in
    production, ``back_to`` is again (default: the most recently retired version). The version
    in production after it (None: none)."""
    with db.sessions() as s, s.begin():
        target = _get(s, version_id)
        was_production = target.status == "production"
        target.status, target.canary_percent = "failed", 0.0
        current = s.scalar(
            select(ModelVersionRecord).where(ModelVersionRecord.status == "production")
        )
        if not was_production:
            return current.id if current is not None else None
        if back_to is None or back_to == version_id:
            back = s.scalar(
                select(ModelVersionRecord)
                .where(ModelVersionRecord.status == "retired")
                .order_by(ModelVersionRecord.id.desc())
            )
        else:
            back = s.get(ModelVersionRecord, back_to)
        if back is None:
            return None
        back.status, back.canary_percent = "production", 0.0
        return back.id


def export_version(
    db: Database, version_id: int | None, out: Path, residency: ResidencySpec | None = None
) -> ModelVersionRecord:
    """Write model version ``version_id`` (default: the newest trained, which need not be the
    one serving) as a Hugging Face directory ``transformers`` loads, each stage file checked
    against its SHA-256 first. ValueError says what is missing, or which ``residency`` rule
    keeps the version out of the home's datacenter (the export is written at the home)."""
    import torch

    from dmsc.planner.plan import Plan
    from dmsc.runtime.compute.checkpoints import (
        CheckpointError,
        read_state,
        stage_file,
        verify_checkpoint,
    )
    from dmsc.runtime.compute.models.chain import layer_names, layer_range
    from dmsc.runtime.compute.models.hf import stage_tensors, write_model_dir
    from dmsc.spec import TransformerSpec, resolve_model

    all_versions = versions(db)
    if not all_versions:
        raise ValueError("no model version yet: train first (dmsc train)")
    if version_id is None:
        version = all_versions[-1]
    else:
        found = [v for v in all_versions if v.id == version_id]
        if not found:
            raise ValueError(f"no model version {version_id}")
        version = found[0]
    with Session(db.engine) as s:
        run = s.get(RunRecord, version.run_id)
        assert run is not None
        plan = Plan.model_validate_json(run.plan_json)
    check_model_store(residency, plan.model, f"the export of version {version.id}", version.id)
    model = plan.model_spec if plan.model_spec is not None else resolve_model(plan.model)
    if not isinstance(model, TransformerSpec):
        raise ValueError(f"{plan.model}: only transformer models export")
    digests = json.loads(version.metrics_json or "{}")
    tensors: dict[str, torch.Tensor] = {}
    for record in plan.stages:
        path = stage_file(Path(version.path), record.index)
        try:
            verify_checkpoint(path, digests.get(str(path), ""))
            state = read_state(path)
        except CheckpointError as exc:
            raise ValueError(f"version {version.id}, stage {record.index}: {exc}") from None
        if state.legacy:  # a torch.save file: the stage module's own names
            lo, hi = layer_range(model, record.chunks[0][0], record.chunks[-1][1])
            names = layer_names(model)[lo:hi]
            tensors.update(stage_tensors(model, names, state.legacy["model"]))
        else:
            tensors.update(state.weights)
    source = Path(model.checkpoint.path) if model.checkpoint is not None else None
    write_model_dir(model, tensors, out, source)
    return version
