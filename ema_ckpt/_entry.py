"""The ``ema-ckpt`` console script's entry point, kept apart from the CLI package.

Worker processes that ``workers=N`` spawns re-import the parent's main script; pointing
the script here instead of at :mod:`ema_ckpt.cli` spares each of them importing Typer, rich
and every command before a worker can join the group.
"""

from __future__ import annotations

from . import _gc, _signals


def main() -> None:
    """Run the ``ema-ckpt`` command line (see :func:`ema_ckpt.cli.main`).

    SIGTERM and Ctrl-C end it with one line and exit 143 / 130 at any moment, even while
    the modules are still being imported (:mod:`ema_ckpt._signals`).
    """
    _signals.install()  # here, not at import: the workers it spawns re-import this module
    _gc.own_the_heap()  # this process is the command's: its imports may be set aside (ema_ckpt._gc)
    from .cli import main as cli_main  # a signal meanwhile is recorded: see _signals

    cli_main()
