"""A folder's changes from Linux's inotify, through libc (no package): what wakes ``watch``.

Only wake-ups come from here, never decisions: ``watch`` rescans the folder after an event
or after its interval, whichever comes first, so a lost or merged event costs at most one
interval. Subfolders created in the folder are watched too (a checkpoint's files are written
inside its own folder).

Example:
    >>> import tempfile; from pathlib import Path
    >>> ckpts = Path(tempfile.mkdtemp()); watcher = Watcher(ckpts)
    >>> watcher.wait(0.0)                   # nothing happened yet
    False
    >>> (ckpts / "step_100").mkdir(); watcher.wait(30.0)   # returns at the event
    True
    >>> watcher.close()
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import struct
import sys
from pathlib import Path

_IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x8, 0x80, 0x100, 0x200
_IN_ISDIR = 0x40000000
_IN_NONBLOCK, _IN_CLOEXEC = 0o4000, 0o2000000
_MASK = _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
_EVENT = struct.Struct("iIII")


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's among them (no ldconfig run)
    return libc if hasattr(libc, "inotify_init1") else None


class Watcher:
    """Events of one folder and the subfolders created in it. Where inotify is missing or refused
    (or ``folder`` is None: poll), a wait lasts its whole time unless :meth:`interrupt` ends it."""

    def __init__(self, folder: Path | None) -> None:
        self._libc = _libc() if folder is not None else None
        self._fd = -1 if self._libc is None else int(self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
        self._folders: dict[int, Path] = {}
        self._wake_read, self._wake_write = os.pipe()
        self._top = self._add(folder) if folder is not None and self._fd >= 0 else -1
        if folder is not None and self._top >= 0:
            with contextlib.suppress(OSError):
                for child in folder.iterdir():
                    if child.is_dir() and not child.name.startswith("."):
                        self._add(child)

    def _add(self, folder: Path) -> int:
        assert self._libc is not None
        wd = int(self._libc.inotify_add_watch(self._fd, os.fsencode(folder), _MASK))
        if wd >= 0:
            self._folders[wd] = folder
        return wd

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for an event; whether one came (drained, new subfolders watched)."""
        ready, _, _ = select.select([fd for fd in (self._fd, self._wake_read) if fd >= 0], [], [], max(0.0, seconds))
        if self._fd >= 0 and self._fd in ready:
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
            if fd >= 0:
                os.close(fd)
        self._fd = -1
