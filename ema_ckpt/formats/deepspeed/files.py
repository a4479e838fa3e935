"""DeepSpeed checkpoint files: tag folders, ``latest``, detection, saves still in progress, the step.

Only file names are looked at, except for the first model-states file's ``dp_world_size`` and
``global_steps``, read once per file version and remembered.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

from ...errors import CheckpointFormatError, CheckpointNotFoundError, UnsafePickleError
from ...storage import Location, as_path, open_structure
from .fastload import fast_load
from .structure import RemoteStructure, load_ds_structure
from .unpickle import STAND_INS, load_ds_file

FORMAT_NAME = "deepspeed"

OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
UNSUPPORTED_FILES = (
    (re.compile(r"^layer_\d+-model_\d+-model_states\.pt$"), "pipeline-parallel layer files"),
    (re.compile(r"^layer_\d+_expert_\d+_.*model_states\.pt$"), "MoE expert files"),
    (re.compile(r"^expp_rank_\d+_.*optim_states\.pt$"), "MoE expert-parallel optimizer files"),
)

TAG_STEP_RE = re.compile(r"(?:global_step|checkpoint-|step)(\d+)$")


def ds_files(folder: Location) -> tuple[list[Location], list[Location]]:
    """The ``*_model_states.pt`` and ``*optim_states.pt`` files directly in ``folder``."""
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return [], []
    models = [folder / n for n in names if n.endswith("_model_states.pt")]
    optims = [folder / n for n in names if n.endswith("optim_states.pt")]
    return models, optims


def _read_latest(folder: Location) -> str | None:
    """The tag named by ``folder/latest`` (DeepSpeed writes it without a newline), or None."""
    latest = folder / "latest"
    if not latest.is_file():
        return None
    try:
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    # A tag is one path component inside the folder, never a way out of it.
    if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
        return None
    return tag


def find_tag_dir(path: str | Location) -> Location | None:
    """The DeepSpeed tag folder ``path`` is, or names through ``latest`` (a save folder, a Hugging
    Face ``checkpoint-N``); None if neither. Only file names are looked at."""
    path = as_path(path)
    if not path.is_dir():
        return None
    if all(ds_files(path)):
        return path
    tag = _read_latest(path)
    return path / tag if tag is not None and (path / tag).is_dir() and all(ds_files(path / tag)) else None


def name_gaps(tag_dir: Location) -> str | None:
    """Why the file names of ``tag_dir`` show missing rank files, or None (names only)."""
    models, optims = ds_files(tag_dir)
    ranks = sorted(int(m.group(2)) for m in (OPTIM_RE.match(p.name) for p in optims) if m)
    if ranks and ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        return f"optimizer files of data-parallel rank(s) {missing} are missing"
    zero3_models = [p for p in models if ZERO3_MODEL_RE.match(p.name)]
    if zero3_models and len(zero3_models) != len(optims):
        return f"{len(zero3_models)} ZeRO-3 model-states files but {len(optims)} optimizer files " \
            "(a rank did not finish saving)"
    return None


def is_deepspeed(path: str | Location) -> bool:
    """Detection by marker files: a tag folder, directly or via ``latest``, that is not
    :func:`incomplete` (so a checkpoint still being written is skipped, not half-read)."""
    tag_dir = find_tag_dir(path)
    return tag_dir is not None and incomplete(tag_dir) is None


def incomplete(path: str | Location) -> str | None:
    """A reason when ``path`` looks like a DeepSpeed checkpoint still being written, else None
    (cheapest first: ``latest`` naming a missing tag, model states without optimizer files or the
    reverse, gaps in the ranks, fewer optimizer files than the recorded ``dp_world_size``)."""
    path = as_path(path)
    if not path.is_dir():
        return None
    tag = _read_latest(path)
    tag_dir = path
    models, optims = ds_files(path)
    if not models and not optims:
        if tag is None:
            return _tag_without_latest(path)
        tag_dir = path / tag
        if not tag_dir.is_dir():
            return f"'latest' names tag {tag!r} but {tag_dir} does not exist (still being written?)"
        models, optims = ds_files(tag_dir)
        if not models and not optims:
            return f"DeepSpeed tag folder {tag_dir} holds no model or optimizer states yet"
    if not optims:
        return f"DeepSpeed tag folder {tag_dir} holds model states but no *_optim_states.pt files " \
            "(still being written, or a ZeRO-0 checkpoint, which is not supported)"
    if not models:
        return f"DeepSpeed tag folder {tag_dir} holds optimizer states but no *_model_states.pt file"
    reason = name_gaps(tag_dir)
    if reason:
        return f"DeepSpeed tag folder {tag_dir}: {reason}"
    first = next((p for p in models if p.name in ("mp_rank_00_model_states.pt",
                                                  "zero_pp_rank_0_mp_rank_00_model_states.pt")), models[0])
    try:
        expected = _model_summary(first)[0]  # dp_world_size
    except UnsafePickleError:
        return None  # complete but refused: opening it gives the real error
    except CheckpointFormatError as err:
        return f"{first} is unreadable, perhaps still being written ({err.reason})"
    if isinstance(expected, int) and len(optims) < expected:
        return f"DeepSpeed tag folder {tag_dir} holds {len(optims)} of the {expected} optimizer " \
            "files its dp_world_size asks for (still being written?)"
    return None


_TRAINER_FILES = {"trainer_state.json", "config.json", "training_args.bin", "zero_to_fp32.py"}  # beside a tag


def _tag_without_latest(path: Location) -> str | None:
    """A reason when a folder without ``latest`` holds a DeepSpeed tag still being written
    (DeepSpeed writes ``latest`` after every rank's files). Only a folder of one tag beside a
    trainer's files is looked into: several tags make a save folder, each judged on its own."""
    try:
        files = [p.name for p in path.iterdir() if p.is_file()]
        if not any(n in _TRAINER_FILES or n.endswith(".safetensors") for n in files):
            return None
        children: list[Location] = sorted(path.iterdir(), key=str)
        tags = [c for c in children if c.is_dir() and any(ds_files(c))]
    except OSError:
        return None
    if len(tags) != 1:
        return None
    reason = incomplete(tags[0])
    if reason:
        return f"no 'latest' yet and {reason}"
    # Complete rank files but no `latest` yet, beside a trainer's other weights: read now, the
    # folder would pass for its bf16 copy and, once `latest` appears, for the fp32 tag.
    return f"DeepSpeed tag {tags[0].name} but no 'latest' naming it yet (still being written?)"


# (path, device, inode, size, mtime_ns) -> (dp_world_size, global_steps) of a settled model-states file.
_SUMMARIES: dict[tuple[str, int, int, int, int], tuple[Any, Any]] = {}
_SETTLED_SECONDS = 2.0  # files modified more recently are read afresh (a same-size rewrite
# within the file system's timestamp granularity would otherwise look unchanged)


def _model_summary(path: Location) -> tuple[Any, Any]:
    """``(dp_world_size, global_steps)`` from a model-states file (None if absent), remembered per
    file version: detection, the step and opening each ask, and a ZeRO-3 one takes tens of ms."""
    found = structure_or_name(path, shared=True)
    if isinstance(found, RemoteStructure):  # read by ranged requests, not unpickled whole
        return _summary(found.state)
    try:
        st = os.stat(found)
    except OSError:
        st = None
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) if st is not None else None
    if key is not None and key in _SUMMARIES:
        return _SUMMARIES[key]
    quick = fast_load(found, STAND_INS, summary=True)  # no tensor built; else the full load (and its errors)
    summary = _summary(quick[0] if quick is not None else load_ds_file(found))
    if key is not None and st is not None and time.time() - st.st_mtime > _SETTLED_SECONDS:
        if len(_SUMMARIES) >= 4096:
            _SUMMARIES.clear()
        _SUMMARIES[key] = summary
    return summary


