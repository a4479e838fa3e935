"""The ``dcp`` output: a DCP checkpoint directory, its regions following the source's stored
chunks (or, for ``reshard``, dim-0 shards for N ranks), files of bounded size per rank.

Example:
    >>> from pathlib import Path; from ema_ckpt.writers.base import output_format
    >>> out = output_format("dcp").make(Path("staging"), "ema", world_size=2)   # reshard for 2 ranks
    >>> out.index_files(), out.owns("__1_0.distcp"), out.owns("model.safetensors")
    (['.metadata'], True, False)
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...dtypes import itemsize, torch_dtype
from ...layout import Box, dim0_shard_regions, split_rows
from ...writers.base import OutputFormat, OutputTensor, OutputWriter, PlannedRegion, WrittenFile, register_output
from ...writers.regions import DEFAULT_CHUNK_BYTES, DEFAULT_FILE_BYTES, MIN_FILE_BYTES, REGION_OVERHEAD_BYTES, box_bytes

if TYPE_CHECKING:
    import torch

    from ..base import CheckpointReader

_DCP_DATA = re.compile(r"^__\d+_\d+(\.[0-9A-Za-z-]+)?\.distcp$")


class DcpOutput(OutputWriter):
    """A DCP checkpoint directory, written chunk by chunk by any number of workers.

    Args:
        world_size: None keeps the source's chunks and ranks; N cuts every tensor on dim 0
            as FSDP2's ``fully_shard`` does.
        max_file_bytes: each rank's files hold about this much work (None: one file per rank).
        max_chunk_bytes: with ``world_size`` None, a larger source chunk is cut on dim 0 into
            chunks of at most this many bytes (None: whole).
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
        self.planner_data: Mapping[str, tuple[str, ...]] = planner_data if planner_data is not None else {}  # read only
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
        """Give each rank's regions consecutive parts of at most ``max_file_bytes`` of work
        (from the layout alone, never the number of workers)."""
        from .writer import data_file_name

        rank_work: dict[int, int] = {}
        for tensor, box, rank in ranked:
            rank_work[rank] = rank_work.get(rank, 0) + box_bytes(box, tensor.stored_dtype) + REGION_OVERHEAD_BYTES
        used: dict[int, tuple[int, int]] = {}  # rank -> (part, work in it)
        names: dict[tuple[int, int], str] = {}  # one string per file, shared by its regions
        regions = []
        for tensor, box, rank in ranked:
            nbytes = box_bytes(box, tensor.stored_dtype)
            part, size = used.get(rank, (0, 0))
            # about 8 parts per rank file (16 MiB to max_file_bytes each): enough to share out
            cap = (None if self.max_file_bytes is None
                   else min(self.max_file_bytes, max(MIN_FILE_BYTES, rank_work[rank] // 8)))
            if cap is not None and size and size + nbytes + REGION_OVERHEAD_BYTES > cap:
                part, size = part + 1, 0
            used[rank] = (part, size + nbytes + REGION_OVERHEAD_BYTES)
            file = names.get((rank, part))
            if file is None:
                file = names[(rank, part)] = data_file_name(rank, part, self.file_tag)
                self._files[file] = (rank, part)
            regions.append(PlannedRegion(tensor.key, box, file, nbytes))
        return regions

    def _new_writer(self) -> Any:
        from .writer import DcpWriter

        writer = DcpWriter(self.staging, file_tag=self.file_tag)
        for tensor in self._tensors:
            writer.declare(tensor.key, tensor.shape, torch_dtype(tensor.dtype))
        return writer

    def _open(self) -> Any:
        if self._writer is None:
            self._writer = self._new_writer()
        return self._writer

    def write(self, region: PlannedRegion, tensor: torch.Tensor) -> None:
        rank, part = self._files[region.file]
        self._open().write(region.key, region.box, tensor, rank=rank, part=part)

    def close(self) -> Any:
        return self._open().close()

    def finish(self, states: Sequence[Any]) -> list[WrittenFile]:
        # holds no tensor data of its own: merges every worker's state; the carried entries go in a part of their own
        merger = self._new_writer()
        part = 1 + max((p for rank, p in self._files.values() if rank == 0), default=-1)
        for key, record in sorted(self.carried_entries.items()):
            merger.write_bytes(key, record, rank=0, part=part)
        files: list[WrittenFile] = merger.finish(self.planner_data, others=list(states),
                                                 key_order=[t.key for t in self._tensors])
        return files + self.write_carried()

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()

    def own_files(self, state: Any) -> list[str]:
        return [f.name for f in state.files]

    def index_files(self) -> list[str]:
        return [".metadata"]

    def owns(self, name: str) -> bool:
        return name == ".metadata" or _DCP_DATA.match(name) is not None


register_output(OutputFormat("dcp", DcpOutput))
