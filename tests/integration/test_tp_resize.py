"""A change of dp at tp = 2: the deployment is re-planned, stopped at a checkpoint and started
again with each new replica a group of two tensor-parallel ranks, and trains on to the losses of
one process that never resized (what the control plane's resize does between tasks and between
steps: :func:`dmsc.runtime.control.training.resize.resize`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_helpers import one_box, reference_losses

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.launch.deployment import Deployment
from dmsc.runtime.control.training.resize import resize
from dmsc.runtime.control.training.session import layout_from_plan, train
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, load_spec, resolve_model

pytestmark = pytest.mark.integration

BATCH, MICRO = 4, 2  # the batches of test_tensor_parallel_deployment: one shared reference


def test_growing_dp_at_tp2_starts_groups_of_ranks_and_trains_as_one_process(
    tmp_path: Path,
) -> None:
    model = resolve_model("gpt-mini")
    assert isinstance(model, TransformerSpec)
    cluster = load_spec(ClusterSpec, one_box(tmp_path, 4))

    def plan(dp: int):  # type: ignore[no-untyped-def]
        job = JobSpec(global_batch=BATCH, micro_batch=MICRO, tp=2, dp=dp)
        return plan_job(cluster, model, job, fixed=True).plan

    text, _ = stdlib_text(max_bytes=200_000)
    corpus = Corpus(text, model.seq, seed=1)
    want = reference_losses(model, 0, 1e-3, [corpus.batch(s, BATCH) for s in range(3)], MICRO)
    dep = Deployment(layout_from_plan(plan(1), model, device="cpu"), home=tmp_path / "home")
    dep.start()
    try:
        got = train(dep, corpus, corpus, 2, BATCH, MICRO, validate=False).losses
        dep, error = resize(dep, plan(2), model, 2, dep.home / "resize", "cpu")
        assert error is None
        assert dep.layout.replicas == 2 and dep.layout.tp == 2
        sids = sorted(s.sid for s in dep.registry.lookup(stage=0))
        assert len(sids) == 4 and all(s.endswith(("-t0", "-t1")) for s in sids), sids
        got += train(dep, corpus, corpus, 1, BATCH, MICRO // 2, validate=False, first_step=2).losses
    finally:
        dep.shutdown()
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4, (got, want)
