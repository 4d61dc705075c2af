"""The README stays a front page and the reference stays whole: the README is at most 300 lines,
every relative link of it (and of the docs pages, which ``make docs`` also checks strictly)
names a file that exists, the command index (``docs/commands.md``) names every command and
sub-command of ``dmsc --help``, and every benchmark figure placeholder of the pages reads a value
of ``benchmarks/results/*.json`` (``docs/_hooks/results.py`` renders them when the pages are
built). The docs test (``tests/integration/test_readme_examples.py``) runs every command the
pages print; ``make docs`` fails on a broken link, anchor or API reference."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest
import typer.main

from dmsc.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
HOOK = DOCS / "_hooks" / "results.py"
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


def test_the_benchmark_table_names_every_benchmark() -> None:
    """docs/results.md's table of programs names every program of benchmarks/ (the modules
    whose names start with an underscore are their shared parts) and no program that is not
    there: gpu_runtime.py and six others had gone unlisted."""
    table = (DOCS / "results.md").read_text()
    listed = set(re.findall(r"^\| `benchmarks/([^`]+\.py)`", table, re.MULTILINE))
    programs = {p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert programs - listed == set(), f"docs/results.md does not list: {programs - listed}"
    assert listed - programs == set(), f"docs/results.md lists no such program: {listed - programs}"


def figures_hook() -> ModuleType:
    """``docs/_hooks/results.py``, the MkDocs hook that reads the pages' benchmark figures."""
    spec = importlib.util.spec_from_file_location("docs_results_hook", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_figure_placeholder_names_a_figure_of_the_results() -> None:
    """Every ``{{ FILE.json#/POINTER : FORMAT }}`` of every page resolves (what ``make docs``
    renders), and the pages quote the benchmarks through it: each JSON the pages name as a
    result they quote is read by at least one placeholder."""
    hook = figures_hook()
    read: set[str] = set()
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        rendered = hook.render(text, page.name)
        assert "{{" not in rendered, page
        read.update(re.findall(r"\{\{\s*(?:from\s+)?([\w.-]+\.json)#", text))
    quoted = {
        "sim_sync.json",
        "thin_links.json",
        "head_aggregation.json",
        "sim_rmsa.json",
        "inference_cpu.json",
        "autoscale.json",
        "replan.json",
        "chaos_recovery_ray.json",
        "validate_costmodel.json",
        "sim_reproduce_cba.json",
        "hardening_cpu.json",
        "tp_sync_modes_cpu.json",
    }
    assert quoted <= read, f"results the pages quote without reading them: {quoted - read}"


def test_the_figures_hook_reads_pointers_and_formats() -> None:
    hook = figures_hook()
    results = json.loads((ROOT / "benchmarks/results/sim_rmsa.json").read_text())
    first_fit = results["reference_first_fit"]
    at_200 = next(row for row in first_fit if row["load"] == 200)
    assert (
        hook.render(
            "{{ sim_rmsa.json#/reference_first_fit/load=200/service_blocking : .1% }} at 200"
        )
        == f"{at_200['service_blocking']:.1%} at 200"
    )
    table = "{{ from sim_rmsa.json#/speed }}| {{ load }} | {{ us_per_request : *1000.0f }} |"
    speed = results["speed"]
    assert hook.render(table) == f"| {speed['load']} | {speed['us_per_request'] * 1000:.0f} |"
    assert hook.render("{{ sim_rmsa.json#/reference_first_fit : len }}") == str(len(first_fit))
    for bad, why in [
        ("{{ sim_rmsa.json#/nope }}", "no key 'nope'"),
        ("{{ missing.json#/a }}", "no file"),
        ("{{ sim_rmsa.json#/speed }}", "not a figure"),
        ("{{ load }}", "no file named"),
        ("{{ sim_rmsa.json#/reference_first_fit/load=7/ci95 }}", "no item with load = '7'"),
    ]:
        with pytest.raises(hook.FigureError, match=re.escape(why)):
            hook.render(bad, "page.md")
