"""Bytes read at offsets wherever they live: the one place that opens data for reading.

A :class:`Source` reads by ranges everywhere and, where the bytes are a local file, offers a
memory map, a descriptor and a name; a reader asks for the capability it wants and takes the
ranged path when it is None, never asking where the bytes are.

Example:
    >>> import tempfile; p = Path(tempfile.mkdtemp()) / "x"; _ = p.write_bytes(b"PK\\x03\\x04")
    >>> with open_readable(p) as source:
    ...     source.pread(2, 0), bytes(source.mapped()[2:])
    (b'PK', b'\\x03\\x04')
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TypeAlias

from .._crc import crc32
from .object_paths import RemotePath

BlockChecksums: TypeAlias = "tuple[int, dict[int, int]]"
"""(block size, {block index: CRC-32}) of the blocks of a file read so far."""


class Source:
    """A file read at offsets. ``fences``: sorted offsets a small ranged read is never extended
    past (a zip's member starts, once known)."""

    size: int
    fences: list[int]

    def readinto(self, view: memoryview, offset: int) -> int:
        """Bytes at ``offset`` into ``view`` (fewer where the file ends, or a short local read); their count."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def pread(self, length: int, offset: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (fewer where the file ends)."""
        out = bytearray(max(0, min(length, self.size - offset)))
        view, done = memoryview(out), 0
        while done < len(out) and (n := self.readinto(view[done:], offset + done)) > 0:
            done += n
        return bytes(out[:done])

    def fill(self, view: memoryview, offset: int) -> bool:
        """Fill ``view`` with the bytes at ``offset``; False when the file ends first."""
        done, total = 0, len(view)
        while done < total:
            n = self.readinto(view[done:], offset + done)
            if n <= 0:
                return False
            done += n
        return True

    def fd(self) -> int | None:
        """An OS descriptor on the bytes (``copy_file_range``, ``preadv``), or None."""
        return None

    def mapped(self) -> memoryview | None:
        """The whole file memory-mapped, read-only, or None."""
        return None

    def name(self) -> str | None:
        """A name for a loader that opens the file itself (``torch.load(mmap=True)``), or None."""
        return None

    def block_checksums(self) -> BlockChecksums | None:
        """The CRC-32s of the blocks fetched so far, where kept; None: :meth:`crc32` reads again."""
        return None

    def crc32(self, known: Iterable[BlockChecksums] = ()) -> int:
        """The whole file's CRC-32 (a source fetched in blocks uses the blocks' CRC-32s and those
        ``known`` by other readers)."""
        return streamed_crc32(self)[1]

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class LocalFile(Source):
    """A local regular file: ``preadv`` on a descriptor, a memory map made when first asked.

    Raises:
        OSError: the file cannot be opened, or is not a regular file.
    """

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO does not block
        info = os.fstat(self._fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(self._fd)
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        self.size = info.st_size
        self.fences = []
        self._path = path
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()

    def readinto(self, view: memoryview, offset: int) -> int:
        return os.preadv(self._fd, [view], offset)

    def pread(self, length: int, offset: int) -> bytes:
        parts = []
        while length > 0 and (part := os.pread(self._fd, length, offset)):  # a local read may come short
            parts.append(part)
            length, offset = length - len(part), offset + len(part)
        return b"".join(parts)

    def fd(self) -> int | None:
        return self._fd

    def name(self) -> str | None:
        return os.fspath(self._path)

    def mapped(self) -> memoryview | None:
        if self._map is None and self.size:
            with self._lock:
                if self._map is None:
                    self._map = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_READ)
        return memoryview(self._map) if self._map is not None else None

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view of it is still referenced: unmapped with the last
                self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_readable(path: Path | RemotePath, *, size: int | None = None,
                  window: tuple[int, int] | None = None, checksums: bool = False) -> Source:
    """``path`` opened for its data: a :class:`LocalFile`, or an object read by blocks with
    read-ahead (``size``, when known, saves a request; ``window``: the only bytes requested;
    ``checksums``: keep the blocks' CRC-32s for :meth:`Source.crc32`).

    Raises:
        OSError: a local file that cannot be opened, or is not a regular file.
    """
    if isinstance(path, RemotePath):
        from .object_reads import RemoteFile

        return RemoteFile(path, size=size, window=window, checksums=checksums)
    return LocalFile(path)


def open_structure(path: Path | RemotePath, *, size: int | None = None) -> Source:
    """``path`` opened for a few small reads of its structure: exact ranged requests in a store.

    Raises:
        OSError: a local file that cannot be opened.
    """
    if isinstance(path, RemotePath):
        from .object_reads import RangedReads

        return RangedReads(path, size=size)
    return LocalFile(path)


def streamed_crc32(source: Source, block_bytes: int = 8 << 20) -> tuple[int, int]:
    """(size, CRC-32) of ``source``, read front to back in blocks of ``block_bytes``."""
    view = memoryview(bytearray(max(1, block_bytes)))
    crc = size = 0
    while n := source.readinto(view, size):
        crc = crc32(view[:n], crc)
        size += n
    return size, crc


__all__ = ["BlockChecksums", "LocalFile", "Source", "open_readable", "open_structure", "streamed_crc32"]
