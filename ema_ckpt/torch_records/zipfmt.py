"""The zip layer of ``torch.save`` records: struct layouts, locating members, file windows.

A DCP data file holds many such zips back to back; everything here works on a
:class:`~ema_ckpt.storage.Source` plus the record's (offset, length), so one open file serves
every record in it.
"""

from __future__ import annotations

import io
import struct
import zipfile
from typing import Any, NamedTuple

from ..storage import Source

LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
"""Local file header: signature, version, flags, method, time, date, crc, sizes, name/extra lengths."""
CENTRAL_HEADER = struct.Struct("<4sHHHHHHIIIHHHHHII")
"""Central directory entry (the last field is the local header's offset)."""
END_OF_CENTRAL = struct.Struct("<4sHHHHIIH")
"""End of central directory record."""
LOCAL_MAGIC = b"PK\x03\x04"
CENTRAL_MAGIC = b"PK\x01\x02"
END_MAGIC = b"PK\x05\x06"
ZIP32_LIMIT = 0xFFFFFFFF
"""Sizes and offsets at or above this need zip64 records."""

_TAIL_BYTES = 4096


class FileWindow(io.RawIOBase):
    """A read-only, seekable file view of ``[start, start + length)`` of an open descriptor
    (``owns_fd``: closing the window closes it)."""

    def __init__(self, fd: Source, start: int, length: int, *, owns_fd: bool = False) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos, self._owns = fd, start, length, 0, owns_fd

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0
        data = self._fd.pread(n, self._start + self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        if self._owns and not self.closed:
            self._fd.close()
        super().close()


class Member(NamedTuple):
    """A zip member as the central directory lists it: method (0 stored, 8 deflated), data size,
    its local header's offset, CRC-32 (0: saved without one)."""

    method: int
    size: int
    local: int
    crc: int


def scan_record(fd: Source, offset: int, length: int) -> dict[str, Member] | None:
    """{member name: :class:`Member`} of a record's zip, from its tail, in one or two reads; None
    (the zipfile module's case) for a comment, zip64, or a directory before the last 4 KiB."""
    if length < END_OF_CENTRAL.size:
        return None
    tail_len = min(length, _TAIL_BYTES)
    tail = fd.pread(tail_len, offset + length - tail_len)
    if len(tail) != tail_len:
        return None
    fields = END_OF_CENTRAL.unpack_from(tail, tail_len - END_OF_CENTRAL.size)
    sig, _, _, _, entries, cd_size, cd_offset, comment = fields
    if sig != END_MAGIC or comment or entries == 0xFFFF or cd_offset == ZIP32_LIMIT:
        return None
    if cd_offset + cd_size + END_OF_CENTRAL.size > length:  # a zip64 end record may sit in between
        return None
    cd_in_tail = cd_offset - (length - tail_len)
    if cd_in_tail < 0:
        return None
    members: dict[str, Member] = {}
    pos = cd_in_tail
    for _ in range(entries):
        if pos + CENTRAL_HEADER.size > tail_len - END_OF_CENTRAL.size:
            return None
        fields = CENTRAL_HEADER.unpack_from(tail, pos)
        if fields[0] != CENTRAL_MAGIC:
            return None
        method, crc, size, name_len, extra_len, comment_len, local = (
            fields[4], fields[7], fields[9], fields[10], fields[11], fields[12], fields[16])
        if size == ZIP32_LIMIT or local == ZIP32_LIMIT:
            return None
        name = tail[pos + CENTRAL_HEADER.size : pos + CENTRAL_HEADER.size + name_len].decode("utf-8", "replace")
        members[name] = Member(method, size, local, crc)
        pos += CENTRAL_HEADER.size + name_len + extra_len + comment_len
    return members


def member_start(fd: Source, offset: int, length: int, local: int) -> int | None:
    """Where a member's data starts in its record (relative to ``offset``), from its local
    header at ``local``; None if the header is malformed or outside the record."""
    if not 0 <= local <= length - LOCAL_HEADER.size:
        return None
    header = fd.pread(LOCAL_HEADER.size, offset + local)
    if len(header) != LOCAL_HEADER.size or header[:4] != LOCAL_MAGIC:
        return None
    fields = LOCAL_HEADER.unpack(header)
    return int(local + LOCAL_HEADER.size + fields[9] + fields[10])


def stored_members(fd: Source, size: int) -> dict[int, tuple[int, int, str]] | None:
    """{where its data starts: (size, CRC-32, name)} of every uncompressed member of the zip file
    open at ``fd`` (``size`` bytes); None when its directory cannot be read or a member lies
    outside the file."""
    try:
        listed = scan_record(fd, 0, size)
        if listed is None:
            with zipfile.ZipFile(FileWindow(fd, 0, size)) as zf:
                listed = {i.filename: Member(i.compress_type, i.file_size, i.header_offset, i.CRC)
                          for i in zf.infolist()}
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return None
    members: dict[int, tuple[int, int, str]] = {}
    for name, member in listed.items():
        if member.method != zipfile.ZIP_STORED:
            continue
        start = member_start(fd, 0, size, member.local)
        if start is None or start + member.size > size:
            return None
        members[start] = (member.size, member.crc, name)
    return members
