"""Objects read by ranged requests: blocks with read-ahead (:class:`RemoteFile`), or exact
small reads of a file's structure (:class:`RangedReads`). Never a whole download."""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

from .._crc import crc32, crc32_combine
from .._env import whole_number
from ..errors import CheckpointNotFoundError, RemoteStorageError
from .object_paths import RemotePath
from .object_paths import read_call as call  # every request here is a read
from .sources import Source


def remote_concurrency() -> int:
    """Ranged requests in flight at most (``EMA_CKPT_REMOTE_CONCURRENCY``, default 8)."""
    return whole_number(CONCURRENCY_ENV, _DEFAULT_CONCURRENCY, "requests")


def block_bytes() -> int:
    """The size of a ranged request (``EMA_CKPT_REMOTE_BLOCK_MIB``, default 32 MiB)."""
    return whole_number(BLOCK_ENV, BLOCK_BYTES >> 20, "MiB") << 20


def read_ahead_bytes() -> int:
    """Bytes fetched ahead of the reads, over every object open (``EMA_CKPT_REMOTE_BUFFER_MIB``,
    default 128 MiB): with the blocks being read, what bounds a remote read's memory."""
    return whole_number(BUFFER_ENV, _DEFAULT_BUFFER_MIB, "MiB") << 20


CONCURRENCY_ENV = "EMA_CKPT_REMOTE_CONCURRENCY"
BUFFER_ENV = "EMA_CKPT_REMOTE_BUFFER_MIB"
BLOCK_ENV = "EMA_CKPT_REMOTE_BLOCK_MIB"
_DEFAULT_CONCURRENCY = 8
_DEFAULT_BUFFER_MIB = 128
BLOCK_BYTES = 32 << 20
"""Ranged requests fetch aligned blocks of this size: a request's fixed cost is small against
it, and tensor data is read front to back, so little of a block goes unused."""
PROBE_BYTES = 256 << 10
"""A read shorter than this, more than a block away from the previous one, is served from a
piece of this size and starts no read-ahead."""
_PROBES_KEPT = 4
_USED_KEPT = 2
_OPEN: list[int] = [0]  # objects open for reading: they share the read-ahead budget
_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _object_size(path: RemotePath) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise CheckpointNotFoundError(path, "no such object") from None


def _read_range(path: RemotePath, start: int, end: int) -> bytes:
    data: bytes = call(path, path.fs.cat_file, path.key, start=start, end=end)
    if len(data) != end - start:
        raise RemoteStorageError(f"{path}: a ranged read of bytes {start}-{end} returned {len(data)} bytes "
                                 "(the object changed while it was read?)")
    return data


def _pool(workers: int) -> ThreadPoolExecutor:
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="ema-ckpt-fetch")
        return pool


