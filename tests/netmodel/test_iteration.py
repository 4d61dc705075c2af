from __future__ import annotations

import pytest

from dmsc.netmodel import (
    BREAKDOWN_KEYS,
    MODES,
    DoesNotFit,
    Topology,
    build_layer_costs,
    check_fit,
    estimate_iteration,
)
from dmsc.spec import ClusterSpec, JobSpec, LayerListSpec, TransformerSpec, resolve_model


def test_breakdown_sums_to_iteration(selene: ClusterSpec) -> None:
    job = JobSpec(
        global_batch=64, tp=8, pp=8, dp=1, schedule="interleaved", interleave=3, recompute="full"
    )
    est = estimate_iteration(selene, resolve_model("gpt3-175b"), job)
    assert set(est.breakdown_s) == set(BREAKDOWN_KEYS)
    assert sum(est.breakdown_s.values()) == pytest.approx(est.iteration_time_s)
    assert 100 < est.tflops_per_gpu < 312
    assert est.memory_per_device < 80 * 1024**3


def test_traffic_by_link_sums_to_traffic_by_mode(nsfnet: ClusterSpec) -> None:
    topo = Topology(nsfnet)
    job = JobSpec(
        global_batch=256, tp=8, pp=4, dp=8, recompute="selective", sequence_parallel=True, zero=1
    )
    est = estimate_iteration(nsfnet, resolve_model("llama3-70b"), job, topology=topo)
    for mode in MODES:
        device_bytes = sum(
            modes[mode]
            for lid, modes in est.traffic_by_link.items()
            if topo.links[lid].kind == "device"
        )
        assert device_bytes == pytest.approx(2 * est.traffic_bytes[mode])
    assert est.traffic_bytes["tp"] > est.traffic_bytes["dp"] > 0
    assert est.traffic_bytes["pp"] > 0 and est.traffic_bytes["ep"] == 0


def test_dp_traffic_is_a_ring_all_reduce_of_the_gradients(selene: ClusterSpec) -> None:
    model = resolve_model("gpt3-1.3b")
    job = JobSpec(global_batch=64, dp=16)
    est = estimate_iteration(selene, model, job)
    grads = est.params * 2
    # 16 replicas each send 2 (n-1)/n of the gradient buffer (any all-reduce algorithm).
    assert est.traffic_bytes["dp"] == pytest.approx(16 * 2 * 15 / 16 * grads, rel=0.02)


def test_more_microbatches_shrink_the_bubble_share(selene: ClusterSpec) -> None:
    model = resolve_model("gpt3-13b")
    shares = []
    for gb in (8, 32, 128):
        est = estimate_iteration(selene, model, JobSpec(global_batch=gb, tp=8, pp=4, dp=1))
        shares.append(est.breakdown_s["bubble"] / est.iteration_time_s)
    assert shares[0] > shares[1] > shares[2]
    # 1F1B bubble: (p - 1) / m of the pipeline's busy time, to first order.
    est = estimate_iteration(selene, model, JobSpec(global_batch=32, tp=8, pp=4, dp=1))
    busy = est.iteration_time_s - est.breakdown_s["bubble"] - est.breakdown_s["optimizer"]
    busy -= est.breakdown_s["dp_comm"]
    assert est.breakdown_s["bubble"] / busy == pytest.approx(3 / 32, rel=0.15)


def test_interleaving_shrinks_the_bubble(selene: ClusterSpec) -> None:
    model = resolve_model("gpt3-13b")
    plain = estimate_iteration(selene, model, JobSpec(global_batch=16, tp=8, pp=4))
    inter = estimate_iteration(
        selene, model, JobSpec(global_batch=16, tp=8, pp=4, schedule="interleaved", interleave=2)
    )
    assert inter.breakdown_s["bubble"] < plain.breakdown_s["bubble"]
    # Waiting for each chunk's activations, interleaving pays for more transfers; sending them
    # while another chunk computes (Megatron-Core's overlapped schedule) hides them.
    blocking = estimate_iteration(
        selene,
        model,
        JobSpec(
            global_batch=16,
            tp=8,
            pp=4,
            schedule="interleaved",
            interleave=2,
            overlap_pp_comm=False,
        ),
    )
    assert blocking.breakdown_s["pp_comm"] > plain.breakdown_s["pp_comm"]
    assert inter.breakdown_s["pp_comm"] < blocking.breakdown_s["pp_comm"]


