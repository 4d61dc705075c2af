"""The Typer application every command module registers on, its consoles and exit codes, and
:func:`main`: the one place that turns errors into a line on standard error and an exit code."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from typer.exceptions import TyperException

from dmsc.spec import SpecError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="dmsc: plan, simulate and run distributed AI models across datacenters.",
)
# No emoji codes: rich reads ":ab:" as 🆎, and a certificate's fingerprint (AB:CD:...) or any
# other text with colons would print wrong (dmsc up --tls printed one in five fingerprints so).
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)

EXIT_DOES_NOT_FIT = 1
EXIT_BAD_INPUT = 2
EXIT_STORAGE = 1  # the database cannot be opened or written

# ``--wide``: the width tables and text on standard output are laid out for, wide enough that no
# cell wraps or folds and every row stays on one line (to read in a pager, or to cut from a pipe).
WIDE_COLUMNS = 10_000


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("dmsc")
        except PackageNotFoundError:  # run from a source tree that was never installed
            number = "unknown"
        typer.echo(f"dmsc {number}")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print the version of dmsc and exit.",
            is_eager=True,
            callback=_print_version,
        ),
    ] = False,
    wide: Annotated[
        bool,
        typer.Option(
            "--wide",
            envvar="DMSC_WIDE",
            help="Do not wrap tables to the terminal: every row stays on one line, however long.",
        ),
    ] = False,
) -> None:
    """Options of ``dmsc`` itself, before the command."""
    if wide:
        console.width = WIDE_COLUMNS


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the app, turning bad input into one line and exit code 2."""
    try:
        result = app(args=argv, standalone_mode=False)
    except SpecError as exc:
        err_console.print(f"error: {exc.line()}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_BAD_INPUT)
    except (typer.Exit, typer.Abort) as exc:
        sys.exit(getattr(exc, "exit_code", 130))
    except TyperException as exc:  # a usage error: unknown flag, bad value, missing option
        if type(exc).__name__ == "NoArgsIsHelpError":
            show = getattr(exc, "show", None)
            if show is not None:
                show()
            sys.exit(0)
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        err_console.print(f"error: {message}", highlight=False, soft_wrap=True)
        sys.exit(getattr(exc, "exit_code", EXIT_BAD_INPUT))
    except Exception as exc:  # a service answered with an error, or the database failed
        import grpc

        from dmsc.data.db import StorageError

        if isinstance(exc, StorageError):  # its message names the database and the reason
            err_console.print(f"error: {exc}", highlight=False, soft_wrap=True)
            sys.exit(EXIT_STORAGE)
        if not isinstance(exc, grpc.RpcError):
            raise
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            details = (
                f"control plane: not answering ({code.name.lower()}); it may be starting or "
                "stopping: try again, or `dmsc down`"
            )
        err_console.print(f"error: {details}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_BAD_INPUT if code == grpc.StatusCode.INVALID_ARGUMENT else 1)
    sys.exit(result if isinstance(result, int) else 0)
