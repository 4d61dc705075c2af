"""Optical capacity of a fiber link given as frequency slots.

The line rate a 12.5 GHz slot carries is 12.5 Gbit/s per bit per symbol of its modulation format
(12.5 GBd per slot), and the format is the most efficient one whose reach covers the distance.
Which formats, and their reaches, is a setting: a named table or a user's file.

- ``dmsc`` (the default): 16QAM to 625 km, 8QAM to 1,250 km, QPSK to 2,000 km, BPSK beyond.
- ``optical-rl-gym``: the table of the optical-rl-gym project, the reference setting of DeepRMSA
  (Chen et al., JLT 2019) and the RMSA studies built on it: 64QAM to 125 km, 32QAM to 250,
  16QAM to 500, 8QAM to 1,000, QPSK to 2,000, BPSK to 100,000 km.

A table in a file (YAML or JSON) lists its formats::

    name: my-table
    formats:
      - {name: 16QAM, bits_per_symbol: 4, max_km: 600}
      - {name: QPSK, bits_per_symbol: 2, max_km: 2500}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dmsc.spec.cluster import InterDCLinkSpec

GBAUD_PER_12G5_SLOT = 12.5  # symbols per ns a 12.5 GHz slot carries


@dataclass(frozen=True)
class Modulation:
    """A modulation format: bits per symbol and the longest path it reaches."""

    name: str
    bits_per_symbol: float
    max_km: float

    @property
    def gbit_s_per_12g5_slot(self) -> float:
        return GBAUD_PER_12G5_SLOT * self.bits_per_symbol


@dataclass(frozen=True)
class ModulationTable:
    """Formats, most efficient first (the order :meth:`choose` tries them)."""

    name: str
    formats: tuple[Modulation, ...]

    def __post_init__(self) -> None:
        if not self.formats:
            raise ValueError("a modulation table needs at least one format")
        ordered = tuple(sorted(self.formats, key=lambda m: -m.bits_per_symbol))
        object.__setattr__(self, "formats", ordered)

    def choose(self, km: float) -> Modulation:
        """The most efficient format whose reach covers ``km``."""
        for mod in self.formats:
            if km <= mod.max_km:
                return mod
        raise ValueError(
            f"{km:g} km is beyond the reach of every format of table {self.name!r} "
            f"(longest: {max(m.max_km for m in self.formats):g} km)"
        )

    def gbit_s_per_slot(self, km: float, slot_ghz: float = 12.5) -> float:
        """The line rate of one slot of ``slot_ghz`` on a path of ``km``."""
        return self.choose(km).gbit_s_per_12g5_slot * slot_ghz / 12.5


DMSC = ModulationTable(
    "dmsc",
    (
        Modulation("16QAM", 4, 625.0),
        Modulation("8QAM", 3, 1250.0),
        Modulation("QPSK", 2, 2000.0),
        Modulation("BPSK", 1, 100_000.0),
    ),
)
OPTICAL_RL_GYM = ModulationTable(
    "optical-rl-gym",
    (
        Modulation("64QAM", 6, 125.0),
        Modulation("32QAM", 5, 250.0),
        Modulation("16QAM", 4, 500.0),
        Modulation("8QAM", 3, 1000.0),
        Modulation("QPSK", 2, 2000.0),
        Modulation("BPSK", 1, 100_000.0),
    ),
)
MODULATION_TABLES: dict[str, ModulationTable] = {t.name: t for t in (DMSC, OPTICAL_RL_GYM)}
MODULATIONS: tuple[Modulation, ...] = DMSC.formats


def modulation_table(name_or_file: str) -> ModulationTable:
    """A named table, or the table in a YAML/JSON file (SpecError names the file and field)."""
    if name_or_file in MODULATION_TABLES:
        return MODULATION_TABLES[name_or_file]
    from dmsc.spec import SpecError, load_spec
    from dmsc.spec.optics import ModulationTableSpec

    if not Path(name_or_file).is_file():
        raise SpecError(
            "command line",
            "--modulations",
            f"{name_or_file!r} is neither a table ({', '.join(MODULATION_TABLES)}) nor a file",
        )
    spec = load_spec(ModulationTableSpec, name_or_file)
    return ModulationTable(
        spec.name, tuple(Modulation(f.name, f.bits_per_symbol, f.max_km) for f in spec.formats)
    )


def choose_modulation(km: float, table: ModulationTable = DMSC) -> Modulation:
    """The most efficient format of ``table`` whose reach covers ``km``."""
    return table.choose(km)


def link_capacity_gbit_s(link: InterDCLinkSpec) -> float:
    """Capacity of an inter-DC link per direction, in Gbit/s."""
    if link.bandwidth_gbit_s is not None:
        return link.bandwidth_gbit_s
    assert link.slots is not None
    per_slot = link.gbit_s_per_slot
    if per_slot is None:
        per_slot = choose_modulation(link.km).gbit_s_per_12g5_slot * link.slot_ghz / 12.5
    return link.slots * per_slot
