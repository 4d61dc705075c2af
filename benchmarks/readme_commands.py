"""How long the README's usage commands take as a new user runs them, one checkout beside another.

For each checkout (``--checkout NAME=PATH``, repeatable; default ``after=`` this repository) the
commands run in order in a fresh working directory of their own (``examples/`` linked to the
checkout's, ``DMSC_HOME`` a new ``.dmsc/`` inside it, so the README's ``.dmsc/...`` and
``${DMSC_HOME:-.dmsc}/...`` name the same file) with the checkout's ``src`` first on the path:

    dmsc --version, estimate (GPT-3 175B on Selene), plan (the plan section's first example),
    segment (its first example), simulate (its first example), calibrate, plan (gpt-mini on the
    calibrated cluster), up, status, train, infer, down, then demo twice (the second is the time
    of ``make demo`` once .venv exists: ``.venv/bin/dmsc demo``).

Each command is taken from the checkout's own README.md (the first line of a code block that
matches, continuation lines joined, optional ``[...]`` arguments left out), so a command that
changed between versions runs as each version documents it; one a README does not show
(``dmsc --version``, ``dmsc demo``) runs as written here. ``dmsc train`` runs 20 steps with a
checkpoint every 10 instead of the README's 500 and 50, which keeps the run short; the table also
gives its seconds per step (wall time over steps, submission and wait included).

Checkouts interleave command by command (before, after, before, after, ...; the order is
reversed on every other repeat), so the noise of a shared machine hits both; the commands that
run on a deployment (up, status, train, infer, down) interleave as one block, so that one
checkout's deployment is never up, heartbeating, while the other's commands are timed. Each
command's time is wall clock (``time.perf_counter`` around the subprocess), the median over
``--repeats`` with every run and exit code kept. Every checkout's deployment is stopped with
``dmsc down`` and any process left behind (found by a tag in its environment) is killed, even on
error.

Prints a table (seconds per checkout, the last checkout over the first, exit codes), or with
--json one object with the same figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRAIN_STEPS = 20
CHECKPOINT_EVERY = 10
TAG = "DMSC_README_BENCH"


@dataclass(frozen=True)
class Command:
    """One row: a README line matching ``pattern`` (or ``fixed`` when the README shows none)."""

    label: str
    pattern: str | None
    fixed: tuple[str, ...]
    timeout_s: float = 600.0
    deployed: bool = False  # runs while the checkout's deployment is up
    make: str | None = None  # a Makefile target run in the checkout instead of a dmsc command


COMMANDS = [
    Command("dmsc --version", None, ("--version",)),
    Command(
        "dmsc estimate (gpt3-175b, Selene)",
        r"dmsc estimate --cluster examples/clusters/a100-selene\.yaml --model gpt3-175b ",
        (),
    ),
    Command("dmsc plan (gpt3-175b, Selene)", r"dmsc plan --cluster examples/clusters/", ()),
    Command("dmsc segment (gpt3-13b)", r"dmsc segment --cluster ", ()),
    Command("dmsc simulate (nsfnet-cba)", r"dmsc simulate --scenario ", ()),
    Command("dmsc calibrate", r"dmsc calibrate\b", ()),
    Command("dmsc plan (calibrated, gpt-mini)", r"dmsc plan --cluster \S*calibrated", ()),
    Command("dmsc up", r"dmsc up --plan plan\.json\s*(#|$)", (), deployed=True),
    Command("dmsc status", r"dmsc status\b", (), deployed=True),
    Command(f"dmsc train ({TRAIN_STEPS} steps)", r"dmsc train --steps ", (), deployed=True),
    Command("dmsc infer", r"dmsc infer --prompt ", (), deployed=True),
    Command("dmsc down", r"dmsc down\b", (), deployed=True),
    Command("dmsc demo (first run)", None, ("demo",), 1200.0),
    Command("dmsc demo (second run = make demo)", None, ("demo",), 1200.0),
    Command("make test-quick", None, (), 1800.0, make="test-quick"),
]


def make_recipe(checkout: Path, target: str) -> list[str]:
    """The argv of a one-line Makefile recipe, with ``$(BIN)/`` the running interpreter's bin."""
    lines = (checkout / "Makefile").read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith(f"{target}:"))
    recipe = lines[start + 1].strip()
    if not recipe or lines[start + 2].startswith("\t"):
        raise SystemExit(f"Makefile target {target} is not a one-line recipe")
    bin_dir = str(Path(sys.executable).parent)
    return shlex.split(recipe.replace("$(BIN)", bin_dir))


