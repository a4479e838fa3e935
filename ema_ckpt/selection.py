"""Which keys of a checkpoint an operation works on, and whether checkpoints agree on them.

Example:
    >>> from ema_ckpt.formats import open_checkpoint            # doctest: +SKIP
    >>> output_names(open_checkpoint("ckpts/step_10"), ["model.fc.weight"])  # doctest: +SKIP
    {'model.fc.weight': 'fc.weight'}
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from .dtypes import is_float
from .errors import IncompatibleCheckpointError
from .formats.base import CheckpointReader
from .layout import as_tuple
from .writers.base import OutputTensor, OutputWriter

_NON_MODEL_ROOTS = {
    "optim", "optimizer", "optimizers", "lr_scheduler", "lr_schedulers", "scheduler",
    "train_state", "dataloader", "data_loader", "rng", "rng_state", "extra_state",
}
MODEL_ROOT = "model"


def select_keys(
    reader: CheckpointReader, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[str]:
    """The model tensors of a checkpoint (its ``model`` root, else all but training state),
    filtered by ``include``/``exclude`` globs."""
    return _model_part(reader, list(reader.stored()), include, exclude, tensors=True)


def _model_part(reader: CheckpointReader, names: list[str], include: Sequence[str], exclude: Sequence[str],
                *, tensors: bool = False) -> list[str]:
    """``names`` (the tensor keys, with ``tensors``) under the model's root (``model`` when the
    tensors have one, else every root but training state), filtered by the globs."""
    if type(reader).root_of is not CheckpointReader.root_of:  # else every root is None: nothing to leave out
        roots = {k: reader.root_of(k) for k in names}
        tensor_roots = set(roots.values()) if tensors else {reader.root_of(k) for k in reader.stored()}
        if MODEL_ROOT in tensor_roots:
            names = [k for k in names if roots[k] == MODEL_ROOT]
        elif any(r is not None for r in roots.values()):
            names = [k for k in names if roots[k] not in _NON_MODEL_ROOTS]
    if include:
        names = [k for k in names if any(fnmatch.fnmatchcase(k, g) for g in include)]
    if exclude:
        names = [k for k in names if not any(fnmatch.fnmatchcase(k, g) for g in exclude)]
    return names


def carry_into(writers: Sequence[OutputWriter], reader: CheckpointReader, include: Sequence[str] = (),
               exclude: Sequence[str] = ()) -> None:
    """Each writer keeps ``reader``'s carried files and its model's non-tensor entries (megatron's
    ``*._extra_state``, chosen as :func:`select_keys` chooses): an output loads where its source did."""
    files = reader.carried_files()
    entries = {key: reader.read_bytes(key) for key in _model_part(reader, list(reader.non_tensor_keys), include,
                                                                  exclude)}
    for writer in writers:
        writer.carry(files, entries, reader.read_options)


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
    """Every reader holds every key with the reference reader's shape and dtype class, and the
    readers in ``same_selection`` no model key the reference lacks, unless ``allow_new_keys``."""
    ref = readers[reference].specs()
    wanted = set(keys)
    _check_overlap(readers, range(len(readers)), include, exclude)
    for index in same_selection:
        if allow_new_keys:
            break
        extra = [k for k in select_keys(readers[index], include, exclude) if k not in wanted]
        if extra:
            raise IncompatibleCheckpointError(
                f"{readers[index].path}: key {extra[0]!r} is not in the newest checkpoint "
                f"{readers[reference].path} (pass {{allow_new_keys=True}} to accept keys added or removed)",
                remedy="allow_new_keys",
            )
    for reader in readers:
        specs = reader.specs()
        if _same_structure(reader, readers[reference]):
            continue
        missing = [k for k in keys if k not in specs]
        if missing and not allow_new_keys:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise IncompatibleCheckpointError(
                f"{reader.path}: key {missing[0]!r}{more} missing (pass {{allow_new_keys=True}} to accept keys "
                "added during training)", remedy="allow_new_keys",
            )
        for key in [k for k in keys if k in specs]:
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


MIN_SHARED_KEYS = 0.5
"""Consecutive checkpoints sharing fewer than this share of their keys use other names."""


def _check_overlap(
    readers: Sequence[CheckpointReader], order: Sequence[int], include: Sequence[str], exclude: Sequence[str]
) -> None:
    """Refuse consecutive checkpoints that barely share keys: a renamed model (torchtitan's
    ``last_save_in_hf`` export beside its DCP steps), not keys added."""
    previous: tuple[CheckpointReader, set[str]] | None = None
    for index in order:
        reader = readers[index]
        if previous is not None and _same_structure(reader, previous[0]):
            continue
        keys = set(select_keys(reader, include, exclude))
        if previous is not None and keys and previous[1]:
            shared = len(keys & previous[1])
            if shared < MIN_SHARED_KEYS * min(len(keys), len(previous[1])):
                raise IncompatibleCheckpointError(
                    f"{reader.path} shares only {shared} of its {len(keys)} keys with {previous[0].path} "
                    "(the same model under other names?); leave it out with {skip} "
                    f"{reader.path}", remedy="skip",
                )
        previous = (reader, keys)


def _same_structure(a: CheckpointReader, b: CheckpointReader) -> bool:
    """Whether two readers share one parsed structure (``formats.dcp.index.Structure``): an identity test."""
    return type(a) is type(b) and a.stored() is b.stored() and a.planner_data is b.planner_data


def container_prefix(reader: CheckpointReader, keys: Sequence[str]) -> str | None:
    """The DCP container level every key sits in (``"model."`` of ``{"model": …}``), or None; only
    a container recorded at save time counts (``DcpReader.container_of``)."""
    containers = {reader.container_of(k) for k in keys}
    container = containers.pop() if len(containers) == 1 else None
    if container is None:
        return None
    prefix = container + "."
    names = [k[len(prefix):] for k in keys]
    if not all(k.startswith(prefix) for k in keys) or len(set(names)) != len(names) or "" in names:
        return None
    return prefix


def output_names(
    reader: CheckpointReader, keys: Sequence[str], *, keep_prefix: bool = False
) -> dict[str, str]:
    """{stored key: the model's own name}: the DCP container level removed, nothing else renamed."""
    prefix = "" if keep_prefix else container_prefix(reader, keys) or ""
    return {k: k[len(prefix):] for k in keys}


NON_WEIGHT_BUFFERS = frozenset({"e_score_correction_bias", "expert_bias", "tokens_per_expert",
                                "local_tokens_per_expert", "expert_bias_E", "tokens_per_expert_E"})
"""The last names of float tensors that are not weights: a mixture-of-experts router's load
balancing state (DeepSeek-V3, megatron-core, torchtitan), set by counting tokens. An average
takes them from the newest checkpoint, as it takes integer tensors, unless ``average_buffers``."""


def is_non_weight_buffer(key: str) -> bool:
    """Whether ``key`` names a router statistic of :data:`NON_WEIGHT_BUFFERS`.

    Example:
        >>> is_non_weight_buffer("model.layers.3.mlp.gate.e_score_correction_bias")
        True
    """
    return key.rsplit(".", 1)[-1] in NON_WEIGHT_BUFFERS


def averaged_tensors(newest: CheckpointReader, keys: Sequence[str], dtype: str,
                     names: dict[str, str] | None = None, *, average_buffers: bool = False) -> list[OutputTensor]:
    """The tensors of an average: floats accumulated and stored in ``dtype``, others as stored
    (router statistics too, taken from ``newest``, unless ``average_buffers``); named
    ``names[key]`` in the output (default: the key)."""
    stored = newest.stored()
    names = names or {}
    tensors = []
    for k in keys:
        shape, stored_dtype = stored[k]
        copied = not average_buffers and is_float(stored_dtype) and is_non_weight_buffer(k)
        averaged = is_float(stored_dtype) and not copied
        tensors.append(OutputTensor(k, names.get(k, k), as_tuple(shape),
                                    dtype if averaged else stored_dtype, stored_dtype, copied=copied))
    return tensors
