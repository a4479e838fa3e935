"""Whether a trainer's checkpoint folder is a finished save: the file its trainer writes last is there.

A format's marker says the *weights* are whole; a trainer writes more around them (the Hugging
Face Trainer writes its model, then its DeepSpeed tag, and ``trainer_state.json`` last). Folding
such a folder early would fold the wrong weights, and the finished save would look folded already.

Example:
    >>> import tempfile; from pathlib import Path
    >>> save = Path(tempfile.mkdtemp()) / "checkpoint-600"; save.mkdir(); (save / "optimizer.pt").touch()
    >>> save_in_progress(save, [])
    'no trainer_state.json yet (the Trainer writes it last: a save in progress?)'
    >>> (save / "trainer_state.json").touch(); save_in_progress(save, []) is None
    True
"""

from __future__ import annotations

from collections.abc import Sequence

from .layouts import HF_TRAINER, TRAINER_SAVES, TrainerSave
from .storage import Location


def _started(path: Location, save: TrainerSave) -> bool:
    """Files the trainer writes into the folder before its last one are there."""
    return any((path / name).exists() for name in save.written_before) or any(
        p.name.startswith(save.written_before_prefixes) for p in path.iterdir())


def save_in_progress(path: Location, beside: Sequence[Location]) -> str | None:
    """Why the trainer folder ``path`` is not a finished save yet, or None (also for any other folder).

    ``beside``: the other entries of its folder. A folder named as a trainer's without the file
    that trainer writes last is in progress when it holds a file written earlier, or (the Hugging
    Face Trainer) when a sibling so named has that last file.
    """
    try:
        if not path.is_dir():
            return None
        for save in TRAINER_SAVES:
            if not save.folder.match(path.name) or (path / save.written_last).exists():
                continue
            siblings = [s for s in beside if s != path and save.folder.match(s.name)] if save is HF_TRAINER else []
            if _started(path, save) or any((s / save.written_last).is_file() for s in siblings):
                return f"no {save.written_last} yet ({save.trainer} writes it last: a save in progress?)"
    except OSError:  # vanishing as it is looked at: retention, or a save starting over
        return "changed while it was read (a save or a deletion in progress?)"
    return None


__all__ = ["save_in_progress"]
