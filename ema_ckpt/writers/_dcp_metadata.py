"""The writers' name for :mod:`ema_ckpt._compat.dcp_metadata`, DCP's ``.metadata`` pickler.

The pickler lives with the project's other reliances on private torch and Python names, each
with its conformance test (``tests/test_compat.py``).
"""

from __future__ import annotations

from .._compat.dcp_metadata import ChunkRecord, dump_metadata

__all__ = ["ChunkRecord", "dump_metadata"]
