"""torch.distributed.checkpoint (DCP) directories: FSDP1, FSDP2, torchtitan.

A directory of a ``.metadata`` pickle (or rank-local ``__<r>.metadata`` files, merged) and
``__<r>_<n>.distcp`` data files, each stored chunk a standalone ``torch.save`` zip record: its
``data.pkl`` is read with an allowlist, its bytes straight into the destination buffer.

Example:
    >>> reader = DcpReader("ckpts/step_1000")               # doctest: +SKIP
    >>> reader.specs()["model.embed.weight"].shape           # doctest: +SKIP
    (50304, 768)
    >>> reader.read("model.embed.weight", Box((0, 0), (16, 768))).shape  # doctest: +SKIP
    torch.Size([16, 768])
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import IO, Any

from ..._gc import paused_gc
from ..._lazy import torch
from ...dtypes import itemsize
from ...errors import CheckpointFormatError
from ...layout import Box, TensorSpec
from ...storage import Location, Source, as_path
from ...torch_records import FileWindow, TensorRecord
from ...torch_records.checks import ReadChecks
from ..base import CheckpointFormat, CheckpointReader, register_format
from ..options import DEFAULT_READ, ReadOptions
from .index import MetadataIndex, StoredSpecs, shared_structure
from .metadata import METADATA_FILE, KeyPaths, StoredChunk, incomplete, is_dcp
from .records import ChunkRecords


class DcpReader(MetadataIndex, ChunkRecords, CheckpointReader):
    """Reader for one DCP checkpoint directory (see the module docstring)."""

    format_name = "dcp"
    # MetadataIndex's concrete types, which CheckpointReader's declarations admit
    planner_data: KeyPaths
    non_tensor_keys: list[str]
    read_checks: ReadChecks

    def __init__(self, path: str | Location, *, read: ReadOptions = DEFAULT_READ,
                 shared: Mapping[str, Any] | None = None) -> None:
        self.path = as_path(path)
        self.read_options = read
        self.step: int | None = None
        self._fds: dict[str, Source] = {}
        self._file_sizes: dict[str, int] = {}
        self._names: dict[str, str] = {}
        self._fallback: tuple[tuple[str, int], torch.Tensor] | None = None
        self._records: dict[tuple[str, int], tuple[int, TensorRecord] | None] = {}
        self.read_checks = ReadChecks(self._name, lambda file, n, offset: self._fd(file).pread(n, offset))
        if shared is not None:  # parsed by another worker: see share()
            for name in self._SHARED:
                setattr(self, name, shared[name])
            with paused_gc():
                self._adopt(shared_structure(shared["planner_data"], shared["_stored"], packed=shared["_chunks"]))
            return
        with paused_gc():
            self._parse()

    _SHARED = ("metadata_files", "_version", "planner_data", "non_tensor_keys", "_stored", "_bytes_records")

    def share(self) -> dict[str, Any]:
        """What parsing the metadata produced, as plain data (inputs of one
        :class:`~.index.Structure` share its objects, so a message pickles those once)."""
        shared = {name: getattr(self, name) for name in self._SHARED}
        # as tuples: pickling 20,000 dataclass instances to send them costs 10× more
        with paused_gc():
            shared["_chunks"] = self._structure.packed_chunks()
        return shared

    def specs(self) -> Mapping[str, TensorSpec]:
        structure = self._structure
        if structure.specs is None:  # made on first use
            structure.specs = StoredSpecs(self._stored)
        return structure.specs

    def stored(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        return self._stored

    def open_data(self, file: str) -> Source:
        return self._fd(file)

    def byte_ranges(self, key: str) -> list[tuple[str, int, int]] | None:
        """As :meth:`CheckpointReader.byte_ranges` (None: chunks split past dimension 0, or
        records that are not plain contiguous tensors); reads record headers only."""
        shape, dtype = self._stored[key]
        size = itemsize(dtype)
        ranges = []
        for chunk in self._chunks[key]:
            if chunk.box.sizes[1:] != shape[1:]:
                return None
            found = self._record(key, chunk)
            if found is None or not found[1].is_contiguous:
                return None
            data_offset, record = found
            self._check_record(key, chunk, record.size, record.dtype)
            if record.storage_offset + chunk.box.numel > record.storage_numel:
                raise CheckpointFormatError(self.path / chunk.file, f"key {key!r}: record storage too small")
            ranges.append((chunk.file, data_offset + record.storage_offset * size, chunk.box.numel * size))
        return ranges

    def layout(self, key: str) -> Sequence[Box]:
        return [c.box for c in self._chunks[key]]

    def chunks(self, key: str) -> Sequence[StoredChunk]:
        return self._chunks[key]

    supports_out = True  # read() can fill a caller's buffer (the engine reuses its buffers)

    def read(self, key: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        spec = self.specs()[key]
        if len(box.sizes) != len(spec.shape) or any(
            o < 0 or s < 0 or o + s > d for o, s, d in zip(box.offsets, box.sizes, spec.shape, strict=True)
        ):
            raise ValueError(f"{key}: box {box} lies outside shape {spec.shape}")
        candidates = self._candidates(key, box)
        for chunk in candidates:
            self._check_extent(chunk.file, chunk.offset, chunk.length)
        if out is None:
            out = torch.empty(box.sizes, dtype=spec.dtype)
        elif tuple(out.shape) != box.sizes or out.dtype != spec.dtype or not out.is_contiguous():
            raise ValueError(f"{key}: buffer {tuple(out.shape)} {out.dtype} does not fit {box} {spec.dtype}")
        if out.numel() == 0:
            return out
        filled = 0
        for chunk in candidates:
            part = chunk.box.intersect(box) if box.sizes else chunk.box
            if part is None:
                continue
            dest = out[part.relative_to(box).slices()] if box.sizes else out
            self._read_chunk_part(key, chunk, part.relative_to(chunk.box), dest)
            filled += part.numel
        if filled != box.numel:
            raise CheckpointFormatError(self.metadata_files[0], f"key {key!r}: stored chunks do not cover {box}")
        return out

    def _candidates(self, key: str, box: Box) -> list[StoredChunk]:
        """Stored chunks that may intersect ``box``: a bisection on dim-0 offsets."""
        chunks = self._chunks[key]
        if not box.sizes or len(chunks) < 2:
            return chunks
        starts, longest = self._starts[key]
        lo = bisect.bisect_left(starts, box.offsets[0] - longest + 1)
        hi = bisect.bisect_left(starts, box.offsets[0] + box.sizes[0])
        return chunks[lo:hi]

    def read_bytes(self, key: str) -> bytes:
        file, offset, length = self._bytes_records[key]
        fd = self._fd(file)
        self._check_extent(file, offset, length)
        return fd.pread(length, offset)

    def info(self) -> dict[str, Any]:
        ranks = sorted({c.rank for cs in self._chunks.values() for c in cs if c.rank is not None})
        files = sorted({c.file for cs in self._chunks.values() for c in cs})
        return {
            "metadata_files": [p.name for p in self.metadata_files],
            "rank_local_metadata": self.metadata_files[0].name != METADATA_FILE,
            "version": self._version,
            "data_files": len(files),
            "ranks": len(ranks),
            "chunks": sum(len(cs) for cs in self._chunks.values()),
            "non_tensor_keys": list(self.non_tensor_keys),
            "top_level": sorted({self.root_of(k) for k in self._stored}),
        }

    def root_of(self, key: str) -> str:
        """From ``planner_data``: keys themselves contain dots and must not be split."""
        path = self.planner_data.get(key)
        if path:
            return str(path[0])
        return key.split(".", 1)[0]

    def stored_records(self) -> list[tuple[str, int, int]]:
        """Every record the metadata names: model, optimizer, bytes."""
        held = ((c.file, c.offset, c.length) for chunks in self._chunks.values() for c in chunks)
        return sorted({*getattr(self, "_records_all", ()), *held, *self._bytes_records.values()})

    def open_record(self, file: str, offset: int, length: int) -> IO[bytes]:
        self._check_extent(file, offset, length)
        return FileWindow(self._fd(file), offset, length)  # type: ignore[return-value]

    def container_of(self, key: str) -> str | None:
        """``model`` of ``dcp.save({"model": model.state_dict()})``, recorded as the path
        ``("model", "fc.weight")``; a module attribute ``model`` is one part, no container."""
        path = self.planner_data.get(key)
        return str(path[0]) if path is not None and len(path) > 1 else None

    def close(self) -> None:
        self._fallback = None
        for fd in self._fds.values():
            fd.close()
        self._fds.clear()


FORMAT = register_format(CheckpointFormat(
    "dcp", detect=is_dcp, open=lambda path, read: DcpReader(path, read=read), incomplete=incomplete,
    reopen=lambda path, shared, read: DcpReader(path, read=read, shared=shared)))

