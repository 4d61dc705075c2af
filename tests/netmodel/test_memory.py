from __future__ import annotations

import pytest

from dmsc.netmodel import build_layer_costs
from dmsc.netmodel.memory import inflight_microbatches, stage_memory
from dmsc.spec import JobSpec, TransformerSpec

GPT = TransformerSpec(layers=8, hidden=1024, heads=16, seq=2048, vocab=51200, dtype="fp16")


def test_activations_follow_korthikanti() -> None:
    # Korthikanti et al. 2023, Table 2: sbh(34 + 5as/h) without parallelism or recomputation,
    # sbh(10 + 24/t + 5as/(ht)) with tensor parallelism, sbh/t (34 + 5as/h) with sequence
    # parallelism too, 2sbh with full recomputation.
    s, b, h, a = 2048, 1, 1024, 16
    sbh = s * b * h

    def act(attention: str = "standard", **job: object) -> float:
        spec = JobSpec(global_batch=8, attention=attention, **job)  # type: ignore[arg-type]
        return build_layer_costs(GPT, spec)[1].activation_bytes

    assert act() == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert act(tp=4) == pytest.approx(sbh * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    assert act(tp=4, sequence_parallel=True) == pytest.approx(sbh / 4 * (34 + 5 * a * s / h))
    assert act(tp=4, sequence_parallel=True, recompute="selective") == pytest.approx(sbh / 4 * 34)
    assert act(recompute="full") == pytest.approx(2 * sbh)
    # A flash kernel keeps no s x s tensor: Korthikanti's 34 sbh of the block, and the fp32
    # log-sum-exp of each row of scores (Dao, "FlashAttention-2", 2024, Algorithm 1).
    lse = 4 * b * a * s
    assert act("flash") == pytest.approx(sbh * 34 + lse)
    assert act("flash", tp=4) == pytest.approx(sbh * (10 + 24 / 4) + lse / 4)
    assert act("flash", recompute="selective") == act("flash")  # nothing left to recompute
    assert act("flash", recompute="full") == act(recompute="full")


def test_zero_stages_shard_states() -> None:
    P = 1e9
    mems = [
        stage_memory(JobSpec(global_batch=8, dp=8, zero=z), "fp16", 0, P, 0.0, 0.0)
        for z in range(4)
    ]
    # ZeRO paper: 2 + 2 + 12 bytes per parameter; stage 1 shards the 12, 2 the grads, 3 all.
    assert mems[0].total == pytest.approx(16 * P)
    assert mems[1].total == pytest.approx(4 * P + 12 * P / 8)
    assert mems[2].total == pytest.approx(2 * P + 14 * P / 8)
    assert mems[3].total == pytest.approx(16 * P / 8)


def test_inflight_microbatches() -> None:
    assert inflight_microbatches(JobSpec(global_batch=32, pp=4, schedule="gpipe"), 0) == 32
    assert inflight_microbatches(JobSpec(global_batch=32, pp=4), 0) == 4
    assert inflight_microbatches(JobSpec(global_batch=32, pp=4), 3) == 1
    inter = JobSpec(global_batch=32, pp=4, schedule="interleaved", interleave=2)
    # Megatron-LM warm-up: 2(p - 1) + (v - 1)p + 1 = 11 chunks of half a stage.
    assert inflight_microbatches(inter, 0) == pytest.approx(11 / 2)
    assert inflight_microbatches(JobSpec(global_batch=32, mode="infer"), 0) == 1
