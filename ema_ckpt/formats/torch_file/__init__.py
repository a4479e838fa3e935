"""``torch.save`` checkpoints, one registered format ``torch``: single files with a checkpoint
suffix (:mod:`.reader`; a zip without its end record is still being written) and trainer folders
of a well-known weights file or an index of ``.bin`` shards (:mod:`.folders`).
"""

from __future__ import annotations

from ...storage import Location
from ..base import CheckpointFormat, register_format
from .folders import TorchFolderReader, is_weights_folder, missing_files
from .model import step_in_tree
from .reader import NOT_MODEL_FILES, SUFFIXES, TorchFileReader, file_facts, has_torch_suffix


def _detect(path: Location) -> bool:
    if path.is_dir():
        return is_weights_folder(path)
    if not (has_torch_suffix(path) and path.is_file()):
        return False
    facts = file_facts(path)
    return facts.kind in ("zip", "legacy") and facts.holds_model


def _incomplete(path: Location) -> str | None:
    if path.is_dir():
        return missing_files(path)
    if has_torch_suffix(path) and path.is_file() and file_facts(path).kind == "partial-zip":
        return "truncated: no zip directory at its end (still being written?)"
    return None


def _not_a_model(path: Location) -> str | None:
    if path.is_dir() or not (has_torch_suffix(path) and path.is_file()):
        return None
    facts = file_facts(path)
    if facts.kind is None:
        return "not a torch.save file (neither a zip nor torch's legacy format)"
    if facts.kind in ("zip", "legacy") and not facts.holds_model:
        if NOT_MODEL_FILES.match(path.name):
            return "training state beside the checkpoints (by its name), not model weights"
        return "holds no model weights (no dict of tensors outside optimizer, scheduler, loop and callback state)"
    return None


def _step_record(path: Location) -> tuple[int, str] | None:
    """The step a single file records and the entry it came from (folders: none here)."""
    if path.is_dir():
        return None
    record = file_facts(path).step
    if record is None:
        return None
    step, entry = record
    return step, f"{entry} in the file"


def _step_of(path: Location) -> int | None:
    record = _step_record(path)
    return record[0] if record is not None else TorchFolderReader.step_of(path) if path.is_dir() else None


FORMAT = register_format(CheckpointFormat(
    "torch", detect=_detect, incomplete=_incomplete, not_a_model=_not_a_model, records_step=True,
    step_of=_step_of, step_record=_step_record,
    open=lambda path, read: TorchFolderReader(path, read) if path.is_dir() else TorchFileReader(path, read)))

__all__ = [
    "FORMAT",
    "SUFFIXES",
    "TorchFileReader",
    "TorchFolderReader",
    "file_facts",
    "has_torch_suffix",
    "step_in_tree",
]
