"""Ending the process once its work is done, without interpreter teardown.

**Relies on** CPython's private ``atexit._run_exitfuncs()``, which runs the exit handlers and
clears them, as the interpreter does when it exits.

**Why it pays:** tearing down an interpreter that has loaded torch takes a noticeable share of
a short command and does nothing a finished command needs, so :func:`exit_now` runs the exit
handlers, flushes the standard streams and calls ``os._exit`` (not waiting for non-daemon threads).

**When it is gone:** :func:`exit_now` calls ``sys.exit(code)``, the normal exit.

Example:
    >>> exit_now(0)  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

FLUSH_FAILED_EXIT = 120  # the exit status when the final flush fails, as CPython's own


def exit_now(code: int) -> NoReturn:
    """End the process with ``code``, exit handlers run and stdout and stderr flushed first (a
    failed flush turns 0 into :data:`FLUSH_FAILED_EXIT`)."""
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if not callable(run_exit_handlers):
        sys.exit(code)
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            code = code or FLUSH_FAILED_EXIT
    os._exit(code)
