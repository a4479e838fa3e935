"""torch.distributed.checkpoint (DCP) directories: FSDP1, FSDP2, torchtitan.

:mod:`.metadata` finds and loads ``.metadata`` (rank-local files merged) through the
restricted unpickler of :mod:`.metadata_unpickle`, :mod:`.index` turns it into every tensor's
stored chunks, :mod:`.records` reads a chunk's bytes from its ``torch.save`` record, and
:mod:`.reader` is the :class:`DcpReader` that registers ``dcp``. Writing: :mod:`.writer`
encodes a DCP directory, its ``.metadata`` emitted by :mod:`.metadata_pickle`, and
:mod:`.output` is the ``dcp`` output.
"""

from .metadata import METADATA_FILE, StoredChunk, load_metadata
from .reader import FORMAT, DcpReader, open_dcp

__all__ = ["FORMAT", "METADATA_FILE", "DcpReader", "StoredChunk", "load_metadata", "open_dcp"]
