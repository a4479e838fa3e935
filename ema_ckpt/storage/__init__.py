"""Where bytes live: local files and object stores, behind one seam.

Everything else in ema-ckpt passes :data:`Location` values around, reads through
:func:`open_readable` / :func:`open_structure`, and publishes through a :class:`Destination`;
only this package knows whether a location is on a local disk or in an object store. It
imports nothing from the formats, writers, manifests or jobs above it.

Example:
    >>> str(as_path("s3://bucket/run") / "step_100")
    's3://bucket/run/step_100'
"""

from .destinations import Destination, HeldLock, Sink, Staged, destination_for, output_lock
from .local_files import (
    HASH_BLOCK_BYTES,
    files_on_disk,
    fsync_dir,
    fsync_tree,
    output_path,
    replace_file,
    size_and_crc32,
    size_without_requests,
    start_writeback,
)
from .local_publish import discard_on_error, discard_stagings_in
from .locations import (
    Location,
    as_path,
    enclosing_folders,
    is_location,
    local_file,
    local_path,
    one_file,
    one_look,
    output_location,
    read_in_blocks,
    scratch_beside,
)
from .object_clients import forget_listings
from .object_publish import new_generation
from .object_reads import remote_concurrency
from .sources import BlockChecksums, Source, open_readable, open_structure

__all__ = ["HASH_BLOCK_BYTES", "BlockChecksums", "Destination", "HeldLock", "Location", "Sink", "Source", "Staged",
           "as_path", "destination_for", "discard_on_error", "discard_stagings_in", "enclosing_folders",
           "files_on_disk", "forget_listings", "fsync_dir", "fsync_tree", "is_location", "local_file", "local_path",
           "new_generation", "one_file", "one_look", "open_readable", "open_structure", "output_location",
           "output_lock", "output_path", "read_in_blocks", "remote_concurrency", "replace_file", "scratch_beside",
           "size_and_crc32", "size_without_requests", "start_writeback"]
