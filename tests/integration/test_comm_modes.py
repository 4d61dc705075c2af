"""A tp = 2 x pp = 2 deployment's step traces carry each mode's communication, measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.data.comm_modes import compare_modes
from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.data.db import Database
from dmsc.data.traces import record_step, step_traces
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.spec import resolve_model

pytestmark = pytest.mark.integration

SPEC = resolve_model("gpt-mini")
TWO = [("embedding", "block_1"), ("block_2", "head")]


def test_tp2_pp2_traces_time_the_all_reduces_and_the_pipeline(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    task = db.new_task(db.new_run("gpt-mini", "local", {}).id, "train", {}).id
    train, _ = stdlib_text(max_bytes=100_000)
    corpus = Corpus(train, SPEC.seq, seed=1)
    with Deployment(StageLayout(SPEC, TWO, tp=2)) as dep:
        for step in range(2):
            record_step(db, task, step, dep.train_step(step, *corpus.batch(step, 4), 2))
    traces = step_traces(db, task)
    assert len(traces) == 4  # 2 steps x 2 stages (a replica's tp rank 0 answers for it)
    for t in traces:
        tp = t.comm["tp"]
        # Megatron: two all-reduces per block forward, two backward, in each micro-batch
        assert tp["calls"] >= 2 * 2 * 2 and tp["s"] > 0 and tp["bytes"] > 0
        pp = t.comm["pp"]  # the other stage's frames: what the trace counts as sent to it
        other = (1 - t.stage, 0)
        assert pp["bytes"] == t.sent[other] > 0 and pp["calls"] > 0
        assert "dp" not in t.comm and "ep" not in t.comm
    rows = {r.mode: r for r in compare_modes({"tp_comm": 0.01, "pp_comm": 0.01}, traces)}
    assert rows["tp"].steps == rows["pp"].steps == 2
    assert rows["tp"].measured_s is not None and rows["tp"].measured_s > 0
