"""Settings of the optical layer given as files: a modulation table (see
:mod:`dmsc.netmodel.optical` for the named tables and how a format is chosen)."""

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


class ModulationTableSpec(BaseModel):
    """A modulation table: its name and formats (any order; one name each)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name = "custom"
    formats: list[ModulationFormatSpec] = Field(min_length=1, max_length=64)

    @model_validator(mode="after")
    def _unique(self) -> Self:
        names = [f.name for f in self.formats]
        if len(set(names)) != len(names):
            raise ValueError(f"formats: a name appears twice ({', '.join(names)})")
        return self
