"""Where each key's data lies in a DeepSpeed checkpoint: ZeRO 1/2 and 3 parameter maps, frozen
parameters, buffers and tied aliases, as flat ranges of the memory-mapped rank tensors."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._lazy import torch
from ...errors import CheckpointFormatError
from ...layout import TensorSpec
from ...storage import Location
from ...torch_records import tensor_view_problem


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[dst, dst + length)`` of a key's flattened data are ``src[start : start + length]``."""

    dst: int
    length: int
    src: torch.Tensor  # 1-D, a view on a memory-mapped file
    start: int
    releasable: bool = False  # src's pages may be dropped after a copy (see release_pages)
    file: Location | None = None  # or read with pread: src[0] lies at byte ``file_start`` of this file
    file_start: int = 0


@dataclass(slots=True)
class Entry:
    """One key of the checkpoint: its spec, its kind, and where its data lies (pieces of flat
    ranges, one stored tensor, or the key it is tied to)."""

    spec: TensorSpec
    kind: str  # "param", "frozen", "buffer" or "tied"
    pieces: tuple[Piece, ...] = ()  # flat-range sources (ZeRO partitions)
    tensor: torch.Tensor | None = None  # or one whole stored tensor (buffers, stage 1/2 frozen)
    owner: str | None = None  # for "tied": the key whose data this one reads
    releasable: bool = False  # ``tensor``'s pages may be dropped after a copy