class RemoteFile(Source):
    """One object read by ranged requests from aligned blocks of :data:`BLOCK_BYTES`, each read
    starting the requests for the blocks after it (a front-to-back reader keeps the link busy).
    Read-ahead is bounded over every object open (:func:`read_ahead_bytes`, shared, at least a
    block each), plus the blocks used last; each block is requested once unless dropped unused.

    ``size``: the object's, when known (no ``HEAD``). ``window``: ``(offset, length)``, the only
    bytes ever requested (blocks aligned to its start).

    Example:
        >>> f = RemoteFile(RemotePath.from_url("s3://bucket/ckpt/__0_0.distcp"))  # doctest: +SKIP
        >>> f.pread(4, 0)                                                        # doctest: +SKIP
        b'PK\\x03\\x04'
    """

    def __init__(self, path: RemotePath, *, concurrency: int | None = None, block: int | None = None,
                 size: int | None = None, window: tuple[int, int] | None = None, checksums: bool = False) -> None:
        self.path = path
        self.size = size = size if size is not None else _object_size(path)
        # Only [base, end) is ever requested; blocks are aligned to ``base``.
        self._base, self._end = (0, size) if window is None else (window[0], min(size, window[0] + window[1]))
        self._concurrency = concurrency if concurrency is not None else remote_concurrency()
        self._budget = read_ahead_bytes()
        self.block = block if block is not None else block_bytes()
        self._blocks: dict[int, Future[bytes]] = {}
        self._used: list[int] = []  # the blocks read from last, newest last
        self._probes: dict[int, bytes] = {}  # pieces fetched for small reads, oldest first
        self._cursor = 0  # where the previous read ended
        self._lock = threading.Lock()
        self._open = True
        _OPEN[0] += 1
        self.bytes_requested = 0  # the blocks requested: what a test checks "read once" by
        self._block_crcs: dict[int, int] | None = {} if checksums else None

    def _depth(self) -> int:
        """Blocks to keep fetched ahead: this object's share of the budget, within the concurrency."""
        share = self._budget // max(1, _OPEN[0]) // max(1, self.block)
        return max(1, min(self._concurrency, share))

    def _block_span(self, index: int) -> tuple[int, int]:
        start = self._base + index * self.block
        return start, min(self._end, start + self.block)

    def _fetch(self, index: int) -> bytes:
        data = _read_range(self.path, *self._block_span(index))
        if self._block_crcs is not None:
            value = crc32(data)  # on the fetching thread, with the GIL released
            with self._lock:
                self._block_crcs[index] = value
        return data

    def block_checksums(self) -> tuple[int, dict[int, int]]:
        """(block size, {block index: CRC-32}) of the blocks fetched so far (``checksums=True``)."""
        with self._lock:
            return self.block, dict(self._block_crcs or {})

    def crc32(self, known: Iterable[tuple[int, Mapping[int, int]]] = ()) -> int:
        """The whole object's CRC-32 from the blocks fetched so far (``checksums=True``), those
        ``known`` by other readers (same block size), and a read of each block never fetched."""
        if self._block_crcs is None or (self._base, self._end) != (0, self.size):
            raise ValueError("this RemoteFile keeps no checksums of the whole object (open it with checksums=True "
                             "and no window)")
        blocks = (self.size + self.block - 1) // self.block
        with self._lock:
            for block, crcs in known:
                if block == self.block:
                    self._block_crcs.update(crcs)
            in_flight = [f for i, f in self._blocks.items() if i not in self._block_crcs and not f.cancelled()]
        for future in in_flight:  # read ahead: its checksum comes with it
            with contextlib.suppress(CancelledError):
                future.result()
        with self._lock:
            missing = [i for i in range(blocks) if i not in self._block_crcs]
        for index in missing:
            self._fetch(index)
            start, end = self._block_span(index)
            self.bytes_requested += end - start
        total = 0
        for index in range(blocks):
            start, end = self._block_span(index)
            total = crc32_combine(total, self._block_crcs[index], end - start)
        return total

    def _request(self, index: int) -> Future[bytes]:  # the caller holds the lock
        future = self._blocks.get(index)
        if future is None:
            future = self._blocks[index] = _pool(self._concurrency).submit(self._fetch, index)
            start, end = self._block_span(index)
            self.bytes_requested += end - start
        return future

    def readinto(self, view: memoryview, offset: int) -> int:
        if offset < self._base:
            raise ValueError(f"{self.path}: offset {offset} is before the window read ({self._base})")
        length = max(0, min(len(view), self._end - offset))
        if length == 0:
            return 0
        near = abs(offset - self._cursor) <= self.block
        self._cursor = offset + length
        if length < PROBE_BYTES and not near:
            return self._read_small(view, offset, length)
        base = self._base
        first, last = (offset - base) // self.block, (offset + length - 1 - base) // self.block
        final = (self._end - 1 - base) // self.block
        depth = self._depth()
        with self._lock:
            wanted = [(i, self._request(i)) for i in range(first, last + 1)]
            for ahead in range(last + 1, min(final, last + depth) + 1):
                self._request(ahead)
            for index in [i for i in self._blocks if i < first and i not in self._used]:
                self._blocks.pop(index).cancel()  # behind the reads: not needed again
            for index in [i for i in self._blocks if i > last + depth]:
                if self._blocks[index].cancel():  # not started: more objects share the budget now
                    del self._blocks[index]
        done = 0
        for index, future in wanted:
            data = future.result()
            block_start, block_end = self._block_span(index)
            lo = max(offset, block_start) - block_start
            hi = min(offset + length, block_end) - block_start
            view[done:done + hi - lo] = memoryview(data)[lo:hi]
            done += hi - lo
            with self._lock:  # keep the last two read from: a record across a block boundary reads both again
                if index in self._used:
                    self._used.remove(index)
                self._used.append(index)
                while len(self._used) > _USED_KEPT:
                    self._blocks.pop(self._used.pop(0), None)
        return done

    def _read_small(self, view: memoryview, offset: int, length: int) -> int:
        """A small read away from where the reads walk (a zip directory, then its header): from a
        block fetched or in flight, else from an aligned piece of :data:`PROBE_BYTES`."""
        base = self._base
        index = (offset - base) // self.block
        with self._lock:
            block = self._blocks.get(index) if (offset + length - 1 - base) // self.block == index else None
        if block is not None:
            data, start = block.result(), self._block_span(index)[0]
        else:
            start = max(base, offset // PROBE_BYTES * PROBE_BYTES)
            if offset + length > start + PROBE_BYTES:  # straddles two pieces: read it as it is
                start = offset
            data = self._probes.get(start, b"")
            if len(data) < offset + length - start:
                end = min(self._end, max(offset + length, start + PROBE_BYTES))
                data = call(self.path, self.path.fs.cat_file, self.path.key, start=start, end=end)
                self.bytes_requested += end - start
                with self._lock:
                    self._probes[start] = data
                    while len(self._probes) > _PROBES_KEPT:
                        self._probes.pop(next(iter(self._probes)))
        piece = memoryview(data)[offset - start: offset - start + length]
        view[: len(piece)] = piece
        return len(piece)

    def close(self) -> None:
        with self._lock:
            for future in self._blocks.values():
                future.cancel()
            self._blocks.clear()
            self._probes.clear()
            self._used.clear()
            if self._open:
                self._open = False
                _OPEN[0] -= 1


class RangedReads(Source):
    """One object read by exact ranged requests, for a file's few small, scattered structure
    reads: no blocks, no read-ahead. A read fetches at least :data:`MIN_READ_BYTES`, never past
    the next of ``fences`` (a zip's member starts: a header read brings no byte of the member);
    every piece is kept until :meth:`close` and serves the reads inside it."""

    def __init__(self, path: RemotePath, *, size: int | None = None) -> None:
        self.path = path
        self.size = size if size is not None else _object_size(path)
        self._pieces: list[tuple[int, bytes]] = []
        self.fences: list[int] = []
        self.bytes_requested = 0

    def pread(self, length: int, offset: int) -> bytes:
        end = min(self.size, offset + max(0, length))
        if offset < 0 or end <= offset:
            return b""
        for start, piece in self._pieces:
            if start <= offset and end <= start + len(piece):
                return piece[offset - start: end - start]
        extended = offset + MIN_READ_BYTES
        fence = bisect.bisect_right(self.fences, offset)
        if fence < len(self.fences):
            extended = min(extended, self.fences[fence])
        fetch_end = min(self.size, max(end, extended))
        data = _read_range(self.path, offset, fetch_end)
        self.bytes_requested += len(data)
        self._pieces.append((offset, data))
        return data[: end - offset]

    def readinto(self, view: memoryview, offset: int) -> int:
        data = self.pread(len(view), offset)
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._pieces.clear()


MIN_READ_BYTES = 1024
"""The least :class:`RangedReads` fetches at once (a zip member's header with its name)."""
