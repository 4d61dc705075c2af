"""The table of recalibrations: a cluster spec refitted to what a training task measured
(:mod:`dmsc.data.calibrations` reads and writes it; kept apart from :mod:`dmsc.data.records` so
that its tables and this one change independently)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from dmsc.data.records import Base, _now


class RecalibrationRecord(Base):
    """The fit of one training task's step traces to the cluster its plan was made for: the
    fitted spec and the figures it came from, or why there is none."""

    __tablename__ = "recalibrations"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"))
    cluster: Mapped[str] = mapped_column(String(128), index=True)  # the plan's cluster name
    created_at: Mapped[dt.datetime] = mapped_column(default=_now)
    spec_json: Mapped[str | None]  # the fitted cluster spec (None: not fitted, see reason)
    fit_json: Mapped[str] = mapped_column(default="{}")  # the figures (Fit.as_json)
    measured_step_s: Mapped[float | None]
    predicted_before_s: Mapped[float | None]  # the plan's iteration on the spec it was made on
    predicted_after_s: Mapped[float | None]  # ... and on the fitted spec
    reason: Mapped[str | None]  # why it was not fitted
