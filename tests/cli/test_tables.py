"""Every table the CLI prints folds, never cuts (issue 29, point 7): rendered at 80 columns, as
in a pipe, each word of each cell and header reads whole on one line of the output, and no cell
ends in an ellipsis. Before, rich narrowed the widest columns below their longest word:
``0.64…`` and ``7.00±…`` in ``simulate --compare``, ``base…`` in the demo's scheduler column,
``(pivote1214/o…`` in ``topology list``, and ``status`` printed PID 26743 as ``2674`` over
``3`` and a Ray node as ``192.`` / ``0.2.`` / ``2``."""

from __future__ import annotations

import ast
import importlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dmsc.cli import main
from dmsc.cli.tables import FoldTable

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _plain(cell: Any) -> str:
    if isinstance(cell, str):
        return Text.from_markup(cell).plain
    return cell.plain if isinstance(cell, Text) else ""


def _values(table: Table) -> Iterator[str]:
    for column in table.columns:
        if table.show_header:
            yield _plain(column.header)
        yield from (_plain(c) for c in column.cells)


def assert_whole(tables: list[Table], text: str) -> None:
    """Each word of each value of ``tables`` is on one line of ``text``; nothing is cut."""
    assert tables, "no table was printed"
    assert "…" not in text
    lines = text.splitlines()
    assert all(len(line.rstrip()) <= 80 for line in lines), text
    for table in tables:
        for value in _values(table):
            for word in value.split():
                assert any(word in line for line in lines), f"{word!r} split in\n{text}"


@pytest.fixture
def printed(monkeypatch: pytest.MonkeyPatch) -> list[Table]:
    """The FoldTables rendered while the test runs, at 80 columns on dmsc's console."""
    tables: list[Table] = []
    render = FoldTable.__rich_console__

    def record(self: FoldTable, console: Any, options: Any) -> Any:
        tables.append(self)
        return render(self, console, options)

    monkeypatch.setattr(FoldTable, "__rich_console__", record)
    monkeypatch.setattr(importlib.import_module("dmsc.cli.app").console, "width", 80)
    monkeypatch.delenv("DMSC_WIDE", raising=False)
    return tables


def run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out = capsys.readouterr()
    assert not exit_.value.code, out.err
    return out.out


COMMANDS = {
    "topology list": ["topology", "list"],
    "simulate --compare": [
        "simulate", "--scenario", str(EXAMPLES / "scenarios" / "nsfnet-cba.yaml"),
        "--compare", "baseline,cba,joint", "--seeds", "2", "--arrivals", "40", "--loads", "1,2",
    ],
    "simulate --lightpaths": [
        "simulate", "--lightpaths", "--topology", "nsfnet", "--requests", "200", "--warmup",
        "100", "--seeds", "2", "--loads", "100,300",
    ],
    "estimate": [
        "estimate", "--cluster", str(EXAMPLES / "clusters" / "a100-selene.yaml"), "--model",
        "gpt3-175b", "--tp", "8", "--pp", "8", "--global-batch", "64",
    ],
    "plan": [
        "plan", "--cluster", str(EXAMPLES / "clusters" / "nsfnet-4dc.yaml"), "--model",
        "llama3-8b", "--global-batch", "512", "--gpus", "64",
    ],
    "segment": [
        "segment", "--cluster", str(EXAMPLES / "clusters" / "a100-selene.yaml"), "--model",
        "gpt3-13b", "--stages", "4",
    ],
    "modules list": ["modules", "list"],
}  # fmt: skip


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_table_reads_whole_at_80_columns(
    name: str, printed: list[Table], capsys: pytest.CaptureFixture[str]
) -> None:
    assert_whole(printed, run(capsys, *COMMANDS[name]))


