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


def test_the_first_version_serves_and_a_canary_can_be_withdrawn(tmp_path: Path) -> None:
    """The first trained version goes to production by itself (it answered from random weights
    until someone promoted); ``--percent 0`` and ``--stop`` withdraw a canary."""
    from dmsc.runtime.control.model_store import promote_if_first, stop_canary

    db = Database(f"sqlite:///{tmp_path / 'v.sqlite'}")
    run = db.new_run("m", "c", {})
    ids = [
        db.add(ModelVersionRecord(run_id=run.id, step=s, path=f"/ck{s}", sha256="0" * 64)).id
        for s in (1, 2, 3)
    ]
    assert promote_if_first(db, ids[0]) and not promote_if_first(db, ids[1])
    assert [v.status for v in versions(db)] == ["production", "candidate", "candidate"]
    canary(db, ids[1], 10)
    canary(db, ids[1], 0)  # no traffic: withdrawn
    assert [v.status for v in versions(db)] == ["production", "candidate", "candidate"]
    canary(db, ids[2], 20)
    assert stop_canary(db) == ids[2] and stop_canary(db) is None
    vs = versions(db)
    assert {pick_version(vs, f"r{i}").id for i in range(1000)} == {ids[0]}  # type: ignore[union-attr]
