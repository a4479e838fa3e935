"""Where a key's pieces lie in the rank files, and reading them from there into a buffer.

A key's flat range is gathered piece by piece: with ``pread`` from the file while it is still
the one mapped, else from the mapping in slices whose pages are then handed back, and on object
storage by ranged reads of the stored tensor. Bytes read from a known place in a file are checked
against their zip member's CRC-32.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..._lazy import torch
from ...errors import CheckpointFormatError
from ...storage import Location, Source, open_readable
from ...torch_records.checks import ReadChecks, expect_zip_members
from .params import Entry, Piece
from .structure import RemoteStructure, meta_member
from .tag import file_identity
from .unpickle import release_pages, storage_file_offsets

RELEASE_SLICE_BYTES = 16 << 20  # copy mapped spans this much at a time, then drop their pages

BLOCK_BYTES = 1 << 20  # small pieces are served from blocks of their flat partition this size, read once
_SMALL_PIECE_BYTES = 64 << 10  # pieces up to this size go through the blocks; larger ones are read directly
_BLOCKS_KEPT = 16  # blocks kept per reader (the most recently read)

_REMOTE_KEPT = 64  # stored tensors on object storage kept open (with their last blocks) per reader


class PieceReads:
    """Placing a reader's pieces in their files and reading them (a base of :class:`~.reader.DeepSpeedReader`)."""

    tag_dir: Location
    read_checks: ReadChecks
    _states: dict[Location, Any]
    _identities: dict[Location, tuple[int, ...]]
    _offsets: dict[Location, dict[int, int] | None]
    _structures: dict[Location, RemoteStructure]
    _sizes: dict[Location, int]
    _remote: dict[tuple[Location, int], Source]
    _remote_lock: threading.Lock
    _blocks: dict[tuple[Location, int], torch.Tensor]  # (file, first byte) -> a block's bytes, oldest first
    _load: Callable[[Location], Any]

    def _storage_offsets(self, path: Location) -> dict[int, int] | None:
        if path in self._offsets:
            return self._offsets[path]
        state = self._load(path)
        # read locally, the file still the one mapped: its storages' places
        offsets = storage_file_offsets(path, state) if path in self._identities else None
        self._offsets[path] = offsets
        if offsets is not None:  # its pieces are read from the file: their bytes get checked
            with open_readable(path) as source:
                expect_zip_members(self.read_checks, str(path), source, source.size)
        return offsets

    def _place_in_files(self, entries: dict[str, Entry]) -> dict[str, Entry]:
        """Whole stored tensors whose place in their file is known as pieces read from the file
        (their bytes are then checked too)."""
        if not any(e.tensor is not None and e.tensor.numel() for e in entries.values()):
            return entries  # nothing to place (ZeRO-3 without buffers): the files' storages need no listing
        places = {ptr: (path, start) for path in list(self._states)
                  for ptr, start in (self._storage_offsets(path) or {}).items()}
        for key, entry in entries.items():
            t = entry.tensor
            where = places.get(t.untyped_storage().data_ptr()) if t is not None and t.is_contiguous() else None
            if t is not None and where is not None and t.numel():
                flat = t.reshape(-1)
                piece = Piece(0, t.numel(), flat, 0, entry.releasable, where[0],
                              where[1] + flat.storage_offset() * flat.element_size())
                entries[key] = dataclasses.replace(entry, pieces=(piece,), tensor=None)
        return entries

    def _place_in_objects(self, entries: dict[str, Entry]) -> dict[str, Entry]:
        """Every key on object storage as byte spans of its objects, read by ranged requests."""
        owners = {ident: structure for structure in self._structures.values() for ident in structure.storages}

        def place(src: torch.Tensor) -> tuple[Location, int]:
            structure = owners.get(id(src.untyped_storage()))
            if structure is None or src.dim() != 1 or (src.numel() > 1 and src.stride() != (1,)):
                raise CheckpointFormatError(self.tag_dir, "a tensor is not stored as one contiguous span")
            name, start, size, crc = meta_member(structure, src)
            self.read_checks.expect(str(structure.path), start, size, crc, f"zip member {name!r}")
            return structure.path, start + src.storage_offset() * src.element_size()

        placed: dict[str, Entry] = {}
        for key, entry in entries.items():
            pieces = list(entry.pieces)
            if entry.tensor is not None:
                t = entry.tensor
                if not t.is_contiguous():
                    raise CheckpointFormatError(self.tag_dir, f"{key} is not stored contiguously")
                pieces = [Piece(0, t.numel(), t.reshape(-1), 0)] if t.numel() else []
            for i, p in enumerate(pieces):
                if p.file is None:  # not placed in a file yet
                    file, start = place(p.src)
                    pieces[i] = dataclasses.replace(p, file=file, file_start=start, releasable=False)
            placed[key] = dataclasses.replace(entry, pieces=tuple(pieces), tensor=None, releasable=False)
        return placed

    def _read_back(self, file: str, length: int, offset: int) -> bytes:
        """Bytes of a file of the tag for :class:`ReadChecks` (those of a member no read covered)."""
        path = next((p for p in self._sizes if str(p) == file), None) or Path(file)
        with open_readable(path, size=self._sizes.get(path)) as source:
            return source.pread(length, offset)

    def _gather(self, entry: Entry, lo: int, hi: int, out: torch.Tensor) -> None:
        """Fill ``out`` (1-D, ``hi - lo`` long) with flat elements ``[lo, hi)`` of ``entry``."""
        fds: dict[Location, Source | None] = {}
        try:
            for p in entry.pieces:
                a, b = max(lo, p.dst), min(hi, p.dst + p.length)
                if a >= b:
                    continue
                source: Source | None = None
                if p.file is not None and p.src.is_meta:  # no data but in its file: ranged reads
                    source = self._remote_source(p)
                elif p.file is not None and out.dtype == p.src.dtype:
                    small = (b - a) * out.element_size() <= _SMALL_PIECE_BYTES
                    if small and self._from_block(p, a, b, out[a - lo : b - lo], fds):
                        continue
                    source = self._open(p.file, fds)
                self._copy_piece(p, a, b, out[a - lo : b - lo], source, self.read_checks)
                if source is not None and p.file is not None and p.src.is_meta and p.start + b - p.dst == p.src.numel():
                    with self._remote_lock:  # read to its end: the blocks it keeps go
                        self._remote.pop((p.file, p.file_start), None)
                    source.close()
        finally:
            for fd in fds.values():
                if fd is not None:
                    fd.close()

    def _from_block(self, p: Piece, a: int, b: int, out: torch.Tensor, fds: dict[Location, Source | None]) -> bool:
        """Flat elements ``[a, b)`` of a key (in piece ``p``) from the block of its flat partition
        that holds them, read and checked once for all the small pieces in it. False when the
        piece crosses a block or its file is no longer the one mapped."""
        assert p.file is not None
        size = p.src.element_size()
        at = p.file_start + (p.start + a - p.dst) * size
        first = p.file_start + (at - p.file_start) // BLOCK_BYTES * BLOCK_BYTES
        last = min(first + BLOCK_BYTES, p.file_start + p.src.numel() * size)
        if at + (b - a) * size > last:
            return False
        key = (p.file, first)
        with self._remote_lock:
            block = self._blocks.pop(key, None)
            if block is not None:
                self._blocks[key] = block  # the most recently used last
        if block is None:
            fd = self._open(p.file, fds)
            if fd is None:
                return False
            block = torch.empty(last - first, dtype=torch.uint8)
            self.read_checks.fill(fd, str(p.file), memoryview(block.numpy()), first)
            with self._remote_lock:
                self._blocks[key] = block
                while len(self._blocks) > _BLOCKS_KEPT:
                    self._blocks.pop(next(iter(self._blocks)))
        out.view(torch.uint8).copy_(block[at - first : at - first + (b - a) * size])
        return True

    def _open(self, path: Location, fds: dict[Location, Source | None]) -> Source | None:
        """``path`` opened (kept in ``fds``) if it is still the file that was mapped, else None
        (opened per read: held, many checkpoints' ranks would exceed the descriptors allowed)."""
        if path not in fds:
            try:
                fd = open_readable(path)
                local = fd.fd()
                now = file_identity(os.fstat(local)) if local is not None else ()
            except OSError:
                fds[path] = None
                return None
            then = self._identities.get(path)
            if now == then:
                fds[path] = fd
            else:
                fd.close()
                if then is not None and now[:2] == then[:2]:
                    # Changed in place: the private mapping shows the new bytes too, so there
                    # is no consistent copy left to read.
                    raise CheckpointFormatError(path, "changed while being read (written to since it was opened)")
                fds[path] = None  # replaced: the mapping still holds the file that was opened
        return fds[path]

    def _remote_source(self, p: Piece) -> Source:
        """Ranged reads of the stored tensor ``p.src`` in its object (its bytes only), kept for the
        next reads (the most recently used :data:`_REMOTE_KEPT`)."""
        assert p.file is not None
        key = (p.file, p.file_start)
        oldest = None
        with self._remote_lock:
            source = self._remote.pop(key, None)
            if source is None:
                window = (p.file_start, p.src.numel() * p.src.element_size())
                source = open_readable(p.file, size=self._sizes[p.file], window=window)
            self._remote[key] = source  # the most recently used last
            if len(self._remote) > _REMOTE_KEPT:
                oldest = self._remote.pop(next(iter(self._remote)))
        if oldest is not None:
            oldest.close()
        return source

    @staticmethod
    def _copy_piece(p: Piece, a: int, b: int, out: torch.Tensor, source: Source | None,
                    checks: ReadChecks) -> None:
        """Flat elements ``[a, b)`` of a key, in piece ``p``, into ``out``: read from ``source`` at
        the piece's place in its file, else copied from ``p.src`` (the mapping)."""
        if source is not None:
            # One copy by the kernel, no page faults on the mapping (a stored dtype other than
            # the key's, as for buffers kept in bf16, goes through a buffer of its own).
            target = out if out.dtype == p.src.dtype else torch.empty(b - a, dtype=p.src.dtype)
            offset = p.file_start + (p.start + a - p.dst) * target.element_size()
            checks.fill(source, str(p.file), memoryview(target.view(torch.uint8).numpy()), offset)
            if target is not out:
                out.copy_(target)
            return
        # Mapped sources go in slices, each handed back once copied: resident file pages stay
        # within one slice, not one rank's share of the parameter.
        step = max(1, RELEASE_SLICE_BYTES // p.src.element_size()) if p.releasable else b - a
        for x in range(a, b, step):
            y = min(b, x + step)
            src = p.src[p.start + x - p.dst : p.start + y - p.dst]
            out[x - a : y - a].copy_(src)
            if p.file is not None:
                at = p.file_start + (p.start + x - p.dst) * src.element_size()
                checks.saw(str(p.file), at, memoryview(src.view(torch.uint8).numpy()))
            if p.releasable:
                release_pages(src)
