"""Tables that fold, never cut: every word of every cell reads whole at any width.

rich shrinks a table that is too wide for the console by narrowing its widest columns evenly,
below the longest word of a cell if need be: a PID became ``2674`` over ``3`` and a source
``(pivote1214/o…``. :class:`FoldTable` lays itself out instead, at the width it is given (80
columns in a pipe, the terminal's otherwise, any with ``dmsc --wide``), in the first of three
forms where every column is at least as wide as its longest word:

1. the table as built, short columns (numbers, names) on one line and long text wrapped at its
   spaces;
2. the same without borders, columns two spaces apart (like ``ps``);
3. one record per row, a ``header  value`` line per column (like ``psql``'s expanded display).

Only a single word longer than the whole width (a path) still folds, over several lines.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from rich.console import Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderableType, RenderResult

# A column whose longest line is at most this wide (numbers, names, short phrases) is given its
# whole width before the columns of longer text share what is left.
SHORT = 20


def _measure(console: Console, options: ConsoleOptions, cell: RenderableType) -> Measurement:
    """A cell's longest word (minimum) and longest line (maximum), as rich measures them."""
    return Measurement.get(console, options.update_width(1_000_000), cell)


def _range(table: Table, console: Console, options: ConsoleOptions, index: int) -> tuple[int, int]:
    """The narrowest a column can be with its words whole, and the width of its longest line."""
    column = table.columns[index]
    cells = list(column.cells)
    if table.show_header:
        cells.append(column.header)
    low = high = column.min_width or 1
    for cell in cells:
        m = _measure(console, options, cell)
        low, high = max(low, m.minimum), max(high, m.maximum)
    if column.no_wrap:  # a column asked to stay on one line (SIDs, addresses): whole lines
        low = high
    return low, high


def _widths(table: Table, console: Console, options: ConsoleOptions) -> list[int] | None:
    """Content widths for the columns that keep every word whole at ``options.max_width``, or
    None where even the narrowest such layout is too wide. Short columns get their full width
    first (a number stays on one line); the longest take what is left and wrap."""
    n = len(table.columns)
    ranges = [_range(table, console, options, i) for i in range(n)]
    overhead = table._extra_width + sum(table._get_padding_width(i) for i in range(n))
    spare = options.max_width - overhead - sum(low for low, _ in ranges)
    if spare < 0:
        return None
    widths = [low for low, _ in ranges]
    order = sorted(range(n), key=lambda i: ranges[i][1] - ranges[i][0])
    short = [i for i in order if ranges[i][1] <= SHORT]
    for i in short:  # a number, a name, "64 (16 x 4)": on one line where there is room
        if ranges[i][1] - widths[i] <= spare:
            spare -= ranges[i][1] - widths[i]
            widths[i] = ranges[i][1]
    rest = [i for i in order if widths[i] < ranges[i][1]]
    for k, i in enumerate(rest):  # text: an even share each, what a column needs at most
        give = min(ranges[i][1] - widths[i], spare // (len(rest) - k))
        widths[i] += give
        spare -= give
    for i in rest:  # what the even shares left over
        give = min(ranges[i][1] - widths[i], spare)
        widths[i] += give
        spare -= give
    return widths


def _with_widths(table: Table, widths: list[int]) -> Table:
    """A copy of ``table`` whose columns have these content widths and fold what does not fit."""
    out = copy.copy(table)
    out.columns = []
    for column, width in zip(table.columns, widths, strict=True):
        c = copy.copy(column)
        c.width, c.no_wrap, c.overflow = width, False, "fold"
        out.columns.append(c)
    return out


def _borderless(table: Table) -> Table:
    out = copy.copy(table)
    out.box, out.show_edge, out.pad_edge, out.padding = None, False, False, (0, 1, 0, 1)
    return out


def _plain(console: Console, cell: RenderableType) -> RenderableType:
    return console.render_str(cell) if isinstance(cell, str) else cell


def _records(table: Table, console: Console) -> list[RenderableType]:
    """One block per row: each column's header and the row's value beside it."""
    out: list[RenderableType] = []
    if table.title:
        out.append(_plain(console, table.title))
    headers = [_plain(console, c.header) for c in table.columns]
    for r in range(table.row_count):
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column(overflow="fold")
        for column, header in zip(table.columns, headers, strict=True):
            value = column._cells[r]
            if table.show_header:
                grid.add_row(header, value)
            else:
                grid.add_row(value)
        if r:
            out.append(Text(""))
        out.append(grid)
    if table.caption:
        out.append(_plain(console, table.caption))
    return out


class FoldTable(Table):
    """A rich table laid out so that no word of a cell is cut or split (see the module)."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if not self.columns:
            yield from super().__rich_console__(console, options)
            return
        for form in (self, _borderless(self)):
            widths = _widths(form, console, options)
            if widths is not None:
                yield from Table.__rich_console__(_with_widths(form, widths), console, options)
                return
        yield Group(*_records(self, console))
