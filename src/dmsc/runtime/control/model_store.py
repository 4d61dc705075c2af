"""Model storage: every checkpoint a version; promote, gray release (canary) and rollback.

State lives in ``model_versions`` (status: candidate, production, canary, retired). Which
version serves a request is the gateway's business
(:func:`dmsc.runtime.business.router.pick_version`).
"""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from dmsc.data.db import Database, ModelVersionRecord, RunRecord


def versions(db: Database) -> list[ModelVersionRecord]:
    """Every version, oldest first."""
    return db.model_versions()


def _get(s: Session, version_id: int) -> ModelVersionRecord:
    v = s.get(ModelVersionRecord, version_id)
    if v is None:
        raise KeyError(f"no model version {version_id}")
    return v


def promote(db: Database, version_id: int) -> None:
    """``version_id`` serves all traffic; the previous production version is retired."""
    with db.sessions() as s, s.begin():
        target = _get(s, version_id)
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


def export_version(db: Database, version_id: int | None, out: Path) -> ModelVersionRecord:
    """Write model version ``version_id`` (default: the one in production, else the newest) as a
    Hugging Face directory ``transformers`` loads, each stage file checked against its
    SHA-256 first. ValueError says what is missing."""
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
        serving = [v for v in all_versions if v.status == "production"]
        version = (serving or all_versions)[-1]
    else:
        found = [v for v in all_versions if v.id == version_id]
        if not found:
            raise ValueError(f"no model version {version_id}")
        version = found[0]
    with Session(db.engine) as s:
        run = s.get(RunRecord, version.run_id)
        assert run is not None
        plan = Plan.model_validate_json(run.plan_json)
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