def test_the_database_tables_read_whole_at_80_columns(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    printed: list[Table],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``tasks list``, ``token list`` (a tenant longer than a column can hold) and ``models
    list``."""
    from dmsc.data.db import Database, ModelVersionRecord
    from dmsc.runtime.control.tasks.task_queue import TaskQueue

    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    tenant = "a-tenant-whose-name-is-long-enough-to-crowd-the-table"
    db = Database()
    run_id = db.new_run("gpt-mini", "c", {}).id
    TaskQueue(db, run_id).submit("train", {"steps": 30}, tenant=tenant)
    db.add(ModelVersionRecord(run_id=run_id, step=1234, path="/x", sha256="0123456789ab" * 5))
    run(capsys, "token", "create", "--tenant", tenant, "--scopes", "admin,infer,read,submit")
    text = run(capsys, "tasks", "list") + run(capsys, "token", "list")
    text += run(capsys, "models", "list")
    assert_whole(printed, text)
    assert tenant in text and "1234" in text and "0123456789ab" in text


@pytest.mark.parametrize("ray", [False, True])
def test_status_keeps_pids_and_nodes_whole(ray: bool, printed: list[Table]) -> None:
    """``status`` printed PID 26743 as ``2674`` / ``3``, and under Ray the node 192.168.0.2 as
    ``192.`` / ``0.2.`` / ``2``."""
    from dmsc.cli.runtime import print_status
    from dmsc.runtime.transport.replies import StatusReply

    answer = {
        "run": 3,
        "epoch": 0,
        "replicas_down": [],
        "spares": [],
        "model": "gpt-mini",
        "steps": 40,
        "services": [
            {
                "sid": f"sid-{s}-92cae7ba9b-r0",
                "stage": s,
                "replica": 0,
                "address": f"192.168.0.{2 + s}:50051" if ray else f"127.0.0.1:{50051 + s}",
                "health": "ok",
                "registered": True,
                "heartbeat_age_s": 0.4,
                "pid": 26743 + s,
                **({"node": f"192.168.0.{2 + s}"} if ray else {}),
                "cpu_percent": 97.4 + s,
                "rss_bytes": 312_000_000 + s * 1_000_000,
            }
            for s in range(2)
        ],
        "nodes": [
            {
                "node": "local",
                "host": "box",
                "cpus": 2,
                "cpu_percent": 88.0,
                "memory_used_bytes": 3.5e9,
                "memory_total_bytes": 25.3e9,
                "workers": 2,
                "workers_cpu_percent": 195.8,
                "workers_rss_bytes": 625e6,
            }
        ],
        "tasks": [{"id": 1, "kind": "train", "state": "running"}],
        "faults": [],
    }
    buf = io.StringIO()
    print_status(Console(file=buf, width=80, force_terminal=False), StatusReply(**answer))
    text = buf.getvalue()
    assert_whole(printed, text)
    assert "26743" in text and "26744" in text
    # each worker's CPU % and memory, then the node's totals
    assert "97" in text and "98" in text and "312.00 MB" in text and "313.00 MB" in text
    assert "25.30" in text and "196" in text and "625.00" in text and "busy %" in text
    if ray:
        assert "192.168.0.2" in text and "192.168.0.3" in text


def test_a_table_that_cannot_fit_becomes_records() -> None:
    """Ten columns of long words do not fit in 80 with or without borders: each row becomes a
    block of ``header  value`` lines, every value whole."""
    t = FoldTable(title="wide")
    for i in range(10):
        t.add_column(f"column-{i}")
    t.add_row(*(f"value-{i}-{'x' * 8}" for i in range(10)))
    t.add_row(*(str(10_000 + i) for i in range(10)))
    buf = io.StringIO()
    Console(file=buf, width=80, force_terminal=False).print(t)
    text = buf.getvalue()
    assert_whole([t], text)
    assert any(line.split() == ["column-3", "value-3-xxxxxxxx"] for line in text.splitlines())


def test_a_table_fits_without_borders_before_it_becomes_records() -> None:
    """Eight columns of eight characters need 89 columns with borders, 78 without."""
    t = FoldTable()
    for i in range(8):
        t.add_column(f"col{i}")
    t.add_row(*(f"{i}.123456" for i in range(8)))
    buf = io.StringIO()
    Console(file=buf, width=80, force_terminal=False).print(t)
    lines = buf.getvalue().splitlines()
    assert lines[0].split() == [f"col{i}" for i in range(8)]
    assert lines[1].split() == [f"{i}.123456" for i in range(8)]


def test_a_table_that_fits_is_drawn_as_rich_draws_it() -> None:
    t = FoldTable("a", "b")
    t.add_row("1", "2")
    mine, theirs = io.StringIO(), io.StringIO()
    Console(file=mine, width=80).print(t)
    plain = Table("a", "b")
    plain.add_row("1", "2")
    Console(file=theirs, width=80).print(plain)
    assert mine.getvalue() == theirs.getvalue()


def test_every_cli_table_is_a_fold_table() -> None:
    """No command module builds a plain rich Table, which cuts its cells at 80 columns."""
    offenders = []
    for path in sorted((ROOT / "src" / "dmsc" / "cli").glob("*.py")):
        if path.name == "tables.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("Table", "Table.grid"):
                offenders.append(path.name)
    assert offenders == []
