"""Checking the bytes read from ``torch.save`` zips against the CRC-32s their directories store.

Each storage is one uncompressed zip member whose CRC-32 the zip's directory holds. A reader
registers the members it reads (:meth:`ReadChecks.expect`) and hands each span it reads to
:meth:`ReadChecks.saw`; spans are joined with ``crc32_combine`` until they cover their member,
which is then compared (:class:`~ema_ckpt.errors.RecordChecksumError`). A member read only in
part is settled at the end of the run (:func:`settle_reads`). Members stored with CRC 0 are not
checked.

Example:
    >>> from ema_ckpt._crc import crc32
    >>> checks = ReadChecks(lambda file: file, lambda file, n, offset: b"")
    >>> checks.expect("f", 100, 4, crc32(b"abcd"), "key 'w'")
    >>> checks.saw("f", 100, b"ab"); checks.pending()[("f", 100)][3] == [(0, 2, crc32(b"ab"))]
    True
    >>> checks.saw("f", 102, b"cd"); checks.pending(), checks.checked_bytes
    ({}, 4)
    >>> checks.expect("f", 200, 2, crc32(b"ok"), "key 'v'")
    >>> checks.saw("f", 200, b"\\0\\0")                      # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    RecordChecksumError: f: key 'v': the 2 bytes stored at offset 200 do not match their CRC-32 ...
"""

from __future__ import annotations

import array
import bisect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._crc import crc32, crc32_combine
from ..errors import CheckpointFormatError, RecordChecksumError
from .zipfmt import stored_members

if TYPE_CHECKING:
    from ..dist import Workers
    from ..storage import Location, Source

Span = tuple[int, int, int]
"""(start, end, CRC-32) of bytes read, relative to their member's first byte."""
Pending = dict[tuple[str, int], tuple[int, int, str, list[Span]]]
"""{(file, member start): (member size, stored CRC-32, key, spans read)} of members read in part."""

_GAP_BLOCK = 8 << 20  # bytes nobody read are read back in blocks of this size when a member is settled


@dataclass(slots=True)
class _Member:
    size: int
    crc: int
    what: str
    spans: list[Span] = field(default_factory=list)


class _Starts:
    """A set of file offsets in 8 bytes each (a ``set`` of ints costs about 70)."""

    __slots__ = ("_sorted",)

    def __init__(self) -> None:
        self._sorted = array.array("q")

    def __contains__(self, start: int) -> bool:
        at = bisect.bisect_left(self._sorted, start)
        return at < len(self._sorted) and self._sorted[at] == start

    def add(self, start: int) -> None:
        found = self._sorted
        if not found or found[-1] < start:  # records are read in order, mostly
            found.append(start)
        elif start not in self:
            found.insert(bisect.bisect_left(found, start), start)


