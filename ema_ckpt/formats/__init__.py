"""Checkpoint formats: one module per format, each registering itself on import.

Detection order matters only when a directory carries markers of two formats: DCP first,
then DeepSpeed, then Hugging Face safetensors; a ``torch.save`` state-dict file is a file,
never a directory.
"""

from . import dcp as _dcp  # noqa: F401  (registers "dcp")
from . import deepspeed as _deepspeed  # noqa: F401  (registers "deepspeed")
from . import safetensors as _safetensors  # noqa: F401  (registers "safetensors")
from . import torch_file as _torch_file  # noqa: F401  (registers "torch")
from .base import CheckpointFormat, CheckpointReader, register_format, registered_formats
from .resolve import ModelLocation, NestedModel, Resolved, detect_format, locate_model, open_checkpoint, resolve

__all__ = [
    "CheckpointFormat",
    "CheckpointReader",
    "ModelLocation",
    "NestedModel",
    "Resolved",
    "detect_format",
    "locate_model",
    "open_checkpoint",
    "register_format",
    "registered_formats",
    "resolve",
]
