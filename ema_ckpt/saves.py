"""Whether a trainer's checkpoint folder is a finished save: the file its trainer writes last is there.

A format's own marker says a checkpoint's *weights* are whole (DCP's ``.metadata``, DeepSpeed's
``latest``, a zip's directory). A trainer writes more around them, and a folder whose weights are
whole may still be half a checkpoint: the Hugging Face Trainer writes the model, then its
DeepSpeed tag, optimizer, scheduler and RNG state, and ``trainer_state.json`` last; accelerate's
``save_state`` writes ``random_states_<i>.pkl`` last. Folding such a folder early would fold the
wrong weights (the Trainer's bf16 copy before the tag's fp32 masters), and the finished save
would then look folded already.

Example:
    >>> save_in_progress(Path("out/checkpoint-600"), [])   # doctest: +SKIP
    'no trainer_state.json yet (the Trainer writes it last: a save in progress?)'
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .formats.base import TRAINER_STATE
from .storage import Location

HF_CHECKPOINT = re.compile(r"^checkpoint-\d+$")
"""The Hugging Face Trainer's checkpoint folders (its ``PREFIX_CHECKPOINT_DIR``)."""
ACCELERATE_CHECKPOINT = re.compile(r"^checkpoint_\d+$")
"""accelerate's ``automatic_checkpoint_naming`` folders."""
TRAINER_FILES = ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
"""Files the Trainer writes into a checkpoint before ``trainer_state.json``."""
ACCELERATE_LAST = "random_states_0.pkl"
"""What accelerate's ``save_state`` writes last (process 0's RNG states)."""
ACCELERATE_FILES = ("optimizer.bin", "scheduler.bin", "model.safetensors", "pytorch_model.bin",
                    "pytorch_model_fsdp.bin")


def _trainer_save(path: Location) -> bool:
    """Files only a Hugging Face Trainer save holds (written before its ``trainer_state.json``)."""
    return any((path / name).exists() for name in TRAINER_FILES) or any(
        p.name.startswith("rng_state") or p.name.startswith("global_step") for p in path.iterdir())


def save_in_progress(path: Location, beside: Sequence[Location]) -> str | None:
    """Why the trainer folder ``path`` is not a finished save yet, or None (also for any other folder).

    ``beside``: the other entries of the folder it was found in. A ``checkpoint-<N>`` folder is
    the Trainer's when it holds the Trainer's own files or another ``checkpoint-<N>`` beside it
    has a ``trainer_state.json``; a ``save_pretrained`` folder named so in a folder of them
    (none with a ``trainer_state.json``) is taken as it is.
    """
    try:
        if not path.is_dir():
            return None
        if HF_CHECKPOINT.match(path.name) and not (path / TRAINER_STATE).exists():
            siblings = [s for s in beside if s != path and HF_CHECKPOINT.match(s.name)]
            if _trainer_save(path) or any((s / TRAINER_STATE).is_file() for s in siblings):
                return f"no {TRAINER_STATE} yet (the Trainer writes it last: a save in progress?)"
        if ACCELERATE_CHECKPOINT.match(path.name) and not (path / ACCELERATE_LAST).exists() and (
                any((path / name).exists() for name in ACCELERATE_FILES)
                or any(p.name.startswith(("pytorch_model_fsdp", "optimizer_")) for p in path.iterdir())):
            return f"no {ACCELERATE_LAST} yet (accelerate's save_state writes it last: a save in progress?)"
    except OSError:  # vanishing as it is looked at: retention, or a save starting over
        return "changed while it was read (a save or a deletion in progress?)"
    return None


__all__ = ["ACCELERATE_CHECKPOINT", "HF_CHECKPOINT", "save_in_progress"]
