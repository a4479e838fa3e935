"""torch.distributed.checkpoint (DCP) directories: FSDP1, FSDP2, torchtitan; read by
:class:`DcpReader`, written by :mod:`.writer` and :mod:`.output`."""

from .metadata import METADATA_FILE, StoredChunk, load_metadata
from .reader import FORMAT, DcpReader

__all__ = ["FORMAT", "METADATA_FILE", "DcpReader", "StoredChunk", "load_metadata"]
