"""The examples of the README and of the docs pages, run as printed: the shell examples of
README.md and of every page of ``mkdocs.yml``'s nav (:func:`pages`: the README first, then the
pages in nav order) are read at test time, expanded into commands, and run with ``bash -c``
(``dmsc`` is ``python -m dmsc`` on the ``PATH``), the offline ones (estimate, plan, segment,
simulate, schema) on the example clusters and the runtime ones against a live deployment, in the
pages' order.

What an example is: every line of a fenced block of a page (a line ending in ``\\`` or followed
by an indented line goes on with the next one; ``# comments`` are dropped) whose fence names no
language or a shell (a ``text``, ``yaml`` or ``json`` block holds no commands), and a heading
that is nothing but one backticked ``dmsc`` command (``dmsc schema cluster|model|job|plan``).
Every example must match a rule of :data:`RULES`, run or deliberately not run with its reason
(:data:`NOT_RUN`): a new example the rules do not know fails
:func:`test_every_usage_example_is_classified`, so no page can drift from what is tested. A page
of the nav without commands is listed in :data:`NO_COMMANDS` with its reason, and must hold none.

How an example becomes commands (:func:`expand`):

- ``a | b | c`` (spaced) lists subcommands: ``dmsc models list | promote VERSION`` runs ``dmsc
  models list`` and ``dmsc models promote VERSION``;
- ``a|b|c`` (one word) outside brackets: one command per alternative (``dmsc schema plan``, ...);
- ``[...]`` optional groups: once all left out, then once all included for each alternative
  ``a|b|c`` inside them (``--late-policy wait``, ``skip``, ``restart``); a rule may keep only
  the groups included with their first alternatives (``dmsc up --gateway``: each more variant
  would be one more ``dmsc up``, about 15 s).

The substitutions (:func:`fill`), and nothing else:

- ``${DMSC_HOME:-.dmsc}``: bash expands it, ``DMSC_HOME`` being the test's data directory; the
  commands run in a directory of their own (``examples`` and ``src`` linked there), so
  ``plan.json``, ``plan.png``, ``blocking.png``, ``rmsa.png``, ``runs.csv`` and the topology
  files land there;
- ``127.0.0.1:8080`` and ``localhost:8080``: a free port instead of 8080;
- ``$KEY``: bash expands it, ``KEY`` being the key the last ``dmsc token create`` printed;
- ``ID``: the task (``tasks show``: the last task, ``tasks cancel``: a training task started in the
  background for it, ``/v1/tasks/ID``: the task the ``curl`` before it submitted) or the API key
  (``token revoke``: the first key created; ``$KEY`` is the one created after it);
  ``VERSION``: the newest model version (``promote``), the one before it (``canary``);
  ``SID``: stage 1's SID without its replica suffix (a unique prefix); ``--tenant T --state
  S``: ``default`` and ``done``;
- ``dmsc estimate ... --json``: ``...`` is the arguments of the block's previous command;
- ``curl``: ``curl --fail-with-body -sS`` (an HTTP status of 400 or more fails the command);
  after ``/v1/tasks/ID`` the test also runs it with ``-X DELETE`` ("DELETE cancels");
- ``dmsc logs --follow``: read until it printed 5 lines, then Ctrl-C (SIGINT);
- speed, to keep the test short: ``dmsc train --steps 500`` (or 200) runs 2 steps (and a
  ``--warmup`` of 1 step, which 2 steps hold),
  ``dmsc simulate`` gets ``--arrivals 100`` (the scenario has 2000 per run) and, with
  ``--lightpaths``, ``--requests 3000 --warmup 1000`` (a tenth), ``dmsc chaos --after 120``
  waits 1 s, a federated ``dmsc train --sync ... --rounds 4 --local-steps 5`` runs 2 rounds of
  2 local steps. Nothing else is scaled.

A command fails the test with its output when it exits non-zero (the pages expect exit 1, "does
not fit", from none of these examples). Between the pages' ``dmsc up`` commands the test runs
``dmsc down`` (the gateway's and the failures' sections start a deployment of their own), and the
deployment is always brought down at the end, the test failed or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import cli_fork
import pytest
import yaml
from cli_shim import ShimServer
from conftest import ROOT, run_dmsc

from dmsc.data.db import Database

pytestmark = pytest.mark.integration

README = ROOT / "README.md"
MKDOCS = ROOT / "mkdocs.yml"
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}

# Pages of the nav that print no command (checked: no fenced line of theirs starts with `dmsc `).
NO_COMMANDS: dict[str, str] = {
    "docs/architecture.md": "the developers' page: diagrams of the packages and processes",
}


def pages() -> list[Path]:
    """README.md, then every Markdown page of mkdocs.yml's nav in nav order (the order the live
    examples run in)."""
    config = yaml.safe_load(MKDOCS.read_text())
    docs = ROOT / config.get("docs_dir", "docs")
    found: list[Path] = []

    def walk(entry: object) -> None:
        if isinstance(entry, str):
            found.append(docs / entry)
        elif isinstance(entry, list):
            for item in entry:
                walk(item)
        elif isinstance(entry, dict):
            for value in entry.values():
                walk(value)

    walk(config["nav"])
    return [README, *found]


@dataclass(frozen=True)
class Example:
    """One shell example of a page, as printed (continuations joined, comments dropped), with
    the heading of its section, its page (relative to the repository) and its line there."""

    text: str
    section: str
    line: int
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def page_examples(text: str, page: str = "README.md") -> list[Example]:
    """The shell examples of one page, in order."""
    lines = text.splitlines()
    examples: list[Example] = []
    section, fenced, shell, joining, block_start = "", False, False, False, 0
    for number, raw in enumerate(lines, start=1):
        if raw.startswith("```"):
            fenced, joining, block_start = not fenced, False, len(examples)
            shell = raw[3:].strip() in SHELL_FENCES
            continue
        if not fenced:
            heading = re.match(r"#+ (.*)", raw)
            if heading:
                section = heading.group(1)
                only_command = re.fullmatch(r"`(dmsc [^`]+)`", section)
                if only_command:
                    examples.append(Example(only_command.group(1), section, number, page))
            continue
        if not shell:
            continue
        text = re.sub(r"(^|\s+)#(\s.*)?$", "", raw).rstrip()
        goes_on = text.endswith("\\")
        text = text.removesuffix("\\").strip()
        if not text:
            joining = False
            continue
        if len(examples) > block_start and (joining or raw[:1].isspace()):
            last = examples[-1]
            examples[-1] = Example(f"{last.text} {text}", last.section, last.line, page)
        else:
            examples.append(Example(text, section, number, page))
        joining = goes_on
    return examples


def expand(text: str, first_only: bool = False) -> list[str]:
    """The commands one example stands for (see the module's docstring)."""
    parts = [p.strip() for p in re.split(r"\s\|\s(?![^\[]*\])", text)]
    head = parts[0].split()[:2]  # `dmsc GROUP`: the other alternatives replace what follows it
    commands = [parts[0]] + [" ".join([*head, p]) for p in parts[1:]]
    out: list[str] = []
    for command in commands:
        for word_variant in _word_alternatives(command):
            out.extend(_optional_groups(word_variant, first_only))
    return out


def _word_alternatives(command: str) -> list[str]:
    """``a|b|c`` outside brackets and quotes: one command per alternative."""
    words = command.split(" ")
    depth = 0
    for i, word in enumerate(words):
        opened = depth + word.count("[")
        depth = opened - word.count("]")
        if opened == 0 and "|" in word and "'" not in word and '"' not in word:
            return [
                variant
                for alt in word.split("|")
                for variant in _word_alternatives(" ".join([*words[:i], alt, *words[i + 1 :]]))
            ]
    return [command]


def _optional_groups(command: str, first_only: bool) -> list[str]:
    groups = list(re.finditer(r"(?<!\S)\[([^\]]*)\]", command))
    if not groups:
        return [command]
    dropped = re.sub(r"\s+", " ", re.sub(r"(?<!\S)\[[^\]]*\]", "", command)).strip()
    options = [_word_alternatives(g.group(1)) for g in groups]
    n = 1 if first_only else max(len(o) for o in options)
    included = []
    for i in range(n):
        variant = command
        for g, alts in zip(reversed(groups), reversed(options), strict=True):
            alt = alts[i] if i < len(alts) else alts[0]
            variant = variant[: g.start()] + alt + variant[g.end() :]
        included.append(re.sub(r"\s+", " ", variant).strip())
    return included if first_only else [dropped, *included]


# -- the rules ------------------------------------------------------------------------------------

OFFLINE, LIVE = "offline", "live"


@dataclass(frozen=True)
class Rule:
    """Examples (their text as printed) matching ``pattern`` run in ``phase``, every command they
    expand into (only the one with the optional groups in, first alternatives, when
    ``first_only``: the others are listed as not run, ``why_not``), or none (``skip``: why)."""

    pattern: str
    phase: str = LIVE
    first_only: bool = False
    skip: str = ""
    why_not: str = ""
    page: str = ""  # only the examples of this page (relative path), before every other rule

    def matches(self, text: str, page: str = "") -> bool:
        if self.page and page != self.page:
            return False
        return re.match(self.pattern, text) is not None


RULES: list[Rule] = [
    Rule(
        r"",
        page="docs/ray.md",
        skip="a Ray cluster of several machines (`ray start` on each); "
        "tests/integration/test_ray.py runs `dmsc up --launcher ray --ray-address` on a local "
        "Ray cluster, tests/integration/test_ray_private.py on one started with `ray start`",
    ),
    Rule(
        r"dmsc calibrate$",
        page="docs/runtime.md",
        skip="the same command as the README's tour, which this test runs first (measuring the "
        "machine again would test nothing more); this page's plan reads the file it wrote",
    ),
    Rule(r"dmsc estimate ", OFFLINE),
    Rule(r"dmsc plan (--compare )?--cluster examples/clusters/", OFFLINE),
    Rule(r"dmsc segment ", OFFLINE),
    Rule(r"dmsc simulate ", OFFLINE),
    Rule(r"dmsc topology ", OFFLINE),
    Rule(r"dmsc schema ", OFFLINE),
    Rule(r"dmsc calibrate$"),
    Rule(r"dmsc plan --cluster \$\{DMSC_HOME:-\.dmsc\}/local-cpu\.calibrated\.yaml "),
    Rule(r"dmsc up --plan plan\.json$"),
    Rule(
        r"dmsc up --plan plan\.json --gateway 127\.0\.0\.1:8080 --autoscale ",
        skip="the runtime page's plan fills local-cpu's three devices, so dmsc up refuses it; "
        "tests/integration/test_serving.py and benchmarks/autoscale.py run serving replicas on "
        "a cluster of four devices, tests/cli/test_autoscale_flag.py the refusals",
    ),
    Rule(r"dmsc up --plan plan\.json --gateway 127\.0\.0\.1:8080 --control advise --policy "),
    Rule(
        r"dmsc up --plan plan\.json --gateway 127\.0\.0\.1:8080 ",
        first_only=True,
        why_not="without its options, or with another --router (round_robin, latency, p2c, "
        "sticky): each would be one more `dmsc up` (about 15 s)",
    ),
    Rule(r"dmsc up --plan plan\.json --failure-timeout "),
    Rule(r"dmsc status$"),
    Rule(
        r"dmsc train --steps 500 ",
        first_only=True,
        why_not="without its options, or with --late-policy skip or restart: each is one more "
        "training task (tests/chaos/test_late_gradients.py runs every policy)",
    ),
    Rule(r"dmsc train "),
    Rule(r"dmsc infer "),
    Rule(r"dmsc tasks list "),
    Rule(
        r"dmsc export --out ",
        skip="tests/integration/test_hf_checkpoint.py runs it after training a checkpoint and "
        "loads what it wrote in transformers",
    ),
    Rule(r"dmsc down$"),
    Rule(r"dmsc logs"),
    Rule(r"dmsc token (create|list|revoke)"),
    Rule(r"curl "),
    Rule(r"dmsc models list "),
    Rule(r"dmsc chaos "),
    Rule(r"dmsc modules list$"),
    Rule(r"dmsc replan --dry-run$"),
    Rule(
        r"dmsc replan$",
        skip="on the pages' deployment it decides to keep the placement; "
        "tests/integration/test_replanning.py applies a move on a slowed link",
    ),
]

# Examples deliberately not run, and why.
NOT_RUN: dict[str, str] = {
    "dmsc demo": "what `make demo` runs: calibrate, a deployment, training, the example clusters "
    "(about 3 minutes on 2 cores); every command it runs is an example of its own here",
    "make demo": "`dmsc demo` in the virtual environment (above)",
    "make test": "runs this test among all the others",
}


def rule_of(example: Example) -> Rule | None:
    for text, reason in NOT_RUN.items():
        if example.text == text:
            return Rule(re.escape(text), skip=reason)
    for rule in RULES:
        if rule.page and rule.matches(example.text, example.page):
            return rule
    return next((r for r in RULES if not r.page and r.matches(example.text)), None)


def doc_examples() -> list[tuple[Example, Rule | None]]:
    """Every example of every page (:func:`pages`), with the rule that runs it."""
    out: list[tuple[Example, Rule | None]] = []
    for page in pages():
        name = page.relative_to(ROOT).as_posix()
        if name in NO_COMMANDS:
            continue
        out.extend((e, rule_of(e)) for e in page_examples(page.read_text(), name))
    return out


def test_every_usage_example_is_classified() -> None:
    """A new example on any page fails here until this module knows how to run it (or why it
    does not); a rule no example matches any more fails too."""
    examples = doc_examples()
    assert len(examples) >= 60, "the pages' examples were not found"
    unknown = [f"{e.where}: {e.text}" for e, r in examples if r is None]
    assert not unknown, "examples this test cannot classify:\n" + "\n".join(unknown)
    unused = [
        r.pattern or f"(every example of {r.page})"
        for r in RULES
        if not any(r.matches(e.text, e.page) for e, _ in examples)
    ]
    assert not unused, f"rules that match no example any more: {unused}"
    placeholders = {"ID", "VERSION", "SID", "T", "S"}
    for example, rule in examples:
        assert rule is not None
        if rule.skip:  # not run: its placeholders are the reader's (`HEAD` of a Ray cluster)
            continue
        for command in expand(example.text, rule.first_only):
            left = set(re.findall(r"(?<![\w${-])[A-Z][A-Z0-9_]*\b(?!\})", command)) - placeholders
            assert not left, f"{example.where}: unknown placeholders {left} in {command}"


def test_every_page_is_read() -> None:
    """Every page of the nav exists and is read for examples (or prints none, as
    :data:`NO_COMMANDS` says), and every Markdown file under docs/ is in the nav."""
    listed = pages()
    missing = [p for p in listed if not p.is_file()]
    assert not missing, f"pages of the nav that do not exist: {missing}"
    docs = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")}
    left_out = docs - {p.relative_to(ROOT).as_posix() for p in listed}
    assert not left_out, f"pages under docs/ that the nav (and so this test) leaves out: {left_out}"
    for name, why in NO_COMMANDS.items():
        assert ROOT / name in listed, f"{name} ({why}) is no longer in the nav"
        commands = [
            e for e in page_examples((ROOT / name).read_text(), name) if e.text.startswith("dmsc ")
        ]
        assert not commands, f"{name} prints commands now: {commands}"


def test_expand() -> None:
    assert expand("dmsc tasks list [--tenant T --state S] | show ID | cancel ID") == [
        "dmsc tasks list",
        "dmsc tasks list --tenant T --state S",
        "dmsc tasks show ID",
        "dmsc tasks cancel ID",
    ]
    assert expand("dmsc train --steps 5 [--p a|b] [--json]") == [
        "dmsc train --steps 5",
        "dmsc train --steps 5 --p a --json",
        "dmsc train --steps 5 --p b --json",
    ]
    assert expand("dmsc up [--r a|b] [--x 1]", first_only=True) == ["dmsc up --r a --x 1"]
    assert expand("dmsc schema cluster|plan") == ["dmsc schema cluster", "dmsc schema plan"]


# -- running them ---------------------------------------------------------------------------------


@dataclass
class Shell:
    """Runs commands with ``bash -c`` in ``cwd``, ``dmsc`` on the ``PATH``, ``DMSC_HOME=home``."""

    cwd: Path
    home: Path
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    server: ShimServer | None = None

    def __post_init__(self) -> None:
        bin_dir = self.cwd / ".bin"
        bin_dir.mkdir(exist_ok=True)
        shim = bin_dir / "dmsc"
        if cli_fork.wanted():  # each call forked from the test's server (tests/cli_shim.py)
            self.server = ShimServer()
            shim.write_text(self.server.command())
        else:
            shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m dmsc "$@"\n')
        shim.chmod(0o755)
        (self.cwd / "examples").symlink_to(ROOT / "examples")
        # `dmsc train --data src/dmsc/`: a copy, for the control plane reads data only inside
        # its data roots (here the directory `dmsc up` runs in), symlinks followed
        shutil.copytree(
            ROOT / "src" / "dmsc",
            self.cwd / "src" / "dmsc",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "DMSC_HOME": str(self.home),
        }

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def _spawn(self, command: str) -> subprocess.Popen[str]:
        """``command`` under bash in its own process group (Ctrl-C or a kill reaches it all)."""
        return subprocess.Popen(
            ["bash", "-c", command],
            cwd=self.cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def run(self, command: str, timeout: float = 300) -> tuple[int | None, str, str]:
        """Exit code (None when it ran past ``timeout`` and was stopped), stdout, stderr."""
        start = time.monotonic()
        proc = self._spawn(command)
        try:
            out, err = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            code = None
        self.log.append(f"{time.monotonic() - start:6.1f} s  {command}")
        return code, out, err

    def follow(self, command: str, lines: int, timeout: float = 60) -> tuple[int | None, str, str]:
        """A command that never ends by itself (``dmsc logs --follow``): its first ``lines``
        lines of output (or what came in ``timeout`` seconds), then Ctrl-C (SIGINT)."""
        start = time.monotonic()
        proc = self._spawn(command)
        timer = threading.Timer(timeout, self._interrupt, (proc,))
        timer.start()
        assert proc.stdout is not None
        got: list[str] = []
        try:
            while len(got) < lines and (line := proc.stdout.readline()):
                got.append(line)
            self._interrupt(proc)
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        finally:
            timer.cancel()
        self.log.append(f"{time.monotonic() - start:6.1f} s  {command}  (then Ctrl-C)")
        return proc.returncode, "".join(got) + out, err

    @staticmethod
    def _interrupt(proc: subprocess.Popen[str]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)

    def ok(self, command: str, timeout: float = 300) -> str:
        code, out, err = self.run(command, timeout)
        assert code == 0, f"`{command}` exited {code}\n--- stdout\n{out}\n--- stderr\n{err}"
        return out


def fill(command: str, values: dict[str, str]) -> str:
    """The substitutions of the module's docstring that do not depend on the live state."""
    command = re.sub(
        r"\b(127\.0\.0\.1|localhost):8080\b", f"\\1:{values.get('port', '8080')}", command
    )
    command = re.sub(r"^curl ", "curl --fail-with-body -sS ", command)
    command = re.sub(r"^(dmsc train .*--steps) (500|200)\b", r"\1 2", command)
    command = re.sub(r"^(dmsc train .*--warmup) \d+\b", r"\1 1", command)  # within 2 steps
    command = re.sub(r"^(dmsc train --sync \w+ --rounds) 4 (--local-steps) 5\b", r"\1 2 \2 2",
                     command)  # fmt: skip
    command = re.sub(r"^(dmsc chaos .*--after) 120\b", r"\1 1", command)
    if command.startswith("dmsc simulate "):
        command += " --arrivals 100"
        command = command.replace(
            "--requests 30000 --warmup 10000", "--requests 3000 --warmup 1000"
        )
    for name, value in values.items():
        if name.isupper():
            command = re.sub(rf"(?<![\w${{-]){name}\b", value, command)
    return command


def commands(phase: str) -> Iterator[tuple[Example, str, str]]:
    """(example, command as expanded, why it is not run or "") of ``phase``, in the pages'
    order."""
    for example, rule in doc_examples():
        assert rule is not None, f"{example.where}: unclassified: {example.text}"
        if rule.phase != phase:
            continue
        if rule.skip:
            yield example, example.text, rule.skip
            continue
        every = expand(example.text)
        kept = expand(example.text, rule.first_only)
        for command in every:
            yield example, command, "" if command in kept else rule.why_not


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_offline_examples(tmp_path: Path) -> None:
    """estimate, plan on the example clusters, segment, simulate, schema: exit 0 each (two at a
    time: they share nothing but the directory, and write different files)."""
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "work").mkdir()
    shell = Shell(tmp_path / "work", home)
    filled, previous = [], ""
    for _example, command, why_not in commands(OFFLINE):
        assert not why_not, command
        if " ... " in command:  # `dmsc estimate ... --json`: the block's previous command
            command = command.replace(" ... ", " " + previous.split(" ", 2)[2] + " ", 1)
        else:
            previous = command
        filled.append(fill(command, {}))
    # the README's tour prints some of the pages' commands again: each runs once
    filled = list(dict.fromkeys(filled))
    assert len(filled) >= 13, filled
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(shell.run, filled))
    finally:
        shell.close()
    print("\n".join(shell.log))
    for command, (code, out, err) in zip(filled, results, strict=True):
        assert code == 0, f"`{command}` exited {code}\n--- stdout\n{out}\n--- stderr\n{err}"
        if command.split()[-1] == "--json" or " --json " in command:
            json.loads(out)
    for name in ("plan.json", "plan.png", "blocking.png", "rmsa.png", "runs.csv", "waxman.csv"):
        assert (shell.cwd / name).is_file(), name


