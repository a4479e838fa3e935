"""Waiting in tests for a condition, never for a guessed number of seconds.

A test that needs another thread or process to have reached some point polls for a sign of it
(a file, a line, a process state) with a deadline long enough that only a stuck run reaches
it: a loaded machine may take many times longer than an idle one, never forever.

Example::

    wait_for(lambda: (out / "ema-ckpt.json").exists(), what="the first fold")
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

DEADLINE = 120.0
"""Seconds a wait lasts before the test fails: far past anything a loaded machine needs."""


def wait_for(condition: Callable[[], object], timeout: float = DEADLINE, what: str = "a condition",
             *, every: float = 0.02) -> None:
    """Poll ``condition`` every ``every`` seconds until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def holds_open(pid: int, path: Path) -> bool:
    """The process ``pid`` has ``path`` open (one of its descriptors in ``/proc`` names that file)."""
    target = os.stat(path) if path.exists() else None
    if target is None:
        return False
    fds = Path(f"/proc/{pid}/fd")
    try:
        entries = list(fds.iterdir())
    except OSError:
        return False
    for entry in entries:
        try:
            found = os.stat(entry)
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


def has_pending_connection(listening: socket.socket) -> bool:
    """A client has connected to ``listening`` and waits in its accept queue (nothing is accepted)."""
    readable, _, _ = select.select([listening], [], [], 0)
    return bool(readable)


def listening_on(port: int) -> bool:
    """Some process on this machine listens on TCP ``port`` (read from ``/proc/net/tcp*``, no connection made)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                return True
    return False


@contextlib.contextmanager
def ending(process: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """The block's ``process``, killed (and its pipes drained) if it still runs when the block
    ends: a test that fails while waiting on a child leaves no child behind."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
