"""DeepSpeed ZeRO 1/2/3 checkpoints, read without DeepSpeed.

:mod:`.files` knows the tag folder's files (detection, saves in progress, the cheap step),
:mod:`.params` maps every key to flat ranges of the rank files, and :mod:`.reader` is the
:class:`DeepSpeedReader` that registers ``deepspeed``.
"""

from .files import deepspeed_tags, find_tag_dir, incomplete, is_deepspeed, step_of
from .reader import DeepSpeedReader, open_deepspeed

__all__ = [
    "DeepSpeedReader",
    "deepspeed_tags",
    "find_tag_dir",
    "incomplete",
    "is_deepspeed",
    "open_deepspeed",
    "step_of",
]
