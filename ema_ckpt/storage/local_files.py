"""Local files made durable, and files anywhere streamed once: ``fsync`` of files and folders,
early writeback, (size, CRC-32) of a file, and the files an output holds.

Example:
    >>> import tempfile; p = Path(tempfile.mkdtemp()) / "x"; _ = p.write_bytes(b"abc")
    >>> size_and_crc32(p)
    (3, 891568578)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import OutputError
from .locations import Location, as_path
from .object_paths import RemotePath, remote_files
from .sources import open_readable, streamed_crc32

_SYNC_FILE_RANGE_WRITE = 2


def _fsync(path: str | Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory entry table to disk (after creating or renaming inside it)."""
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def fsync_tree(path: Path) -> None:
    """fsync every regular file under ``path`` and every directory, deepest first."""
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            _fsync(os.path.join(root, name))
        fsync_dir(Path(root))


@functools.cache
def libc_function(name: str, *argtypes: Any) -> Any:
    """libc's ``name`` from the process's own symbols (no ``ldconfig`` run), typed; None where missing."""
    func = getattr(ctypes.CDLL(None, use_errno=True), name, None)
    if func is not None:
        func.argtypes = list(argtypes)
    return func


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a just-written range to disk without waiting (Linux ``sync_file_range``), so
    the closing fsync finds most pages written; a no-op where the call is missing."""
    func = libc_function("sync_file_range", ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    if func is not None and length > 0:
        func(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def output_path(out: str | os.PathLike[str] | RemotePath) -> Location:
    """Where an output is published: ``out``, or its final target when it is a symlink (renaming
    over the link would replace the link, not the output it points to).

    Raises:
        OutputError: the link cannot be followed (a loop), or its target's folder is missing.
    """
    out = as_path(out)
    if isinstance(out, RemotePath) or not out.is_symlink():
        return out
    try:
        target = out.resolve(strict=False)
    except (OSError, RuntimeError) as err:
        raise OutputError(f"{out}: a symlink that cannot be followed ({err})") from None
    if target.is_symlink() or not target.parent.is_dir():
        raise OutputError(f"{out}: a symlink to {target}, whose folder does not exist")
    return target


def size_without_requests(path: Location) -> int | None:
    """The bytes of the files at ``path`` (:func:`files_on_disk`) where that costs no request; else None."""
    return None if isinstance(path, RemotePath) else sum(n for _, n in files_on_disk(path))


def files_on_disk(path: Location) -> list[tuple[str, int]]:
    """(name, size) of every regular file of an output: the file itself, or each file under the
    directory (names relative, sorted; symlinks not followed).

    Example:
        >>> import tempfile; from pathlib import Path
        >>> ema = Path(tempfile.mkdtemp()); _ = (ema / "__0_0.distcp").write_bytes(bytes(96))
        >>> _ = (ema / ".metadata").write_bytes(bytes(17))
        >>> files_on_disk(ema)
        [('.metadata', 17), ('__0_0.distcp', 96)]
    """
    if isinstance(path, RemotePath):
        return remote_files(path)
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return []
    if stat.S_ISREG(st.st_mode):
        return [(path.name, st.st_size)]
    found = []
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            st = os.stat(full, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                found.append((os.path.relpath(full, path), st.st_size))
    return sorted(found)


HASH_BLOCK_BYTES = 8 << 20  # CRC-32s are computed over blocks of this size


def size_and_crc32(file: Location, block_bytes: int = HASH_BLOCK_BYTES) -> tuple[int, int]:
    """``file``'s length and CRC-32 (as :mod:`zlib` computes it), read once."""
    with open_readable(file) as source:
        return streamed_crc32(source, block_bytes)


def replace_file(path: Location, data: bytes) -> None:
    """Put ``data`` at ``path`` atomically: a reader sees the old bytes or the new, never a mix
    (a temporary file fsynced and renamed over it; in object storage, one PUT)."""
    if isinstance(path, RemotePath):
        path.write_bytes(data)
        return
    temp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(temp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    fsync_dir(path.parent)
