"""``dmsc models``: the versions of the trained model in the database, and which of them serve
inference: promote one to production, send a share of traffic to a canary, roll back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from dmsc.cli.app import console
from dmsc.spec import SpecError

if TYPE_CHECKING:
    from dmsc.data.db import Database

models_app = typer.Typer(
    help="Model versions: list, promote, canary, rollback.", no_args_is_help=True
)


@models_app.command("list")
def models_list() -> None:
    """Every model version with its status, and the replicas that hold it (by the digests of
    the files they loaded)."""
    from dmsc.cli.database import open_database
    from dmsc.cli.tables import FoldTable
    from dmsc.runtime.control.serving.held import holding
    from dmsc.runtime.control.serving.model_store import versions

    db = open_database()
    held = holding(db)
    t = FoldTable("version", "run", "step", "sha256", "status", "canary %", "served by")
    for v in versions(db):
        t.add_row(
            str(v.id),
            str(v.run_id),
            str(v.step),
            v.sha256[:12],
            v.status,
            f"{v.canary_percent:g}" if v.status == "canary" else "",
            ", ".join(name for name, h in held.items() if h.version == v.id),
        )
    console.print(t)
    for name, h in held.items():
        if h.version is None:
            console.print(f"{name} holds {h.what}", highlight=False)


@models_app.command("promote")
def models_promote(
    version: Annotated[int, typer.Argument(help="The model version (`dmsc models list`).")],
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for the running replicas to load it.")
    ] = 60.0,
) -> None:
    """Serve all traffic with VERSION: refused when its files do not verify; with a control
    plane running, done once every replica has loaded it (or failed, and back on the version
    before)."""
    from dmsc.cli.database import open_database, running_database
    from dmsc.runtime.control.serving.model_store import promote

    db = open_database()
    try:
        promote(db, version)
    except (KeyError, ValueError) as exc:  # no such version; its files do not verify
        raise SpecError("command line", "VERSION", str(exc)) from None
    if running_database() is None:
        console.print(f"version {version} in production (replicas load it when they start)")
        return
    _wait_loaded(db, version, wait)


def _wait_loaded(db: Database, version: int, wait: float) -> None:
    """Until every replica of the running control plane holds ``version``: exit 1 with the
    fault's reason when a replica could not load it."""
    import time

    from sqlalchemy import select

    from dmsc.data.db import FaultRecord
    from dmsc.runtime.control.serving.held import holding
    from dmsc.runtime.control.serving.model_store import versions

    deadline = time.monotonic() + wait
    while True:
        status = next(v.status for v in versions(db) if v.id == version)
        held = holding(db)
        if status == "failed":
            with db.sessions() as s:
                fault = s.scalar(
                    select(FaultRecord)
                    .where(FaultRecord.kind == "model-version")
                    .order_by(FaultRecord.id.desc())
                )
            why = fault.reason if fault is not None else "a replica could not load it"
            console.print(f"version {version} not promoted: {why}", highlight=False)
            raise typer.Exit(1)
        if status != "production":
            console.print(f"version {version} is {status} now (changed meanwhile)")
            return
        if held and all(h.version == version for h in held.values()):
            names = ", ".join(held)
            console.print(f"version {version} in production, loaded by {names}", highlight=False)
            return
        if time.monotonic() > deadline:
            now = ", ".join(f"{n}: {h.label}" for n, h in held.items()) or "nothing recorded"
            console.print(
                f"version {version} in production; not every replica has loaded it yet "
                f"(a task may be running, or long requests: they load it when those end). "
                f"Now: {now}",
                highlight=False,
            )
            return
        time.sleep(0.2)


@models_app.command("canary")
def models_canary(
    version: Annotated[
        int | None, typer.Argument(help="The model version (`dmsc models list`); not with --stop.")
    ] = None,
    percent: Annotated[
        float, typer.Option(help="Share of inference traffic; 0 withdraws the canary.")
    ] = 10.0,
    stop: Annotated[
        bool, typer.Option("--stop", help="Withdraw the canary: production takes all traffic.")
    ] = False,
) -> None:
    """Send a share of inference traffic to VERSION (gray release), or withdraw it."""
    from dmsc.cli.database import open_database
    from dmsc.runtime.control.serving.model_store import canary, stop_canary

    if stop or (version is not None and percent == 0):
        withdrawn = stop_canary(open_database())
        console.print(
            f"canary version {withdrawn} withdrawn" if withdrawn else "no canary to withdraw"
        )
        return
    if version is None:
        raise SpecError("command line", "VERSION", "a version is needed (or --stop)")
    try:
        canary(open_database(), version, percent)
    except (KeyError, ValueError) as exc:
        percent_wrong = isinstance(exc, ValueError) and "cannot serve" not in str(exc)
        field = "--percent" if percent_wrong else "VERSION"
        raise SpecError("command line", field, str(exc)) from None
    console.print(f"version {version} takes {percent:g}% of inference traffic")


@models_app.command("rollback")
def models_rollback() -> None:
    """Back to the previous production version."""
    from dmsc.cli.database import open_database
    from dmsc.runtime.control.serving.model_store import rollback

    try:
        back = rollback(open_database())
    except KeyError as exc:
        raise SpecError("models", "", str(exc)) from None
    console.print(f"rolled back to version {back}")
