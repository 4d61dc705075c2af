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
      - {name: 16QAM, bits_per_symbol: 4, max_km: 600, min_osnr_db: 18.6}
      - {name: QPSK, bits_per_symbol: 2, max_km: 2500, min_osnr_db: 12.0}
    osnr: {span_km: 80, loss_db_per_km: 0.2, noise_figure_db: 5, launch_dbm: 0}

A format that gives ``min_osnr_db`` is used on a path only when the path's OSNR (0.1 nm
reference bandwidth) reaches it as well as its reach: amplified spans of ``span_km``, each
amplifier making up the span's loss and adding its noise, ``OSNR = 58 + P_launch - span loss -
NF - 10 log10(spans)`` dB (58 dB: -10 log10 of h * nu * 12.5 GHz in mW at 1550 nm; the
textbook ASE-limited link, without nonlinear noise).
"""

from __future__ import annotations

import math
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
    min_osnr_db: float | None = None  # checked against the path's OSNR when given

    @property
    def gbit_s_per_12g5_slot(self) -> float:
        return GBAUD_PER_12G5_SLOT * self.bits_per_symbol


@dataclass(frozen=True)
class OsnrModel:
    """An ASE-limited amplified line: spans of ``span_km``, each amplifier of ``noise_figure_db``
    making up the span's loss, ``launch_dbm`` per channel."""

    span_km: float = 80.0
    loss_db_per_km: float = 0.2
    noise_figure_db: float = 5.0
    launch_dbm: float = 0.0

    def osnr_db(self, km: float) -> float:
        spans = max(1, math.ceil(km / self.span_km - 1e-9))
        span_loss = self.span_km * self.loss_db_per_km
        return 58.0 + self.launch_dbm - span_loss - self.noise_figure_db - 10 * math.log10(spans)


@dataclass(frozen=True)
class ModulationTable:
    """Formats, most efficient first (the order :meth:`choose` tries them)."""

    name: str
    formats: tuple[Modulation, ...]
    osnr: OsnrModel = OsnrModel()  # for the formats that give a required OSNR

    def __post_init__(self) -> None:
        if not self.formats:
            raise ValueError("a modulation table needs at least one format")
        ordered = tuple(sorted(self.formats, key=lambda m: -m.bits_per_symbol))
        object.__setattr__(self, "formats", ordered)

    def choose(self, km: float) -> Modulation:
        """The most efficient format whose reach (and required OSNR, where given) covers
        ``km``."""
        osnr = None
        for mod in self.formats:
            if km > mod.max_km:
                continue
            if mod.min_osnr_db is not None:
                osnr = self.osnr.osnr_db(km) if osnr is None else osnr
                if osnr < mod.min_osnr_db:
                    continue
            return mod
        raise ValueError(
            f"{km:g} km is beyond the reach of every format of table {self.name!r} "
            f"(longest: {max(m.max_km for m in self.formats):g} km"
            + (f"; OSNR there {osnr:.1f} dB)" if osnr is not None else ")")
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
    formats = tuple(
        Modulation(f.name, f.bits_per_symbol, f.max_km, f.min_osnr_db) for f in spec.formats
    )
    o = spec.osnr
    return ModulationTable(
        spec.name,
        formats,
        OsnrModel(o.span_km, o.loss_db_per_km, o.noise_figure_db, o.launch_dbm),
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
