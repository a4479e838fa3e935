"""The built-in output formats, each an :class:`~ema_ckpt.writers.base.OutputWriter`.

* ``dcp``: a DCP checkpoint directory; regions follow the source's stored chunks (or, for
  ``reshard``, dim-0 shards for N ranks); files of bounded size per rank.
* ``safetensors`` (one ``.safetensors`` file) and ``hf-sharded`` (a directory of shards and
  ``model.safetensors.index.json``): tensors in row blocks of bounded size, or as stored
  bytes copied file to file when nothing is cast.
* ``torch``: a ``.pt``/``.bin``/``.pth`` file of a flat state dict.

Adding a format: a class implementing the contract and one :func:`register_output` call.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dtypes import itemsize, torch_dtype
from ..errors import OutputError
from ..layout import Box, dim0_shard_regions, row_blocks, split_rows
from .base import OutputFormat, OutputTensor, OutputWriter, PlannedRegion, WrittenFile, register_output

if TYPE_CHECKING:
    import torch

    from ..formats.base import CheckpointReader

DEFAULT_FILE_BYTES = 256 << 20
"""Largest DCP data file the engine starts (a file is the unit workers share out)."""
MIN_FILE_BYTES = 16 << 20
DEFAULT_CHUNK_BYTES = 16 << 20
"""Largest chunk a DCP output stores when it follows the source's layout: a larger stored chunk
is written as several, each whole rows of it, so the engine holds a few of these per output
(a sweep of K outputs), never a few whole shards of each."""
# Each region also costs fixed Python work (records to parse, a record to write), about what
# reading 256 KiB costs: counted in, files of many small tensors split finely enough to share out.
REGION_OVERHEAD_BYTES = 256 << 10
BLOCK_BYTES = 64 << 20
"""Row blocks of a row-major output (safetensors, torch file): memory holds one at a time."""


def region_cost(region: PlannedRegion) -> int:
    """The work of one region, in bytes: its data plus the fixed per-region overhead."""
    return region.nbytes + REGION_OVERHEAD_BYTES


def _nbytes(box: Box, dtype: str) -> int:
    return box.numel * itemsize(dtype)


_DCP_DATA = re.compile(r"^__\d+_\d+(\.[0-9A-Za-z-]+)?\.distcp$")
_SAFETENSORS_FILES = re.compile(
    r"^(model|adapter_model)(-\d+-of-\d+)?(\.[0-9A-Za-z-]+)?\.safetensors$|^model\.safetensors\.index\.json$")


class DcpOutput(OutputWriter):
    """A DCP checkpoint directory, written chunk by chunk by any number of workers.

    Args:
        world_size: None keeps the source's chunks and ranks; N cuts every tensor on dim 0
            as FSDP2's ``fully_shard`` does, rank r's rows in ``__r_<part>.distcp``.
        max_file_bytes: split each rank's chunks into files of about this much work
            (None: one file per rank).
        max_chunk_bytes: with ``world_size`` None, cut a larger source chunk on its first
            dim into chunks of at most this many bytes (None: keep every chunk whole). The
            cut depends only on the layout, so an incremental run reads the previous EMA
            chunk for chunk.
        planner_data: DCP's key paths (``{"model.w": ("model", "w")}``) for ``.metadata``.
    """

    name = "dcp"

    def __init__(self, staging: Path, final_name: str, *, world_size: int | None = None,
                 max_file_bytes: int | None = DEFAULT_FILE_BYTES,
                 max_chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
                 planner_data: Mapping[str, tuple[str, ...]] | None = None) -> None:
        super().__init__(staging, final_name)
        self.world_size = world_size
        self.max_file_bytes = max_file_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.planner_data = dict(planner_data or {})
        self._tensors: list[OutputTensor] = []
        self._files: dict[str, tuple[int, int]] = {}
        self._writer: Any = None

    def plan(self, tensors: Sequence[OutputTensor], source: CheckpointReader) -> list[PlannedRegion]:
        self._tensors = list(tensors)
        ranked: list[tuple[OutputTensor, Box, int]] = []
        for tensor in tensors:
            if self.world_size is not None:
                ranked.extend((tensor, box, rank) for rank, box in dim0_shard_regions(tensor.shape, self.world_size))
                continue
            chunks = [(c.box, c.rank or 0) for c in source.chunks(tensor.key)]
            limit = (None if self.max_chunk_bytes is None
                     else max(1, self.max_chunk_bytes // max(itemsize(tensor.stored_dtype), itemsize(tensor.dtype), 1)))
            for box, rank in chunks or [(Box.full(tensor.shape), 0)]:
                pieces = [box] if limit is None else split_rows(box, limit)
                ranked.extend((tensor, piece, rank) for piece in pieces)
        return self._split_files(ranked)

    def _split_files(self, ranked: Sequence[tuple[OutputTensor, Box, int]]) -> list[PlannedRegion]:
        """Give each rank's regions consecutive parts of at most ``max_file_bytes`` of work.

        The split depends only on the layout, never on the number of workers, so the
        output is the same bytes whatever their number.
        """
        from ..formats.dcp.writer import data_file_name

        rank_work: dict[int, int] = {}
        for tensor, box, rank in ranked:
            rank_work[rank] = rank_work.get(rank, 0) + _nbytes(box, tensor.stored_dtype) + REGION_OVERHEAD_BYTES
        used: dict[int, tuple[int, int]] = {}  # rank -> (part, work in it)
        regions = []
        for tensor, box, rank in ranked:
            nbytes = _nbytes(box, tensor.stored_dtype)
            part, size = used.get(rank, (0, 0))
            # about 8 parts per rank file (16 MiB to max_file_bytes each): enough to share out
            cap = (None if self.max_file_bytes is None
                   else min(self.max_file_bytes, max(MIN_FILE_BYTES, rank_work[rank] // 8)))
            if cap is not None and size and size + nbytes + REGION_OVERHEAD_BYTES > cap:
                part, size = part + 1, 0
            used[rank] = (part, size + nbytes + REGION_OVERHEAD_BYTES)
            file = data_file_name(rank, part, self.file_tag)
            self._files[file] = (rank, part)
            regions.append(PlannedRegion(tensor.key, box, file, nbytes))
        return regions

    def _open(self) -> Any:
        if self._writer is None:
            from ..formats.dcp.writer import DcpWriter

            self._writer = DcpWriter(self.staging, file_tag=self.file_tag)
            for tensor in self._tensors:
                self._writer.declare(tensor.key, tensor.shape, torch_dtype(tensor.dtype))
        return self._writer

    def write(self, region: PlannedRegion, tensor: torch.Tensor) -> None:
        rank, part = self._files[region.file]
        self._open().write(region.key, region.box, tensor, rank=rank, part=part)

    def close(self) -> Any:
        return self._open().close()

    def finish(self, states: Sequence[Any]) -> list[WrittenFile]:
        from ..formats.dcp.writer import DcpWriter

        # holds no tensor data of its own: merges every worker's state; the carried entries go in a part of their own
        merger = DcpWriter(self.staging, file_tag=self.file_tag)
        for tensor in self._tensors:
            merger.declare(tensor.key, tensor.shape, torch_dtype(tensor.dtype))
        part = 1 + max((p for rank, p in self._files.values() if rank == 0), default=-1)
        for key, record in sorted(self.carried_entries.items()):
            merger.write_bytes(key, record, rank=0, part=part)
        files = merger.finish(self.planner_data, others=list(states), key_order=[t.key for t in self._tensors])
        return [WrittenFile(f.name, f.size, f.crc32) for f in files] + self.write_carried()

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()

    def own_files(self, state: Any) -> list[str]:
        return [f.name for f in state.files]

    def index_files(self) -> list[str]:
        return [".metadata"]

    def owns(self, name: str) -> bool:
        return name == ".metadata" or _DCP_DATA.match(name) is not None


class SafetensorsOutput(OutputWriter):
    """One ``.safetensors`` file, or (``max_shard_bytes``) the Hugging Face sharded layout.

    When no tensor is cast and the source can say where each tensor's bytes lie, every
    tensor is one raw region: the kernel copies its bytes file to file and torch is never
    imported.
    """

    name = "safetensors"

    def __init__(self, staging: Path, final_name: str, *, max_shard_bytes: int | None = None,
                 block_bytes: int = BLOCK_BYTES) -> None:
        super().__init__(staging, final_name)
        self.single_file = max_shard_bytes is None
        self.max_shard_bytes = max_shard_bytes
        self.block_bytes = block_bytes
        self._by_file: dict[str, list[OutputTensor]] = {}
        self._tensors: dict[str, OutputTensor] = {}
        self._open_file: tuple[str, Any] | None = None
        self._written: dict[str, tuple[int, int | None]] = {}

    def plan(self, tensors: Sequence[OutputTensor], source: CheckpointReader) -> list[PlannedRegion]:
        from ..formats.safetensors.writer import ADAPTER_CONFIG, check_key, plan_shards, shard_file_names

        for tensor in tensors:  # before anything is written: a key the format cannot hold
            check_key(tensor.name, self.shown_path)
        self._tensors = {t.key: t for t in tensors}
        if self.max_shard_bytes is None:
            groups = [list(tensors)]
            names = [self.final_name]
        else:
            sizes = [(t.key, math.prod(t.shape) * itemsize(t.dtype)) for t in tensors]
            shards = plan_shards(sizes, self.max_shard_bytes)
            groups = [[self._tensors[k] for k in shard] for shard in shards]
            adapter = any(f.name == ADAPTER_CONFIG for f in self.carried)  # peft loads adapter_model.safetensors
            names = shard_file_names(len(shards), self.file_tag, adapter=adapter)
        raw = self.may_copy_stored and self.copies_stored(tensors, source)
        regions = []
        for name, group in zip(names, groups, strict=True):
            self._by_file[name] = group
            for tensor in group:
                if raw:
                    full = Box.full(tensor.shape)
                    regions.append(PlannedRegion(tensor.key, full, name, _nbytes(full, tensor.dtype), raw=True))
                    continue
                regions.extend(_row_block_regions([tensor], source, name, self.block_bytes))
        return regions

    def copies_stored(self, tensors: Sequence[OutputTensor], source: CheckpointReader) -> bool:
        """Every tensor is stored as it is in ``source`` (no cast) and as plain runs of bytes."""
        return all(t.dtype == t.stored_dtype for t in tensors) and all(
            source.byte_ranges(t.key) is not None for t in tensors)

    def _file_for(self, region: PlannedRegion) -> Any:
        from ..formats.safetensors.writer import SafetensorsFileWriter

        if self._open_file is not None and self._open_file[0] == region.file:
            return self._open_file[1]
        self._end_open_file()
        writer = SafetensorsFileWriter(self.staging / region.file)
        writer.begin([(t.name, t.shape, t.dtype) for t in self._by_file[region.file]])
        self._open_file = (region.file, writer)
        return writer

    def _end_open_file(self) -> None:
        if self._open_file is not None:
            name, writer = self._open_file
            self._open_file = None
            self._written[name] = (writer.finish(), writer.crc32)

    def write(self, region: PlannedRegion, tensor: torch.Tensor) -> None:
        self._file_for(region).write(self._tensors[region.key].name, tensor)

    def copy_stored(self, region: PlannedRegion, source: CheckpointReader) -> None:
        writer = self._file_for(region)
        name = self._tensors[region.key].name
        checks = source.read_checks
        for file, offset, length in source.byte_ranges(region.key) or [("", 0, 0)]:  # an empty tensor has no runs
            fd = source.open_data(file) if length else -1
            # bytes with a stored CRC-32 go through memory to be checked: never copied unseen
            seen = (functools.partial(checks.saw, file)
                    if checks is not None and length and checks.wants(file, offset, length) else None)
            writer.copy_range(name, source.path / file, fd, offset, length, seen=seen)

    def close(self) -> dict[str, tuple[int, int | None]]:
        self._end_open_file()
        return dict(self._written)

    def finish(self, states: Sequence[Any]) -> list[WrittenFile]:
        from ..formats.safetensors.writer import INDEX_NAME, write_index

        written: dict[str, tuple[int, int | None]] = {}
        for state in states:
            written.update(state)
        files = [WrittenFile(name, *written[name]) for name in self._by_file]
        if len(self._by_file) > 1:
            weight_map = {t.name: name for name, group in self._by_file.items() for t in group}
            total = sum(math.prod(t.shape) * itemsize(t.dtype) for t in self._tensors.values())
            write_index(self.staging, weight_map, total)
            files.append(WrittenFile(INDEX_NAME, (self.staging / INDEX_NAME).stat().st_size, role="index"))
        return files + self.write_carried()

    def abort(self) -> None:
        if self._open_file is not None:
            self._open_file[1].abort()
            self._open_file = None

    def own_files(self, state: Any) -> list[str]:
        return list(state)

    def owns(self, name: str) -> bool:
        return _SAFETENSORS_FILES.match(name) is not None


class TorchFileOutput(OutputWriter):
    """A ``torch.save``-format file of a flat state dict, streamed in row blocks
    (``torch.load(weights_only=True)`` reads it)."""

    name = "torch"
    single_file = True

    def __init__(self, staging: Path, final_name: str, *, block_bytes: int = BLOCK_BYTES) -> None:
        super().__init__(staging, final_name)
        self.block_bytes = block_bytes
        self._tensors: dict[str, OutputTensor] = {}
        self._writer: Any = None
        self._size: dict[str, int] = {}

    def plan(self, tensors: Sequence[OutputTensor], source: CheckpointReader) -> list[PlannedRegion]:
        self._tensors = {t.key: t for t in tensors}
        return _row_block_regions(tensors, source, self.final_name, self.block_bytes)

    def wrap(self) -> Callable[[bytes], bytes] | None:
        """What the file's pickle holds around the state dict (None: the state dict alone)."""
        return None

    def write(self, region: PlannedRegion, tensor: torch.Tensor) -> None:
        if self._writer is None:
            from ..torch_records import StateDictFileWriter

            wrap = self.wrap()
            self._writer = self._guarded(lambda: StateDictFileWriter(
                self.staging / self.final_name,
                [(t.name, t.shape, torch_dtype(t.dtype)) for t in self._tensors.values()], wrap=wrap))
        self._guarded(lambda: self._writer.write(self._tensors[region.key].name, tensor))

    def close(self) -> dict[str, int]:
        if self._writer is not None:
            self._size[self.final_name] = self._guarded(self._writer.finish)
            self._writer = None
        return dict(self._size)

    def _guarded(self, step: Any) -> Any:
        try:
            return step()
        except OSError as err:
            raise OutputError(f"{self.staging / self.final_name}: write failed ({err.strerror})") from None

    def finish(self, states: Sequence[Any]) -> list[WrittenFile]:
        sizes = {name: size for state in states for name, size in state.items()}
        return [WrittenFile(self.final_name, sizes[self.final_name])]

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


