"""The ``ema-ckpt`` console script's entry point, kept apart from the CLI package.

Worker processes that ``workers=N`` spawns re-import the parent's main script; pointing
the script here instead of at :mod:`ema_ckpt.cli` spares each of them importing Typer, rich
and every command before a worker can join the group.
"""

from __future__ import annotations

import contextlib
import sys

from . import _gc, _signals

_MOST_STARTED_AHEAD = 64
"""More workers than this start when the command asks for them, not ahead of it."""


def workers_requested(args: list[str]) -> int:
    """The ``--workers``/``-j`` count of a command line that will run a job, as far as its words
    show before Typer has parsed them; 1 when unsure (the command then starts its workers itself).

    Example:
        >>> workers_requested(["average", "ckpts", "--last", "4", "--workers", "2"])
        2
        >>> workers_requested(["accumulate", "ckpts", "-j4", "--dry-run"])
        1
    """
    count = 1
    for index, word in enumerate(args):
        if word == "--":
            break
        if word in ("--help", "-h", "--dry-run", "--version"):
            return 1
        value: str | None = None
        if word in ("--workers", "-j") and index + 1 < len(args):
            value = args[index + 1]
        elif word.startswith("--workers="):
            value = word.partition("=")[2]
        elif word.startswith("-j") and len(word) > 2 and word[2:].isascii() and word[2:].isdigit():
            value = word[2:]
        if value is not None:
            count = int(value) if value.isascii() and value.isdigit() else 1
    return count if count <= _MOST_STARTED_AHEAD else 1


def main() -> None:
    """Run the ``ema-ckpt`` command line; SIGTERM and Ctrl-C end it with one line and exit
    143 / 130 at any moment, even while modules are imported (:mod:`ema_ckpt._signals`)."""
    _signals.install()  # here, not at import: the workers it spawns re-import this module
    _gc.own_the_heap()  # this process is the command's: its imports may be set aside (ema_ckpt._gc)
    workers = workers_requested(sys.argv[1:])
    if workers > 1:  # they start while the command line loads (ema_ckpt.dist.pool.start_standby_workers)
        from .dist.pool import start_standby_workers

        with contextlib.suppress(Exception):  # only a head start: the run starts its workers itself
            start_standby_workers(workers - 1)
    from .cli import main as cli_main  # a signal meanwhile is recorded: see _signals

    cli_main()
