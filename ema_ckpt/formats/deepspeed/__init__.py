"""DeepSpeed ZeRO 1/2/3 checkpoints, read without DeepSpeed.

:mod:`.files` knows the tag folder's files (detection, saves in progress, the cheap step);
:mod:`.unpickle` loads a ``.pt`` file through the restricted weights-only unpickler, and
:mod:`.structure` loads an object's structure only, by ranged reads. :mod:`.tag` loads and
checks one tag folder's files, :mod:`.params` maps every key to flat ranges of the rank files,
:mod:`.pieces` places those ranges in the files and reads them, and :mod:`.reader` is the
:class:`DeepSpeedReader` that registers ``deepspeed``.
"""

from .files import deepspeed_tags, find_tag_dir, incomplete, is_deepspeed, step_of
from .reader import DeepSpeedReader

__all__ = ["DeepSpeedReader", "deepspeed_tags", "find_tag_dir", "incomplete", "is_deepspeed", "step_of"]
