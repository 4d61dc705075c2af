"""The data-parallel all-reduce's buckets and exposed time, against a step-by-step replay and the
runtime's own bucket cut."""

from __future__ import annotations

import random

import pytest

from dmsc.netmodel import (
    DEFAULT_CALIBRATION,
    CommModel,
    Topology,
    build_layer_costs,
    estimate_iteration,
)
from dmsc.netmodel.dp_buckets import (
    BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    exposed_after_backward,
    layer_tensors,
    pack_buckets,
    stage_exposed_s,
)
from dmsc.netmodel.iteration import assign_stage_layers
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, resolve_model


def _replay(ready: list[int], comm: list[int], backward: int) -> int:
    """The bucket timeline tick by tick: one communication thread takes the buckets in order,
    each once its gradients are ready, and works one tick at a time on it."""
    t, k, left = 0, 0, 0  # the tick, the next bucket, ticks left of the running one
    while k < len(ready) or left:
        if not left and ready[k] <= t:  # the thread is free and the next bucket ready
            left, k = comm[k], k + 1
        if left:
            left -= 1  # one tick's work on it
        t += 1
    return max(0, t - backward)


def test_exposed_time_is_the_replayed_timeline() -> None:
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randint(1, 8)
        backward = rng.randint(1, 60)
        ready = sorted(rng.randint(0, backward) for _ in range(n))
        ready[-1] = backward if rng.random() < 0.7 else ready[-1]
        comm = [rng.randint(1, 15) for _ in range(n)]
        assert exposed_after_backward(ready, comm, backward) == _replay(ready, comm, backward)


def test_the_last_bucket_is_never_hidden() -> None:
    # ready at the end of the backward: its whole all-reduce is exposed, however quick the rest
    assert exposed_after_backward([1.0, 2.0, 10.0], [0.5, 0.5, 3.0], 10.0) == 3.0
    # a slow early bucket holds up the ones after it on the one thread
    assert exposed_after_backward([1.0, 10.0], [12.0, 1.0], 10.0) == pytest.approx(4.0)


def test_pack_buckets_caps() -> None:
    small = FIRST_BUCKET_BYTES // 4
    buckets = pack_buckets([small] * 4 + [BUCKET_BYTES] + [small] * 3 + [2 * BUCKET_BYTES])
    assert buckets == [[0, 1, 2, 3], [4], [5, 6, 7], [8]]


def test_pack_buckets_of_another_framework_has_no_small_first_bucket() -> None:
    small = FIRST_BUCKET_BYTES // 4
    sizes = [small] * 4 + [BUCKET_BYTES] + [small] * 3 + [2 * BUCKET_BYTES]
    cap = BUCKET_BYTES + FIRST_BUCKET_BYTES  # the first bucket as large as the others
    assert pack_buckets(sizes, cap) == [[0, 1, 2, 3, 4], [5, 6, 7], [8]]
    assert pack_buckets(sizes, 1e12) == [list(range(len(sizes)))]


def test_a_jobs_bucket_size_is_the_one_priced(local_cpu: ClusterSpec) -> None:
    """A job that names its framework's bucket (``dp_bucket_bytes``) is priced with it: one
    bucket as large as the whole gradient can only go once the backward is over, so all of
    its all-reduce is exposed (dmsc's own small buckets hide some of it)."""
    spec = _gpt_mini()
    job = JobSpec(global_batch=8, micro_batch=4, dp=2, allreduce="ring")
    one = job.model_copy(update={"dp_bucket_bytes": 1 << 40})
    comm = CommModel(Topology(local_cpu), DEFAULT_CALIBRATION)
    layers = assign_stage_layers(build_layer_costs(spec, job), job)[0]
    whole = sum(lc.params_per_device for lc in layers) * 4  # gpt-mini is fp32
    whole_s = comm.collective("all_reduce", [[0, 1]], whole, "ring").time_s
    got = estimate_iteration(local_cpu, spec, one).breakdown_s["dp_comm"]
    assert got == pytest.approx(whole_s, rel=1e-9)
    assert estimate_iteration(local_cpu, spec, job).breakdown_s["dp_comm"] < got


def _gpt_mini() -> TransformerSpec:
    spec = resolve_model("gpt-mini")
    assert isinstance(spec, TransformerSpec)
    return spec


def test_the_cost_models_buckets_are_the_runtimes() -> None:
    """gpt-mini in one stage: the buckets the runtime cuts from its real parameters and those the
    cost model cuts from its layers come out the same in number, each within 1% in bytes (the
    cost model counts a block's small tensors after its matrices, the runtime between them)."""
    from dmsc.runtime.compute.dp_collective import buckets_of
    from dmsc.runtime.compute.models.chain import build_stage

    spec = _gpt_mini()
    params = list(build_stage(spec, 0, "embedding", "head").parameters())
    runtime = [
        sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets_of(params)
    ]
    layers = build_layer_costs(spec, JobSpec(global_batch=8, dp=2))
    sizes = [nbytes for lc in reversed(layers) for nbytes in layer_tensors(lc, 4)]
    model = [sum(sizes[i] for i in b) for b in pack_buckets(sizes)]
    assert sum(model) == sum(runtime)
    assert len(model) == len(runtime) == 2
    for got, want in zip(model, runtime, strict=True):
        assert got == pytest.approx(want, rel=0.01)


def test_gpt_mini_at_dp_2_exposes_its_last_bucket(local_cpu: ClusterSpec) -> None:
    """The embedding's gradients come last, so the bucket holding them goes after the backward:
    the cost model priced gpt-mini's data-parallel time as fully hidden (0 s) where the runtime
    waits for that bucket's all-reduce (8-100 ms measured on the CPU host)."""
    spec = _gpt_mini()
    job = JobSpec(global_batch=8, micro_batch=4, dp=2, allreduce="ring")
    est = estimate_iteration(local_cpu, spec, job)
    comm = CommModel(Topology(local_cpu), DEFAULT_CALIBRATION)
    groups = [[0, 1]]
    layers = assign_stage_layers(build_layer_costs(spec, job), job)[0]
    sizes = [nbytes for lc in reversed(layers) for nbytes in layer_tensors(lc, 4)]
    last = sum(sizes[i] for i in pack_buckets(sizes)[-1])
    last_s = comm.collective("all_reduce", groups, last, "ring").time_s
    assert est.breakdown_s["dp_comm"] >= last_s > 0
    # and no more than the buckets back to back after a backward that hid nothing
    every = sum(
        comm.collective("all_reduce", groups, sum(sizes[i] for i in b), "ring").time_s
        for b in pack_buckets(sizes)
    )
    assert est.breakdown_s["dp_comm"] <= every * (1 + 1e-9)


def test_stage_exposed_s_counts_each_bucket_after_its_layer() -> None:
    spec = _gpt_mini()
    layers = build_layer_costs(spec, JobSpec(global_batch=8, dp=2))
    n = len(layers)
    # a free network hides nothing and exposes nothing
    assert stage_exposed_s(layers, [1.0] * n, 4, lambda b: 0.0) == 0.0
    # a backward of 1 s a layer, 1 s a bucket: the head's bucket goes at 1 s, the rest (ready
    # when the embedding's backward ends, at n s) after it
    assert stage_exposed_s(layers, [1.0] * n, 4, lambda b: 1.0) == pytest.approx(1.0)