class ReadChecks:
    """The members of one checkpoint's zips that have checksums, and what has been read of them
    (thread-safe). ``name(file)`` is what errors call ``file``; ``read(file, n, offset)`` reads
    the bytes a member still lacks when it is settled."""

    def __init__(self, name: Callable[[str], str | Location], read: Callable[[str, int, int], bytes]) -> None:
        self._name, self._read = name, read
        self._members: dict[str, dict[int, _Member]] = {}
        self._starts: dict[str, list[int]] = {}
        self._done: dict[str, _Starts] = {}  # members checked, by file
        self._lock = threading.Lock()
        self.checked_bytes = 0
        """Bytes of members found intact so far."""

    def expect(self, file: str, start: int, size: int, crc: int, what: str) -> None:
        """Member data ``[start, start + size)`` of ``file`` has CRC-32 ``crc``; ``what`` names it
        in messages (``key 'fc.weight'``)."""
        if size <= 0 or crc == 0:  # nothing stored, or saved without checksums
            return
        with self._lock:
            members = self._members.setdefault(file, {})
            done = self._done.get(file)
            if start in members or (done is not None and start in done):
                return
            members[start] = _Member(size, crc, what)
            bisect.insort(self._starts.setdefault(file, []), start)

    def wants(self, file: str, offset: int, length: int) -> bool:
        """Whether bytes ``[offset, offset + length)`` of ``file`` lie in a member still to be checked."""
        with self._lock:
            return self._first_member(file, offset, offset + length) is not None

    def saw(self, file: str, offset: int, data: Any) -> None:
        """Bytes ``data`` were read from ``file`` at ``offset`` (``RecordChecksumError`` when a
        member they complete does not match)."""
        view = memoryview(data).cast("B")
        end = offset + len(view)
        with self._lock:
            pos = offset
            while pos < end:
                found = self._first_member(file, pos, end)
                if found is None:
                    return
                start, member = found
                a, b = max(pos, start), min(end, start + member.size)
                self._add(file, start, member, a - start, b - start, view[a - offset:b - offset])
                pos = b

    def fill(self, source: Source, file: str, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes of ``file`` (open at ``source``) at ``offset``, then :meth:`saw` them."""
        if not source.fill(view, offset):
            raise CheckpointFormatError(self._name(file), f"truncated: expected {len(view)} bytes at offset {offset}")
        self.saw(file, offset, view)

    def pending(self) -> Pending:
        """The members read in part, for :func:`settle_reads`."""
        with self._lock:
            return {(file, start): (m.size, m.crc, m.what, list(m.spans))
                    for file, members in self._members.items() for start, m in members.items() if m.spans}

    def settle(self, parts: Sequence[Pending]) -> None:
        """Compare every member of ``parts`` (each worker's :meth:`pending`), reading what no worker read."""
        joined: dict[tuple[str, int], tuple[int, int, str, list[Span]]] = {}
        for part in parts:
            for place, (size, crc, what, spans) in part.items():
                joined.setdefault(place, (size, crc, what, []))[3].extend(spans)
        for (file, start), (size, crc, what, spans) in sorted(joined.items()):
            self._compare(file, start, size, crc, what, self._whole_crc(file, start, size, spans))
            with self._lock:
                self._finish(file, start)

    def _first_member(self, file: str, pos: int, end: int) -> tuple[int, _Member] | None:
        """The first unchecked member of ``file`` holding a byte of ``[pos, end)``."""
        starts = self._starts.get(file)
        if not starts:
            return None
        members = self._members[file]
        i = max(0, bisect.bisect_right(starts, pos) - 1)
        while i < len(starts) and starts[i] < end:
            start = starts[i]
            if start + members[start].size > pos:
                return start, members[start]
            i += 1
        return None

    def _add(self, file: str, start: int, member: _Member, a: int, b: int, view: memoryview) -> None:
        """Record bytes ``[a, b)`` of ``member`` (``view``); parts already read are not read twice."""
        spans = member.spans
        pos = a
        i = bisect.bisect_left(spans, (a,))
        if i > 0 and spans[i - 1][1] > a:
            i -= 1
        new: list[Span] = []
        while pos < b:
            if i < len(spans) and spans[i][0] <= pos:  # already covered: skip it
                pos = max(pos, spans[i][1])
                i += 1
                continue
            stop = min(b, spans[i][0]) if i < len(spans) else b
            new.append((pos, stop, crc32(view[pos - a:stop - a])))
            pos = stop
        for span in new:
            bisect.insort(spans, span)
        member.spans = _joined(spans)
        if len(member.spans) == 1 and member.spans[0][:2] == (0, member.size):
            self._compare(file, start, member.size, member.crc, member.what, member.spans[0][2])
            self._finish(file, start)

    def _finish(self, file: str, start: int) -> None:
        member = self._members.get(file, {}).pop(start, None)
        if member is None:
            return
        self.checked_bytes += member.size
        starts = self._starts[file]
        del starts[bisect.bisect_left(starts, start)]
        done = self._done.get(file)
        if done is None:
            done = self._done[file] = _Starts()
        done.add(start)

    def _compare(self, file: str, start: int, size: int, stored: int, what: str, actual: int) -> None:
        if actual != stored:
            raise RecordChecksumError(
                self._name(file),
                f"{what}: the {size} bytes stored at offset {start} do not match their CRC-32 (read "
                f"{actual:08x}, the zip records {stored:08x}): the file was damaged after it was written "
                "(a hole, a torn or partial copy)")

    def _whole_crc(self, file: str, start: int, size: int, spans: list[Span]) -> int:
        """The member's CRC-32 from spans that may overlap, reading the bytes none covers."""
        total, pos = 0, 0
        for a, b, crc in sorted(spans, key=lambda s: (s[0], -s[1])):
            if b <= pos or a < pos:  # inside what is counted, or overlapping it: not usable
                continue
            if a > pos:
                total = self._read_crc(file, start, pos, a, total)
            total = crc32_combine(total, crc, b - a)
            pos = b
        return self._read_crc(file, start, pos, size, total)

    def _read_crc(self, file: str, start: int, a: int, b: int, value: int) -> int:
        for x in range(a, b, _GAP_BLOCK):
            n = min(_GAP_BLOCK, b - x)
            data = self._read(file, n, start + x)
            if len(data) != n:
                raise CheckpointFormatError(self._name(file), f"truncated: expected {n} bytes at offset {start + x}")
            value = crc32(data, value)
        return value


def _joined(spans: list[Span]) -> list[Span]:
    """Sorted disjoint spans with neighbours that touch combined into one."""
    out: list[Span] = []
    for a, b, crc in spans:
        if out and out[-1][1] == a:
            pa, _, pcrc = out[-1]
            out[-1] = (pa, b, crc32_combine(pcrc, crc, b - a))
        else:
            out.append((a, b, crc))
    return out


def expect_zip_members(checks: ReadChecks, file: str, source: Source, size: int) -> None:
    """Register every uncompressed member of the zip file open at ``source`` (``size`` bytes) as
    ``file`` in ``checks``; a file whose directory cannot be read registers nothing."""
    for start, (length, crc, name) in (stored_members(source, size) or {}).items():
        checks.expect(file, start, length, crc, f"zip member {name!r}")


def settle_reads(readers: Sequence[Any], workers: Workers) -> None:
    """Before anything is published: every member the workers read only in part is joined and
    compared on the coordinator (``RecordChecksumError`` on every worker). ``readers``: the
    run's sources, in the same order on every worker."""
    checks: list[ReadChecks | None] = [getattr(r, "read_checks", None) for r in readers]
    mine = [c.pending() if c is not None else {} for c in checks]
    everyone: list[list[Pending]] = workers.exchange(mine)

    def settle() -> None:
        for i, c in enumerate(checks):
            parts = [e[i] for e in everyone if e[i]]
            if c is not None and parts:
                c.settle(parts)

    if any(e[i] for e in everyone for i in range(len(checks))):
        workers.on_coordinator(settle)

