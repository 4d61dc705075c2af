from __future__ import annotations

import pytest

from dmsc.netmodel import build_layer_costs, count_params, estimate_iteration
from dmsc.netmodel.layers import padded_vocab
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec

GPT = TransformerSpec(layers=24, hidden=2304, heads=24, seq=2048, vocab=51200, dtype="fp16")


def _megatron_flops(model: TransformerSpec, batch: int) -> float:
    """Narayanan et al. SC'21 eq. 3: FLOPs per iteration with full recomputation."""
    B, s, L, h, V = batch, model.seq, model.layers, model.hidden, model.vocab
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def test_block_forward_flops_by_hand() -> None:
    job = JobSpec(global_batch=1)
    block = build_layer_costs(GPT, job)[1]
    T, h, s = 2048, 2304, 2048
    assert block.forward_flops == pytest.approx(24 * T * h * h + 4 * T * s * h)


@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 1, 4), (2, 2, 2), (8, 1, 1)])
def test_iteration_flops_match_megatron_eq3(selene: ClusterSpec, tp: int, pp: int, dp: int) -> None:
    job = JobSpec(global_batch=16, tp=tp, pp=pp, dp=dp, recompute="full", attention="standard")
    est = estimate_iteration(selene, GPT, job)
    assert est.flops_per_iteration == pytest.approx(_megatron_flops(GPT, 16), rel=1e-9)
    # Without recomputation, three passes instead of four over the blocks.
    no_rc = estimate_iteration(selene, GPT, job.model_copy(update={"recompute": "none"}))
    assert no_rc.flops_per_iteration == pytest.approx(est.model_flops_per_iteration)
    assert no_rc.flops_per_iteration < est.flops_per_iteration


def test_params_match_megatron_formula() -> None:
    # 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) with tied embeddings (Megatron-LM SC'21 sec. 5.1).
    model = GPT.model_copy(update={"tied_embeddings": True})
    L, h, V, s = model.layers, model.hidden, model.vocab, model.seq
    expected = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
    assert count_params(model) == pytest.approx(expected, rel=1e-3)


def test_tensor_parallel_splits_work() -> None:
    one = build_layer_costs(GPT, JobSpec(global_batch=1))[1]
    eight = build_layer_costs(GPT, JobSpec(global_batch=1, tp=8))[1]
    assert eight.forward_flops == pytest.approx(one.forward_flops / 8)
    # the two LayerNorms (weight and bias) and the two row-parallel biases stay whole on every
    # rank, as Megatron-LM keeps them
    whole = 6 * 2304
    assert eight.params_per_device == pytest.approx((one.params_per_device - whole) / 8 + whole)
    assert one.tp_allreduce_bytes == 0 and eight.tp_allreduce_bytes == 2 * 2048 * 2304


def test_vocab_padding() -> None:
    assert padded_vocab(50257, 1) == 50304
    assert padded_vocab(50257, 8) == 51200
    assert padded_vocab(51200, 8) == 51200


def test_moe_layers() -> None:
    model = TransformerSpec(
        layers=2, hidden=256, heads=4, seq=64, vocab=1000, experts=8, top_k=2, mlp="swiglu"
    )
    job = JobSpec(global_batch=8, dp=8, ep=4)
    costs = build_layer_costs(model, job)
    dense = build_layer_costs(model.model_copy(update={"experts": 1, "top_k": 1}), job)
    moe, ref = costs[1], dense[1]
    assert moe.kind == "moe_block" and moe.ep_alltoall_bytes == 2 * 64 * 256 * 2
    # Each token visits top_k experts: the MLP work doubles (router aside).
    mlp_moe = moe.forward_flops - 2 * 64 * 256 * 8
    assert mlp_moe - ref.forward_flops == pytest.approx(sum(g.flops for g in ref.gemms[4:]))
    # A device holds experts / ep of the experts.
    assert moe.expert_params_per_device == pytest.approx(8 * 3 * 256 * 1024 / 4)


def test_flash_attention_moves_the_scores_off_memory_and_recomputes_them_in_backward(
    selene: ClusterSpec,
) -> None:
    """Flash against standard attention, term by term: the same forward GEMMs, no s x s
    element-wise traffic (softmax and dropout stay on chip), one more Q K^T in the backward."""
    from dmsc.netmodel.compute import layer_time, peak_flops
    from dmsc.netmodel.constants import DEFAULT_CALIBRATION

    gpt = GPT.model_copy(update={"dropout": 0.1})
    std = build_layer_costs(gpt, JobSpec(global_batch=8, attention="standard"))[1]
    fl = build_layer_costs(gpt, JobSpec(global_batch=8, attention="flash"))[1]
    shape = [(g.m, g.n, g.k, g.batch) for g in fl.gemms]
    assert shape == [(g.m, g.n, g.k, g.batch) for g in std.gemms]
    assert [g.kind for g in fl.gemms[1:3]] == ["flash", "flash"]
    b, a, s = 1, GPT.heads, GPT.seq
    scores = b * a * s * s
    assert std.elementwise_bytes - fl.elementwise_bytes == pytest.approx(scores * (4 * 2 + 1))
    assert fl.backward_recompute == (fl.gemms[1],) and fl.recompute_flops == std.gemms[1].flops
    device = selene.device_types[next(iter(selene.device_types))]
    t_std = layer_time(std, device, "fp16", "none", DEFAULT_CALIBRATION)
    t_fl = layer_time(fl, device, "fp16", "none", DEFAULT_CALIBRATION)
    assert t_fl.forward < t_std.forward and t_fl.recompute == 0
    # Backward: twice the GEMMs, the element-wise kernels once more, and Q K^T again at the
    # generation's flash-attention rate (FlashAttention-2: a backward of 2.5 forwards).
    dc = DEFAULT_CALIBRATION.for_device(device)
    eltwise = fl.elementwise_bytes / (device.memory_bw_gbyte_s * 1e9 * dc.memory_efficiency)
    eltwise += fl.elementwise_kernels * dc.kernel_overhead_s
    qk = t_fl.backward - (2 * t_fl.forward - eltwise)
    eff = dc.attention_efficiency
    assert qk == pytest.approx(std.gemms[1].flops / (peak_flops(device, "fp16") * eff))
    # the FLOPs the hardware does: three passes plus flash's Q K^T again
    job = JobSpec(global_batch=8, attention="flash")
    est = estimate_iteration(selene, gpt, job)
    assert est.flops_per_iteration == pytest.approx(
        est.model_flops_per_iteration + 8 * GPT.layers * std.gemms[1].flops
    )
