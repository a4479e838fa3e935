"""Which keys of a checkpoint an operation works on, and whether checkpoints agree on them.

Example:
    >>> strip_model_prefix(["model.fc.weight", "model.fc.bias"])
    {'model.fc.weight': 'fc.weight', 'model.fc.bias': 'fc.bias'}
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from .errors import IncompatibleCheckpointError
from .formats.base import CheckpointReader, stored_tensors

_NON_MODEL_ROOTS = {
    "optim", "optimizer", "optimizers", "lr_scheduler", "lr_schedulers", "scheduler",
    "train_state", "dataloader", "data_loader", "rng", "rng_state", "extra_state",
}
MODEL_ROOT = "model"


def _root_of(reader: CheckpointReader, key: str) -> str | None:
    root_of = getattr(reader, "root_of", None)
    return root_of(key) if root_of is not None else None


def select_keys(
    reader: CheckpointReader, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[str]:
    """The model tensors of a checkpoint, filtered by ``include``/``exclude`` globs.

    A DCP saved as ``{"model": …, "optim": …}`` contributes its ``model`` part; a checkpoint
    without a ``model`` root contributes everything but optimizer and training state.
    """
    keys = list(stored_tensors(reader))
    roots = {k: _root_of(reader, k) for k in keys}
    if MODEL_ROOT in roots.values():
        keys = [k for k in keys if roots[k] == MODEL_ROOT]
    elif any(r is not None for r in roots.values()):
        keys = [k for k in keys if roots[k] not in _NON_MODEL_ROOTS]
    if include:
        keys = [k for k in keys if any(fnmatch.fnmatchcase(k, g) for g in include)]
    if exclude:
        keys = [k for k in keys if not any(fnmatch.fnmatchcase(k, g) for g in exclude)]
    return keys


def check_compatible(
    readers: Sequence[CheckpointReader],
    keys: Sequence[str],
    reference: int,
    *,
    allow_new_keys: bool = False,
    same_selection: Sequence[int] = (),
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> None:
    """Every reader holds every key with the reference reader's shape and dtype class.

    With ``allow_new_keys`` a reader may lack keys (a key added during training starts its
    average where it first appears). The readers in ``same_selection`` (raw checkpoints) must
    also hold no model key the reference lacks (a key removed during training), unless allowed.
    """
    ref = readers[reference].specs()
    wanted = set(keys)
    for index in same_selection:
        if allow_new_keys:
            break
        extra = [k for k in select_keys(readers[index], include, exclude) if k not in wanted]
        if extra:
            raise IncompatibleCheckpointError(
                f"{readers[index].path}: key {extra[0]!r} is not in the newest checkpoint "
                f"{readers[reference].path} (pass --allow-new-keys to accept keys added or removed)"
            )
    for reader in readers:
        specs = reader.specs()
        missing = [k for k in keys if k not in specs]
        if missing and not allow_new_keys:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise IncompatibleCheckpointError(
                f"{reader.path}: key {missing[0]!r}{more} missing (pass --allow-new-keys to accept keys "
                "added during training)"
            )
        for key in keys:
            if key not in specs:
                continue
            a, b = ref[key], specs[key]
            if a.shape != b.shape:
                raise IncompatibleCheckpointError(
                    f"{reader.path}: key {key!r} has shape {list(b.shape)}, "
                    f"{readers[reference].path} has {list(a.shape)}"
                )
            if a.is_float != b.is_float:
                raise IncompatibleCheckpointError(
                    f"{reader.path}: key {key!r} is {b.dtype}, {readers[reference].path} has {a.dtype}"
                )


def strip_model_prefix(keys: Sequence[str]) -> dict[str, str]:
    """Map ``model.<fqn>`` keys to ``<fqn>`` when every key carries the prefix (else unchanged)."""
    prefix = MODEL_ROOT + "."
    if keys and all(k.startswith(prefix) for k in keys):
        return {k: k[len(prefix):] for k in keys}
    return {k: k for k in keys}
