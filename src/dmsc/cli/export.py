"""``dmsc export``: a trained model version as a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dmsc.cli.app import console
from dmsc.spec import SpecError


def export(
    out: Annotated[str, typer.Option("--out", help="Directory to write (config.json, weights).")],
    version: Annotated[
        int | None,
        typer.Option(help="Model version (default: the newest trained, served or not)."),
    ] = None,
) -> None:
    """Write a trained model version as a directory `transformers` loads."""
    from dmsc.cli.database import open_database
    from dmsc.data.db import data_dir
    from dmsc.runtime.compute import sealing
    from dmsc.runtime.control.serving.model_store import export_version
    from dmsc.spec.residency import recorded_residency

    if sealing.key_file(data_dir()).exists():  # sealed checkpoints: the home's key opens them
        sealing.install(sealing.home_key(data_dir()))
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise SpecError("command line", "--out", f"{out} exists and is not a directory")
    try:
        rules = recorded_residency(data_dir())  # those of the cluster dmsc up ran on
        record = export_version(open_database(), version, target, rules)
    except ValueError as exc:
        raise SpecError("command line", "--version" if version else "--out", str(exc)) from None
    which = "" if version else ", the newest"
    console.print(
        f"version {record.id} (step {record.step}{which}, {record.status}) written to {target}",
        highlight=False,
    )
