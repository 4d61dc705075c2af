"""Settings of the optical layer given as files: a modulation table, with the OSNR each format
needs and the line the check assumes where it gives them (see :mod:`dmsc.netmodel.optical` for
the named tables and how a format is chosen)."""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

Name = Annotated[str, Field(min_length=1, max_length=64)]


class ModulationFormatSpec(BaseModel):
    """One format: bits per symbol (a 12.5 GHz slot carries 12.5 Gbit/s per bit) and reach."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name
    bits_per_symbol: float = Field(gt=0, le=16)
    max_km: float = Field(gt=0, description="Longest path the format reaches, in km.")
    min_osnr_db: float | None = Field(
        default=None, ge=-10, le=60, description="OSNR (0.1 nm) the format needs, in dB."
    )


class OsnrSpec(BaseModel):
    """The amplified line the OSNR check assumes (see dmsc.netmodel.optical)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    span_km: float = Field(default=80.0, gt=0, le=500)
    loss_db_per_km: float = Field(default=0.2, gt=0, le=5)
    noise_figure_db: float = Field(default=5.0, ge=0, le=30)
    launch_dbm: float = Field(default=0.0, ge=-30, le=30)


class ModulationTableSpec(BaseModel):
    """A modulation table: its name and formats (any order; one name each)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name = "custom"
    formats: list[ModulationFormatSpec] = Field(min_length=1, max_length=64)
    osnr: OsnrSpec = OsnrSpec()

    @model_validator(mode="after")
    def _unique(self) -> Self:
        names = [f.name for f in self.formats]
        if len(set(names)) != len(names):
            raise ValueError(f"formats: a name appears twice ({', '.join(names)})")
        return self
