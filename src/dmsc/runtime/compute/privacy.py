"""Differential privacy of the sites' updates: clipping, Gaussian noise and the privacy ledger.

Central DP as in DP-FedAvg (McMahan et al., ICLR 2018): each site clips its update to L2 norm
``max_norm`` (:func:`clip_update`), so that adding or removing one site moves the sum of the clipped
updates by at most ``max_norm``. Gaussian noise of standard deviation ``noise_multiplier *
max_norm`` per coordinate is added once to that sum (:func:`add_noise`), before dividing by the
count, which makes every round a Gaussian mechanism with noise multiplier ``noise_multiplier``.
The protected unit is a site, not an example: epsilon bounds what the released models say about
whether any one site took part.

Adding the noise to the sum rather than at each site keeps the noise at one site's scale instead of
growing with the square root of the count; the price is that the party adding it sees the sum
before noise. With secure aggregation (:mod:`dmsc.runtime.compute.secure_agg`) that party is the
leader, who sees only the sum anyway.

:class:`PrivacyLedger` counts rounds and converts them to (epsilon, delta) with Opacus'
Rényi-DP accountant (Mironov 2017; RDP-to-DP conversion of Balle et al. 2020) rather than our own
code, so that the number we publish comes from a library others audit. Opacus is imported only when
an epsilon is asked for: the import takes seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dmsc.runtime.compute.frames import finite

MECHANISM = "gaussian (site update clipping + noise, central DP)"
ACCOUNTANT = "opacus RDP"


def clip_update(
    x: torch.Tensor, max_norm: float, norm: float | None = None
) -> tuple[torch.Tensor, float]:
    """``x`` scaled by ``min(1, max_norm / ||x||_2)``, and ``||x||_2`` before clipping.

    The norm is computed in float64 so that a long fp32 vector does not lose it to rounding.
    ``norm``, when given, is the norm to clip by instead: that of the whole update ``x`` is a
    part of (a tensor-parallel rank's shard, :mod:`dmsc.runtime.compute.tp_sync`).
    """
    _check_positive(max_norm, "max_norm")
    _check_finite(x, "update")
    if norm is None:
        norm = float(torch.linalg.vector_norm(x.detach().to(torch.float64)))
    factor = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return (x * factor if factor < 1.0 else x.clone()), norm


def add_noise(
    total: torch.Tensor, noise_multiplier: float, max_norm: float, generator: torch.Generator
) -> torch.Tensor:
    """``total`` plus N(0, (noise_multiplier * max_norm)^2) per coordinate, from ``generator``.

    Apply it once to the sum of the clipped site updates, before dividing by their count. The noise
    is drawn in float32 (float64 for a float64 total) on the generator's device.
    """
    _check_non_negative(noise_multiplier, "noise_multiplier")
    _check_positive(max_norm, "max_norm")
    _check_finite(total, "sum of updates")
    draw_dtype = torch.float64 if total.dtype == torch.float64 else torch.float32
    noise = torch.randn(total.shape, generator=generator, dtype=draw_dtype, device=generator.device)
    noise *= noise_multiplier * max_norm
    return (total.to(draw_dtype) + noise.to(total.device)).to(total.dtype)


@dataclass
class PrivacyLedger:
    """The record of one training's privacy spending: the mechanism's settings and its rounds."""

    noise_multiplier: float
    max_norm: float
    sample_rate: float = 1.0
    """Fraction of the sites that take part in a round (all of them: 1.0)."""
    rounds: int = 0

    def __post_init__(self) -> None:
        _check_non_negative(self.noise_multiplier, "noise_multiplier")
        _check_positive(self.max_norm, "max_norm")
        if not (0.0 < self.sample_rate <= 1.0):
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {self.rounds}")

    def record_round(self, count: int = 1) -> None:
        """Count ``count`` more noised aggregations."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self.rounds += count

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta`` (0 before any round, inf without noise)."""
        _check_delta(delta)
        if self.rounds == 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        # slow import (see the module docstring); Opacus ships no type information
        from opacus.accountants import RDPAccountant  # type: ignore[import-untyped]

        accountant = RDPAccountant()
        accountant.history = [(self.noise_multiplier, self.sample_rate, self.rounds)]
        # orders below Opacus' default range too: with little noise the best order is near 1
        # (the default range then warns and gives a looser bound)
        alphas = [1 + x / 100 for x in range(1, 10)] + RDPAccountant.DEFAULT_ALPHAS
        return float(accountant.get_epsilon(delta=delta, alphas=alphas))

    def as_json(self, delta: float) -> dict[str, str | float | int]:
        """The record as published next to a model trained under it."""
        return {
            "mechanism": MECHANISM,
            "max_norm": self.max_norm,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "rounds": self.rounds,
            "delta": delta,
            "epsilon": self.epsilon(delta),
            "accountant": ACCOUNTANT,
        }


def _check_delta(delta: float) -> None:
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def _check_positive(value: float, name: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def _check_non_negative(value: float, name: str) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def _check_finite(x: torch.Tensor, what: str) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{what} must be a floating tensor, got {x.dtype}")
    if not finite(x):
        raise ValueError(f"{what} holds NaN or inf values")
