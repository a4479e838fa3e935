"""DeepSpeed ZeRO 1/2/3 checkpoints, read without DeepSpeed.

A DeepSpeed checkpoint is a *tag folder* (``save_dir/global_step1000/``) of
``*_model_states.pt`` files and one ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per
data-parallel rank; ``save_dir/latest`` names the newest tag. The reader serves the fp32 master
weights as ``zero_to_fp32`` rebuilds them, bit for bit, plus the frozen parameters it drops at
ZeRO-1 (from ``module``, in their saved dtype); buffers come from ``module`` (floating ones
upcast to fp32, as ``zero_to_fp32`` does); a tied parameter reads its owner's data.

Nothing is gathered at open: each key knows which flat ranges of which files hold it, and
``read`` takes only the span covering the box asked for (fp32 partitions by ``pread`` into the
caller's buffer, the Adam moments never touched; anything else from the memory map, whose pages
are then handed back, :func:`~.unpickle.release_pages`). ``layout`` offers tensors over 32 MiB
as row blocks. In object storage each file's structure is read by ranged requests
(:func:`~.structure.load_ds_structure`) and ``read`` fetches the spans it needs.

Example:
    >>> from ema_ckpt.formats import open_checkpoint                  # doctest: +SKIP
    >>> with open_checkpoint("out/checkpoint-500") as reader:          # doctest: +SKIP
    ...     reader.info()["stage"], reader.step
    (3, 500)
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..._lazy import torch
from ...errors import CheckpointFormatError, CheckpointNotFoundError, EmaCkptError, one_line
from ...layout import Box, TensorSpec, split_rows
from ...storage import Location, Source, as_path
from ...torch_records.checks import ReadChecks
from ...torch_records.pickles import row_major_strides
from ..base import CheckpointFormat, CheckpointReader, register_format
from .files import FORMAT_NAME, find_tag_dir, incomplete, is_deepspeed, step_from, step_of
from .params import Entry, ParameterMaps
from .pieces import RELEASE_SLICE_BYTES, PieceReads
from .structure import RemoteStructure
from .tag import TagFiles
from .unpickle import release_pages

_REGION_BYTES = 32 << 20  # layout(): larger tensors are served in row blocks of at most this


class DeepSpeedReader(TagFiles, PieceReads, ParameterMaps, CheckpointReader):
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
    path: Location
    step: int | None
    """``global_steps`` from the model states, else the number in the tag name, else None."""

    tag_dir: Location
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

    def __init__(self, path: str | Location) -> None:
        self.path = as_path(path)
        tag_dir = find_tag_dir(self.path)
        if tag_dir is None:
            raise CheckpointNotFoundError(self.path, incomplete(self.path)
                                          or "no DeepSpeed tag folder (no *_model_states.pt and *optim_states.pt)")
        self.tag_dir = tag_dir
        self.tag = tag_dir.name
        self._states: dict[Location, Any] = {}  # file -> loaded (memory-mapped) object
        self._releasable: dict[Location, bool] = {}  # file -> its mapped pages may be dropped
        self._identities: dict[Location, tuple[int, ...]] = {}  # file -> (dev, inode, size, mtime) when mapped
        self._offsets: dict[Location, dict[int, int] | None] = {}  # file -> its storages' places (see _storage_offsets)
        self._entries: dict[str, Entry] = {}
        self._specs: dict[str, TensorSpec] = {}  # built once: the engine asks per region
        self._structures: dict[Location, RemoteStructure] = {}  # object -> its structure, while building
        self._sizes: dict[Location, int] = {}  # object -> its size in bytes
        self._remote: dict[tuple[Location, int], Source] = {}  # (object, first byte) -> a stored tensor's reads
        self._remote_lock = threading.Lock()
        self._blocks: dict[tuple[Location, int], torch.Tensor] = {}  # read blocks of flat partitions (see _from_block)
        self._closed = False
        self.read_checks = ReadChecks(str, self._read_back)  # files named by their full path
        try:
            self._build()
        except Exception as err:  # any malformed field: one line naming the checkpoint
            self.close()
            if isinstance(err, EmaCkptError):
                raise
            message = f"malformed DeepSpeed checkpoint ({one_line(err)[:200]})"
            raise CheckpointFormatError(self.tag_dir, message) from None

    def specs(self) -> Mapping[str, TensorSpec]:
        self._check_open()
        return self._specs

    def layout(self, key: str) -> Sequence[Box]:
        """Whole rows, at most 32 MiB each: a ZeRO share is a flat range with no stored boxes to
        follow, and one box per tensor would make memory scale with the largest parameter."""
        spec = self._entry(key).spec
        if spec.numel == 0:
            return []
        return split_rows(Box.full(spec.shape), max(1, _REGION_BYTES // max(1, spec.dtype.itemsize)))

    whole_file_records = True

    @classmethod
    def step_of(cls, path: Location) -> int | None:
        """``global_steps`` from the first model-states file alone (see :func:`.files.step_of`)."""
        return step_of(path)

    def stored_records(self) -> Sequence[tuple[str, int, int]]:
        """Every ``.pt`` file of the tag folder, each one ``torch.save`` zip (relative to :attr:`path`)."""
        self._check_open()
        base = self.tag_dir.name if self.tag_dir != self.path else ""
        files = sorted(p for p in self.tag_dir.iterdir() if p.name.endswith(".pt"))
        return [(f"{base}/{p.name}" if base else p.name, 0, p.stat().st_size) for p in files]

    def data_ranges(self) -> list[tuple[Location, int, int]]:
        """``(file, offset, length)``, merged: what reading every key takes (the optimizer files'
        fp32 partitions, not those read through the map; the model-states files whole), a
        benchmark's floor.

        Example:
            >>> sum(n for _, _, n in reader.data_ranges())  # doctest: +SKIP
            1088548864
        """
        self._check_open()
        ranges: dict[Location, list[tuple[int, int]]] = {p: [(0, p.stat().st_size)] for p in self._model_files}
        for entry in self._entries.values():
            for p in entry.pieces:
                if p.file is not None:
                    start = p.file_start + p.start * p.src.element_size()
                    ranges.setdefault(p.file, []).append((start, start + p.length * p.src.element_size()))
        merged: list[tuple[Location, int, int]] = []
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
            rows = max(1, RELEASE_SLICE_BYTES // max(1, row))
            for r in range(0, part.shape[0], rows) if part.dim() else (None,):
                dst, src = (out, part) if r is None else (out[r : r + rows], part[r : r + rows])
                dst.copy_(src)
                release_pages(src)
            return out
        strides = row_major_strides(shape)
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
        self._blocks = {}
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

    def _entry(self, key: str) -> Entry:
        self._check_open()
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"{key!r} is not a tensor of {self.tag_dir}") from None

    def _build(self) -> None:
        self._refuse_unsupported_files()
        bf16_file_names = self._index_files()
        model0_path = self._model_files[0]
        model0 = self._load(model0_path)
        osds = self._check_states(model0_path, model0)
        self._describe(model0, bf16_file_names=bf16_file_names)
        self._entries = self._map_keys(model0_path, model0, osds)
        if self._structures:
            self._entries = self._place_in_objects(self._entries)
            for structure in self._structures.values():
                structure.close()
            self._structures = {}
        else:
            self._entries = self._place_in_files(self._entries)
        self._specs = {k: e.spec for k, e in self._entries.items()}
        # The loaded files were needed to map the keys only: the entries hold what reads use (the
        # mappings stay alive through them), so a ZeRO-3 model-states file's tensor per parameter goes.
        self._states = {}

    def _describe(self, model0: dict[str, Any], *, bf16_file_names: bool) -> None:
        ds_config = model0.get("ds_config")
        if not isinstance(ds_config, dict):
            ds_config = {}
        if bf16_file_names or (ds_config.get("bf16") or {}).get("enabled"):
            self.train_dtype = "bf16"
        elif (ds_config.get("fp16") or {}).get("enabled"):
            self.train_dtype = "fp16"
        else:
            self.train_dtype = "fp32"
        version = model0.get("ds_version")
        self.ds_version = None if version is None else str(version)
        self.step = step_from(model0.get("global_steps"), self.tag)


register_format(
    CheckpointFormat(
        name=FORMAT_NAME,
        detect=is_deepspeed,
        open=lambda path, _read: DeepSpeedReader(path),
        incomplete=incomplete,
        records_step=True,
        step_label="DeepSpeed global_steps",
        step_of=DeepSpeedReader.step_of,
    )
)

