"""Optical capacity of a fiber link given as frequency slots.

The line rate a 12.5 GHz slot carries depends on the modulation format, and the format on the
distance it must reach. Table as used by the optical-rl-gym project and DeepRMSA (Chen et al., JLT
2019): BPSK 12.5 Gbit/s per slot up to 100,000 km (no practical limit), QPSK 25 up to 2,000 km,
8-QAM 37.5 up to 1,250 km, 16-QAM 50 up to 625 km. Rates scale with the slot width.
"""

from __future__ import annotations

from dataclasses import dataclass

from dmsc.spec.cluster import InterDCLinkSpec


@dataclass(frozen=True)
class Modulation:
    """A modulation format: its line rate per 12.5 GHz slot and its maximum reach."""

    name: str
    gbit_s_per_12g5_slot: float
    max_km: float


MODULATIONS: tuple[Modulation, ...] = (
    Modulation("16QAM", 50.0, 625.0),
    Modulation("8QAM", 37.5, 1250.0),
    Modulation("QPSK", 25.0, 2000.0),
    Modulation("BPSK", 12.5, 100_000.0),
)


def choose_modulation(km: float) -> Modulation:
    """The most efficient format whose reach covers ``km``."""
    for mod in MODULATIONS:
        if km <= mod.max_km:
            return mod
    raise ValueError(f"{km} km is beyond the reach of every modulation format")


def link_capacity_gbit_s(link: InterDCLinkSpec) -> float:
    """Capacity of an inter-DC link per direction, in Gbit/s."""
    if link.bandwidth_gbit_s is not None:
        return link.bandwidth_gbit_s
    assert link.slots is not None
    per_slot = link.gbit_s_per_slot
    if per_slot is None:
        per_slot = choose_modulation(link.km).gbit_s_per_12g5_slot * link.slot_ghz / 12.5
    return link.slots * per_slot
