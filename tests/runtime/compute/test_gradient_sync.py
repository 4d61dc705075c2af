"""Gradients flattened for averaging and put back: every parameter gets its own slice."""

from __future__ import annotations

import time

import torch

from dmsc.runtime.compute.gradient_sync import LinkShaper, assign_grads, flatten_grads


def test_flatten_then_assign_is_the_identity_and_a_missing_gradient_is_zero() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    params = list(module.parameters())
    for n, p in enumerate(params[:-1]):
        p.grad = torch.full_like(p, float(n + 1))
    flat = flatten_grads(params)
    assert flat.shape == (sum(p.numel() for p in params),)
    assert torch.equal(flat[-1:], torch.zeros(1))  # the last bias had no gradient
    assign_grads(params, flat * 2)
    for n, p in enumerate(params[:-1]):
        assert p.grad is not None and torch.equal(p.grad, torch.full_like(p, 2.0 * (n + 1)))
    assert params[-1].grad is not None and not params[-1].grad.any()


def test_a_shaped_link_holds_each_send_for_its_bytes_at_its_rate() -> None:
    link = LinkShaper(1.0)  # 1 Mbit/s: 12,500 bytes take 0.1 s
    t0 = time.monotonic()
    link.take(12_500)
    link.take(12_500)
    assert time.monotonic() - t0 >= 0.2 - 1e-3
    assert link.bytes == 25_000
    free = LinkShaper(0.0)
    free.take(10**9)  # no limit: counted, not held
    assert free.bytes == 10**9