def readme_lines(readme: Path) -> list[str]:
    """The logical lines of the README's code blocks (continuation lines joined)."""
    lines: list[str] = []
    inside = False
    pending = ""
    for raw in readme.read_text().splitlines():
        if raw.strip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        text = pending + raw.strip()
        if text.endswith("\\"):
            pending = text[:-1].rstrip() + " "
            continue
        pending = ""
        lines.append(text)
    return lines


def documented(cmd: Command, lines: list[str], home: Path) -> tuple[list[str], str]:
    """The argv after ``dmsc`` for ``cmd`` as this README writes it, and the line it came from."""
    if cmd.make is not None:
        return [f"make {cmd.make}"], ""
    if cmd.pattern is None:
        return list(cmd.fixed), ""
    line = next((x for x in lines if re.match(cmd.pattern, x)), None)
    if line is None:
        raise SystemExit(f"README shows no line matching {cmd.pattern!r}")
    text = re.sub(r"\s*\[[^\]]*\]", "", line)  # optional arguments
    text = text.replace("${DMSC_HOME:-.dmsc}", str(home))
    argv = shlex.split(text, comments=True)[1:]
    if argv[:1] == ["train"]:  # a short run: 20 steps instead of 500
        for flag, value in (("--steps", TRAIN_STEPS), ("--checkpoint-every", CHECKPOINT_EVERY)):
            if flag in argv:
                argv[argv.index(flag) + 1] = str(value)
    return argv, line