class LightningCheckpointOutput(TorchFileOutput):
    """A Lightning checkpoint (``.ckpt``): the weights as its ``state_dict``, beside the source's
    own entries that hold no tensor (``hyper_parameters``, ``epoch``, ``global_step``, carried
    from a single file or a sharded checkpoint's ``meta.pt``), so ``load_from_checkpoint`` loads
    it; ``pytorch-lightning_version`` is added when the source had none."""

    name = "lightning"

    def wrap(self) -> Callable[[bytes], bytes]:
        from ..formats.torch_file.reader import carried_trainer_state
        from ..torch_records.emit import wrap_pickle

        beside = carried_trainer_state(self.carried, str(self.shown_path))
        beside.setdefault(LIGHTNING_VERSION_KEY, _lightning_version())
        return lambda inner: wrap_pickle(inner, "state_dict", beside)


LIGHTNING_VERSION_KEY = "pytorch-lightning_version"


def _lightning_version() -> str:
    """The installed Lightning's version (read from its metadata, never imported), else 2.0.0."""
    import importlib.metadata

    for distribution in ("lightning", "pytorch-lightning"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "2.0.0"


def _row_block_regions(tensors: Sequence[OutputTensor], source: CheckpointReader, file: str,
                       block_bytes: int) -> list[PlannedRegion]:
    """Each tensor in blocks of whole rows (following the stored chunks where they allow)."""
    regions = []
    for tensor in tensors:
        limit = max(1, block_bytes // max(itemsize(tensor.stored_dtype), 1))
        for box in row_blocks(tensor.shape, list(source.layout(tensor.key)), limit):
            regions.append(PlannedRegion(tensor.key, box, file, _nbytes(box, tensor.stored_dtype)))
    return regions


register_output(OutputFormat("dcp", DcpOutput))
register_output(OutputFormat("safetensors", SafetensorsOutput, suffixes=(".safetensors",), single_file=True))
register_output(OutputFormat("hf-sharded", SafetensorsOutput, is_default=True, settings=("max_shard_bytes",)))
register_output(OutputFormat("torch", TorchFileOutput, suffixes=(".pt", ".bin", ".pth", ".tar"), single_file=True))
register_output(OutputFormat("lightning", LightningCheckpointOutput, suffixes=(".ckpt",), single_file=True))