def test_cross_datacenter_pipeline_pays_for_the_fiber(nsfnet: ClusterSpec) -> None:
    model = resolve_model("llama3-8b")
    # 8 devices per stage: pp=4 inside one DC's 256 devices, or one stage per DC.
    inside = estimate_iteration(nsfnet, model, JobSpec(global_batch=64, tp=8, pp=4, dp=1))
    across = estimate_iteration(
        nsfnet, model, JobSpec(global_batch=64, tp=8, pp=4, dp=32, first_device=0)
    )
    assert across.stages[1].pp_comm_s > inside.stages[1].pp_comm_s * 10
    assert across.traffic_bytes["pp"] > 0


def test_overlap_hides_dp_communication(selene: ClusterSpec) -> None:
    model = resolve_model("gpt3-2.7b")
    base = JobSpec(global_batch=64, dp=32, overlap_dp_comm=False)
    exposed = estimate_iteration(selene, model, base)
    hidden = estimate_iteration(selene, model, base.model_copy(update={"overlap_dp_comm": True}))
    assert hidden.breakdown_s["dp_comm"] < exposed.breakdown_s["dp_comm"]
    assert hidden.traffic_bytes["dp"] == pytest.approx(exposed.traffic_bytes["dp"])


def test_expert_parallel_all_to_all(selene: ClusterSpec) -> None:
    est = estimate_iteration(
        selene,
        resolve_model("mixtral-8x7b"),
        JobSpec(global_batch=64, pp=4, dp=16, ep=8, recompute="full"),
    )
    assert est.breakdown_s["ep_comm"] > 0 and est.traffic_bytes["ep"] > 0


def test_inference_has_no_backward(selene: ClusterSpec) -> None:
    model = resolve_model("llama3-8b")
    train = estimate_iteration(selene, model, JobSpec(global_batch=8, tp=8))
    infer = estimate_iteration(selene, model, JobSpec(global_batch=8, tp=8, mode="infer"))
    # the forward's compute alone: an inference forward also gathers the logits of every
    # position over the vocabulary (8192 x 128256 at 2 bytes a micro-batch, as the runtime's
    # vocabulary-parallel head does), which a training step never sends
    assert infer.breakdown_s["compute"] < train.breakdown_s["compute"] / 2.5
    assert infer.breakdown_s["dp_comm"] == 0 and infer.breakdown_s["optimizer"] == 0


@pytest.mark.parametrize(
    ("job", "reason"),
    [
        (JobSpec(global_batch=4096, dp=4096), "devices"),
        (JobSpec(global_batch=8, tp=5), "heads=96 is not divisible by tp=5"),
        (JobSpec(global_batch=8, pp=64, schedule="interleaved", interleave=2), "chunks"),
        (JobSpec(global_batch=8, dp=8, ep=8), "mixture of experts"),
    ],
)
def test_does_not_fit_reasons(selene: ClusterSpec, job: JobSpec, reason: str) -> None:
    reasons = check_fit(selene, resolve_model("gpt3-175b"), job)
    assert any(reason in r for r in reasons)
    with pytest.raises(DoesNotFit):
        estimate_iteration(selene, resolve_model("gpt3-175b"), job)


def test_memory_does_not_fit(selene: ClusterSpec) -> None:
    with pytest.raises(DoesNotFit, match="GiB per device"):
        estimate_iteration(selene, resolve_model("gpt3-175b"), JobSpec(global_batch=8))


