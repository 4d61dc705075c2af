"""A model version that cannot load is never labelled as served (issue 29, point 11).

Stage 1 of version 2 is corrupted (one byte flipped: its SHA-256 no longer matches). ``dmsc
models promote 2`` refuses it with the reason; a version corrupted after it was promoted fails on
the replica that loads it, and every replica goes back to the version before (stage 0, which
did load it, included), the version is ``failed``, production is the version before again, and
a ``model-version`` fault says which stage refused and why in words, no raw gRPC error. A
production version that fails its hash when the control plane starts is handled the same way.
Real worker processes on 127.0.0.1 and real files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from conftest import run_dmsc
from runtime_helpers import control_plane, local_plan

from dmsc.runtime.control.serving.held import holding
from dmsc.runtime.control.serving.model_store import promote, versions
from dmsc.runtime.transport.messages import InferRequest, TrainRequest

GREEDY = InferRequest(prompt="def ", tokens=8, temperature=0.0)


def corrupt(path: Path) -> bytes:
    """Flip one byte in the middle of ``path``; its bytes before."""
    data = path.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(flipped))
    return data


def stage_digests(db: object, version: int) -> dict[int, str]:
    v = next(v for v in versions(db) if v.id == version)  # type: ignore[arg-type]
    files = json.loads(v.metrics_json)
    return {s: files[str(Path(v.path) / f"stage{s}.safetensors")] for s in (0, 1)}


def status(db: object) -> dict[int, str]:
    return {v.id: v.status for v in versions(db)}  # type: ignore[arg-type]


def model_faults(db: object, run: int) -> list[str]:
    return [f.reason for f in db.faults(run) if f.kind == "model-version"]  # type: ignore[attr-defined]


def test_a_corrupt_version_is_not_promoted_and_the_replicas_stay_on_the_one_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = local_plan()
    with control_plane(plan, tmp_path) as cp:
        cp.log.propagate = True
        v1 = cp.train(TrainRequest(steps=3, lr=3e-3))["model_version"]
        v2 = cp.train(TrainRequest(steps=3, lr=3e-3))["model_version"]
        cp.inference.sync_versions()
        before = cp.infer(GREEDY)
        assert before["model_version"] == v1
        path = Path(next(v.path for v in versions(cp.db) if v.id == v2)) / "stage1.safetensors"
        good = corrupt(path)
        # the command refuses it, with the reason, and changes nothing
        res = run_dmsc("models", "promote", str(v2), home=tmp_path, timeout=120)
        assert res.returncode == 2, (res.stdout, res.stderr)
        assert "cannot serve: checkpoint fails its hash" in res.stderr
        assert "Traceback" not in res.stderr
        assert status(cp.db) == {v1: "production", v2: "candidate"}

        # corrupted after it was promoted: stage 0 loads it, stage 1 refuses
        path.write_bytes(good)
        promote(cp.db, v2)
        corrupt(path)
        with caplog.at_level(logging.INFO, logger="dmsc.control"):
            cp.inference.sync_versions()
        assert status(cp.db) == {v1: "production", v2: "failed"}
        held = holding(cp.db, cp.run.id)["replica-0"]
        assert held.version == v1 and held.digests == stage_digests(cp.db, v1)
        after = cp.infer(GREEDY)
        assert after["model_version"] == v1 and after["token_ids"] == before["token_ids"]
        (reason,) = model_faults(cp.db, cp.run.id)
        assert f"version {v2} did not load on replica-0" in reason
        assert "stage 1: checkpoint fails its hash" in reason and "stage 0" not in reason
        assert f"version {v1} in production again" in reason
        assert "replica-0 on version" in reason
        for text in (reason, caplog.text):
            assert "_InactiveRpcError" not in text and "StatusCode" not in text

        # mended and promoted again, it serves
        path.write_bytes(good)
        promote(cp.db, v2)
        cp.inference.sync_versions()
        held = holding(cp.db, cp.run.id)["replica-0"]
        assert held.version == v2 and held.digests == stage_digests(cp.db, v2)
        assert cp.infer(GREEDY)["model_version"] == v2
        run = cp.run.id
        corrupt(path)  # production fails its hash before the next start

    with control_plane(plan, tmp_path) as cp:  # the run resumes
        assert cp.run.id == run
        cp.inference.sync_versions()  # v2 refused: back to v1, which then loads
        cp.inference.sync_versions()
        assert status(cp.db)[v2] == "failed" and status(cp.db)[v1] == "production"
        held = holding(cp.db, cp.run.id)["replica-0"]
        assert held.version == v1 and held.digests == stage_digests(cp.db, v1)
        out = cp.infer(GREEDY)
        assert out["model_version"] == v1 and out["token_ids"] == before["token_ids"]
        assert any("stage 1: checkpoint fails its hash" in r for r in model_faults(cp.db, run)[1:])