@dataclass
class Checkout:
    name: str
    path: Path
    work: Path = field(init=False)
    home: Path = field(init=False)
    env: dict[str, str] = field(init=False)
    tag: str = field(init=False)

    def fresh(self) -> None:
        """A new working directory and data directory for one pass over the commands."""
        self.work = Path(tempfile.mkdtemp(prefix=f"dmsc-readme-{self.name}-"))
        (self.work / "examples").symlink_to(self.path / "examples")
        (self.work / "logs").mkdir()
        self.home = self.work / ".dmsc"
        self.tag = uuid.uuid4().hex
        env = {k: v for k, v in os.environ.items() if k != "DMSC_DATABASE_URL"}
        path = os.pathsep.join(p for p in (str(self.path / "src"), env.get("PYTHONPATH")) if p)
        self.env = {**env, "PYTHONPATH": path, "DMSC_HOME": str(self.home), TAG: self.tag}

    def resolves(self) -> Path:
        out = subprocess.run(
            [sys.executable, "-c", "import dmsc; print(dmsc.__file__)"],
            env=self.env,
            cwd=self.work,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return Path(out).resolve()

    def run(
        self, index: int, argv: list[str], timeout_s: float, make: str | None = None
    ) -> tuple[float, int | str, str]:
        """Seconds, exit code (or "timeout") and the last line of stderr of ``dmsc ARGV`` (or
        of the checkout's Makefile target ``make``, run in the checkout)."""
        name = make or (argv[0].lstrip("-") if argv else "dmsc")
        base = self.work / "logs" / f"{index:02d}-{name}"
        full = make_recipe(self.path, make) if make else [sys.executable, "-m", "dmsc", *argv]
        with open(f"{base}.out", "w") as out, open(f"{base}.err", "w") as err:
            start = time.perf_counter()
            try:
                rc: int | str = subprocess.run(
                    full,
                    env=self.env,
                    cwd=self.path if make else self.work,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    timeout=timeout_s,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            seconds = time.perf_counter() - start
        tail = [x.strip() for x in Path(f"{base}.err").read_text().splitlines() if x.strip()]
        return seconds, rc, tail[-1] if tail else ""

    def tagged_pids(self) -> list[int]:
        """Processes whose environment carries this pass's tag (its deployment, whoever the
        parent now is)."""
        needle = f"{TAG}={self.tag}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0"):
                pids.append(int(entry.name))
        return pids

    def clean_up(self, keep: bool) -> list[int]:
        """``dmsc down``, then kill what is left; the pids that had to be killed."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                [sys.executable, "-m", "dmsc", "down"],
                env=self.env,
                cwd=self.work,
                capture_output=True,
                timeout=120,
            )
        left = self.tagged_pids()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.tagged_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 5
            while self.tagged_pids() and time.monotonic() < deadline:
                time.sleep(0.1)
        if not keep:
            shutil.rmtree(self.work, ignore_errors=True)
        return left


def groups() -> list[list[int]]:
    """The commands in the order they interleave: one at a time, except that the commands run
    on a deployment (up .. down) go together, so that no checkout's deployment is up while
    another checkout's commands are timed."""
    out: list[list[int]] = []
    for i, cmd in enumerate(COMMANDS):
        if cmd.deployed and out and COMMANDS[out[-1][-1]].deployed:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def one_pass(
    checkouts: list[Checkout], keep: bool
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[int]]]:
    """Every command on every checkout, interleaved command by command (the deployment's
    commands as one block)."""
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in checkouts}
    killed: dict[str, list[int]] = {}
    for c in checkouts:
        c.fresh()
    try:
        for c in checkouts:
            where = c.resolves()
            if not where.is_relative_to(c.path.resolve()):
                raise SystemExit(f"{c.name}: dmsc imports from {where}, not from {c.path}")
        lines = {c.name: readme_lines(c.path / "README.md") for c in checkouts}
        for group in groups():
            for c in checkouts:
                for i in group:
                    cmd = COMMANDS[i]
                    argv, line = documented(cmd, lines[c.name], c.home)
                    seconds, rc, err = c.run(i, argv, cmd.timeout_s, cmd.make)
                    runs[c.name].append(
                        {
                            "argv": argv,
                            "readme": line,
                            "seconds": seconds,
                            "exit": rc,
                            "stderr": err,
                        }
                    )
    finally:
        for c in checkouts:
            killed[c.name] = c.clean_up(keep)
    return runs, killed


def summarise(
    checkouts: list[Checkout], passes: list[dict[str, list[dict[str, Any]]]]
) -> list[dict[str, Any]]:
    rows = []
    first, last = checkouts[0].name, checkouts[-1].name
    for i, cmd in enumerate(COMMANDS):
        row: dict[str, Any] = {"command": cmd.label, "argv": {}, "readme": {}}
        row["seconds"], row["all_seconds"], row["exit_codes"], row["stderr"] = {}, {}, {}, {}
        for c in checkouts:
            mine = [p[c.name][i] for p in passes]
            row["argv"][c.name] = mine[0]["argv"]
            row["readme"][c.name] = mine[0]["readme"]
            row["all_seconds"][c.name] = [round(m["seconds"], 3) for m in mine]
            row["seconds"][c.name] = round(statistics.median(m["seconds"] for m in mine), 3)
            row["exit_codes"][c.name] = [m["exit"] for m in mine]
            row["stderr"][c.name] = [m["stderr"] for m in mine if m["exit"] != 0]
        notes = []
        if len({json.dumps(a) for a in row["argv"].values()}) > 1:
            notes.append(
                "command differs: "
                + "; ".join(f"{n}: dmsc {shlex.join(a)}" for n, a in row["argv"].items())
            )
        for name, codes in row["exit_codes"].items():
            bad = [x for x in codes if x != 0]
            if bad:
                why = row["stderr"][name][0] if row["stderr"][name] else ""
                notes.append(f"{name} exit {bad[0]}" + (f": {why}" if why else ""))
        row["notes"] = notes
        row["ratio"] = (
            round(row["seconds"][last] / row["seconds"][first], 3) if len(checkouts) > 1 else None
        )
        rows.append(row)
    per_step = {
        "command": f"  train: seconds per step ({TRAIN_STEPS} steps)",
        "seconds": {},
        "exit_codes": {},
        "notes": ["wall time of dmsc train over its steps (submission and wait included)"],
    }
    train = next(r for r in rows if r["command"].startswith("dmsc train"))
    for c in checkouts:
        per_step["seconds"][c.name] = round(train["seconds"][c.name] / TRAIN_STEPS, 4)
        per_step["exit_codes"][c.name] = train["exit_codes"][c.name]
    per_step["ratio"] = (
        round(per_step["seconds"][last] / per_step["seconds"][first], 3)
        if len(checkouts) > 1
        else None
    )
    rows.insert(rows.index(train) + 1, per_step)
    total: dict[str, Any] = {"command": "README sequence (--version .. down)", "seconds": {}}
    total["exit_codes"] = {}
    total["notes"] = []
    seq = [r for r in rows if r["command"].startswith("dmsc") and "demo" not in r["command"]]
    for c in checkouts:
        total["seconds"][c.name] = round(sum(r["seconds"][c.name] for r in seq), 3)
        total["exit_codes"][c.name] = []
    total["ratio"] = (
        round(total["seconds"][last] / total["seconds"][first], 3) if len(checkouts) > 1 else None
    )
    rows.insert(rows.index(next(r for r in rows if "demo" in r["command"])), total)
    return rows