def test_live_examples(tmp_path: Path) -> None:
    """calibrate, plan, up, status, train, infer, tasks, logs, token, curl, models, chaos, down
    against a live deployment, in the pages' order."""
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "work").mkdir()
    shell = Shell(tmp_path / "work", home)
    live = Live(shell)
    try:
        for example, command, why_not in commands(LIVE):
            if why_not:
                shell.log.append(f"  (not run: {command}: {why_not})")
                continue
            live.step(example, command)
        assert live.ran >= 30, live.ran
    finally:
        live.close()
        print("\n".join(shell.log))


def calibrate_printed_what_it_wrote(out: str, written_file: Path) -> None:
    """``dmsc calibrate`` printed the figures it wrote: the memory bandwidth, the peak, the
    node's link and its gloo all-reduce the cost model will read, and the file's path."""
    written = yaml.safe_load(written_file.read_text())
    dev = next(iter(written["device_types"].values()))
    assert f"memory {dev['memory_bw_gbyte_s']:.2f} GB/s" in out, out
    peak = dev["peak_tflops"]["fp32"]
    assert f"peak {peak * 1e3:.1f} GFLOP/s" in out or f"peak {peak:.1f} TFLOP/s" in out, out
    node = next(iter(written["node_types"].values()))
    assert f"link {node['link']['bandwidth_gbit_s']:.2f} Gbit/s" in out, out
    gloo = node["collective"]  # the node's all-reduce
    assert gloo["backend"] == "gloo" and f"{gloo['bandwidth_gbit_s']:.2f} Gbit/s" in out, out
    assert str(written_file) in out, out


