"""Terminal output: results on stdout, messages and progress on stderr.

Progress bars show only on an interactive terminal and never with ``--json`` or
``--quiet``, so cron logs and scripts get clean output. Every byte count on screen, bar and
summaries alike, is in binary units from one formatter, :func:`human_bytes`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn
from rich.table import Column
from rich.text import Text

from .._text import escaped
from ..progress import Progress as EngineProgress
from ._flags import cli_json, cli_text

# Under torchrun every rank runs the command; only rank 0 speaks.
_PRIMARY = os.environ.get("RANK", "0") == "0"


class _SafeConsole(Console):
    """A console that never interprets markup and escapes control characters in every string.

    Keys and paths come from checkpoints: ``[red]``, ESC or OSC sequences, bidi overrides and
    lone surrogates in them are shown as text, never acted on (see :mod:`ema_ckpt._text`).
    """

    def render_str(self, text: str, **kwargs: Any) -> Any:
        kwargs["markup"] = False
        return super().render_str(escaped(text, keep_newlines=True), **kwargs)


console = _SafeConsole(soft_wrap=True, quiet=not _PRIMARY, markup=False)
err_console = _SafeConsole(stderr=True, soft_wrap=True, quiet=not _PRIMARY, markup=False)
# On a terminal, long messages wrap between words at its width; into a file or a pipe each stays
# one line (logs are read by grep, not by eye).
for _console in (console, err_console):
    _console.soft_wrap = not _console.is_terminal


def shown(name: object) -> str:
    """A key or path as one line of safe text (newlines escaped too)."""
    return escaped(str(name))


_JSON_BLOCK = 1 << 16


def print_json(data: Any, *, compact: bool = False) -> None:
    """One JSON document on stdout (``compact``: on one line, as a JSON-lines stream); notes and
    warnings in it name flags (:func:`cli_json`)."""
    if not _PRIMARY:
        return
    # written as it is encoded: a report of many tensors is never one string (ema_ckpt.streamed)
    encoder = json.JSONEncoder(indent=None if compact else 2, default=str)
    pending: list[str] = []
    size = 0
    for part in encoder.iterencode(cli_json(data)):
        pending.append(part)
        size += len(part)
        if size >= _JSON_BLOCK:
            sys.stdout.write("".join(pending))
            pending.clear()
            size = 0
    sys.stdout.write("".join(pending) + "\n")
    sys.stdout.flush()


def note(*messages: str) -> None:
    """Notes of a result, on stderr, naming flags."""
    for message in messages:
        err_console.print(cli_text(message), style="dim", highlight=False)


def warn(*messages: str) -> None:
    """Warnings of a result, on stderr, naming flags."""
    for message in messages:
        err_console.print(f"warning: {cli_text(message)}", style="yellow", highlight=False)


def error(message: str, **options: Any) -> None:
    """An error line on stderr: ``error: message``."""
    err_console.print(f"error: {message}", style="red", highlight=False, **options)


def folded(out: object, steps: list[int]) -> str:
    """``out: folded steps 10, 20``, as accumulate and watch say a fold."""
    return f"{shown(out)}: folded {'step' if len(steps) == 1 else 'steps'} {', '.join(map(str, steps))}"


class _Figure(ProgressColumn):
    """A column of figures, ``text(task)`` (in ``style`` unless styled): never wrapped or cut (the bar gives
    way instead)."""

    def __init__(self, text: Callable[[Task], str | Text], style: str = "none") -> None:
        super().__init__(table_column=Column(no_wrap=True))
        self.text, self.style = text, style

    def render(self, task: Task) -> Text:
        text = self.text(task)
        return text if isinstance(text, Text) else Text(text, style=self.style)


def _bytes(task: Task) -> str | Text:
    """``12.5 MiB / 1.2 GiB`` (binary units, as the summaries), or what happens before the total is known."""
    if task.total is None:
        return Text("planning…", style="progress.description")
    return f"{human_bytes(task.completed)} / {human_bytes(task.total)}"


def _speed(task: Task) -> str:
    speed = task.finished_speed or task.speed
    return "" if speed is None else f"{human_bytes(speed)}/s"


def _eta(task: Task) -> str:
    """Time left, ``0:01:05``; nothing until it can be estimated (never ``-:--:--``)."""
    left = task.time_remaining
    if task.total is None or left is None:
        return ""
    minutes, seconds = divmod(int(left), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


@contextmanager
def progress_bar(description: str, *, enabled: bool) -> Iterator[Callable[[EngineProgress], None] | None]:
    """A byte progress bar fed by the engine's callback, or None when disabled.

    Until the run has planned its work the bar pulses beside "planning…"; the first report
    (sent before any region is read) gives it its total.
    """
    if not enabled or not err_console.is_terminal:
        yield None
        return
    columns = (
        TextColumn("{task.description}", table_column=Column(no_wrap=True)),
        BarColumn(bar_width=None),  # the bar takes what the figures leave: they are never cut at 80 columns
        _Figure(_bytes, "progress.download"),
        _Figure(_speed, "progress.data.speed"),
        _Figure(lambda task: "" if task.total is None else task.fields["regions"]),
        _Figure(_eta, "progress.remaining"),
    )
    with Progress(*columns, console=err_console, transient=True, expand=True) as bar:
        task = bar.add_task(description, total=None, regions="")

        def update(p: EngineProgress) -> None:
            bar.update(task, completed=p.bytes_done, total=p.bytes_total,
                       regions=f"{p.regions_done}/{plural(p.regions_total, 'region')}")

        yield update


def human_bytes(n: float) -> str:
    """A byte count in binary units, the one formatter of every count shown.

    Example:
        >>> human_bytes(512), human_bytes(471_040), human_bytes(3 << 30)
        ('512 B', '460.0 KiB', '3.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def exact_bytes(n: int) -> str:
    """A size and its exact count: ``926.3 KiB (948,528 bytes)``."""
    return f"{human_bytes(n)} ({n:,} bytes)"


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and the word, singular or plural: ``1 file``, ``3 files``, ``2 indexes``.

    Example:
        >>> plural(1, "shard"), plural(6, "shard"), plural(0, "key")
        ('1 shard', '6 shards', '0 keys')
    """
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


def files_written(files: int, total: int) -> str:
    """What a run wrote, counted on disk: ``460.0 KiB written in 5 files``."""
    return f"{human_bytes(total)} written in {plural(files, 'file')}"
