"""The README stays a front page and the reference stays whole: the README is at most 300 lines,
every relative link of it (and of the docs pages, which ``make docs`` also checks strictly)
names a file that exists, and the command index (``docs/commands.md``) names every command and
sub-command of ``dmsc --help``. The docs test (``tests/integration/test_readme_examples.py``) runs
every command the pages print; ``make docs`` fails on a broken link, anchor or API reference."""

from __future__ import annotations

import re
from pathlib import Path

import typer.main

from dmsc.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300


def test_the_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move reference to docs/"
    )
    headings = [line for line in lines if line.startswith("## ")]
    assert headings == [
        "## The two commands",
        "## A five-minute tour",
        "## Documentation",
    ], headings


def relative_links(page: Path) -> list[str]:
    """The targets of the Markdown links and images of ``page`` that are files of this
    repository (not ``http(s):``, ``mailto:`` or an anchor of the page itself), without their
    ``#anchor``."""
    targets = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    return [
        t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")
    ]


def test_every_relative_link_names_a_file() -> None:
    pages = [README, *sorted(DOCS.rglob("*.md"))]
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in pages
        for target in relative_links(page)
        if not (page.parent / target).exists()
    ]
    assert not broken, broken
    assert relative_links(README), "the README links to no page"


def test_the_command_index_names_every_command() -> None:
    index = (DOCS / "commands.md").read_text()
    cli = typer.main.get_command(app)
    groups = {
        name: set(getattr(command, "commands", {}) or {})
        for name, command in cli.commands.items()  # type: ignore[attr-defined]
    }
    named: set[str] = set()
    for row in re.findall(r"^\| `(dmsc [^`]+)`", index, re.MULTILINE):
        words = row.replace("\\|", "|").split()
        named.add(words[1])
        if groups.get(words[1]) and len(words) > 2:  # `dmsc tasks list|show|cancel`
            named.update(f"{words[1]} {sub}" for sub in words[2].split("|"))
    expected = set(groups) | {f"{name} {sub}" for name, subs in groups.items() for sub in subs}
    assert expected - named == set(), f"commands docs/commands.md does not name: {expected - named}"
    assert named - expected == set(), f"docs/commands.md names no such command: {named - expected}"