class _FlatChunks:
    """Several 1-D tensors seen as their concatenation, without concatenating them."""

    def __init__(self, chunks: Sequence[torch.Tensor], releasable: Sequence[bool],
                 files: Sequence[tuple[Location, int] | None]) -> None:
        self.chunks, self.releasable, self.files = list(chunks), list(releasable), list(files)
        self.starts = [0]
        for c in self.chunks:
            self.starts.append(self.starts[-1] + c.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def pieces(self, start: int, length: int, dst: int) -> list[Piece]:
        """Pieces for ``concat[start : start + length]`` placed at ``dst`` of a key."""
        out: list[Piece] = []
        end = start + length
        for i, chunk in enumerate(self.chunks):
            lo, hi = max(start, self.starts[i]), min(end, self.starts[i + 1])
            if lo < hi:
                file, file_start = self.files[i] or (None, 0)
                out.append(Piece(dst + lo - start, hi - lo, chunk, lo - self.starts[i], self.releasable[i],
                                 file, file_start))
        return out


def _check_view(t: torch.Tensor, where: Location, what: str) -> None:
    """Refuse a loaded tensor whose view does not fit its storage or repeats it (a stride of 0:
    a few stored bytes claiming terabytes), before anything is sized or copied from it."""
    problem = tensor_view_problem(t)
    if problem is not None:
        raise CheckpointFormatError(where, f"{what}: {problem}")


def _check_disjoint(flats: Sequence[torch.Tensor], where: Location, what: str) -> None:
    """Refuse flat groups of one file whose bytes overlap (each group is its own partition)."""
    spans = sorted(
        (t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(),
         (t.storage_offset() + t.numel()) * t.element_size(), i)
        for i, t in enumerate(flats) if t.device.type == "cpu" and t.numel())
    last: tuple[int, int, int] | None = None  # (storage, furthest end so far, its group)
    for ptr, start, end, i in spans:
        if last is not None and last[0] == ptr and start < last[1]:
            raise CheckpointFormatError(where, f"{what}[{last[2]}] and {what}[{i}] overlap in one storage")
        if last is None or last[0] != ptr or end > last[1]:
            last = (ptr, end, i)


def _flat(t: Any, where: Location, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CheckpointFormatError(where, f"{what} is {type(t).__name__}, not a tensor")
    _check_view(t, where, what)
    if t.dim() != 1:
        t = t.reshape(-1)
    return t


def _same_storage(view: torch.Tensor, original: torch.Tensor) -> bool:
    """Whether ``view`` still shares ``original``'s memory (``reshape`` copies when it must)."""
    return bool(view.untyped_storage().data_ptr() == original.untyped_storage().data_ptr())


def _shape(value: Any, where: Location, name: str) -> tuple[int, ...]:
    """A recorded shape as a tuple of non-negative ints, or a format error naming the file."""
    try:
        shape = tuple(int(d) for d in value)
    except (TypeError, ValueError):
        raise CheckpointFormatError(where, f"shape of {name} is not a list of sizes: {value!r}") from None
    if any(d < 0 for d in shape):
        raise CheckpointFormatError(where, f"shape of {name} has a negative size: {shape}")
    return shape


class ParameterMaps:
    """Building the key map of a :class:`~.reader.DeepSpeedReader` (a base class of it)."""

    tag_dir: Location
    stage: int
    world_size: int
    master_dtype: torch.dtype
    _optim_files: list[Location]
    _model_files: list[Location]
    _releasable: dict[Location, bool]
    _load: Callable[[Location], Any]
    _storage_offsets: Callable[[Location], dict[int, int] | None]

    def _file_places(self, path: Location, flats: Sequence[torch.Tensor],
                     loaded: Sequence[Any]) -> list[tuple[Location, int] | None]:
        """For each flat tensor of ``path``, ``(path, byte offset of its first element)`` when it can
        be read from the file directly (see :func:`~.unpickle.storage_file_offsets`), else None."""
        offsets = self._storage_offsets(path) if self._releasable[path] else None
        places: list[tuple[Location, int] | None] = []
        for flat, original in zip(flats, loaded, strict=True):
            start = offsets.get(flat.untyped_storage().data_ptr()) if offsets is not None else None
            if start is None or not _same_storage(flat, original) or flat.stride() != (1,):
                places.append(None)
            else:
                places.append((path, start + flat.storage_offset() * flat.element_size()))
        return places

    def _map_keys(self, model0_path: Location, model0: dict[str, Any], osds: list[dict[str, Any]]) -> dict[str, Entry]:
        """Every key: buffers, frozen, trainable (masters), tied aliases; in state_dict order."""
        entries: dict[str, Entry] = {}
        module = model0.get("module") or {}
        if not isinstance(module, Mapping):
            raise CheckpointFormatError(model0_path, "'module' is not a state dict")
        for name, t in module.items():  # buffers and frozen weights are read from these
            if isinstance(t, torch.Tensor):
                _check_view(t, model0_path, f"key {name!r} of 'module'")
        buffer_names = list(model0.get("buffer_names") or [])
        for name in buffer_names:
            t = module.get(name)
            if not isinstance(t, torch.Tensor):
                continue
            dtype = torch.float32 if t.is_floating_point() else t.dtype
            spec = TensorSpec(name, tuple(t.shape), dtype)
            entries[name] = Entry(spec, "buffer", tensor=t, releasable=self._releasable[model0_path])

        param_shapes = model0.get("param_shapes")
        if not isinstance(param_shapes, list):
            raise CheckpointFormatError(model0_path, "no param_shapes (not a ZeRO checkpoint)")
        trainable = (self._stage12_params if self.stage <= 2 else self._stage3_params)(param_shapes, osds)
        entries.update(self._frozen(model0_path, model0, module, buffer_names, trainable))
        entries.update(trainable)
        masters = {e.pieces[0].src.dtype for e in trainable.values() if e.pieces}
        self.master_dtype = masters.pop() if len(masters) == 1 else torch.float32

        shared = model0.get("shared_params") or {}
        if not isinstance(shared, Mapping):
            raise CheckpointFormatError(model0_path, "shared_params is not a mapping")
        for alias, owner in shared.items():
            if owner in entries and alias not in entries:
                spec = entries[owner].spec
                entries[alias] = Entry(TensorSpec(alias, spec.shape, spec.dtype), "tied", owner=owner)

        # Keys in the module's own state_dict order where known, then zero_to_fp32's order.
        order = [k for k in module if k in entries]
        seen = set(order)
        order += [k for k in entries if k not in seen]
        return {k: entries[k] for k in order}

    def _rank_flats(self, key: str, osds: list[dict[str, Any]]) -> list[_FlatChunks]:
        """Each rank's flat groups under ``key``, checked, with their pages and places in the file."""
        per_rank = []
        for p, osd in zip(self._optim_files, osds, strict=True):
            groups = osd.get(key)
            if not isinstance(groups, list | tuple):
                raise CheckpointFormatError(p, f"no {key}")
            flats = [_flat(t, p, f"{key}[{i}]") for i, t in enumerate(groups)]
            _check_disjoint(flats, p, key)
            mapped = [self._releasable[p] and _same_storage(f, t) for f, t in zip(flats, groups, strict=True)]
            per_rank.append(_FlatChunks(flats, mapped, self._file_places(p, flats, groups)))
        return per_rank

    def _group_shapes(self, g: int, shapes: Any) -> Mapping[str, Any]:
        if not isinstance(shapes, Mapping):
            raise CheckpointFormatError(self._model_files[0], f"param_shapes[{g}] is not a mapping")
        return shapes

    def _stage12_params(self, param_shapes: list[Any], osds: list[dict[str, Any]]) -> dict[str, Entry]:
        per_rank = self._rank_flats("single_partition_of_fp32_groups", osds)
        n_groups = len(per_rank[0].chunks)
        if any(len(r.chunks) != n_groups for r in per_rank) or len(param_shapes) != n_groups:
            raise CheckpointFormatError(self._optim_files[0],
                                        f"{n_groups} flat groups per rank but {len(param_shapes)} param_shapes groups")
        alignment = osds[0].get("param_alignment_paddings")
        align_to = 2 * self.world_size  # DeepSpeed pads each group to a multiple of 2·ws
        entries: dict[str, Entry] = {}
        for g, shapes in enumerate(param_shapes):
            shapes = self._group_shapes(g, shapes)
            flat = _FlatChunks([r.chunks[g] for r in per_rank], [r.releasable[g] for r in per_rank],
                               [r.files[g] for r in per_rank])
            paddings = alignment[g] if alignment is not None else None
            if paddings is not None and len(paddings) != len(shapes):
                raise CheckpointFormatError(self._optim_files[0],
                                            f"group {g}: {len(paddings)} alignment paddings for {len(shapes)} params")
            offset = 0
            for j, (name, shape) in enumerate(shapes.items()):
                shape = _shape(shape, self._model_files[0], name)
                n = math.prod(shape)
                if offset + n > flat.numel:
                    raise CheckpointFormatError(
                        self.tag_dir, f"group {g}: {name} needs elements up to {offset + n} of {flat.numel}")
                spec = TensorSpec(name, shape, flat.chunks[0].dtype)
                entries[name] = Entry(spec, "param", pieces=tuple(flat.pieces(offset, n, 0)))
                offset += n + (int(paddings[j]) if paddings is not None else 0)
            if math.ceil(offset / align_to) != math.ceil(flat.numel / align_to):
                raise CheckpointFormatError(self.tag_dir, f"group {g}: consumed {offset} numels out of {flat.numel}; "
                                                          "the layout is not understood")
        return entries

    def _stage3_params(self, param_shapes: list[Any], osds: list[dict[str, Any]]) -> dict[str, Entry]:
        key = "fp32_flat_groups"
        ws = self.world_size
        per_rank = self._rank_flats(key, osds)
        merged = {name: _shape(shape, self._model_files[0], name)
                  for g, shapes in enumerate(param_shapes) for name, shape in self._group_shapes(g, shapes).items()}
        entries: dict[str, Entry] = {}
        offset = 0  # within every rank's flat (all sub-groups back to back)
        for name, shape in merged.items():
            n = math.prod(shape)
            part = math.ceil(n / ws)
            pieces: list[Piece] = []
            for r, flat in enumerate(per_rank):
                length = min(part, n - r * part)
                if length > 0:
                    pieces.extend(flat.pieces(offset, length, r * part))
            dtype = per_rank[0].chunks[0].dtype if per_rank[0].chunks else torch.float32
            entries[name] = Entry(TensorSpec(name, shape, dtype), "param", pieces=tuple(pieces))
            offset += part
        for p, flat in zip(self._optim_files, per_rank, strict=True):
            if flat.numel != offset:
                raise CheckpointFormatError(
                    p, f"consumed {offset} numels out of {flat.numel} in {key}; the layout is not understood")
        return entries

    def _frozen(self, model0_path: Location, model0: dict[str, Any], module: Mapping[str, Any],
                buffer_names: list[str], trainable: Mapping[str, Entry]) -> dict[str, Entry]:
        entries: dict[str, Entry] = {}
        shapes = model0.get("frozen_param_shapes")
        if shapes is not None and not isinstance(shapes, Mapping):
            raise CheckpointFormatError(model0_path, "frozen_param_shapes is not a mapping")
        if shapes is None:
            if self.stage == 3:
                return entries  # saved with exclude_frozen_parameters: nothing to read
            # ZeRO-1 records no frozen parameters (zero_to_fp32 drops them); they are the
            # module's tensors that are neither optimized nor buffers nor tied aliases.
            aliases = set((model0.get("shared_params") or {}).keys())
            skip = set(trainable) | set(buffer_names) | aliases
            for name, t in module.items():
                if name not in skip and isinstance(t, torch.Tensor):
                    entries[name] = Entry(TensorSpec(name, tuple(t.shape), t.dtype), "frozen", tensor=t,
                                          releasable=self._releasable[model0_path])
            return entries
        if self.stage <= 2:
            fragments = model0.get("frozen_param_fragments") or {}
            for name, shape in shapes.items():
                shape = _shape(shape, model0_path, name)
                t = fragments.get(name)
                if not isinstance(t, torch.Tensor) or t.numel() != math.prod(shape):
                    raise CheckpointFormatError(model0_path, f"frozen parameter {name} is missing or the wrong size")
                _check_view(t, model0_path, f"frozen parameter {name!r}")
                whole = t.reshape(shape)
                entries[name] = Entry(TensorSpec(name, shape, t.dtype), "frozen", tensor=whole,
                                      releasable=self._releasable[model0_path] and _same_storage(whole, t))
            return entries
        if not shapes:  # ZeRO-3 with nothing frozen: the other ranks' model states are not needed
            return entries
        ws = self.world_size
        per_rank = []
        for p in self._model_files:
            state = self._load(p)
            per_rank.append((p, (state.get("frozen_param_fragments") if isinstance(state, dict) else None) or {}))
        for name, shape in shapes.items():
            shape = _shape(shape, model0_path, name)
            n = math.prod(shape)
            part = math.ceil(n / ws)
            pieces = []
            dtype = None
            for r, (p, fragments) in enumerate(per_rank):
                t = fragments.get(name)
                if not isinstance(t, torch.Tensor) or t.numel() != part:
                    raise CheckpointFormatError(p, f"frozen fragment of {name} is missing or not {part} elements")
                _check_view(t, p, f"frozen fragment of {name!r}")
                dtype = t.dtype
                length = min(part, n - r * part)
                if length > 0:
                    flat = t.reshape(-1)
                    releasable = self._releasable[p] and _same_storage(flat, t)
                    pieces.append(Piece(r * part, length, flat, 0, releasable))
            entries[name] = Entry(TensorSpec(name, shape, dtype or torch.float32), "frozen", pieces=tuple(pieces))
        return entries

