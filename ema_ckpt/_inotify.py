"""A folder's changes from Linux's inotify, through libc (no package): what wakes ``watch``.

Only wake-ups come from here, never decisions: ``watch`` rescans the folder after an event
or after its interval, whichever comes first, so a lost or merged event costs at most one
interval. Subfolders created in the folder are watched too (a checkpoint's files are written
inside its own folder).

Example:
    >>> import tempfile; from pathlib import Path
    >>> ckpts = Path(tempfile.mkdtemp()); watcher = Watcher.open(ckpts)
    >>> watcher.wait(0.0)                   # nothing happened yet
    False
    >>> (ckpts / "step_100").mkdir(); watcher.wait(30.0)   # returns at the event
    True
    >>> watcher.close()
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import struct
import sys
from pathlib import Path

_IN_MODIFY, _IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x2, 0x8, 0x80, 0x100, 0x200
_IN_ISDIR = 0x40000000
_IN_NONBLOCK, _IN_CLOEXEC = 0o4000, 0o2000000
_MASK = _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
_EVENT = struct.Struct("iIII")


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    if not hasattr(libc, "inotify_init1"):
        return None
    return libc


def available() -> bool:
    """Whether this platform offers inotify."""
    return _libc() is not None


class Watcher:
    """Events of one folder and the subfolders created in it."""

    def __init__(self, libc: ctypes.CDLL, fd: int) -> None:
        self._libc = libc
        self._fd = fd
        self._top = -1
        self._folders: dict[int, Path] = {}
        self._wake_read, self._wake_write = os.pipe()

    @classmethod
    def open(cls, folder: Path) -> Watcher | None:
        """A watcher of ``folder``; None where inotify is missing or refused (then: poll)."""
        libc = _libc()
        if libc is None:
            return None
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return None
        watcher = cls(libc, fd)
        watcher._top = watcher._add(folder)
        if watcher._top < 0:
            watcher.close()
            return None
        with contextlib.suppress(OSError):
            for child in folder.iterdir():
                if child.is_dir() and not child.name.startswith("."):
                    watcher._add(child)
        return watcher

    def _add(self, folder: Path) -> int:
        wd = int(self._libc.inotify_add_watch(self._fd, os.fsencode(folder), _MASK))
        if wd >= 0:
            self._folders[wd] = folder
        return wd

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for an event; whether one came (drained, new subfolders watched)."""
        ready, _, _ = select.select([self._fd, self._wake_read], [], [], max(0.0, seconds))
        if self._fd in ready:
            self._drain()
        return bool(ready)

    def interrupt(self) -> None:
        """End a :meth:`wait` in progress at once (from another thread)."""
        os.write(self._wake_write, b"x")

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                return
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size: offset + _EVENT.size + length].rstrip(b"\0")
                offset += _EVENT.size + length
                new_folder = mask & _IN_ISDIR and mask & (_IN_CREATE | _IN_MOVED_TO)
                if new_folder and wd == self._top and name and not name.startswith(b"."):
                    self._add(self._folders[wd] / os.fsdecode(name))

    def close(self) -> None:
        """Close the watch (after the thread that waits on it has ended)."""
        for fd in (self._fd, self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fd = -1
