"""Tables whose names never hide the part that tells rows apart.

Keys and paths often differ only at the end (``….exp_avg`` against ``….exp_avg_sq``), so a name
is never cut: :class:`Name` breaks it onto more lines after a separator (``.``, ``/``, a space),
inside a part only where that part alone is wider than the column (after ``_`` or ``-``, else
anywhere). The other columns stay on one line, so the names give way on a narrow terminal.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from typing import Any

from rich.cells import cell_len, chop_cells
from rich.console import Console, ConsoleOptions
from rich.measure import Measurement
from rich.segment import Segment
from rich.table import Table

from ._output import shown

_LEVELS = (
    re.compile(r"\S*\s*"),  # words
    re.compile(r"[^./\\:,]*[./\\:,]*"),  # a word's parts: a key's or a path's components
    re.compile(r"[^_\-]*[_\-]*"),  # a part's pieces: exp_, avg_, sq
)
"""Where a line may end, tried in order: a piece wider than the line is broken at the next level
(and, past the last, anywhere)."""


def _split(text: str, level: int) -> list[str]:
    return [p for p in _LEVELS[level].findall(text) if p]


def wrap_name(text: str, width: int) -> list[str]:
    """``text`` as lines of at most ``width`` cells, broken after separators (see the module).

    Example:
        >>> wrap_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", 24)
        ['decoder.layers.0.', 'self_attention.', 'linear_qkv.', 'layer_norm_weight']
    """
    lines: list[str] = []
    line = _fill(text, 0, max(1, width), lines, "")
    if line or not lines:
        lines.append(line)
    return lines


def _fill(text: str, level: int, width: int, lines: list[str], line: str) -> str:
    """Add ``text`` to ``line`` and ``lines`` greedily; the line still open is returned."""
    if level == len(_LEVELS):  # no separator left: anywhere
        while cell_len(line + text) > width:
            if line:
                lines.append(line)
                line = ""
                continue
            head = chop_cells(text, width)[0] or text[0]
            lines.append(head)
            text = text[len(head):]
        return line + text
    for piece in _split(text, level):
        if cell_len(line + piece.rstrip()) <= width:
            line += piece
            continue
        if cell_len(piece.rstrip()) <= width:  # on a line of its own
            if line:
                lines.append(line.rstrip() or line)
            line = piece
        else:  # wider than a line: broken at the next level, from where this line stands
            line = _fill(piece, level + 1, width, lines, line)
    return line


class Name:
    """A key, path or any text cell that wraps at its separators and is never cut.

    Control characters are escaped (:func:`~ema_ckpt.cli._output.shown`).
    """

    def __init__(self, name: object) -> None:
        self.text = shown(name)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        total = cell_len(self.text)
        longest = max((cell_len(p) for p in _split(self.text, 1)), default=0)
        return Measurement(min(longest, total), total)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Segment]:
        for line in wrap_name(self.text, options.max_width):
            yield Segment(line)
            yield Segment.line()


def name_table(name: str, *columns: str, right: Collection[str] = (), **table_options: Any) -> Table:
    """A table whose first column holds names (:class:`Name` cells) and whose other columns
    stay on one line (``right``: the columns justified right, numbers).

    Example:
        >>> table = name_table("key", "shape", "bytes", right={"bytes"})
        >>> [c.no_wrap for c in table.columns]
        [False, True, True]
    """
    table = Table(show_edge=False, **table_options)
    table.add_column(name, overflow="fold")
    for column in columns:
        table.add_column(column, no_wrap=True, justify="right" if column in right else "left")
    return table


def summary_grid() -> Table:
    """Two columns, label and value: the summary above a command's table.

    Values are :class:`Name` cells (paths fold at their separators, never cut).
    """
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    return grid
