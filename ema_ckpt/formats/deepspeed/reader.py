"""DeepSpeed ZeRO 1/2/3 checkpoints, read without DeepSpeed.

A DeepSpeed checkpoint is a *tag folder* (``save_dir/global_step1000/``) holding one or more
``*_model_states.pt`` files and one ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``
file per data-parallel rank; ``save_dir/latest`` names the newest tag. The reader serves the
fp32 master weights exactly as DeepSpeed's ``zero_to_fp32`` rebuilds them, key for key and bit
for bit, plus what ``zero_to_fp32`` drops at ZeRO-1 (frozen parameters):

* trainable parameters: fp32 masters, from ``single_partition_of_fp32_groups`` (stage 1/2, and
  BF16_Optimizer) or ``fp32_flat_groups`` (stage 3);
* frozen parameters: ``frozen_param_fragments`` (stage 2: whole; stage 3: one padded slice per
  rank), or, at stage 1 where DeepSpeed records nothing, the tensors of the model-states
  ``module`` that are neither trainable nor buffers; in their saved (training) dtype;
* buffers: from ``module``; floating ones upcast to fp32 as ``zero_to_fp32`` does, integer
  and bool ones in their own dtype;
* tied parameters (``shared_params``): the alias key reads the owner's data.

Nothing is gathered at open: every ``.pt`` file is memory-mapped once for its structure (see
:mod:`._ds_unpickle`) and each key knows which flat ranges of which rank tensors hold it, and
where those lie in the file. ``read`` takes only the flat span that covers the box asked for:
fp32 partitions with ``pread`` straight into the caller's buffer (one copy by the kernel; the
Adam moments beside them are never touched), anything else from the mapping, whose pages it
then hands back to the kernel (:func:`~._ds_unpickle.release_pages`) so that they do not stay
resident. ``layout`` offers tensors over 32 MiB as row blocks, so a run's memory is a few such
blocks, whatever the largest parameter and however it straddles ranks.

On object storage (a :class:`~ema_ckpt.remote.RemotePath`) nothing is mapped or fetched whole:
each file's zip directory and pickle are read by ranged requests and unpickled by the same
restricted loader with every tensor left on the ``meta`` device
(:func:`~._ds_unpickle.load_ds_structure`); each key then knows the byte spans it lies in, and
``read`` fetches those spans only (a :class:`~ema_ckpt.remote.RemoteFile` per stored tensor,
read ahead within it), so an optimizer file's Adam moments are never requested.

Refused with :class:`~ema_ckpt.errors.CheckpointFormatError` (naming the file): tensor
parallelism (``mp_rank_01``), pipeline ``layer_*`` files, MoE (``expp_rank_*``, expert
layers), NVMe-offloaded tensors, ZeRO-0, and a world size that does not match the number of
optimizer files.

Example:
    >>> from ema_ckpt.formats import open_checkpoint                  # doctest: +SKIP
    >>> with open_checkpoint("out/checkpoint-500") as reader:          # doctest: +SKIP
    ...     reader.info()["stage"], reader.step
    (3, 500)
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, cast

from ..._lazy import torch
from ...errors import CheckpointFormatError, CheckpointNotFoundError, EmaCkptError
from ...layout import Box, TensorSpec, split_rows
from ...remote import RemoteFile, RemotePath, as_path, is_remote, remote_concurrency
from ...torch_records import FileWindow, pread_into
from ...torch_records.checks import ReadChecks, expect_zip_members
from .._ds_unpickle import (
    RemoteStructure,
    load_ds_file_releasable,
    load_ds_structure,
    meta_member,
    release_pages,
    storage_file_offsets,
)
from ..base import CheckpointFormat, CheckpointReader, register_format
from .files import (
    FORMAT_NAME,
    OPTIM_RE,
    UNSUPPORTED_FILES,
    ZERO3_MODEL_RE,
    ds_files,
    find_tag_dir,
    incomplete,
    is_deepspeed,
    model_files,
    name_gaps,
    remote_structure,
    step_from,
    step_of,
)
from .params import ParameterMaps, _Entry, _Piece, _row_major_strides

_RELEASE_SLICE_BYTES = 16 << 20  # copy mapped spans this much at a time, then drop their pages

_REGION_BYTES = 32 << 20  # layout(): larger tensors are served in row blocks of at most this

_REMOTE_KEPT = 64  # stored tensors on object storage kept open (with their last blocks) per reader



class DeepSpeedReader(ParameterMaps, CheckpointReader):
    """Reads one DeepSpeed ZeRO 1/2/3 checkpoint (a tag folder) key by key, box by box.

    ``path`` is what was opened (a tag folder, or a save folder / HF ``checkpoint-N`` whose
    ``latest`` names the tag); ``tag_dir`` is the tag folder itself.

    Raises:
        CheckpointNotFoundError: no DeepSpeed tag folder at ``path``.
        CheckpointFormatError: a file is corrupt, or the checkpoint uses something this reader
            does not support (tensor/pipeline/expert parallelism, NVMe offload, ZeRO-0, a
            world size that does not match the optimizer files).
        UnsafePickleError: a file refers to code outside the allowlist (nothing ran).
    """


    format_name = FORMAT_NAME


    path: Path


    step: int | None


    """``global_steps`` from the model states, else the number in the tag name, else None."""


    tag_dir: Path


    tag: str


    stage: int


    world_size: int


    optimizer_kind: str


    """``"zero"`` (DeepSpeedZeroOptimizer / stage 3) or ``"bf16_optimizer"`` (BF16_Optimizer)."""


    train_dtype: str


    """``"fp32"``, ``"bf16"`` or ``"fp16"``: the precision the model trained in."""


    master_dtype: torch.dtype


    ds_version: str | None


    read_checks: ReadChecks

    def __init__(self, path: str | Path) -> None:
        self.path = as_path(path)
        tag_dir = find_tag_dir(self.path)
        if tag_dir is None:
            reason = (
                incomplete(self.path) or "no DeepSpeed tag folder (no *_model_states.pt and *optim_states.pt)"
            )
            raise CheckpointNotFoundError(self.path, reason)
        self.tag_dir = tag_dir
        self.tag = tag_dir.name
        self._states: dict[Path, Any] = {}  # file -> loaded (memory-mapped) object
        self._releasable: dict[Path, bool] = {}  # file -> its mapped pages may be dropped
        self._identities: dict[Path, tuple[int, ...]] = {}  # file -> (dev, inode, size, mtime) when mapped
        self._offsets: dict[Path, dict[int, int] | None] = {}  # file -> its storages' places (see _storage_offsets)
        self._entries: dict[str, _Entry] = {}
        self._structures: dict[Path, RemoteStructure] = {}  # object -> its structure, while building
        self._sizes: dict[Path, int] = {}  # object -> its size in bytes
        self._remote: dict[tuple[Path, int], RemoteFile] = {}  # (object, first byte) -> a stored tensor's reads
        self._remote_lock = threading.Lock()
        self._closed = False
        self.read_checks = ReadChecks(str, self._read_back)  # files named by their full path
        try:
            self._build()
        except EmaCkptError:
            self.close()
            raise
        except Exception as err:  # any malformed field: one line naming the checkpoint
            self.close()
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            message = f"malformed DeepSpeed checkpoint ({type(err).__name__}: {first})"
            raise CheckpointFormatError(self.tag_dir, message) from None


    def specs(self) -> Mapping[str, TensorSpec]:
        self._check_open()
        return {k: e.spec for k, e in self._entries.items()}


    def layout(self, key: str) -> Sequence[Box]:
        """The regions to read ``key`` by: whole rows, at most 32 MiB each.

        A ZeRO rank's share is a flat range, not a box, so there are no stored boxes to
        follow; one box covering the tensor (the answer for every tensor up to 32 MiB) would
        make memory scale with the largest parameter (a 250k-token embedding is GiBs), so
        larger tensors are cut into row blocks that ``read`` serves as cheaply.
        """
        spec = self._entry(key).spec
        if spec.numel == 0:
            return []
        return split_rows(Box.full(spec.shape), max(1, _REGION_BYTES // max(1, spec.dtype.itemsize)))


    whole_file_records = True

    @classmethod
    def step_of(cls, path: Path) -> int | None:
        """``global_steps`` from the first model-states file alone (see :func:`.files.step_of`)."""
        return step_of(path)

    def stored_records(self) -> Sequence[tuple[str, int, int]]:
        """Every ``.pt`` file of the tag folder, each one ``torch.save`` zip (relative to :attr:`path`)."""
        self._check_open()
        base = self.tag_dir.name if self.tag_dir != self.path else ""
        files = sorted(p for p in self.tag_dir.iterdir() if p.name.endswith(".pt"))
        return [(f"{base}/{p.name}" if base else p.name, 0, p.stat().st_size) for p in files]

    def open_record(self, file: str, offset: int, length: int) -> IO[bytes]:
        """A read-only file view of one ``.pt`` file (on object storage: ranged reads of it)."""
        full = self.path / file
        if not is_remote(full):
            return super().open_record(file, offset, length)
        return FileWindow(RemoteFile(cast(RemotePath, full)), offset, length, owns_fd=True)  # type: ignore[return-value]

    def data_ranges(self) -> list[tuple[Path, int, int]]:
        """``(file, offset, length)``: the bytes reading every key takes from the files, merged.

        The fp32 partitions of the optimizer files (never the optimizer's moments), and every
        model-states file whole (buffers, frozen parameters; they are small). Partitions read
        through the mapping instead (legacy or foreign-endian files) are not listed. What a
        benchmark reads to know the floor of a run.

        Example:
            >>> sum(n for _, _, n in reader.data_ranges())  # doctest: +SKIP
            1088548864
        """
        self._check_open()
        ranges: dict[Path, list[tuple[int, int]]] = {p: [(0, p.stat().st_size)] for p in self._model_files}
        for entry in self._entries.values():
            for p in entry.pieces:
                if p.file is not None:
                    start = p.file_start + p.start * p.src.element_size()
                    ranges.setdefault(p.file, []).append((start, start + p.length * p.src.element_size()))
        merged: list[tuple[Path, int, int]] = []
        for path, spans in sorted(ranges.items()):
            spans.sort()
            lo, hi = spans[0] if spans else (0, 0)
            for a, b in spans[1:]:
                if a > hi:
                    merged.append((path, lo, hi - lo))
                    lo = a
                hi = max(hi, b)
            if hi > lo:
                merged.append((path, lo, hi - lo))
        return merged

    supports_out = True  # pieces are gathered straight into a caller's buffer (the engine reuses its buffers)

    def read(self, key: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():  # saved parameters may require grad: a caller's buffer must not
            return self._read(key, box, out)

    def _read(self, key: str, box: Box, given: torch.Tensor | None = None) -> torch.Tensor:
        entry = self._entry(key)
        spec = entry.spec
        if entry.owner is not None:
            entry = self._entries[entry.owner]
        shape = spec.shape
        if len(box.offsets) != len(shape) or len(box.sizes) != len(shape):
            raise ValueError(f"{key}: box {box} has {len(box.sizes)} dims, tensor has {len(shape)}")
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(box.offsets, box.sizes, shape, strict=True)):
            raise ValueError(f"{key}: box {box} is outside shape {shape}")
        if given is not None and (tuple(given.shape) != box.sizes or given.dtype != spec.dtype
                                  or not given.is_contiguous()):
            raise ValueError(f"{key}: buffer {tuple(given.shape)} {given.dtype} does not fit {box} {spec.dtype}")
        out = given if given is not None else torch.empty(box.sizes, dtype=spec.dtype)
        if out.numel() == 0:
            return out
        if entry.tensor is not None:
            part = entry.tensor[box.slices()]
            if not entry.releasable:
                out.copy_(part)
                return out
            row = part[0].numel() * part.element_size() if part.dim() else 1
            rows = max(1, _RELEASE_SLICE_BYTES // max(1, row))
            for r in range(0, part.shape[0], rows) if part.dim() else (None,):
                dst, src = (out, part) if r is None else (out[r : r + rows], part[r : r + rows])
                dst.copy_(src)
                release_pages(src)
            return out
        strides = _row_major_strides(shape)
        lo = sum(o * s for o, s in zip(box.offsets, strides, strict=True))
        hi = sum((o + n - 1) * s for o, n, s in zip(box.offsets, box.sizes, strides, strict=True)) + 1
        if hi - lo == out.numel():  # the box is one contiguous run (rows, or a whole tensor)
            self._gather(entry, lo, hi, out.view(-1))
            return out
        span = torch.empty(hi - lo, dtype=entry.pieces[0].src.dtype if entry.pieces else spec.dtype)
        self._gather(entry, lo, hi, span)
        out.copy_(span.as_strided(box.sizes, strides))
        return out


    def info(self) -> dict[str, Any]:
        self._check_open()
        kinds = [e.kind for e in self._entries.values()]
        return {
            "format": FORMAT_NAME,
            "tag": self.tag,
            "tag_dir": str(self.tag_dir),
            "stage": self.stage,
            "optimizer": self.optimizer_kind,
            "world_size": self.world_size,
            "dtype": self.train_dtype,
            "master_dtype": str(self.master_dtype).removeprefix("torch."),
            "global_step": self.step,
            "ds_version": self.ds_version,
            "params": kinds.count("param"),
            "frozen": kinds.count("frozen"),
            "tied": kinds.count("tied"),
            "buffers": kinds.count("buffer"),
            "tensors": len(kinds),
            "model_states_files": [p.name for p in self._model_files],
            "optim_states_files": [p.name for p in self._optim_files],
        }


    def close(self) -> None:
        self._entries = {}
        self._states = {}
        for structure in self._structures.values():
            structure.close()
        self._structures = {}
        with self._remote_lock:
            sources, self._remote = list(self._remote.values()), {}
        for source in sources:
            source.close()
        self._closed = True


    def __repr__(self) -> str:
        return f"DeepSpeedReader({str(self.path)!r}, tag={self.tag!r})"


    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: reader is closed")


    def _entry(self, key: str) -> _Entry:
        self._check_open()
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"{key!r} is not a tensor of {self.tag_dir}") from None


    def _load_remote(self, paths: Sequence[Path]) -> None:
        """Load the structure of every object in ``paths`` not loaded yet, several at a time (each
        is a few small requests, so latency, not bandwidth, is their cost)."""
        todo = [p for p in paths if is_remote(p) and p not in self._states]
        if len(todo) < 2:
            return
        with ThreadPoolExecutor(min(len(todo), remote_concurrency()), thread_name_prefix="ema-ckpt-ds") as pool:
            loaded = dict(zip(todo, pool.map(_structure_of, todo), strict=True))
        for path, structure in loaded.items():
            self._structures[path] = structure
            self._states[path], self._releasable[path] = structure.state, False
            self._sizes[path] = structure.source.size

    def _load(self, path: Path) -> Any:
        if path not in self._states and is_remote(path):
            structure = self._structures[path] = _structure_of(path)
            self._states[path], self._releasable[path] = structure.state, False
            self._sizes[path] = structure.source.size
        if path not in self._states:
            # The file's identity is taken before the mapping is made and kept only if the path
            # still names that file afterwards; pread checks it again on every open, so a tag
            # folder rewritten meanwhile is never read partly from the old file and partly from
            # the new one (the mapping, which holds the old file, is read instead).
            try:
                before: tuple[int, ...] | None = _identity(path.stat())
            except OSError:
                before = None
            self._states[path], self._releasable[path] = load_ds_file_releasable(path)
            try:
                after: tuple[int, ...] | None = _identity(path.stat())
            except OSError:
                after = None
            if before is not None and before == after:
                self._identities[path] = before
        return self._states[path]


    def _storage_offsets(self, path: Path) -> dict[int, int] | None:
        if path in self._offsets:
            return self._offsets[path]
        state = self._load(path)
        offsets = self._offsets[path] = storage_file_offsets(path, state) if path in self._identities else None
        if offsets is not None:  # its pieces are read from the file: their bytes get checked
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                expect_zip_members(self.read_checks, str(path), fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
        return offsets

    def _read_back(self, file: str, length: int, offset: int) -> bytes:
        """Bytes of a file of the tag for :class:`ReadChecks` (those of a member no read covered)."""
        path = next((p for p in self._sizes if str(p) == file), None) or Path(file)
        if is_remote(path):
            source = RemoteFile(cast(RemotePath, path), size=self._sizes[path])
            try:
                return source.pread(length, offset)
            finally:
                source.close()
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def _gather(self, entry: _Entry, lo: int, hi: int, out: torch.Tensor) -> None:
        """Fill ``out`` (1-D, ``hi - lo`` long) with flat elements ``[lo, hi)`` of ``entry``."""
        fds: dict[Path, int | None] = {}
        try:
            for p in entry.pieces:
                a, b = max(lo, p.dst), min(hi, p.dst + p.length)
                if a >= b:
                    continue
                source: int | RemoteFile | None = None
                if p.file is not None and is_remote(p.file):
                    source = self._remote_source(p)
                elif p.file is not None and out.dtype == p.src.dtype:
                    source = self._open(p.file, fds)
                self._copy_piece(p, a, b, out[a - lo : b - lo], source, self.read_checks)
                if isinstance(source, RemoteFile) and p.start + b - p.dst == p.src.numel():
                    self._drop_remote(p, source)  # read to its end: the blocks it keeps go
        finally:
            for fd in fds.values():
                if fd is not None:
                    os.close(fd)

    def _open(self, path: Path, fds: dict[Path, int | None]) -> int | None:
        """A descriptor on ``path`` (kept in ``fds``) if it is still the file that was mapped, else None.

        Opened per read rather than held: a run over many checkpoints of many ranks would
        otherwise hold more descriptors than a process may have.
        """
        if path not in fds:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                fds[path] = None
                return None
            now, then = _identity(os.fstat(fd)), self._identities.get(path)
            if now == then:
                fds[path] = fd
            else:
                os.close(fd)
                if then is not None and now[:2] == then[:2]:
                    # Changed in place: the private mapping shows the new bytes too, so there
                    # is no consistent copy left to read.
                    raise CheckpointFormatError(path, "changed while being read (written to since it was opened)")
                fds[path] = None  # replaced: the mapping still holds the file that was opened
        return fds[path]

    def _remote_source(self, p: _Piece) -> RemoteFile:
        """Ranged reads of the stored tensor ``p.src`` in its object: its bytes only, read ahead
        within it; kept for the next reads of it (the most recently used :data:`_REMOTE_KEPT`)."""
        assert p.file is not None
        key = (p.file, p.file_start)
        oldest = None
        with self._remote_lock:
            source = self._remote.pop(key, None)
            if source is None:
                window = (p.file_start, p.src.numel() * p.src.element_size())
                source = RemoteFile(cast(RemotePath, p.file), size=self._sizes[p.file], window=window)
            self._remote[key] = source  # the most recently used last
            if len(self._remote) > _REMOTE_KEPT:
                oldest = self._remote.pop(next(iter(self._remote)))
        if oldest is not None:
            oldest.close()
        return source

    def _drop_remote(self, p: _Piece, source: RemoteFile) -> None:
        with self._remote_lock:
            self._remote.pop((cast(Path, p.file), p.file_start), None)
        source.close()

    @staticmethod
    def _copy_piece(p: _Piece, a: int, b: int, out: torch.Tensor, source: int | RemoteFile | None,
                    checks: ReadChecks) -> None:
        """Flat elements ``[a, b)`` of a key, which lie in piece ``p``, into ``out``: read from
        ``source`` (a descriptor, or ranged reads of an object) at the piece's place in its
        file, else copied from ``p.src`` (the mapping). Bytes whose place in the file is known
        are checked against their zip member's CRC-32."""
        if source is not None:
            # Straight from the file into the buffer: one copy by the kernel, no page faults
            # on the mapping and no pages to hand back (a stored dtype other than the key's,
            # as for buffers kept in bf16, goes through a buffer of its own).
            target = out if out.dtype == p.src.dtype else torch.empty(b - a, dtype=p.src.dtype)
            view = memoryview(target.view(torch.uint8).numpy())
            offset = p.file_start + (p.start + a - p.dst) * target.element_size()
            if not pread_into(source, view, offset):
                raise CheckpointFormatError(str(p.file), f"truncated: expected {len(view)} bytes at offset {offset}")
            checks.saw(str(p.file), offset, view)
            if target is not out:
                out.copy_(target)
            return
        # Mapped sources go in slices, each handed back once copied: resident file pages stay
        # within one slice, not one rank's share of the parameter.
        step = max(1, _RELEASE_SLICE_BYTES // p.src.element_size()) if p.releasable else b - a
        for x in range(a, b, step):
            y = min(b, x + step)
            src = p.src[p.start + x - p.dst : p.start + y - p.dst]
            out[x - a : y - a].copy_(src)
            if p.file is not None:
                at = p.file_start + (p.start + x - p.dst) * src.element_size()
                checks.saw(str(p.file), at, memoryview(src.view(torch.uint8).numpy()))
            if p.releasable:
                release_pages(src)


    def _build(self) -> None:
        """Index the files, check the layout is one this reader understands, map every key."""
        self._refuse_unsupported_files()
        parsed, zero3_models = self._index_files()
        model0_path = self._model_files[0]
        model0 = self._load(model0_path)
        osds = self._check_states(model0_path, model0, zero3_models)
        self._describe(model0, bf16_file_names=any(bf16 for _, _, bf16 in parsed))
        self._entries = self._map_keys(model0_path, model0, osds)
        if self._structures:
            self._entries = self._place_in_objects(self._entries)
            for structure in self._structures.values():
                structure.close()
            self._structures = {}
        else:
            self._entries = self._place_in_files(self._entries)

    def _place_in_files(self, entries: dict[str, _Entry]) -> dict[str, _Entry]:
        """Whole stored tensors (buffers, frozen parameters) whose place in their file is known
        as pieces read from the file, like the partitions: their bytes are then checked too."""
        places = {ptr: (path, start) for path in list(self._states) if not is_remote(path)
                  for ptr, start in (self._storage_offsets(path) or {}).items()}
        for key, entry in entries.items():
            t = entry.tensor
            where = places.get(t.untyped_storage().data_ptr()) if t is not None and t.is_contiguous() else None
            if t is not None and where is not None and t.numel():
                flat = t.reshape(-1)
                piece = _Piece(0, t.numel(), flat, 0, entry.releasable, where[0],
                               where[1] + flat.storage_offset() * flat.element_size())
                entries[key] = dataclasses.replace(entry, pieces=(piece,), tensor=None)
        return entries

    def _place_in_objects(self, entries: dict[str, _Entry]) -> dict[str, _Entry]:
        """Every key of a checkpoint on object storage as byte spans of its objects: each
        ``meta`` tensor the structure gave becomes a piece read by ranged requests."""
        owners = {ident: structure for structure in self._structures.values() for ident in structure.storages}

        def place(src: torch.Tensor) -> tuple[Path, int]:
            structure = owners.get(id(src.untyped_storage()))
            if structure is None or src.dim() != 1 or (src.numel() > 1 and src.stride() != (1,)):
                raise CheckpointFormatError(self.tag_dir, "a tensor is not stored as one contiguous span")
            name, start, size, crc = meta_member(structure, src)
            self.read_checks.expect(str(structure.path), start, size, crc, f"zip member {name!r}")
            return structure.path, start + src.storage_offset() * src.element_size()

        placed: dict[str, _Entry] = {}
        for key, entry in entries.items():
            pieces = list(entry.pieces)
            if entry.tensor is not None:
                t = entry.tensor
                if not t.is_contiguous():
                    raise CheckpointFormatError(self.tag_dir, f"{key} is not stored contiguously")
                pieces = [_Piece(0, t.numel(), t.reshape(-1), 0)] if t.numel() else []
            for i, p in enumerate(pieces):
                if p.file is None or not is_remote(p.file):
                    file, start = place(p.src)
                    pieces[i] = dataclasses.replace(p, file=file, file_start=start, releasable=False)
            placed[key] = dataclasses.replace(entry, pieces=tuple(pieces), tensor=None, releasable=False)
        return placed


    def _index_files(self) -> tuple[list[tuple[int, Path, bool]], list[tuple[int, Path]]]:
        """Sort the rank files by data-parallel rank; refuse names this reader does not know."""
        tag_dir = self.tag_dir
        models, optims = ds_files(tag_dir)
        parsed = []
        for p in optims:
            m = OPTIM_RE.match(p.name)
            if m is None:
                raise CheckpointFormatError(p, "unrecognised optimizer-states file name")
            parsed.append((int(m.group(2)), p, bool(m.group(1))))
        parsed.sort(key=lambda t: t[0])
        self._optim_files = [p for _, p, _ in parsed]
        reason = name_gaps(tag_dir)
        if reason:
            raise CheckpointFormatError(tag_dir, reason)

        zero3_models = sorted(
            ((int(m.group(1)), p) for p in models if (m := ZERO3_MODEL_RE.match(p.name))),
            key=lambda t: t[0],
        )
        self._model_files = model_files(models)
        if not self._model_files:
            raise CheckpointFormatError(models[0], "unrecognised model-states file name")
        return parsed, zero3_models


    def _check_states(
        self, model0_path: Path, model0: Any, zero3_models: list[tuple[int, Path]]
    ) -> list[dict[str, Any]]:
        """Stage, world size and file counts; returns each rank's ``optimizer_state_dict``."""
        tag_dir = self.tag_dir
        if not isinstance(model0, dict) or "buffer_names" not in model0:
            raise CheckpointFormatError(model0_path, "not a DeepSpeed model-states file (no buffer_names)")
        for moe_key in ("num_experts", "ds_autoep_layers", "ds_autoep_layers_v1"):
            if model0.get(moe_key):
                raise CheckpointFormatError(
                    model0_path, f"mixture-of-experts checkpoints ({moe_key}) are not supported"
                )
        if model0.get("mp_world_size", 1) not in (None, 1):
            raise CheckpointFormatError(
                model0_path,
                f"tensor-parallel checkpoints (mp_world_size={model0['mp_world_size']}) are not supported",
            )

        self._load_remote([*self._optim_files, *self._model_files])
        osds = []
        for p in self._optim_files:
            state = self._load(p)
            osd = state.get("optimizer_state_dict") if isinstance(state, dict) else None
            if not isinstance(osd, dict):
                raise CheckpointFormatError(
                    p, "not a DeepSpeed optimizer-states file (no optimizer_state_dict)"
                )
            osds.append(osd)
        osd0 = osds[0]
        if "zero_stage" in osd0:
            self.stage = int(osd0["zero_stage"])
            self.optimizer_kind = "zero"
        elif "single_partition_of_fp32_groups" in osd0:
            self.stage = 1  # BF16_Optimizer: ZeRO-1 layout, no zero_stage, no loss scaler
            self.optimizer_kind = "bf16_optimizer"
        else:
            raise CheckpointFormatError(self._optim_files[0], "not a ZeRO checkpoint (no zero_stage)")
        if self.stage not in (1, 2, 3):
            raise CheckpointFormatError(self._optim_files[0], f"ZeRO stage {self.stage} is not supported")

        counts = osd0.get("partition_count")
        if isinstance(counts, list | tuple):
            if len(set(counts)) > 1:
                raise CheckpointFormatError(
                    self._optim_files[0],
                    f"parameter groups are split over different rank counts {list(counts)} "
                    "(expert or hierarchical partitioning), which is not supported",
                )
            counts = counts[0] if counts else None
        if not isinstance(counts, int) or counts < 1:
            raise CheckpointFormatError(
                self._optim_files[0], f"bad partition_count {osd0.get('partition_count')!r}"
            )
        self.world_size = counts
        if counts != len(self._optim_files):
            raise CheckpointFormatError(
                tag_dir,
                f"expected {counts} *_optim_states.pt files (partition_count) but found "
                f"{len(self._optim_files)}: an old checkpoint was overwritten, a rank did not save, "
                "or the run used hierarchical partitioning (MiCS/hpZ), which is not supported",
            )
        if self.stage == 3 and len(self._model_files) != counts:
            raise CheckpointFormatError(
                tag_dir, f"expected {counts} ZeRO-3 model-states files but found {len(self._model_files)}"
            )
        if self.stage < 3 and zero3_models:
            raise CheckpointFormatError(
                zero3_models[0][1], f"ZeRO-3 model-states file in a stage-{self.stage} checkpoint"
            )
        return osds


    def _describe(self, model0: dict[str, Any], *, bf16_file_names: bool) -> None:
        """Training dtype, DeepSpeed version and step, for ``info()`` and ``step``."""
        ds_config = model0.get("ds_config")
        if not isinstance(ds_config, dict):
            ds_config = {}
        if bf16_file_names or (ds_config.get("bf16") or {}).get("enabled"):
            self.train_dtype = "bf16"
        elif (ds_config.get("fp16") or {}).get("enabled"):
            self.train_dtype = "fp16"
        else:
            self.train_dtype = "fp32"
        self.ds_version = str(model0.get("ds_version")) if model0.get("ds_version") is not None else None
        self.step = step_from(model0.get("global_steps"), self.tag)

    def _refuse_unsupported_files(self) -> None:
        for child in sorted(self.tag_dir.iterdir()):
            name = child.name
            if child.is_dir() and name == "offloaded_tensors":
                raise CheckpointFormatError(child, "NVMe-offloaded optimizer state is not supported")
            for pattern, what in UNSUPPORTED_FILES:
                if pattern.match(name):
                    raise CheckpointFormatError(child, f"{what} are not supported")
            m = re.search(r"mp_rank_(\d+)", name)
            if m and int(m.group(1)) != 0 and name.endswith(".pt"):
                raise CheckpointFormatError(
                    child, "tensor-parallel checkpoints (mp_rank_01 and up) are not supported"
                )



def _structure_of(path: Path) -> RemoteStructure:
    """An object's structure: a model-states file's shared per version, an optimizer file's its own."""
    return remote_structure(path) if path.name.endswith("model_states.pt") else load_ds_structure(path)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells one version of a file from another: device, inode, size, modification time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def open_deepspeed(path: str | Path) -> DeepSpeedReader:
    """Open a DeepSpeed checkpoint (tag folder, or a folder whose ``latest`` names one)."""
    return DeepSpeedReader(path)



register_format(
    CheckpointFormat(
        name=FORMAT_NAME,
        detect=is_deepspeed,
        open=open_deepspeed,
        incomplete=incomplete,
        records_step=True,
        step_label="DeepSpeed global_steps",
        step_of=DeepSpeedReader.step_of,
        remote=True,
    )
)

