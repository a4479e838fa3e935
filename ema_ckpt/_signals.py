"""SIGTERM handled like Ctrl-C: the work unwinds, staging is removed, one line is printed.

Slurm, systemd, Kubernetes and ``timeout`` stop a job with SIGTERM, whose default action ends
the process on the spot, leaving staging directories behind and saying nothing. Here it
raises :class:`Terminated` (a ``KeyboardInterrupt``) in the main thread instead, so every
``finally`` and every cleanup that handles Ctrl-C runs; the CLI then exits 143 (128 + 15).

Example:
    >>> install()   # doctest: +SKIP
"""

from __future__ import annotations

import signal
import threading
from typing import Any

TERMINATED_EXIT = 143
INTERRUPTED_EXIT = 130


class Terminated(KeyboardInterrupt):
    """The process was asked to stop with SIGTERM."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signum}")


def install() -> None:
    """Turn SIGTERM into :class:`Terminated` (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """143 for SIGTERM, 130 for Ctrl-C."""
    return TERMINATED_EXIT if isinstance(interrupt, Terminated) else INTERRUPTED_EXIT
