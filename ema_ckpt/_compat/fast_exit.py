"""Ending the process once its work is done, without interpreter teardown.

**Relies on** CPython's private ``atexit._run_exitfuncs()``: it runs the registered exit
handlers (last registered first) and clears them, as the interpreter does when it exits.

**Why it pays:** tearing down an interpreter that has loaded torch (its modules, their
objects, the thread pools) takes a noticeable share of a short command (docs/performance.md)
and does nothing a finished command needs. So
:func:`exit_now` runs the exit handlers, flushes the standard streams and calls
``os._exit``. Unlike a normal exit it does not wait for non-daemon threads.

**When it is gone:** :func:`exit_now` calls ``sys.exit(code)``, the normal exit, at the
normal cost.

Example:
    >>> exit_now(0)  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

FLUSH_FAILED_EXIT = 120
"""The exit status when the final flush of stdout or stderr fails, as CPython's own."""


def exit_now(code: int) -> NoReturn:
    """End the process with ``code``: exit handlers run, stdout and stderr flushed first.

    A flush that fails (a closed pipe, a full disk: the output was lost) turns an exit
    status of 0 into :data:`FLUSH_FAILED_EXIT`.
    """
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
