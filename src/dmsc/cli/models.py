"""``dmsc models``: the versions of the trained model in the database, and which of them serve
inference: promote one to production, send a share of traffic to a canary, roll back."""

from __future__ import annotations

from typing import Annotated

import typer

from dmsc.cli.app import console
from dmsc.spec import SpecError

models_app = typer.Typer(
    help="Model versions: list, promote, canary, rollback.", no_args_is_help=True
)


@models_app.command("list")
def models_list() -> None:
    """Every model version with its status."""
    from rich.table import Table

    from dmsc.cli.database import open_database
    from dmsc.runtime.control.model_store import versions

    t = Table("version", "run", "step", "sha256", "status", "canary %")
    for v in versions(open_database()):
        t.add_row(
            str(v.id),
            str(v.run_id),
            str(v.step),
            v.sha256[:12],
            v.status,
            f"{v.canary_percent:g}" if v.status == "canary" else "",
        )
    console.print(t)


@models_app.command("promote")
def models_promote(
    version: Annotated[int, typer.Argument(help="The model version (`dmsc models list`).")],
) -> None:
    """Serve all traffic with VERSION."""
    from dmsc.cli.database import open_database
    from dmsc.runtime.control.model_store import promote

    try:
        promote(open_database(), version)
    except KeyError as exc:
        raise SpecError("command line", "VERSION", str(exc)) from None
    console.print(f"version {version} in production")


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
    from dmsc.runtime.control.model_store import canary, stop_canary

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
        field = "--percent" if isinstance(exc, ValueError) else "VERSION"
        raise SpecError("command line", field, str(exc)) from None
    console.print(f"version {version} takes {percent:g}% of inference traffic")


@models_app.command("rollback")
def models_rollback() -> None:
    """Back to the previous production version."""
    from dmsc.cli.database import open_database
    from dmsc.runtime.control.model_store import rollback

    try:
        back = rollback(open_database())
    except KeyError as exc:
        raise SpecError("models", "", str(exc)) from None
    console.print(f"rolled back to version {back}")
