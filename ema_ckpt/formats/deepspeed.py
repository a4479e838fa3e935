"""DeepSpeed ZeRO 1/2/3 checkpoints, read without DeepSpeed.

A DeepSpeed checkpoint is a *tag folder* (``save_dir/global_step1000/``) holding one or more
``*_model_states.pt`` files and one ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``
file per data-parallel rank; ``save_dir/latest`` names the newest tag. The reader serves the
fp32 master weights exactly as DeepSpeed's ``zero_to_fp32`` rebuilds them, key for key and bit
for bit, plus what ``zero_to_fp32`` drops at ZeRO-1 (frozen parameters):

* trainable parameters: fp32 masters, from ``single_partition_of_fp32_groups`` (stage 1/2, and
  BF16_Optimizer) or ``fp32_flat_groups`` (stage 3);
* frozen parameters: ``frozen_param_fragments`` (stage 2: whole; stage 3: one padded slice per
  rank), or, at stage 1 where DeepSpeed records nothing, the tensors of the model-states
  ``module`` that are neither trainable nor buffers; in their saved (training) dtype;
* buffers: from ``module``; floating ones upcast to fp32 as ``zero_to_fp32`` does, integer
  and bool ones in their own dtype;
* tied parameters (``shared_params``): the alias key reads the owner's data.

Nothing is gathered at open: every ``.pt`` file is memory-mapped once (see
:mod:`._ds_unpickle`) and each key knows which flat ranges of which rank tensors hold it.
``read`` copies only the flat span that covers the box asked for, then hands the mapped pages
it touched back to the kernel (:func:`~._ds_unpickle.release_pages`): without that, every page
read from every rank file of every open checkpoint would stay resident (4 GiB for four 1 GiB
steps). ``layout`` offers tensors over 32 MiB as row blocks, so a run's memory is a few such
blocks, whatever the largest parameter and however it straddles ranks.

Refused with :class:`~ema_ckpt.errors.CheckpointFormatError` (naming the file): tensor
parallelism (``mp_rank_01``), pipeline ``layer_*`` files, MoE (``expp_rank_*``, expert
layers), NVMe-offloaded tensors, ZeRO-0, and a world size that does not match the number of
optimizer files.

Example:
    >>> from ema_ckpt.formats import open_checkpoint                  # doctest: +SKIP
    >>> with open_checkpoint("out/checkpoint-500") as reader:          # doctest: +SKIP
    ...     reader.info()["stage"], reader.step
    (3, 500)
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from .._lazy import torch
from ..errors import CheckpointFormatError, CheckpointNotFoundError, EmaCkptError, UnsafePickleError
from ..layout import Box, TensorSpec, split_rows
from ._ds_unpickle import load_ds_file, load_ds_file_releasable, release_pages
from .base import CheckpointFormat, register_format

__all__ = [
    "DeepSpeedReader",
    "deepspeed_tags",
    "find_tag_dir",
    "incomplete",
    "is_deepspeed",
    "open_deepspeed",
]

FORMAT_NAME = "deepspeed"

_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_UNSUPPORTED_FILES = (
    (re.compile(r"^layer_\d+-model_\d+-model_states\.pt$"), "pipeline-parallel layer files"),
    (re.compile(r"^layer_\d+_expert_\d+_.*model_states\.pt$"), "MoE expert files"),
    (re.compile(r"^expp_rank_\d+_.*optim_states\.pt$"), "MoE expert-parallel optimizer files"),
)
_TAG_STEP_RE = re.compile(r"(?:global_step|checkpoint-|step)(\d+)$")
_RELEASE_SLICE_BYTES = 16 << 20  # copy mapped spans this much at a time, then drop their pages
_REGION_BYTES = 32 << 20  # layout(): larger tensors are served in row blocks of at most this


# --- detection -----------------------------------------------------------------------------


def _ds_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """The ``*_model_states.pt`` and ``*optim_states.pt`` files directly in ``folder``."""
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return [], []
    models = [folder / n for n in names if n.endswith("_model_states.pt")]
    optims = [folder / n for n in names if n.endswith("optim_states.pt")]
    return models, optims


def _read_latest(folder: Path) -> str | None:
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


def find_tag_dir(path: str | Path) -> Path | None:
    """The DeepSpeed tag folder ``path`` is or names through ``latest``; None if neither.

    Accepts a tag folder (``save_dir/global_step10``), a save folder whose ``latest`` names a
    tag folder, and so Hugging Face Trainer's ``checkpoint-N`` (``latest`` + ``global_stepN``).
    Only file names are looked at.
    """
    path = Path(path)
    if not path.is_dir():
        return None
    models, optims = _ds_files(path)
    if models and optims:
        return path
    tag = _read_latest(path)
    if tag is not None:
        tag_dir = path / tag
        if tag_dir.is_dir():
            models, optims = _ds_files(tag_dir)
            if models and optims:
                return tag_dir
    return None


def _name_gaps(tag_dir: Path) -> str | None:
    """Why the file names of ``tag_dir`` show missing rank files, or None (names only)."""
    models, optims = _ds_files(tag_dir)
    ranks = sorted(int(m.group(2)) for m in (_OPTIM_RE.match(p.name) for p in optims) if m)
    if ranks and ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        return f"optimizer files of data-parallel rank(s) {missing} are missing"
    zero3_models = [p for p in models if _ZERO3_MODEL_RE.match(p.name)]
    if zero3_models and len(zero3_models) != len(optims):
        return (
            f"{len(zero3_models)} ZeRO-3 model-states files but {len(optims)} optimizer files "
            "(a rank did not finish saving)"
        )
    return None


def is_deepspeed(path: str | Path) -> bool:
    """Detection by marker files: a tag folder, directly or via ``latest``, that is not
    :func:`incomplete` (so a checkpoint still being written is skipped, not half-read)."""
    tag_dir = find_tag_dir(path)
    return tag_dir is not None and incomplete(tag_dir) is None


def incomplete(path: str | Path) -> str | None:
    """A reason when ``path`` looks like a DeepSpeed checkpoint still being written, else None.

    Checks, cheapest first: ``latest`` naming a missing tag, a tag folder with model states but
    no optimizer files (or the reverse), gaps in the rank numbers, and fewer optimizer files
    than the ``dp_world_size`` recorded in the model states.
    """
    path = Path(path)
    if not path.is_dir():
        return None
    tag = _read_latest(path)
    tag_dir = path
    models, optims = _ds_files(path)
    if not models and not optims:
        if tag is None:
            return _tag_without_latest(path)
        tag_dir = path / tag
        if not tag_dir.is_dir():
            return f"'latest' names tag {tag!r} but {tag_dir} does not exist (still being written?)"
        models, optims = _ds_files(tag_dir)
        if not models and not optims:
            return f"DeepSpeed tag folder {tag_dir} holds no model or optimizer states yet"
    if not models and not optims:
        return None
    if not optims:
        return (
            f"DeepSpeed tag folder {tag_dir} holds model states but no *_optim_states.pt files "
            "(still being written, or a ZeRO-0 checkpoint, which is not supported)"
        )
    if not models:
        return f"DeepSpeed tag folder {tag_dir} holds optimizer states but no *_model_states.pt file"
    reason = _name_gaps(tag_dir)
    if reason:
        return f"DeepSpeed tag folder {tag_dir}: {reason}"
    first = _first_model_file(models)
    try:
        expected = _recorded_world_size(first)
    except UnsafePickleError:
        return None  # complete but refused: opening it gives the real error
    except CheckpointFormatError as err:
        return f"{first} is unreadable, perhaps still being written ({err.reason})"
    if isinstance(expected, int) and len(optims) < expected:
        return (
            f"DeepSpeed tag folder {tag_dir} holds {len(optims)} of the {expected} optimizer "
            "files its dp_world_size asks for (still being written?)"
        )
    return None


_TRAINER_FILES = {"trainer_state.json", "config.json", "training_args.bin", "zero_to_fp32.py"}
"""Files a trainer writes beside its DeepSpeed tag (the Hugging Face Trainer's checkpoint-N)."""


def _tag_without_latest(path: Path) -> str | None:
    """A reason when a folder without ``latest`` holds a DeepSpeed tag that is still being written.

    DeepSpeed writes ``latest`` after every rank's files, so a Hugging Face Trainer
    ``checkpoint-N/global_stepN/`` holding rank 0's files only is a save in progress (or one
    that died). A folder of several tags is a save folder: each tag is judged on its own, and a
    folder without a trainer's files beside its subfolders (a folder of checkpoints) is not
    looked into at all.
    """
    try:
        files = [p.name for p in path.iterdir() if p.is_file()]
        if not any(n in _TRAINER_FILES or n.endswith(".safetensors") for n in files):
            return None
        tags = [c for c in sorted(path.iterdir()) if c.is_dir() and any(_ds_files(c))]
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


# (path, device, inode, size, mtime_ns) -> dp_world_size of a settled model-states file.
_WORLD_SIZES: dict[tuple[str, int, int, int, int], Any] = {}
_SETTLED_SECONDS = 2.0  # files modified more recently are read afresh (a same-size rewrite
# within the file system's timestamp granularity would otherwise look unchanged)


def _recorded_world_size(path: Path) -> Any:
    """``dp_world_size`` from a model-states file (None if absent), remembered per file version.

    Detection asks this of the same files several times per run (``detect_format``, discovery,
    then opening), and unpickling a ZeRO-3 model-states file costs tens of milliseconds.
    Errors are not remembered, so a file still being written is read again next time.
    """
    try:
        st = path.stat()
    except OSError:
        st = None
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) if st is not None else None
    if key is not None and key in _WORLD_SIZES:
        return _WORLD_SIZES[key]
    state = load_ds_file(path)
    expected = state.get("dp_world_size") if isinstance(state, dict) else None
    if key is not None and time.time() - st.st_mtime > _SETTLED_SECONDS:
        if len(_WORLD_SIZES) >= 4096:
            _WORLD_SIZES.clear()
        _WORLD_SIZES[key] = expected
    return expected


