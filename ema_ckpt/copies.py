"""Two checkpoints that are one: links, the same weights, the same kind.

One step is one checkpoint: a symlink or hard link (timm's ``last.pth.tar``), or another save of
the same step with the same weights (the Hugging Face Trainer's final ``save_model`` beside its
last ``checkpoint-N``, Lightning's ``last.ckpt``) counts once, the named checkpoint kept over the
alias; two saves of one step with other weights are refused. Comparing keys reads metadata only;
comparing weights reads block by block and stops at the first difference.

Example:
    >>> import tempfile; from pathlib import Path
    >>> ckpts = Path(tempfile.mkdtemp()); (ckpts / "checkpoint-3.pth.tar").touch()
    >>> (ckpts / "last.pth.tar").hardlink_to(ckpts / "checkpoint-3.pth.tar")
    >>> same_file(ckpts / "last.pth.tar", ckpts / "checkpoint-3.pth.tar")
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, TypeVar

from .errors import EmaCkptError, IncompatibleCheckpointError
from .formats import open_checkpoint
from .formats.base import CheckpointReader
from .formats.options import DEFAULT_READ, ReadOptions
from .layout import row_blocks
from .layouts import ALIAS_NAMES, EXPORT_NAMES, TRAINER_STATE
from .selection import select_keys
from .storage import Location, one_file

if TYPE_CHECKING:
    from .discovery import FoundCheckpoint

F = TypeVar("F", bound="FoundCheckpoint")


def same_model_bytes(a: CheckpointReader, b: CheckpointReader, keys: Sequence[str]) -> bool:
    """True when ``a`` and ``b`` hold the same ``keys`` with the same shapes, dtypes and bytes
    (read block by block, stopping at the first difference)."""
    import torch

    specs_a, specs_b = a.specs(), b.specs()
    for key in keys:
        spec_a, spec_b = specs_a[key], specs_b.get(key)
        if spec_b is None or spec_a.shape != spec_b.shape or spec_a.dtype != spec_b.dtype:
            return False
    for key in keys:
        spec = specs_a[key]
        limit = max(1, (16 << 20) // max(spec.dtype.itemsize, 1))
        for box in row_blocks(spec.shape, list(a.layout(key)), limit):
            x = a.read(key, box).contiguous().reshape(-1).view(torch.uint8)
            y = b.read(key, box).contiguous().reshape(-1).view(torch.uint8)
            if not torch.equal(x, y):  # bytes, so NaNs in the same places compare equal
                return False
    return True


def same_file(a: Location, b: Location) -> bool:
    """One file or folder under two names: a symlink, or a hard link (timm's ``last.pth.tar``)."""
    return a.resolve() == b.resolve() or (one_file(a, b) and not a.is_dir())


def same_weights(a: Location, b: Location, read: ReadOptions = DEFAULT_READ, *, bytes_too: bool = True) -> bool:
    """The checkpoints at ``a`` and ``b``, read with ``read``, hold the same keys (and, with
    ``bytes_too``, the same bytes)."""
    with contextlib.closing(open_checkpoint(a, read=read)) as x, \
            contextlib.closing(open_checkpoint(b, read=read)) as y:
        keys = select_keys(x)
        return sorted(keys) == sorted(select_keys(y)) and (not bytes_too or same_model_bytes(x, y, keys))


def same_kind(a: Location, b: Location, read: ReadOptions = DEFAULT_READ) -> bool:
    """Two checkpoints holding the same keys (metadata only); an unreadable one is not known to
    differ, so it is never left unsaid."""
    try:
        return same_weights(a, b, read, bytes_too=False)
    except EmaCkptError:
        return True


def copy_of(path: Location, checkpoints: Sequence[F], read: ReadOptions = DEFAULT_READ) -> F | None:
    """The checkpoint an alias with no step of its own copies (a link, or the same weights), or None."""
    for c in reversed(checkpoints):
        if same_file(path, c.path):
            return c
        try:
            if same_weights(path, c.path, read):
                return c
        except EmaCkptError:
            return None
    return None


def _prefer(a: F, b: F, known: Collection[Location]) -> tuple[F, F]:
    """(kept, skipped) of two copies of one step: the one already folded, else the one with a
    trainer's own step record, else the one not named as an alias (``last.ckpt``), else the
    first by path."""

    def rank(c: F) -> tuple[int, int, int, str]:
        named = c.entry.name  # the checkpoint's name (final/), not its model file's (lit_model.pth)
        return (0 if c.path.resolve() in known else 1, 0 if c.step_source.startswith(TRAINER_STATE) else 1,
                1 if ALIAS_NAMES.match(named) or EXPORT_NAMES.match(named) else 0, str(c.path))

    return (a, b) if rank(a) <= rank(b) else (b, a)


def one_per_step(checkpoints: Sequence[F], known: Collection[Location], compare_after: int | None,
                 read: ReadOptions = DEFAULT_READ) -> tuple[list[F], list[tuple[Location, str]]]:
    """(kept, [(skipped path, why)]) of checkpoints sorted by step: identical copies of a step
    count once; different ones are refused. ``known``: checkpoints already folded (kept first).

    Bytes are compared only for steps after ``compare_after`` (the steps a run will read); an
    older duplicate keeps the copy already folded, unread.

    Raises:
        IncompatibleCheckpointError: two checkpoints of one step with different weights.
    """
    kept: list[F] = []
    skipped: list[tuple[Location, str]] = []
    for candidate in checkpoints:
        previous = kept[-1] if kept else None
        if previous is None or previous.step != candidate.step:
            kept.append(candidate)
            continue
        keep, skip = _prefer(previous, candidate, known)
        unread = compare_after is not None and candidate.step <= compare_after  # not read by this run either way
        if not (same_file(previous.path, candidate.path) or unread
                or same_weights(previous.path, candidate.path, read)):
            raise IncompatibleCheckpointError(
                f"{previous.path} and {candidate.path} both hold step {candidate.step} with different "
                "weights; leave one out with {skip=PATH}", remedy="skip"
            )
        kept[-1] = keep
        what = "as" if unread else "and the same weights as"
        skipped.append((skip.path, f"the same step {skip.step} {what} {keep.path}" + (", already folded"
                                                                                      if unread else "")))
    return kept, skipped


__all__ = ["copy_of", "one_per_step", "same_file", "same_kind", "same_model_bytes", "same_weights"]
