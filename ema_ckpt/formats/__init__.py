"""Checkpoint formats: one module per format, each registering itself on import.

Detection order matters only when a directory carries markers of two formats: DCP first,
then DeepSpeed, then Hugging Face safetensors.
"""

from . import dcp as _dcp  # noqa: F401  (registers "dcp")
from . import deepspeed as _deepspeed  # noqa: F401  (registers "deepspeed")
from . import hf_safetensors as _hf_safetensors  # noqa: F401  (registers "safetensors")
from .base import (
    ByteRangeReader,
    CheckpointFormat,
    CheckpointReader,
    detect_format,
    open_checkpoint,
    register_format,
    registered_formats,
    stored_tensors,
)

__all__ = [
    "ByteRangeReader",
    "CheckpointFormat",
    "CheckpointReader",
    "detect_format",
    "open_checkpoint",
    "register_format",
    "registered_formats",
    "stored_tensors",
]
