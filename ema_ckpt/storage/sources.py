"""Ranged reads of a file wherever it lives: the one place that opens data for reading.

A reader gets a :data:`Readable`: a local descriptor (``int``: ``os.pread``, a memory map,
``copy_file_range`` all work on it), or a :class:`Source` read by ranged requests (an object
in a store). :func:`pread` and :func:`pread_into` read either; only a fast path that needs a
local descriptor checks ``isinstance(readable, int)``.

Example:
    >>> import tempfile; p = Path(tempfile.mkdtemp()) / "x"; _ = p.write_bytes(b"PK\\x03\\x04")
    >>> fd = open_readable(p)
    >>> pread(fd, 2, 0)
    b'PK'
    >>> close_readable(fd)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, TypeAlias

from .._crc import crc32
from .object_paths import RemotePath
from .object_reads import RangedReads, RemoteFile


class Source(Protocol):
    """A file read at offsets by requests (:class:`RemoteFile`, :class:`RangedReads`)."""

    size: int

    def pread(self, length: int, offset: int) -> bytes: ...

    def readinto(self, view: memoryview, offset: int) -> int: ...

    def close(self) -> None: ...


class StructureReads(Source, Protocol):
    """A :class:`Source` for the small reads of a file's structure. ``fences``: sorted offsets
    a read is never extended past (the starts of a zip's members, once known)."""

    fences: list[int]


class LocalReads:
    """A local file as a :class:`StructureReads` (``pread`` on a descriptor; nothing is kept)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        self.fences: list[int] = []

    def pread(self, length: int, offset: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def readinto(self, view: memoryview, offset: int) -> int:
        return os.preadv(self.fd, [view], offset)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


Readable: TypeAlias = "int | Source"
"""A local descriptor, or a :class:`Source`."""


def open_readable(path: Path | RemotePath, *, flags: int = 0, size: int | None = None,
                  window: tuple[int, int] | None = None, checksums: bool = False) -> Readable:
    """``path`` opened for reading its data: a local descriptor (``flags`` added to
    ``O_RDONLY | O_CLOEXEC``), or an object read by blocks with read-ahead (``size`` when
    known saves a request; ``window``: the only bytes ever requested; ``checksums``: keep
    each block's CRC-32 for :meth:`RemoteFile.crc32`).

    Raises:
        OSError: a local file that cannot be opened.
    """
    if isinstance(path, RemotePath):
        return RemoteFile(path, size=size, window=window, checksums=checksums)
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)


def open_structure(path: Path | RemotePath, *, size: int | None = None) -> StructureReads:
    """``path`` opened for a few small, scattered reads of its structure (a zip directory, a
    pickle, headers): exact ranged requests in a store, no blocks or read-ahead.

    Raises:
        OSError: a local file that cannot be opened.
    """
    if isinstance(path, RemotePath):
        return RangedReads(path, size=size)
    return LocalReads(path)


BlockChecksums: TypeAlias = "tuple[int, dict[int, int]]"
"""(block size, {block index: CRC-32}) of the blocks of a file read so far."""


def blocks_read(readable: Readable) -> BlockChecksums | None:
    """The CRC-32s of the blocks ``readable`` fetched (opened with ``checksums=True``); None for a
    local descriptor, which :func:`whole_crc32` reads again from the page cache instead."""
    return readable.block_checksums() if isinstance(readable, RemoteFile) else None


def whole_crc32(readable: Readable, known: Iterable[BlockChecksums] = ()) -> int:
    """The whole file's CRC-32: in a store from the blocks fetched so far and those ``known`` by
    other readers of it (:func:`blocks_read`), requesting only the blocks none fetched; a local
    file is streamed."""
    if isinstance(readable, RemoteFile):
        return readable.crc32(known)
    if not isinstance(readable, int):
        raise TypeError(f"{readable!r}: no checksums of its reads")
    return streamed_crc32(readable)[1]


def streamed_crc32(source: Readable, block_bytes: int = 8 << 20) -> tuple[int, int]:
    """(size, CRC-32) of everything ``source`` holds, read once front to back in blocks of
    ``block_bytes`` (memory stays bounded by one block)."""
    view = memoryview(bytearray(max(1, block_bytes)))
    crc = size = 0
    while n := (os.preadv(source, [view], size) if isinstance(source, int) else source.readinto(view, size)):
        crc = crc32(view[:n], crc)
        size += n
    return size, crc


def readable_size(readable: Readable) -> int:
    """The size of what ``readable`` reads."""
    return os.fstat(readable).st_size if isinstance(readable, int) else readable.size


def close_readable(readable: Readable) -> None:
    """Close a local descriptor or a :class:`Source`."""
    if isinstance(readable, int):
        os.close(readable)
    else:
        readable.close()


def pread(source: Readable, length: int, offset: int) -> bytes:
    """``os.pread`` of a local descriptor, or a ranged read of a :class:`Source`."""
    if isinstance(source, int):
        return os.pread(source, length, offset)
    return source.pread(length, offset)


def pread_into(source: Readable, view: memoryview, offset: int) -> bool:
    """Fill ``view`` from ``source`` at ``offset``; False when the file ends first."""
    if not isinstance(source, int):
        return source.readinto(view, offset) == len(view)
    done = 0
    total = len(view)
    while done < total:
        n = os.preadv(source, [view[done:]], offset + done)
        if n <= 0:
            return False
        done += n
    return True


__all__ = [
    "BlockChecksums",
    "Readable",
    "Source",
    "StructureReads",
    "blocks_read",
    "close_readable",
    "open_readable",
    "open_structure",
    "pread",
    "pread_into",
    "readable_size", "streamed_crc32",
    "whole_crc32",
]
