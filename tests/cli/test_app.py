"""The ``dmsc`` application itself: ``--version``, and a description for every option."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import pytest
import typer

from dmsc.cli import app, main


def commands(group: Any, prefix: str = "dmsc") -> list[tuple[str, Any]]:
    """Every command and group under ``group``, with its full name."""
    found = [(prefix, group)]
    for name, sub in getattr(group, "commands", {}).items():  # a group (typer's own click)
        found += commands(sub, f"{prefix} {name}")
    return found


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"dmsc {version('dmsc')}\n"


def test_every_option_and_argument_has_a_description() -> None:
    undocumented = []
    for name, command in commands(typer.main.get_command(app)):
        for param in command.params:
            text = getattr(param, "help", None)
            if not (text and text.strip()):
                undocumented.append(f"{name} {param.opts[0] if param.opts else param.name}")
    assert undocumented == []
    assert len(commands(typer.main.get_command(app))) > 15  # the walk reached the sub-commands


def test_text_with_colons_prints_as_it_is() -> None:
    """rich read ``:AB:`` in a certificate's fingerprint as the 🆎 emoji code: ``dmsc up
    --tls`` printed about one fingerprint in five wrong (CI)."""
    from dmsc.cli.app import console, err_console

    for out in (console, err_console):
        with out.capture() as got:
            out.print("SHA-256 12:AB:CD:EF", highlight=False)
        assert got.get().strip() == "SHA-256 12:AB:CD:EF"