def test_layer_list_model(local_cpu: ClusterSpec) -> None:
    model = LayerListSpec.model_validate(
        {
            "layer_list": [
                {
                    "forward_gflop": 2.0,
                    "params": 1_000_000,
                    "activation_bytes": 1 << 20,
                    "output_bytes": 1 << 16,
                }
            ]
            * 6
        }
    )
    one = estimate_iteration(local_cpu, model, JobSpec(global_batch=8))
    three = estimate_iteration(local_cpu, model, JobSpec(global_batch=8, pp=3))
    assert three.breakdown_s["compute"] < one.breakdown_s["compute"]
    assert three.traffic_bytes["pp"] == pytest.approx(8 * 2 * 2 * (1 << 16))
    with pytest.raises(DoesNotFit, match="transformer"):
        estimate_iteration(local_cpu, model, JobSpec(global_batch=8, tp=2, dp=1, pp=1))


def test_inference_memory_is_weights_kv_cache_and_one_layer(selene: ClusterSpec) -> None:
    model = resolve_model("llama3-8b")
    est = estimate_iteration(selene, model, JobSpec(global_batch=1, mode="infer"))
    mem = est.stages[0].memory
    assert mem.gradients == 0 and mem.optimizer == 0
    kv_cache = 2 * 32 * 8192 * 8 * 128 * 2  # K and V, 32 layers, 8 kv heads of 128, bf16
    job = JobSpec(global_batch=1, mode="infer")
    largest = max(lc.activation_bytes for lc in build_layer_costs(model, job))
    assert mem.activations == pytest.approx(kv_cache + largest)
    assert mem.weights == pytest.approx(est.params * 2, rel=1e-3)


def test_the_split_may_count_the_embedding_and_the_loss_as_layers(selene: ClusterSpec) -> None:
    """Llama 3 405B's 126 blocks on 16 stages of 8 chunks: the embedding and the output layer
    count as one layer each, so the first and the last stage take one block fewer (Llama 3,
    sec. 3.3.2; Megatron-Core's account-for-embedding/loss-in-pipeline-split)."""
    from dmsc.netmodel.iteration import assign_stage_layers, check_fit

    model = TransformerSpec(layers=126, hidden=256, heads=8, seq=128, vocab=1000)
    job = JobSpec(global_batch=16, pp=16, schedule="interleaved", interleave=8)
    assert check_fit(selene, model, job)  # 126 blocks cannot fill 128 chunks
    balanced = job.model_copy(update={"split_counts_embedding_and_loss": True})
    assert not check_fit(selene, model, balanced)
    stages = assign_stage_layers(build_layer_costs(model, balanced), balanced)
    blocks = [sum(1 for lc in st if lc.kind == "block") for st in stages]
    assert blocks == [7] + [8] * 14 + [7]
    assert stages[0][0].kind == "embedding" and stages[-1][-1].kind == "head"


def test_backward_tensor_parallel_all_reduces_hide_under_weight_gradients(
    selene: ClusterSpec,
) -> None:
    """Megatron's asynchronous all-reduce of the input gradient runs while the weight gradient
    is computed: with ``overlap_tp_comm`` only the forward's all-reduces (and what the
    weight-gradient GEMMs do not cover) stay on the critical path."""
    model = resolve_model("gpt3-13b")
    job = JobSpec(global_batch=8, tp=8)
    hidden = estimate_iteration(selene, model, job)
    waited = estimate_iteration(selene, model, job.model_copy(update={"overlap_tp_comm": False}))
    assert hidden.breakdown_s["tp_comm"] < waited.breakdown_s["tp_comm"]
    # two all-reduces forward, two backward per block: at most half of them stay hidden
    assert hidden.breakdown_s["tp_comm"] >= waited.breakdown_s["tp_comm"] / 2 * 0.99
    assert hidden.traffic_bytes["tp"] == waited.traffic_bytes["tp"]  # the bytes still move
