"""The model versions as the gateway serves them: read from the database at most once a
second, their JSON for ``GET /v1/models`` made once per read, and each tenant's view of it (the
task that trained a version shown to its own tenant only)."""

from __future__ import annotations

import json
import time
from typing import Any

from anyio import to_thread

from dmsc.data.db import Database, ModelVersionRecord


def version_json(v: ModelVersionRecord) -> dict[str, Any]:
    return {
        "id": v.id,
        "run": v.run_id,
        "step": v.step,
        "sha256": v.sha256,
        "status": v.status,
        "canary_percent": v.canary_percent,
        "task": v.task_id,
    }


class ModelVersions:
    """The model versions, read from the database at most once per ``ttl_s`` (a promotion
    made with ``dmsc models`` reaches the gateway within it), and their JSON for
    ``GET /v1/models`` made once per read."""

    def __init__(self, db: Database, ttl_s: float = 1.0) -> None:
        self.db, self.ttl_s = db, ttl_s
        self._at, self._versions = -float("inf"), list[ModelVersionRecord]()
        self.json = b"[]"
        self._owners: dict[int, str | None] = {}  # task -> tenant, for .json_for

    async def get(self) -> list[ModelVersionRecord]:
        if time.monotonic() - self._at > self.ttl_s:
            self._versions = await to_thread.run_sync(self.db.model_versions)
            self.json = json.dumps([version_json(v) for v in self._versions]).encode()
            self._at = time.monotonic()
        return self._versions

    async def json_for(self, tenant: str | None) -> bytes:
        """Every version as ``tenant`` may read it: the task that trained it is shown only to
        its own tenant (None: every task, for an admin key), as ``GET /v1/tasks`` shows it."""
        versions = await self.get()
        if tenant is None:
            return self.json
        tasks = {v.task_id for v in versions if v.task_id is not None}
        if tasks - self._owners.keys():
            rows = await to_thread.run_sync(self.db.tasks)
            self._owners.update({t.id: t.tenant for t in rows})
        out = [
            {
                **version_json(v),
                "task": v.task_id if self._owner(v.task_id) == tenant else None,
            }
            for v in versions
        ]
        return json.dumps(out).encode()

    def _owner(self, task: int | None) -> str | None:
        return None if task is None else self._owners.get(task)
