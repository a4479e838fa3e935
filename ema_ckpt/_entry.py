"""The ``ema-ckpt`` console script's entry point, kept apart from the CLI package.

Worker processes that ``--workers N`` spawns re-import the parent's main script; pointing
the script here instead of at :mod:`ema_ckpt.cli` spares each of them importing Typer, rich
and every command (about 0.15 s before a worker can join the group).
"""

from __future__ import annotations


def main() -> None:
    """Run the ``ema-ckpt`` command line (see :func:`ema_ckpt.cli.main`)."""
    from .cli import main as cli_main

    cli_main()