class Live:
    """The live state the placeholders are filled from, and the checks of each command."""

    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self.values: dict[str, str] = {}
        self.up = False
        self.ran = 0
        self.keys: list[tuple[str, str]] = []  # (id, key) of each `token create`
        self.background: subprocess.Popen[str] | None = None

    @property
    def db(self) -> Database:
        return Database(f"sqlite:///{self.shell.home / 'dmsc.sqlite'}")

    def step(self, example: Example, command: str) -> None:
        words = command.split()
        prepare: Callable[[], None] | None = getattr(self, f"before_{words[0]}_{words[1]}", None)
        if words[0] == "dmsc" and prepare is not None:
            prepare()
        if "ID" in command.split() or "/ID" in command:
            self.values["ID"] = self.id_for(command)
        if "VERSION" in command.split():
            versions = sorted(v.id for v in self.db.model_versions())
            assert len(versions) >= 3, versions
            # promote the newest; canary one that is neither in production nor retired (the
            # rollback after it goes back to the retired one)
            self.values["VERSION"] = str(versions[-1] if "promote" in command else versions[-2])
        filled = fill(command, self.values)
        self.shell.log.append(example.where)
        if filled.startswith("dmsc logs --follow"):
            code, out, err = self.shell.follow(filled, lines=5)
            assert len(out.splitlines()) >= 5, (code, out, err)
        else:
            code, out, err = self.shell.run(filled)
            assert code == 0, f"`{filled}` exited {code}\n--- stdout\n{out}\n--- stderr\n{err}"
        self.ran += 1
        self.after(filled, out, err)

    def before_dmsc_up(self) -> None:
        if self.up:  # the section's deployment replaces the one before
            self.shell.ok("dmsc down")
        self.values["port"] = str(free_port())
        self.up = True

    def before_dmsc_logs(self) -> None:
        if "SID" not in self.values:  # the deployment of the section before (it is down)
            sid = next(s.sid for s in self.db.services(1) if s.stage == 1)
            self.values["SID"] = sid.rsplit("-r", 1)[0]

    def before_dmsc_tasks(self) -> None:
        self.values.setdefault("T", "default")
        self.values.setdefault("S", "done")

    def id_for(self, command: str) -> str:
        if command.startswith("dmsc token revoke"):
            return self.keys[0][0]
        if command.startswith("dmsc tasks show"):
            return str(max(t.id for t in self.db.tasks()))
        if command.startswith("dmsc tasks cancel"):
            # a training task to cancel: 500 steps, in the background, cancelled between steps
            self.background = subprocess.Popen(
                ["bash", "-c", "dmsc train --steps 500 --json"],
                cwd=self.shell.cwd,
                env=self.shell.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            assert self.background.stdout is not None
            first = self.background.stdout.readline()
            assert first, self.background.communicate(timeout=30)
            return str(json.loads(first)["task"])
        assert "/v1/tasks/ID" in command, command
        return self.values["submitted"]

    def after(self, command: str, out: str, err: str) -> None:
        if command == "dmsc calibrate":
            calibrate_printed_what_it_wrote(out, self.shell.home / "local-cpu.calibrated.yaml")
        elif command.startswith("dmsc tasks cancel") and self.background is not None:
            out, err = self.background.communicate(timeout=60)
            report = json.loads(out.splitlines()[-1])
            assert report["state"] == "cancelled", (out, err)
            self.background = None
        elif command.startswith("dmsc token create"):
            found = re.search(r"key (\d+) for tenant", err)
            assert found, err
            self.keys.append((found.group(1), out.strip()))
            self.shell.env["KEY"] = out.strip()
        elif command.startswith("curl") and command.endswith("/v1/tasks") and " -d " in command:
            self.values["submitted"] = str(json.loads(out)["id"])
        elif re.match(r"curl .*/v1/tasks/\d+$", command):
            # "# DELETE cancels": the task the curl before submitted (100 steps) is cancelled
            assert json.loads(out)["id"] == int(self.values["submitted"])
            self.shell.ok(command.replace("curl ", "curl -X DELETE ", 1))
        elif command.startswith("dmsc train") and command.endswith("--json"):
            assert json.loads(out.splitlines()[-1])["state"] == "done", out
        elif command.startswith("dmsc infer --prompt") and command.endswith("--json"):
            answer = json.loads(out)
            assert answer["text"] and answer["seed"] == 1, out  # the example's --seed 1
        elif command.startswith("dmsc infer --batch") and command.endswith("--json"):
            answers = [json.loads(line) for line in out.splitlines()]
            assert [a["line"] for a in answers] == [1, 2] and answers[0]["seed"] == 1, out
        elif command.startswith("dmsc infer --batch"):
            assert len(out.splitlines()) == 2, out  # the example file's two requests
        elif command.startswith("curl") and command.endswith("/v1/tasks/infer"):
            assert json.loads(out)["kind"] == "infer", out
        elif command.startswith("dmsc infer --prompt"):
            prompt = re.search(r'--prompt "([^"]*)"', command)
            assert prompt and out.startswith(prompt.group(1)), out
        elif command == "dmsc status":
            assert re.search(r"\bok\b", out), out
        elif command.startswith("curl") and command.endswith("/v1/infer"):
            assert json.loads(out)["text"], out
        elif command.startswith("dmsc chaos"):
            assert "recover" in (out + err).lower(), out + err
        elif command == "dmsc down":
            self.up = False

    def close(self) -> None:
        if self.background is not None and self.background.poll() is None:
            os.killpg(self.background.pid, signal.SIGKILL)
            self.background.communicate()
        control = self.shell.home / "control.json"
        if control.exists():
            res = run_dmsc("down", home=self.shell.home, timeout=60)
            if res.returncode != 0 and control.exists():  # kill what is left
                pid = json.loads(control.read_text()).get("pid")
                if pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(int(pid), signal.SIGKILL)
        self.shell.close()