def _first_model_file(models: list[Path]) -> Path:
    for p in models:
        if p.name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
            return p
    return models[0]


def deepspeed_tags(save_dir: str | Path) -> list[Path]:
    """Every tag folder directly under a DeepSpeed ``save_dir``, oldest first.

    ``save_dir/latest`` names only the newest tag; an EMA wants them all. Order is by the step
    in the tag name (``global_step<N>``), then by name.
    """
    save_dir = Path(save_dir)
    tags = [c for c in sorted(save_dir.iterdir()) if c.is_dir() and all(_ds_files(c))]

    def order(p: Path) -> tuple[int, str]:
        m = _TAG_STEP_RE.search(p.name)
        return (int(m.group(1)) if m else -1, p.name)

    return sorted(tags, key=order)


# --- reading -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Piece:
    """Elements ``[dst, dst + length)`` of a key's flattened data are ``src[start : start + length]``."""

    dst: int
    length: int
    src: torch.Tensor  # 1-D, a view on a memory-mapped file
    start: int
    releasable: bool = False  # src's pages may be dropped after a copy (see release_pages)


@dataclass(slots=True)
class _Entry:
    spec: TensorSpec
    kind: str  # "param", "frozen", "buffer" or "tied"
    pieces: tuple[_Piece, ...] = ()  # flat-range sources (ZeRO partitions)
    tensor: torch.Tensor | None = None  # or one whole stored tensor (buffers, stage 1/2 frozen)
    owner: str | None = None  # for "tied": the key whose data this one reads
    releasable: bool = False  # ``tensor``'s pages may be dropped after a copy


