from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.data.db import Database, ModelVersionRecord
from dmsc.runtime.business.router import pick_version
from dmsc.runtime.control.model_store import canary, promote, rollback, versions


def test_promote_canary_rollback(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'v.sqlite'}")
    run = db.new_run("m", "c", {})
    ids = [
        db.add(ModelVersionRecord(run_id=run.id, step=s, path=f"/ck{s}", sha256="0" * 64)).id
        for s in (100, 200, 300)
    ]
    promote(db, ids[0])
    promote(db, ids[1])
    assert [v.status for v in versions(db)] == ["retired", "production", "candidate"]
    canary(db, ids[2], 10)
    vs = versions(db)
    served = [pick_version(vs, f"req-{i}").id for i in range(20_000)]  # type: ignore[union-attr]
    share = served.count(ids[2]) / len(served)
    assert abs(share - 0.10) < 0.01
    assert pick_version(vs, "session-7") == pick_version(vs, "session-7")  # sticky
    with pytest.raises(ValueError):
        canary(db, ids[1], 10)  # already production
    with pytest.raises(ValueError):
        canary(db, ids[2], 150)
    back = rollback(db)
    assert back == ids[0]
    assert [v.status for v in versions(db)] == ["production", "retired", "candidate"]
    with pytest.raises(KeyError):
        promote(db, 999)
