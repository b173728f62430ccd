"""One table renderer for every command: it fits the terminal, whatever its width.

A :class:`Grid` is laid out when it is printed, for the width it is given
(``COLUMNS``, the terminal, or 80 when output is piped), in the first of these
that fits:

1. one table, headers on one line;
2. one table, headers wrapped between words, free text (``wrap`` columns such
   as an error) wrapped between words;
3. several tables (at most three), each repeating the ``key`` columns (the
   queue name), the other columns split at ``group`` boundaries (``nmbus
   status`` at 80 columns: subqueues in one, the recent window in the other);
   only when the keys tell the rows apart, and unless ``split=False``;
4. stacked: one block per row, one ``header  value`` line per column.

Names (queues, types) and numbers never wrap and are never cut: a column is
at least as wide as its widest value. Numbers are right-aligned, with
thousands separators; times are short (``15:04:05`` today, ``11-22 15:04``
this year, ``2025-11-22`` before, in local time); ages and durations read
``42s``, ``3m20s``, ``1h05m``, ``7d``. ``--json`` keeps every value whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Literal

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

Align = Literal["left", "right"]

# Space between two columns: the right padding of one and the (blank) divider.
GAP = 2
# Split into more tables than this, a table reads worse than stacked rows.
MAX_PARTS = 3


@dataclass(frozen=True)
class Column:
    """How one column is shown. A plain string in place of a Column: ``Column(that)``."""

    header: str
    # None: right when every value is a number (int, float, Decimal), else left.
    align: Align | None = None
    # Free text (an error, a list of settings): may wrap between words.
    wrap: bool = False
    # Names the row: repeated in every part when the table is split.
    key: bool = False
    # Columns of one group stay together in one part when the table is split.
    group: str | None = None
    # The narrowest a wrap column becomes before the table is split instead.
    min_width: int = 20


def is_number(value: Any) -> bool:
    return isinstance(value, int | float | Decimal) and not isinstance(value, bool)


def number_text(value: float | Decimal, digits: int = 1) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    return f"{float(value):,.{digits}f}"


def short_time(value: datetime, now: datetime | None = None) -> str:
    """``15:04:05`` today, ``11-22 15:04`` this year, ``2025-11-22`` before (local time)."""
    local = value.astimezone()
    today = (now or datetime.now()).astimezone(local.tzinfo)
    if local.date() == today.date():
        return local.strftime("%H:%M:%S")
    if local.year == today.year:
        return local.strftime("%m-%d %H:%M")
    return local.strftime("%Y-%m-%d")


_STEPS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def age_text(seconds: float | timedelta | None) -> str:
    """A duration in at most two units: ``0.4s``, ``42s``, ``3m20s``, ``1h05m``, ``7d``."""
    if seconds is None:
        return "-"
    value = seconds.total_seconds() if isinstance(seconds, timedelta) else float(seconds)
    sign, value = ("-", -value) if value < 0 else ("", value)
    if value < 10 and value != int(value):
        return f"{sign}{value:.1f}s"
    whole = round(value)
    for i, (unit, size) in enumerate(_STEPS):
        if whole >= size or unit == "s":
            first, rest = divmod(whole, size)
            text = f"{first}{unit}"
            if i + 1 < len(_STEPS) and unit != "s":
                small, small_size = _STEPS[i + 1]
                second = rest // small_size
                if second:
                    text += f"{second:02d}{small}"
            return sign + text
    raise AssertionError("unreachable")  # pragma: no cover


_SIZES = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def size_text(size_bytes: int) -> str:
    """A size on disk in binary units: ``512 B``, ``40.0 KiB``, ``56.6 MiB``, ``1.2 GiB``."""
    for unit, size in _SIZES:
        if size_bytes >= size:
            return f"{size_bytes / size:,.1f} {unit}"
    return f"{size_bytes} B"


def cell_text(value: Any) -> Text:
    """A value as the text of a cell (never parsed as markup)."""
    if isinstance(value, Text):
        return value
    if value is None:
        return Text("-")
    if isinstance(value, bool):
        return Text("yes" if value else "no")
    if is_number(value):
        return Text(number_text(value))
    if isinstance(value, datetime):
        return Text(short_time(value))
    if isinstance(value, timedelta):
        return Text(age_text(value))
    return Text(str(value))


def _longest_word(text: str) -> int:
    return max((len(word) for word in text.split()), default=0)


def _line_width(text: Text) -> int:
    return max((Text(line).cell_len for line in text.plain.splitlines()), default=0)


class Grid:
    """A table that lays itself out for the width it is printed at (see the module)."""

    def __init__(
        self,
        title: str | None,
        columns: Sequence[str | Column],
        rows: Sequence[Sequence[Any]],
        *,
        empty: str | None = None,
        split: bool = True,
    ) -> None:
        self.title = title
        self.split = split
        self.columns = [c if isinstance(c, Column) else Column(c) for c in columns]
        self.raw = [list(row) for row in rows]
        self.cells = [[cell_text(v) for v in row] for row in self.raw]
        self.empty = empty
        self.aligns = [self._align(i) for i in range(len(self.columns))]
        self.least = [self._least(i) for i in range(len(self.columns))]
        self.natural = [self._natural(i) for i in range(len(self.columns))]

    # -- measuring -------------------------------------------------------------------------

    def _align(self, i: int) -> Align:
        column = self.columns[i]
        if column.align is not None:
            return column.align
        values = [row[i] for row in self.raw if row[i] is not None]
        return "right" if values and all(is_number(v) for v in values) else "left"

    def _widest(self, i: int) -> int:
        return max((_line_width(row[i]) for row in self.cells), default=0)

    def _least(self, i: int) -> int:
        column = self.columns[i]
        header = _longest_word(column.header)
        if column.wrap:
            return max(header, min(column.min_width, self._widest(i)), 1)
        return max(header, self._widest(i), 1)

    def _natural(self, i: int) -> int:
        return max(len(self.columns[i].header), self._widest(i), 1)

    def fit(self, indices: Sequence[int], width: int) -> dict[int, int] | None:
        """Widths of these columns in ``width`` characters, or None when they cannot fit."""
        least = sum(self.least[i] for i in indices) + GAP * (len(indices) - 1)
        if least > width:
            return None
        widths = {i: self.least[i] for i in indices}
        slack = width - least
        # Free text first (an error on one line), then headers on one line.
        order = [i for i in indices if self.columns[i].wrap]
        order += [i for i in indices if not self.columns[i].wrap]
        for i in order:
            grow = min(slack, self.natural[i] - widths[i])
            widths[i] += grow
            slack -= grow
        return widths

    def parts(self, width: int) -> list[list[int]] | None:
        """The columns of each table to print; None: stack the rows instead."""
        every = list(range(len(self.columns)))
        if self.fit(every, width) is not None:
            return [every]
        keys = [i for i in every if self.columns[i].key] or every[:1]
        named = [tuple(row[i].plain for i in keys) for row in self.cells]
        if not self.split or len(set(named)) < len(named):
            return None  # parts whose rows cannot be matched up by their keys: stack instead
        chunks: list[list[int]] = []
        for i in every:
            if i in keys:
                continue
            group = self.columns[i].group
            if chunks and group is not None and self.columns[chunks[-1][0]].group == group:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        found: list[list[int]] = []
        current: list[int] = []
        for chunk in chunks:
            if self.fit(keys + current + chunk, width) is not None:
                current += chunk
                continue
            if current:
                found.append(current)
                current = []
            for i in chunk:  # a chunk too wide for a table of its own: column by column
                if self.fit(keys + current + [i], width) is not None:
                    current.append(i)
                    continue
                if current:
                    found.append(current)
                if self.fit([*keys, i], width) is None:
                    return None
                current = [i]
        if current:
            found.append(current)
        if len(found) > MAX_PARTS:
            return None  # one table per column or two: stacked rows read better
        return [keys + part for part in found]

    # -- rendering -------------------------------------------------------------------------

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        if not self.cells and self.empty is not None:
            yield Text(self.empty)  # instead of the title and an empty table
            return
        if self.title:
            yield Text(self.title, style="bold")
        parts = self.parts(width)
        if parts is None:
            yield from self._stacked()
            return
        for n, part in enumerate(parts):
            if n:
                yield Text("")
            widths = self.fit(part, width)
            assert widths is not None
            yield self._table(part, widths)

    def _table(self, part: list[int], widths: dict[int, int]) -> Table:
        table = Table(
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            padding=(0, 1, 0, 0),
            header_style="bold",
        )
        for i in part:
            column = self.columns[i]
            table.add_column(
                column.header,
                justify=self.aligns[i],
                width=widths[i],
                # Never no_wrap: it would cut the header too. A value of a column
                # that is not free text fits its width, so it never wraps anyway.
                overflow="fold",
            )
        for row in self.cells:
            table.add_row(*(row[i] for i in part))
        return table

    def _stacked(self) -> Iterator[Padding | Text]:
        keys = [i for i, c in enumerate(self.columns) if c.key] or [0]
        label = max(len(c.header) for c in self.columns)
        for n, row in enumerate(self.cells):
            if n:
                yield Text("")
            yield Text("  ".join(row[i].plain for i in keys), style="bold")
            block = Table.grid(padding=(0, GAP, 0, 0))
            block.add_column(width=label, no_wrap=True)
            block.add_column(overflow="fold")
            for i, column in enumerate(self.columns):
                if i not in keys:
                    value = row[i].copy()
                    value.justify = self.aligns[i]
                    block.add_row(column.header, value)
            yield Padding(block, (0, 0, 0, GAP))
