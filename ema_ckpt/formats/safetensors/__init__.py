"""Hugging Face safetensors: one file, or the sharded layout an index names. Reading (and the
format's registration) in :mod:`.reader`; the encoder and the shard plan in :mod:`.writer`."""

from .reader import FORMAT, SafetensorsReader

__all__ = ["FORMAT", "SafetensorsReader"]
