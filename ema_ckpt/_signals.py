"""Ctrl-C and SIGTERM at any moment: one line, the staging removed, exit 130 / 143.

SIGTERM (Slurm, systemd, Kubernetes, ``timeout``) would end the process on the spot, staging
left behind, and Ctrl-C while modules import or Click parses prints a traceback or "Aborted!".
So the console script (alone: importing ema-ckpt as a library changes nothing) handles both:

- outside a command's body (starting up, parsing, exiting) a signal is only recorded;
- inside it (see :func:`armed`) the signal raises :class:`Terminated` or ``KeyboardInterrupt``
  in the main thread, so every ``finally`` and every cleanup runs, and the command's error
  handling prints one line; a signal recorded before the body starts is raised on entry;
- while a module is being imported, the signal is delivered again a moment later instead:
  an extension's initialisation (torch's) calls back into Python from C++, and an exception
  raised there cannot unwind through it, so the process would abort (SIGABRT) instead.

Example:
    >>> install()                  # doctest: +SKIP
    >>> with armed():              # doctest: +SKIP
    ...     run_the_command()
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, TypedDict

TERMINATED_EXIT = 143
INTERRUPTED_EXIT = 130


class _State(TypedDict):
    armed: bool  # inside a command's body: a signal raises
    deferred: Callable[[int], None] | None  # inside deferring(): the first signal calls this instead
    pending: int | None  # a signal recorded outside it
    entered: bool  # the body has begun
    raised: int | None  # a signal raised inside the body


_state: _State = {"armed": False, "deferred": None, "pending": None, "entered": False, "raised": None}
_redelivering: dict[str, int | None] = {"signum": None}
"""The signal being sent again while an import runs (None: none)."""


class Terminated(KeyboardInterrupt):
    """The process was asked to stop with SIGTERM."""


def _interrupt(signum: int) -> KeyboardInterrupt:
    return Terminated(f"signal {signum}") if signum == signal.SIGTERM else KeyboardInterrupt()


_REDELIVERY_DELAY_S = 0.02
_IMPORTING = "<frozen importlib._bootstrap"


def _importing(frame: types.FrameType | None) -> bool:
    """Whether the interrupted code runs inside an ``import`` (any frame of the import system)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_IMPORTING):
            return True
        frame = frame.f_back
    return False


def _deliver_again(signum: int) -> None:
    """Send ``signum`` to the main thread every few milliseconds, from a helper thread, until
    the handler takes it (see :func:`_handler`). Again and again, not once: a signal that lands
    after the interpreter's last look and before a blocking call (a sleep, a read) would wait
    for that call to end; the next one interrupts it."""
    main = threading.main_thread().ident
    sending = _redelivering["signum"] is not None  # a helper is already at it
    _redelivering["signum"] = signum
    if sending or main is None:
        return

    def resend() -> None:
        while True:
            time.sleep(_REDELIVERY_DELAY_S)
            pending = _redelivering["signum"]
            if pending is None:
                return
            signal.pthread_kill(main, pending)

    threading.Thread(target=resend, name="ema-ckpt-signal", daemon=True).start()


def _handler(signum: int, frame: Any) -> None:
    deferred = _state["deferred"]
    if deferred is not None:
        _state["deferred"] = None  # a second signal interrupts as usual
        _redelivering["signum"] = None  # taken: no more of it is sent
        deferred(signum)
        return
    if _state["armed"] and _importing(frame):
        _deliver_again(signum)  # raised once the import is done (see the module's docstring)
        return
    _redelivering["signum"] = None  # taken: no more of it is sent
    if _state["armed"]:
        _state["armed"] = False  # a second signal during cleanup is recorded, not raised again
        _state["raised"] = signum
        raise _interrupt(signum)
    if _state["pending"] is None:
        _state["pending"] = signum


def install() -> None:
    """Handle SIGINT and SIGTERM as described above (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _handler)


@contextlib.contextmanager
def armed() -> Iterator[None]:
    """Let signals interrupt the block (a command's body); one recorded before it is raised now."""
    _state["entered"] = True
    pending = _state["pending"]
    if pending is not None:
        _state["pending"] = None
        raise _interrupt(pending)
    _state["armed"] = True
    try:
        yield
    finally:
        _state["armed"] = False


@contextlib.contextmanager
def deferring(on_signal: Callable[[int], None]) -> Iterator[None]:
    """Inside the block, the first SIGINT or SIGTERM calls ``on_signal`` (a loop's request to
    stop after the work in hand) instead of interrupting; a second one interrupts as usual."""
    _state["deferred"] = on_signal
    try:
        yield
    finally:
        _state["deferred"] = None


def pending() -> int | None:
    """A signal recorded outside a command's body, if any."""
    return _state["pending"]


def raised() -> KeyboardInterrupt | None:
    """The interrupt a signal raised inside the body, if one did. Code ema-ckpt does not own
    may swallow it (a half-done ``import torch`` then fails again with another error): the
    run still ends as that signal asked."""
    signum = _state["raised"]
    return None if signum is None else _interrupt(signum)


def entered() -> bool:
    """Whether a command's body has begun (see :func:`armed`)."""
    return bool(_state["entered"])


def exit_code(interrupt: KeyboardInterrupt | int) -> int:
    """143 for SIGTERM, 130 for Ctrl-C (an exception or a signal number)."""
    if isinstance(interrupt, int):
        return TERMINATED_EXIT if interrupt == signal.SIGTERM else INTERRUPTED_EXIT
    return TERMINATED_EXIT if isinstance(interrupt, Terminated) else INTERRUPTED_EXIT
