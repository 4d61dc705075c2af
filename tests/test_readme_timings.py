"""The timings the README and the docs pages give of their own commands are the measured ones:
each figure they quote for ``make demo``, ``make test-quick`` and ``dmsc up`` equals, to two
significant figures, the median that ``benchmarks/readme_commands.py --json`` wrote into
``benchmarks/results/readme_commands_cpu.json`` on this kind of machine (2 cores). A sentence
that drifts from the measurement, or a measurement that drifts from the page, fails here:
re-run the benchmark and quote it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "readme_commands_cpu.json"

# (what the page says it times, the page, a pattern whose one group is the figure, the
# benchmark's row)
CLAIMS = [
    (
        "make demo, in the README's introduction",
        "README.md",
        r"on the example clusters \(about (\d+) s on\s+two cores",
        "dmsc demo (second run = make demo)",
    ),
    (
        "make demo, in the runtime page's dmsc demo",
        "docs/runtime.md",
        r"What `make demo` runs \(about (\d+) s on 2 cores",
        "dmsc demo (second run = make demo)",
    ),
    (
        "make test-quick, in the README",
        "README.md",
        r"no processes started, about (\d+) s on\s+two cores",
        "make test-quick",
    ),
    (
        "dmsc up, in the Ray page",
        "docs/ray.md",
        r"`dmsc up` of a 3-stage plan takes\s+about (\d+) s",
        "dmsc up",
    ),
]


def two_figures(seconds: float) -> int:
    """``seconds`` to two significant figures, as the pages quote it."""
    if seconds < 10:
        return round(seconds)
    digits = math.floor(math.log10(seconds)) - 1
    return int(round(seconds, -digits))


def measured() -> dict[str, float]:
    out = json.loads(RESULTS.read_text())
    names = list(out["checkouts"])  # a run beside an older checkout: this one's, "after"
    name = "after" if "after" in names else names[0]
    return {row["command"]: row["seconds"][name] for row in out["commands"]}


def test_the_results_are_of_a_two_core_machine_and_every_dmsc_command_succeeded() -> None:
    """Every ``dmsc`` command of the run exited 0. ``make test-quick``'s own exit code is not
    held: it runs this file against the results of the run before, which the pages no longer
    quote while the new figures are being measured."""
    out = json.loads(RESULTS.read_text())
    assert out["cpu_count"] == 2
    for row in out["commands"]:
        if row["command"].startswith("make "):
            continue
        for codes in row["exit_codes"].values():
            assert all(code == 0 for code in codes), (row["command"], codes)


@pytest.mark.parametrize(("what", "page", "pattern", "row"), CLAIMS, ids=[c[0] for c in CLAIMS])
def test_each_timing_is_the_measured_one(what: str, page: str, pattern: str, row: str) -> None:
    text = (ROOT / page).read_text()
    found = re.search(pattern, text)
    assert found, f"{page} no longer times {what} as {pattern!r}"
    figures = measured()
    assert row in figures, f"{RESULTS.name} has no row {row!r}"
    assert int(found.group(1)) == two_figures(figures[row]), (
        f"{page}: {what} about {found.group(1)} s; measured {figures[row]:.1f} s "
        f"({RESULTS.name}, {row!r})"
    )


def test_two_figures() -> None:
    assert [two_figures(x) for x in (4.4, 18.2, 64.9, 176.0, 323.0, 1049)] == [
        4,
        18,
        65,
        180,
        320,
        1000,
    ]
