"""What the built-in output formats share: a region's cost (how work is shared out), size limits, row blocks.

Example:
    >>> region_cost(PlannedRegion("w", Box((0,), (4,)), "model.safetensors", 16)) >= 16
    True
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..dtypes import itemsize
from ..layout import Box, row_blocks
from .base import OutputTensor, PlannedRegion

if TYPE_CHECKING:
    from ..formats.base import CheckpointReader

DEFAULT_FILE_BYTES = 256 << 20
"""Largest DCP data file the engine starts (a file is the unit workers share out)."""
MIN_FILE_BYTES = 16 << 20
DEFAULT_CHUNK_BYTES = 16 << 20
"""Largest chunk a DCP output stores when it follows the source's layout (a larger one is cut in rows)."""
# Each region also costs fixed Python work (records to parse, a record to write), about what
# reading 256 KiB costs: counted in, files of many small tensors split finely enough to share out.
REGION_OVERHEAD_BYTES = 256 << 10
BLOCK_BYTES = 64 << 20
"""Row blocks of a row-major output (safetensors, torch file): memory holds one at a time."""


def region_cost(region: PlannedRegion) -> int:
    """The work of one region, in bytes: its data plus the fixed per-region overhead."""
    return region.nbytes + REGION_OVERHEAD_BYTES


def box_bytes(box: Box, dtype: str) -> int:
    """The bytes of ``box`` of a tensor stored in ``dtype``."""
    return box.numel * itemsize(dtype)


def row_block_regions(tensors: Sequence[OutputTensor], source: CheckpointReader, file: str,
                       block_bytes: int) -> list[PlannedRegion]:
    """Each tensor in blocks of whole rows (following the stored chunks where they allow)."""
    regions = []
    for tensor in tensors:
        limit = max(1, block_bytes // max(itemsize(tensor.stored_dtype), 1))
        for box in row_blocks(tensor.shape, list(source.layout(tensor.key)), limit):
            regions.append(PlannedRegion(tensor.key, box, file, box_bytes(box, tensor.stored_dtype)))
    return regions
