"""Terminal output: results on stdout, messages and progress on stderr.

Progress bars show only on an interactive terminal and never with ``--json`` or
``--quiet``, so cron logs and scripts get clean output.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

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


def shown(name: object) -> str:
    """A key or path as one line of safe text (newlines escaped too)."""
    return escaped(str(name))


def print_json(data: Any) -> None:
    """One JSON document on stdout; notes and warnings in it name flags (:func:`cli_json`)."""
    if not _PRIMARY:
        return
    sys.stdout.write(json.dumps(cli_json(data), indent=2, default=str) + "\n")
    sys.stdout.flush()


def note(message: str) -> None:
    """A note of a result, on stderr, naming flags."""
    err_console.print(cli_text(message), style="dim", highlight=False)


def warn(message: str) -> None:
    """A warning of a result, on stderr, naming flags."""
    err_console.print(f"warning: {cli_text(message)}", style="yellow", highlight=False)


@contextmanager
def progress_bar(description: str, *, enabled: bool) -> Iterator[Callable[[EngineProgress], None] | None]:
    """A byte progress bar fed by the engine's callback, or None when disabled."""
    if not enabled or not err_console.is_terminal:
        yield None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[regions]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task(description, total=None, regions="")

        def update(p: EngineProgress) -> None:
            bar.update(task, completed=p.bytes_done, total=p.bytes_total,
                       regions=f"{p.regions_done}/{p.regions_total} regions")

        yield update


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
