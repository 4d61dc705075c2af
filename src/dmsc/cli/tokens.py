"""``dmsc token``: the API keys of the HTTP gateway. A key is shown once, when it is created; the
database keeps only its hash."""

from __future__ import annotations

from typing import Annotated

import typer

from dmsc.cli.app import console, err_console
from dmsc.cli.runtime import control_client
from dmsc.runtime.transport.messages import RevokeRequest
from dmsc.spec import SpecError

token_app = typer.Typer(help="API keys of the gateway.", no_args_is_help=True)


@token_app.command("create")
def token_create(
    tenant: Annotated[str, typer.Option(help="Tenant the key acts for.")],
    scopes: Annotated[str, typer.Option(help="Comma-separated: admin, submit, infer, read.")],
    rate: Annotated[
        float | None,
        typer.Option(help="This tenant's requests per second (default: the gateway's --rate)."),
    ] = None,
    burst: Annotated[
        float | None,
        typer.Option(help="Requests it may save up (default: the gateway's --burst)."),
    ] = None,
    weight: Annotated[
        float | None,
        typer.Option(
            help="The tenant's weight in the task queue's fair share (dmsc up --queue "
            "fair; default 1; every key of the tenant shares it)."
        ),
    ] = None,
) -> None:
    """Create an API key (printed once; only its hash is stored)."""
    from dmsc.cli.database import open_database
    from dmsc.runtime.business.auth import create_key

    for flag, value in (("--rate", rate), ("--burst", burst), ("--weight", weight)):
        if value is not None and not 0 < value <= 1e6:
            raise SpecError(
                "command line", flag, f"must be above 0 and at most 1e6 (got {value:g})"
            )
    try:
        key_id, key = create_key(
            open_database(),
            tenant,
            [s.strip() for s in scopes.split(",") if s],
            rate,
            burst,
            weight,
        )
    except ValueError as exc:
        raise SpecError("command line", "--scopes", str(exc)) from None
    err_console.print(f"key {key_id} for tenant {tenant!r} (shown once):", highlight=False)
    typer.echo(key)


@token_app.command("list")
def token_list() -> None:
    """Every key: id, tenant, scopes, limits, when it was made and whether it is revoked (the
    keys themselves are never stored, so never shown)."""
    from dmsc.cli.database import open_database
    from dmsc.cli.render import fit_table
    from dmsc.runtime.business.auth import list_keys

    headers = ("id", "tenant", "scopes", "rate/s", "burst", "created (UTC)", "revoked")
    t = fit_table(*headers, keep=(0,))
    for k in list_keys(open_database()):
        t.add_row(
            str(k.id),
            k.tenant,
            k.scopes,
            "" if k.rate is None else f"{k.rate:g}",
            "" if k.burst is None else f"{k.burst:g}",
            k.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            "yes" if k.revoked else "",
        )
    console.print(t)


@token_app.command("revoke")
def token_revoke(key_id: Annotated[int, typer.Argument(help="Key id.")]) -> None:
    """Revoke an API key. With a control plane running, through it: its gateway refuses the
    key from the next request on (otherwise within a second, its key cache's lifetime)."""
    from dmsc.cli.database import open_database
    from dmsc.data.db import control_file
    from dmsc.runtime.business.auth import revoke_key

    if control_file().exists():
        import grpc

        try:
            control_client().revoke(RevokeRequest(key_id=key_id), timeout_s=10)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise SpecError("command line", "KEY_ID", str(exc.details())) from None
        except SpecError:
            pass  # no control plane after all: the database alone
        else:
            console.print(f"key {key_id} revoked")
            return
    try:
        revoke_key(open_database(), key_id)
    except KeyError as exc:
        raise SpecError("command line", "KEY_ID", str(exc).strip("'")) from None
    console.print(f"key {key_id} revoked")
