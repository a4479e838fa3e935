"""The one place that imports torch's DCP metadata classes, private ones included.

DCP promises no compatibility across torch releases and ``_StorageInfo`` is private, so
every such import lives here; ``tests/test_torch_compat.py`` checks them on the pinned range.
"""

from __future__ import annotations

from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

__all__ = [
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageInfo",
    "TensorProperties",
    "TensorStorageMetadata",
]
