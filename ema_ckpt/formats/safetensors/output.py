"""The ``safetensors`` output (one file) and ``hf-sharded`` (shards and
``model.safetensors.index.json``).

Example:
    >>> from pathlib import Path; from ema_ckpt.writers.base import output_format
    >>> out = output_format("hf-sharded").make(Path("staging"), "hf_ema", max_shard_bytes=5 << 30)
    >>> out.single_file, out.owns("model-00001-of-00002.safetensors"), out.owns("config.json")
    (False, True, False)
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...dtypes import itemsize
from ...layout import Box
from ...writers.base import OutputFormat, OutputTensor, OutputWriter, PlannedRegion, WrittenFile, register_output
from ...writers.regions import BLOCK_BYTES, box_bytes, row_block_regions
from ..base import SAFETENSORS_METADATA_FILE
from ..options import DEFAULT_READ, ReadOptions

if TYPE_CHECKING:
    import torch

    from ..base import CarriedFile, CheckpointReader

_SAFETENSORS_FILES = re.compile(
    r"^(model|adapter_model)(-\d+-of-\d+)?(\.[0-9A-Za-z-]+)?\.safetensors$|^model\.safetensors\.index\.json$")


class SafetensorsOutput(OutputWriter):
    """One ``.safetensors`` file, or (``max_shard_bytes``) the Hugging Face sharded layout.

    Tensors go in row blocks, or, when nothing is cast and the source knows where each
    tensor's bytes lie, as raw regions copied file to file (torch never imported). Each
    header's ``__metadata__``: ``format``, the source's carried header metadata, :attr:`provenance`.
    """

    name = "safetensors"
    provenance: Mapping[str, str] | None = None
    """The ``ema_ckpt.*`` header entries, set before :meth:`plan` by a caller that knows what it
    writes; None: found from the source (:func:`.metadata.provenance_of`)."""

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
        self._carried_metadata: list[CarriedFile] = []
        self._header: dict[str, str] = {}

    def carry(self, files: Sequence[CarriedFile], entries: Mapping[str, bytes] | None = None,
              read: ReadOptions = DEFAULT_READ) -> None:
        """As :meth:`OutputWriter.carry`; the header metadata goes into each header, not beside."""
        super().carry([f for f in files if f.name != SAFETENSORS_METADATA_FILE], entries, read)
        self._carried_metadata = [f for f in files if f.name == SAFETENSORS_METADATA_FILE]

    def plan(self, tensors: Sequence[OutputTensor], source: CheckpointReader) -> list[PlannedRegion]:
        from .metadata import header_metadata, metadata_from_carried, provenance_of
        from .writer import ADAPTER_CONFIG, check_key, plan_shards, shard_file_names

        for tensor in tensors:  # before anything is written: a key the format cannot hold
            check_key(tensor.name, self.shown_path)
        carried = metadata_from_carried(self._carried_metadata, source.path)
        made = (self.provenance if self.provenance is not None else
                provenance_of(source, copied=self.may_copy_stored, carried=bool(carried)))
        self._header = header_metadata(carried, made)
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
                    regions.append(PlannedRegion(tensor.key, full, name, box_bytes(full, tensor.dtype), raw=True))
                    continue
                regions.extend(row_block_regions([tensor], source, name, self.block_bytes))
        return regions

    def copies_stored(self, tensors: Sequence[OutputTensor], source: CheckpointReader) -> bool:
        """Every tensor is stored as it is in ``source`` (no cast) and as plain runs of bytes."""
        return all(t.dtype == t.stored_dtype for t in tensors) and all(
            source.byte_ranges(t.key) is not None for t in tensors)

    def _file_for(self, region: PlannedRegion) -> Any:
        from .writer import SafetensorsFileWriter

        if self._open_file is not None and self._open_file[0] == region.file:
            return self._open_file[1]
        self._end_open_file()
        writer = SafetensorsFileWriter(self.staging / region.file, metadata=dict(self._header or {"format": "pt"}))
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
            fd = source.open_data(file) if length else None
            # bytes with a stored CRC-32 go through memory to be checked: never copied unseen
            seen = (functools.partial(checks.saw, file)
                    if checks is not None and length and checks.wants(file, offset, length) else None)
            writer.copy_range(name, source.path / file, fd, offset, length, seen=seen)

    def close(self) -> dict[str, tuple[int, int | None]]:
        self._end_open_file()
        return dict(self._written)

    def finish(self, states: Sequence[Any]) -> list[WrittenFile]:
        from .writer import INDEX_NAME, write_index

        written: dict[str, tuple[int, int | None]] = {k: v for state in states for k, v in state.items()}
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


register_output(OutputFormat("safetensors", SafetensorsOutput, suffixes=(".safetensors",), single_file=True))
register_output(OutputFormat("hf-sharded", SafetensorsOutput, is_default=True, settings=("max_shard_bytes",)))
