"""The attention backends of an inference step (:func:`inference_attention`)."""

from __future__ import annotations

import pytest
import torch

from dmsc.runtime.compute.models.attention import LayerKV, causal_attention, inference_attention


def _flags() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return (
        b.cudnn_sdp_enabled(),
        b.flash_sdp_enabled(),
        b.mem_efficient_sdp_enabled(),
        b.math_sdp_enabled(),
    )


def test_a_cuda_inference_step_leaves_out_cudnn_attention_and_restores_the_choice_after() -> None:
    """cuDNN's attention built a graph per new key length: a token's keys are one longer than
    the last token's, so on an H200 each token paid one in every layer (42 of 58 ms,
    benchmarks/gpu_decode.py). The flags are the process's: the choice must not outlive the
    step, also when it fails."""
    before = _flags()
    assert before[0], "torch enables cuDNN attention by default"
    with inference_attention(torch.device("cuda", 0)):
        assert _flags() == (False, True, True, True)
    assert _flags() == before
    with pytest.raises(RuntimeError), inference_attention(torch.device("cuda")):
        raise RuntimeError("a failed step")
    assert _flags() == before


def test_on_the_cpu_nothing_changes() -> None:
    before = _flags()
    with inference_attention(torch.device("cpu")):
        assert _flags() == before


def test_cached_attention_equals_attention_over_the_whole_context() -> None:
    """A reference: a token at a time over the kept keys gives what one causal pass over the
    whole sequence gives, grouped heads and all."""
    g = torch.Generator().manual_seed(0)
    B, H, KV, T, D = 2, 4, 2, 9, 8
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, KV, T, D, generator=g), torch.randn(B, KV, T, D, generator=g)
    whole = causal_attention(q, k, v, None, gqa=True)
    kv = LayerKV()
    parts = [causal_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], kv, gqa=True)]
    for t in range(4, T):
        s = slice(t, t + 1)
        parts.append(causal_attention(q[:, :, s], k[:, :, s], v[:, :, s], kv, gqa=True))
    torch.testing.assert_close(torch.cat(parts, dim=2), whole)