def _summary(state: Any) -> tuple[Any, Any]:
    return (state.get("dp_world_size"), state.get("global_steps")) if isinstance(state, dict) else (None, None)


_STRUCTURES: dict[tuple[str, str, int], RemoteStructure] = {}  # (URL, ETag, size) -> its structure
_STRUCTURES_KEPT = 256
_STRUCTURES_LOCK = threading.Lock()  # the reader loads a tag's objects from several threads


def structure_or_name(path: Location, *, shared: bool = False) -> RemoteStructure | str:
    """``path``'s structure by ranged requests (:func:`~.structure.load_ds_structure`), or the name
    a loader maps the file by (:func:`~.unpickle.load_ds_file`). ``shared``: loaded once per object
    version (its ETag) for detection, discovery and the reader."""
    key, size = None, None
    if shared:
        try:
            st = path.stat()
        except FileNotFoundError:
            raise CheckpointNotFoundError(path, "no such file") from None
        etag = str(getattr(st, "etag", ""))
        key, size = ((str(path), etag, st.st_size) if etag else None), st.st_size
        with _STRUCTURES_LOCK:
            cached = _STRUCTURES.get(key) if key is not None else None
        if cached is not None:
            return cached
    try:
        source = open_structure(path, size=size)
    except FileNotFoundError:
        raise CheckpointNotFoundError(path, "no such file") from None
    except OSError as err:
        raise CheckpointFormatError(path, f"cannot read: {err.strerror or err}") from None
    name = source.name()
    if name is not None:  # mapped whole by name
        source.close()
        return name
    found = load_ds_structure(path, source)
    if shared:
        found.close()  # its pieces go; a later header check reads afresh
        if key is not None:
            with _STRUCTURES_LOCK:
                if len(_STRUCTURES) >= _STRUCTURES_KEPT:
                    _STRUCTURES.pop(next(iter(_STRUCTURES)))
                _STRUCTURES[key] = found
    return found


def _tag_step(tag: str) -> int | None:
    m = TAG_STEP_RE.search(tag)
    return int(m.group(1)) if m else None


def step_from(global_steps: Any, tag: str) -> int | None:
    """A DeepSpeed checkpoint's step: ``global_steps`` when recorded, else the number in the tag name."""
    return global_steps if isinstance(global_steps, int) else _tag_step(tag)


def model_files(models: list[Location]) -> list[Location]:
    """The model-states files a reader uses, in rank order: ZeRO-3's per-rank files, else ``mp_rank_00``."""
    zero3 = sorted(((int(m.group(1)), p) for p in models if (m := ZERO3_MODEL_RE.match(p.name))), key=lambda t: t[0])
    return [p for _, p in zero3] or [p for p in models if MODEL_RE.match(p.name)]


def step_of(path: str | Location) -> int | None:
    """The step a :class:`~.reader.DeepSpeedReader` of ``path`` reports, from the first
    model-states file alone.

    Example:
        >>> step_of("out/checkpoint-500")  # doctest: +SKIP
        500
    """
    tag_dir = find_tag_dir(path)
    if tag_dir is None:
        return None
    files = model_files(ds_files(tag_dir)[0])
    if not files:
        return None
    return step_from(_model_summary(files[0])[1], tag_dir.name)


def deepspeed_tags(save_dir: str | Location) -> list[Location]:
    """Every tag folder directly under a DeepSpeed ``save_dir`` (``latest`` names only the newest),
    by the step in its name, then by name."""
    tags = [c for c in as_path(save_dir).iterdir() if c.is_dir() and all(ds_files(c))]
    return sorted(tags, key=lambda p: (step if (step := _tag_step(p.name)) is not None else -1, p.name))

