from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.data.db import Database, ModelVersionRecord
from dmsc.runtime.business.router import pick_version
from dmsc.runtime.control.serving.model_store import canary, promote, rollback, versions


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
    from dmsc.runtime.control.serving.model_store import promote_if_first, stop_canary

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


def test_a_version_whose_files_do_not_verify_is_not_promoted_and_a_failed_one_goes_back(
    tmp_path: Path,
) -> None:
    """``promote`` checks every file against the SHA-256 recorded when it was saved; a version
    a replica could not load anyway (``refuse``) is failed and production goes back."""
    import json

    from dmsc.runtime.compute.checkpoints import checkpoint_sha256
    from dmsc.runtime.control.serving.model_store import refuse

    db = Database(f"sqlite:///{tmp_path / 'v.sqlite'}")
    run = db.new_run("m", "c", {})
    ids = []
    for step in (1, 2, 3):
        folder = tmp_path / f"step{step}"
        folder.mkdir()
        digests = {}
        for s in (0, 1):
            f = folder / f"stage{s}.safetensors"
            f.write_bytes(bytes([step, s]) * 100)
            digests[str(f)] = checkpoint_sha256(f)
        v = ModelVersionRecord(
            run_id=run.id, step=step, path=str(folder), sha256="0" * 64,
            metrics_json=json.dumps(digests),
        )  # fmt: skip
        ids.append(db.add(v).id)
    promote(db, ids[0])
    (tmp_path / "step2" / "stage1.safetensors").write_bytes(b"corrupt")
    with pytest.raises(ValueError, match=r"version 2 cannot serve: checkpoint fails its hash"):
        promote(db, ids[1])
    assert [v.status for v in versions(db)] == ["production", "candidate", "candidate"]
    promote(db, ids[2])  # loaded by no replica: back to version 1
    assert refuse(db, ids[2], back_to=ids[0]) == ids[0]
    assert [v.status for v in versions(db)] == ["production", "candidate", "failed"]
    with pytest.raises(ValueError, match=r"version 2 cannot serve"):
        canary(db, ids[1], 10)
    (tmp_path / "step2" / "stage1.safetensors").write_bytes(bytes([2, 1]) * 100)
    canary(db, ids[1], 10)  # a canary no replica could load: production stays
    assert refuse(db, ids[1], back_to=None) == ids[0]
    assert [v.status for v in versions(db)] == ["production", "failed", "failed"]
    promote(db, ids[2])  # at a start, no version known to serve: the last one retired
    assert refuse(db, ids[2], back_to=None) == ids[0]