def print_table(checkouts: list[Checkout], rows: list[dict[str, Any]], repeats: int) -> None:
    from rich.console import Console
    from rich.table import Table

    names = [c.name for c in checkouts]
    title = f"README commands, wall seconds (median of {repeats})"
    table = Table(title=title)
    table.add_column("command")
    for n in names:
        table.add_column(f"{n} s", justify="right")
    if len(names) > 1:
        table.add_column(f"{names[-1]}/{names[0]}", justify="right")
    table.add_column("exit codes")
    for r in rows:
        cells = [r["command"], *(f"{r['seconds'][n]:.3f}" for n in names)]
        if len(names) > 1:
            cells.append(f"{r['ratio']:.2f}")
        codes = "/".join(",".join(str(x) for x in r["exit_codes"][n]) for n in names)
        cells.append(codes)
        table.add_row(*cells)
    console = Console(width=160)
    console.print(table)
    for r in rows:
        for note in r["notes"]:
            console.print(f"{r['command']}: {note}", highlight=False, soft_wrap=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkout",
        action="append",
        metavar="NAME=PATH",
        help="A checkout to time (repeatable; the ratio is the last over the first). "
        "Default: after=this repository.",
    )
    parser.add_argument("--repeats", type=int, default=1, help="Passes over the commands.")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true", help="Keep the working directories.")
    args = parser.parse_args()
    checkouts = []
    for spec in args.checkout or [f"after={ROOT}"]:
        name, sep, path = spec.partition("=")
        if not sep or not name or not (Path(path) / "README.md").is_file():
            parser.error(f"--checkout {spec}: expected NAME=PATH of a checkout with README.md")
        checkouts.append(Checkout(name, Path(path).resolve()))
    passes = []
    killed: dict[str, list[int]] = {c.name: [] for c in checkouts}
    for r in range(args.repeats):
        order = checkouts if r % 2 == 0 else checkouts[::-1]
        runs, left = one_pass(order, args.keep)
        passes.append(runs)
        for name, pids in left.items():
            killed[name] += pids
    rows = summarise(checkouts, passes)
    out = {
        "checkouts": {c.name: str(c.path) for c in checkouts},
        "python": sys.executable,
        "repeats": args.repeats,
        "train_steps": TRAIN_STEPS,
        "checkpoint_every": CHECKPOINT_EVERY,
        "cpu_count": os.cpu_count(),
        "interleaving": [[COMMANDS[i].label for i in g] for g in groups()],
        "commands": rows,
        "processes_killed_after_down": killed,
    }
    if args.json:
        print(json.dumps(out))
        return
    print_table(checkouts, rows, args.repeats)
    if any(killed.values()):
        print(f"processes left after dmsc down (killed): {killed}")


if __name__ == "__main__":
    main()