class _FlatChunks:
    """Several 1-D tensors seen as their concatenation, without concatenating them."""

    def __init__(self, chunks: Sequence[torch.Tensor], releasable: Sequence[bool] | None = None) -> None:
        self.chunks = list(chunks)
        self.releasable = list(releasable) if releasable is not None else [False] * len(self.chunks)
        self.starts = [0]
        for c in self.chunks:
            self.starts.append(self.starts[-1] + c.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def pieces(self, start: int, length: int, dst: int) -> list[_Piece]:
        """Pieces for ``concat[start : start + length]`` placed at ``dst`` of a key."""
        out: list[_Piece] = []
        end = start + length
        for i, chunk in enumerate(self.chunks):
            lo, hi = max(start, self.starts[i]), min(end, self.starts[i + 1])
            if lo < hi:
                out.append(_Piece(dst + lo - start, hi - lo, chunk, lo - self.starts[i], self.releasable[i]))
        return out


def _flat(t: Any, where: Path, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CheckpointFormatError(where, f"{what} is {type(t).__name__}, not a tensor")
    if t.dim() != 1:
        t = t.reshape(-1)
    return t


def _same_storage(view: torch.Tensor, original: torch.Tensor) -> bool:
    """Whether ``view`` still shares ``original``'s memory (``reshape`` copies when it must)."""
    return view.untyped_storage().data_ptr() == original.untyped_storage().data_ptr()


def _shape(value: Any, where: Path, name: str) -> tuple[int, ...]:
    """A recorded shape as a tuple of non-negative ints, or a format error naming the file."""
    try:
        shape = tuple(int(d) for d in value)
    except (TypeError, ValueError):
        raise CheckpointFormatError(where, f"shape of {name} is not a list of sizes: {value!r}") from None
    if any(d < 0 for d in shape):
        raise CheckpointFormatError(where, f"shape of {name} has a negative size: {shape}")
    return shape


def _row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


class DeepSpeedReader:
    """Reads one DeepSpeed ZeRO 1/2/3 checkpoint (a tag folder) key by key, box by box.

    ``path`` is what was opened (a tag folder, or a save folder / HF ``checkpoint-N`` whose
    ``latest`` names the tag); ``tag_dir`` is the tag folder itself.

    Raises:
        CheckpointNotFoundError: no DeepSpeed tag folder at ``path``.
        CheckpointFormatError: a file is corrupt, or the checkpoint uses something this reader
            does not support (tensor/pipeline/expert parallelism, NVMe offload, ZeRO-0, a
            world size that does not match the optimizer files).
        UnsafePickleError: a file refers to code outside the allowlist (nothing ran).
    """

    format_name = FORMAT_NAME
    path: Path
    step: int | None
    """``global_steps`` from the model states, else the number in the tag name, else None."""
    tag_dir: Path
    tag: str
    stage: int
    world_size: int
    optimizer_kind: str
    """``"zero"`` (DeepSpeedZeroOptimizer / stage 3) or ``"bf16_optimizer"`` (BF16_Optimizer)."""
    train_dtype: str
    """``"fp32"``, ``"bf16"`` or ``"fp16"``: the precision the model trained in."""
    master_dtype: torch.dtype
    ds_version: str | None

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        tag_dir = find_tag_dir(self.path)
        if tag_dir is None:
            reason = (
                incomplete(self.path) or "no DeepSpeed tag folder (no *_model_states.pt and *optim_states.pt)"
            )
            raise CheckpointNotFoundError(self.path, reason)
        self.tag_dir = tag_dir
        self.tag = tag_dir.name
        self._states: dict[Path, Any] = {}  # file -> loaded (memory-mapped) object
        self._releasable: dict[Path, bool] = {}  # file -> its mapped pages may be dropped
        self._entries: dict[str, _Entry] = {}
        self._closed = False
        try:
            self._build()
        except EmaCkptError:
            raise
        except Exception as err:  # any malformed field: one line naming the checkpoint
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise CheckpointFormatError(self.tag_dir, f"malformed DeepSpeed checkpoint ({type(err).__name__}: {first})") from None

    # -- protocol --

    def specs(self) -> Mapping[str, TensorSpec]:
        self._check_open()
        return {k: e.spec for k, e in self._entries.items()}

    def layout(self, key: str) -> Sequence[Box]:
        """The regions to read ``key`` by: whole rows, at most 32 MiB each.

        A ZeRO rank's share is a flat range, not a box, so there are no stored boxes to
        follow; one box covering the tensor (the answer for every tensor up to 32 MiB) would
        make memory scale with the largest parameter (a 250k-token embedding is GiBs), so
        larger tensors are cut into row blocks that ``read`` serves as cheaply.
        """
        spec = self._entry(key).spec
        if spec.numel == 0:
            return []
        return split_rows(Box.full(spec.shape), max(1, _REGION_BYTES // max(1, spec.dtype.itemsize)))

    def read(self, key: str, box: Box) -> torch.Tensor:
        entry = self._entry(key)
        spec = entry.spec
        if entry.owner is not None:
            entry = self._entries[entry.owner]
        shape = spec.shape
        if len(box.offsets) != len(shape) or len(box.sizes) != len(shape):
            raise ValueError(f"{key}: box {box} has {len(box.sizes)} dims, tensor has {len(shape)}")
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(box.offsets, box.sizes, shape, strict=True)):
            raise ValueError(f"{key}: box {box} is outside shape {shape}")
        out = torch.empty(box.sizes, dtype=spec.dtype)
        if out.numel() == 0:
            return out
        if entry.tensor is not None:
            part = entry.tensor[box.slices()]
            if not entry.releasable:
                out.copy_(part)
                return out
            row = part[0].numel() * part.element_size() if part.dim() else 1
            rows = max(1, _RELEASE_SLICE_BYTES // max(1, row))
            for r in range(0, part.shape[0], rows) if part.dim() else (None,):
                dst, src = (out, part) if r is None else (out[r : r + rows], part[r : r + rows])
                dst.copy_(src)
                release_pages(src)
            return out
        strides = _row_major_strides(shape)
        lo = sum(o * s for o, s in zip(box.offsets, strides, strict=True))
        hi = sum((o + n - 1) * s for o, n, s in zip(box.offsets, box.sizes, strides, strict=True)) + 1
        if hi - lo == out.numel():  # the box is one contiguous run (rows, or a whole tensor)
            self._gather(entry, lo, hi, out.view(-1))
            return out
        span = torch.empty(hi - lo, dtype=entry.pieces[0].src.dtype if entry.pieces else spec.dtype)
        self._gather(entry, lo, hi, span)
        out.copy_(span.as_strided(box.sizes, strides))
        return out

    def info(self) -> dict[str, Any]:
        self._check_open()
        kinds = [e.kind for e in self._entries.values()]
        return {
            "format": FORMAT_NAME,
            "tag": self.tag,
            "tag_dir": str(self.tag_dir),
            "stage": self.stage,
            "optimizer": self.optimizer_kind,
            "world_size": self.world_size,
            "dtype": self.train_dtype,
            "master_dtype": str(self.master_dtype).removeprefix("torch."),
            "global_step": self.step,
            "ds_version": self.ds_version,
            "params": kinds.count("param"),
            "frozen": kinds.count("frozen"),
            "tied": kinds.count("tied"),
            "buffers": kinds.count("buffer"),
            "tensors": len(kinds),
            "model_states_files": [p.name for p in self._model_files],
            "optim_states_files": [p.name for p in self._optim_files],
        }

    def close(self) -> None:
        self._entries = {}
        self._states = {}
        self._closed = True

    def __enter__(self) -> DeepSpeedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DeepSpeedReader({str(self.path)!r}, tag={self.tag!r})"

    # -- internals --

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: reader is closed")

    def _entry(self, key: str) -> _Entry:
        self._check_open()
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"{key!r} is not a tensor of {self.tag_dir}") from None

    def _load(self, path: Path) -> Any:
        if path not in self._states:
            self._states[path], self._releasable[path] = load_ds_file_releasable(path)
        return self._states[path]

    @staticmethod
    def _gather(entry: _Entry, lo: int, hi: int, out: torch.Tensor) -> None:
        """Fill ``out`` (1-D, ``hi - lo`` long) with flat elements ``[lo, hi)`` of ``entry``."""
        for p in entry.pieces:
            a, b = max(lo, p.dst), min(hi, p.dst + p.length)
            if a >= b:
                continue
            # Mapped sources go in slices, each handed back once copied: resident file pages
            # stay within one slice, not one rank's share of the parameter.
            step = max(1, _RELEASE_SLICE_BYTES // p.src.element_size()) if p.releasable else b - a
            for x in range(a, b, step):
                y = min(b, x + step)
                src = p.src[p.start + x - p.dst : p.start + y - p.dst]
                out[x - lo : y - lo].copy_(src)
                if p.releasable:
                    release_pages(src)

    def _build(self) -> None:
        """Index the files, check the layout is one this reader understands, map every key."""
        self._refuse_unsupported_files()
        parsed, zero3_models = self._index_files()
        model0_path = self._model_files[0]
        model0 = self._load(model0_path)
        osds = self._check_states(model0_path, model0, zero3_models)
        self._describe(model0, bf16_file_names=any(bf16 for _, _, bf16 in parsed))
        self._entries = self._map_keys(model0_path, model0, osds)

    def _index_files(self) -> tuple[list[tuple[int, Path, bool]], list[tuple[int, Path]]]:
        """Sort the rank files by data-parallel rank; refuse names this reader does not know."""
        tag_dir = self.tag_dir
        models, optims = _ds_files(tag_dir)
        parsed = []
        for p in optims:
            m = _OPTIM_RE.match(p.name)
            if m is None:
                raise CheckpointFormatError(p, "unrecognised optimizer-states file name")
            parsed.append((int(m.group(2)), p, bool(m.group(1))))
        parsed.sort(key=lambda t: t[0])
        self._optim_files = [p for _, p, _ in parsed]
        reason = _name_gaps(tag_dir)
        if reason:
            raise CheckpointFormatError(tag_dir, reason)

        zero3_models = sorted(
            ((int(m.group(1)), p) for p in models if (m := _ZERO3_MODEL_RE.match(p.name))),
            key=lambda t: t[0],
        )
        plain_models = [p for p in models if _MODEL_RE.match(p.name)]
        self._model_files = [p for _, p in zero3_models] or plain_models
        if not self._model_files:
            raise CheckpointFormatError(models[0], "unrecognised model-states file name")
        return parsed, zero3_models

    def _check_states(self, model0_path: Path, model0: Any, zero3_models: list) -> list[dict]:
        """Stage, world size and file counts; returns each rank's ``optimizer_state_dict``."""
        tag_dir = self.tag_dir
        if not isinstance(model0, dict) or "buffer_names" not in model0:
            raise CheckpointFormatError(model0_path, "not a DeepSpeed model-states file (no buffer_names)")
        for moe_key in ("num_experts", "ds_autoep_layers", "ds_autoep_layers_v1"):
            if model0.get(moe_key):
                raise CheckpointFormatError(
                    model0_path, f"mixture-of-experts checkpoints ({moe_key}) are not supported"
                )
        if model0.get("mp_world_size", 1) not in (None, 1):
            raise CheckpointFormatError(
                model0_path,
                f"tensor-parallel checkpoints (mp_world_size={model0['mp_world_size']}) are not supported",
            )

        osds = []
        for p in self._optim_files:
            state = self._load(p)
            osd = state.get("optimizer_state_dict") if isinstance(state, dict) else None
            if not isinstance(osd, dict):
                raise CheckpointFormatError(
                    p, "not a DeepSpeed optimizer-states file (no optimizer_state_dict)"
                )
            osds.append(osd)
        osd0 = osds[0]
        if "zero_stage" in osd0:
            self.stage = int(osd0["zero_stage"])
            self.optimizer_kind = "zero"
        elif "single_partition_of_fp32_groups" in osd0:
            self.stage = 1  # BF16_Optimizer: ZeRO-1 layout, no zero_stage, no loss scaler
            self.optimizer_kind = "bf16_optimizer"
        else:
            raise CheckpointFormatError(self._optim_files[0], "not a ZeRO checkpoint (no zero_stage)")
        if self.stage not in (1, 2, 3):
            raise CheckpointFormatError(self._optim_files[0], f"ZeRO stage {self.stage} is not supported")

        counts = osd0.get("partition_count")
        if isinstance(counts, list | tuple):
            if len(set(counts)) > 1:
                raise CheckpointFormatError(
                    self._optim_files[0],
                    f"parameter groups are split over different rank counts {list(counts)} "
                    "(expert or hierarchical partitioning), which is not supported",
                )
            counts = counts[0] if counts else None
        if not isinstance(counts, int) or counts < 1:
            raise CheckpointFormatError(
                self._optim_files[0], f"bad partition_count {osd0.get('partition_count')!r}"
            )
        self.world_size = counts
        if counts != len(self._optim_files):
            raise CheckpointFormatError(
                tag_dir,
                f"expected {counts} *_optim_states.pt files (partition_count) but found "
                f"{len(self._optim_files)}: an old checkpoint was overwritten, a rank did not save, "
                "or the run used hierarchical partitioning (MiCS/hpZ), which is not supported",
            )
        if self.stage == 3 and len(self._model_files) != counts:
            raise CheckpointFormatError(
                tag_dir, f"expected {counts} ZeRO-3 model-states files but found {len(self._model_files)}"
            )
        if self.stage < 3 and zero3_models:
            raise CheckpointFormatError(
                zero3_models[0][1], f"ZeRO-3 model-states file in a stage-{self.stage} checkpoint"
            )
        return osds

    def _describe(self, model0: dict, *, bf16_file_names: bool) -> None:
        """Training dtype, DeepSpeed version and step, for ``info()`` and ``step``."""
        ds_config = model0.get("ds_config") if isinstance(model0.get("ds_config"), dict) else {}
        if bf16_file_names or (ds_config.get("bf16") or {}).get("enabled"):
            self.train_dtype = "bf16"
        elif (ds_config.get("fp16") or {}).get("enabled"):
            self.train_dtype = "fp16"
        else:
            self.train_dtype = "fp32"
        self.ds_version = str(model0.get("ds_version")) if model0.get("ds_version") is not None else None
        steps = model0.get("global_steps")
        if isinstance(steps, int):
            self.step = steps
        else:
            m = _TAG_STEP_RE.search(self.tag)
            self.step = int(m.group(1)) if m else None

    def _map_keys(self, model0_path: Path, model0: dict, osds: list[dict]) -> dict[str, _Entry]:
        """Every key: buffers, frozen, trainable (masters), tied aliases; in state_dict order."""
        entries: dict[str, _Entry] = {}
        module = model0.get("module") or {}
        if not isinstance(module, Mapping):
            raise CheckpointFormatError(model0_path, "'module' is not a state dict")
        buffer_names = list(model0.get("buffer_names") or [])
        for name in buffer_names:
            t = module.get(name)
            if not isinstance(t, torch.Tensor):
                continue
            dtype = torch.float32 if t.is_floating_point() else t.dtype
            spec = TensorSpec(name, tuple(t.shape), dtype)
            entries[name] = _Entry(spec, "buffer", tensor=t, releasable=self._releasable[model0_path])

        param_shapes = model0.get("param_shapes")
        if not isinstance(param_shapes, list):
            raise CheckpointFormatError(model0_path, "no param_shapes (not a ZeRO checkpoint)")
        if self.stage <= 2:
            trainable = self._stage12_params(param_shapes, osds)
        else:
            trainable = self._stage3_params(param_shapes, osds)

        frozen = self._frozen(model0_path, model0, module, buffer_names, trainable)
        entries.update(frozen)
        entries.update(trainable)
        masters = {e.pieces[0].src.dtype for e in trainable.values() if e.pieces}
        self.master_dtype = masters.pop() if len(masters) == 1 else torch.float32

        shared = model0.get("shared_params") or {}
        if not isinstance(shared, Mapping):
            raise CheckpointFormatError(model0_path, "shared_params is not a mapping")
        for alias, owner in shared.items():
            if owner in entries and alias not in entries:
                entries[alias] = _Entry(
                    TensorSpec(alias, entries[owner].spec.shape, entries[owner].spec.dtype),
                    "tied",
                    owner=owner,
                )

        # Keys in the module's own state_dict order where known, then zero_to_fp32's order.
        order = [k for k in module if k in entries]
        seen = set(order)
        order += [k for k in entries if k not in seen]
        return {k: entries[k] for k in order}

    def _refuse_unsupported_files(self) -> None:
        for child in sorted(self.tag_dir.iterdir()):
            name = child.name
            if child.is_dir() and name == "offloaded_tensors":
                raise CheckpointFormatError(child, "NVMe-offloaded optimizer state is not supported")
            for pattern, what in _UNSUPPORTED_FILES:
                if pattern.match(name):
                    raise CheckpointFormatError(child, f"{what} are not supported")
            m = re.search(r"mp_rank_(\d+)", name)
            if m and int(m.group(1)) != 0 and name.endswith(".pt"):
                raise CheckpointFormatError(
                    child, "tensor-parallel checkpoints (mp_rank_01 and up) are not supported"
                )

    def _stage12_params(self, param_shapes: list, osds: list[dict]) -> dict[str, _Entry]:
        key = "single_partition_of_fp32_groups"
        per_rank = []
        mapped: list[list[bool]] = []  # per rank, per group: pages releasable
        for p, osd in zip(self._optim_files, osds, strict=True):
            groups = osd.get(key)
            if not isinstance(groups, list | tuple):
                raise CheckpointFormatError(p, f"no {key}")
            flats = [_flat(t, p, f"{key}[{i}]") for i, t in enumerate(groups)]
            per_rank.append(flats)
            mapped.append(
                [self._releasable[p] and _same_storage(f, t) for f, t in zip(flats, groups, strict=True)]
            )
        n_groups = len(per_rank[0])
        if any(len(g) != n_groups for g in per_rank) or len(param_shapes) != n_groups:
            raise CheckpointFormatError(
                self._optim_files[0],
                f"{n_groups} flat groups per rank but {len(param_shapes)} param_shapes groups",
            )
        alignment = osds[0].get("param_alignment_paddings")
        align_to = 2 * self.world_size  # DeepSpeed pads each group to a multiple of 2·ws
        entries: dict[str, _Entry] = {}
        for g, shapes in enumerate(param_shapes):
            if not isinstance(shapes, Mapping):
                raise CheckpointFormatError(self._model_files[0], f"param_shapes[{g}] is not a mapping")
            flat = _FlatChunks([ranks[g] for ranks in per_rank], [m[g] for m in mapped])
            paddings = alignment[g] if alignment is not None else None
            if paddings is not None and len(paddings) != len(shapes):
                raise CheckpointFormatError(
                    self._optim_files[0],
                    f"group {g}: {len(paddings)} alignment paddings for {len(shapes)} params",
                )
            offset = 0
            for j, (name, shape) in enumerate(shapes.items()):
                shape = _shape(shape, self._model_files[0], name)
                n = math.prod(shape)
                if offset + n > flat.numel:
                    raise CheckpointFormatError(
                        self.tag_dir, f"group {g}: {name} needs elements up to {offset + n} of {flat.numel}"
                    )
                spec = TensorSpec(name, shape, flat.chunks[0].dtype)
                entries[name] = _Entry(spec, "param", pieces=tuple(flat.pieces(offset, n, 0)))
                offset += n + (int(paddings[j]) if paddings is not None else 0)
            if math.ceil(offset / align_to) != math.ceil(flat.numel / align_to):
                raise CheckpointFormatError(
                    self.tag_dir,
                    f"group {g}: consumed {offset} numels out of {flat.numel}; the layout is not understood",
                )
        return entries

    def _stage3_params(self, param_shapes: list, osds: list[dict]) -> dict[str, _Entry]:
        key = "fp32_flat_groups"
        ws = self.world_size
        per_rank = []
        for p, osd in zip(self._optim_files, osds, strict=True):
            groups = osd.get(key)
            if not isinstance(groups, list | tuple):
                raise CheckpointFormatError(p, f"no {key}")
            flats = [_flat(t, p, f"{key}[{i}]") for i, t in enumerate(groups)]
            mapped = [self._releasable[p] and _same_storage(f, t) for f, t in zip(flats, groups, strict=True)]
            per_rank.append(_FlatChunks(flats, mapped))
        merged: dict[str, tuple[int, ...]] = {}
        for g, shapes in enumerate(param_shapes):
            if not isinstance(shapes, Mapping):
                raise CheckpointFormatError(self._model_files[0], f"param_shapes[{g}] is not a mapping")
            for name, shape in shapes.items():
                merged[name] = _shape(shape, self._model_files[0], name)
        entries: dict[str, _Entry] = {}
        offset = 0  # within every rank's flat (all sub-groups back to back)
        for name, shape in merged.items():
            n = math.prod(shape)
            part = math.ceil(n / ws)
            pieces: list[_Piece] = []
            for r, flat in enumerate(per_rank):
                length = min(part, n - r * part)
                if length > 0:
                    pieces.extend(flat.pieces(offset, length, r * part))
            dtype = per_rank[0].chunks[0].dtype if per_rank[0].chunks else torch.float32
            entries[name] = _Entry(TensorSpec(name, shape, dtype), "param", pieces=tuple(pieces))
            offset += part
        for p, flat in zip(self._optim_files, per_rank, strict=True):
            if flat.numel != offset:
                raise CheckpointFormatError(
                    p, f"consumed {offset} numels out of {flat.numel} in {key}; the layout is not understood"
                )
        return entries

    def _frozen(
        self,
        model0_path: Path,
        model0: dict,
        module: Mapping,
        buffer_names: list[str],
        trainable: Mapping[str, _Entry],
    ) -> dict[str, _Entry]:
        entries: dict[str, _Entry] = {}
        shapes = model0.get("frozen_param_shapes")
        if shapes is not None and not isinstance(shapes, Mapping):
            raise CheckpointFormatError(model0_path, "frozen_param_shapes is not a mapping")
        if shapes is None:
            if self.stage == 3:
                return entries  # saved with exclude_frozen_parameters: nothing to read
            # ZeRO-1 records no frozen parameters (zero_to_fp32 drops them); they are the
            # module's tensors that are neither optimized nor buffers nor tied aliases.
            aliases = set((model0.get("shared_params") or {}).keys())
            skip = set(trainable) | set(buffer_names) | aliases
            for name, t in module.items():
                if name not in skip and isinstance(t, torch.Tensor):
                    entries[name] = _Entry(
                        TensorSpec(name, tuple(t.shape), t.dtype),
                        "frozen",
                        tensor=t,
                        releasable=self._releasable[model0_path],
                    )
            return entries
        if self.stage <= 2:
            fragments = model0.get("frozen_param_fragments") or {}
            for name, shape in shapes.items():
                shape = _shape(shape, model0_path, name)
                t = fragments.get(name)
                if not isinstance(t, torch.Tensor) or t.numel() != math.prod(shape):
                    raise CheckpointFormatError(
                        model0_path, f"frozen parameter {name} is missing or the wrong size"
                    )
                whole = t.reshape(shape)
                entries[name] = _Entry(
                    TensorSpec(name, shape, t.dtype),
                    "frozen",
                    tensor=whole,
                    releasable=self._releasable[model0_path] and _same_storage(whole, t),
                )
            return entries
        ws = self.world_size
        per_rank = []
        for p in self._model_files:
            state = self._load(p)
            per_rank.append(
                (p, (state.get("frozen_param_fragments") if isinstance(state, dict) else None) or {})
            )
        for name, shape in shapes.items():
            shape = _shape(shape, model0_path, name)
            n = math.prod(shape)
            part = math.ceil(n / ws)
            pieces = []
            dtype = None
            for r, (p, fragments) in enumerate(per_rank):
                t = fragments.get(name)
                if not isinstance(t, torch.Tensor) or t.numel() != part:
                    raise CheckpointFormatError(
                        p, f"frozen fragment of {name} is missing or not {part} elements"
                    )
                dtype = t.dtype
                length = min(part, n - r * part)
                if length > 0:
                    flat = t.reshape(-1)
                    releasable = self._releasable[p] and _same_storage(flat, t)
                    pieces.append(_Piece(r * part, length, flat, 0, releasable))
            entries[name] = _Entry(
                TensorSpec(name, shape, dtype or torch.float32), "frozen", pieces=tuple(pieces)
            )
        return entries


def open_deepspeed(path: str | Path) -> DeepSpeedReader:
    """Open a DeepSpeed checkpoint (tag folder, or a folder whose ``latest`` names one)."""
    return DeepSpeedReader(path)


register_format(
    CheckpointFormat(
        name=FORMAT_NAME,
        detect=is_deepspeed,
        open=open_deepspeed,
        incomplete=incomplete,
        records_step=True,
        step_label="DeepSpeed global_steps",
    )
)
