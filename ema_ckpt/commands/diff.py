"""``diff``: compare two checkpoints of any supported formats, key by key.

Keys are paired by name, a leading ``model.`` stripped on either side where that pairs more
(a DCP ``{"model": …}`` checkpoint against the safetensors file consolidated from it). Values
stream in row blocks, floats compared in float64 (complex in complex128), integers exactly.
Per key: shapes, dtypes, ``max|a − b|``, ``max|a − b| / max|b|`` and how many elements differ;
NaN against NaN counts as equal, NaN or ±Inf against anything else as an infinite difference.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..dtypes import name_of
from ..formats.base import CheckpointReader
from ..job_context import JobContext, Piece, Tally
from ..jobs import ReadingJob, run_job
from ..layout import TensorSpec, row_blocks
from ..options import KeyFields, ReadFields, RunFields
from ..progress import Progress
from ..storage import Location, as_path

MODEL_PREFIX = "model."
BLOCK_BYTES = 32 << 20
"""Each side is read (and widened to 64-bit) in row blocks of about this many bytes."""


@dataclass(slots=True)
class KeyDiff:
    """How one key of A compares with its partner in B.

    ``max_abs``/``max_rel`` are None when the shapes differ (values were not compared).
    ``mismatched`` counts elements that are not equal (NaN equals NaN here).
    """

    key_a: str
    key_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    numel: int = 0
    max_abs: float | None = None
    max_rel: float | None = None
    mismatched: int = 0

    @property
    def name(self) -> str:
        return self.key_a

    @property
    def same_shape(self) -> bool:
        return self.shape_a == self.shape_b

    @property
    def same_dtype(self) -> bool:
        return self.dtype_a == self.dtype_b

    def matches(self, atol: float = 0.0) -> bool:
        """Same shape, and every element within ``atol`` (``atol == 0``: bit-for-bit equal values)."""
        if not self.same_shape or self.max_abs is None:
            return False
        return self.mismatched == 0 if atol <= 0 else self.max_abs <= atol

    def to_dict(self, atol: float = 0.0) -> dict[str, Any]:
        return {**{f.name: _json_value(getattr(self, f.name)) for f in fields(self)}, "matches": self.matches(atol)}


@dataclass(slots=True)
class DiffResult:
    """What :func:`diff` found: paired keys, and keys only one side holds."""

    a: Location
    b: Location
    format_a: str
    format_b: str
    keys: list[KeyDiff] = field(default_factory=list)
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    pairing: str = "exact"
    """How names were paired: ``exact``, ``strip-a`` / ``strip-b`` / ``strip-both`` (``model.``)."""
    bytes_read: int = 0

    def differing(self, atol: float = 0.0) -> list[KeyDiff]:
        return [k for k in self.keys if not k.matches(atol)]

    def equal(self, atol: float = 0.0) -> bool:
        """The same keys on both sides, each with the same shape and values within ``atol``."""
        return not self.only_in_a and not self.only_in_b and not self.differing(atol)

    def to_dict(self, atol: float = 0.0) -> dict[str, Any]:
        return {
            "a": str(self.a),
            "b": str(self.b),
            "format_a": self.format_a,
            "format_b": self.format_b,
            "pairing": self.pairing,
            "atol": atol,
            "equal": self.equal(atol),
            "compared": len(self.keys),
            "differing": [k.key_a for k in self.differing(atol)],
            "only_in_a": list(self.only_in_a),
            "only_in_b": list(self.only_in_b),
            "bytes_read": self.bytes_read,
            "keys": [k.to_dict(atol) for k in self.keys],
        }


def _json_value(value: Any) -> Any:
    """Tuples as lists; JSON has no Inf/NaN: those become the strings ``"inf"`` / ``"nan"``."""
    if isinstance(value, tuple):
        return list(value)
    if not isinstance(value, float) or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _names(keys: Sequence[str], strip: bool) -> dict[str, str] | None:
    """``{name: key}``, or None when stripping makes two keys collide."""
    out: dict[str, str] = {}
    for key in keys:
        name = key.removeprefix(MODEL_PREFIX) if strip else key
        if name in out:
            return None
        out[name] = key
    return out


def pair_keys(
    keys_a: Sequence[str], keys_b: Sequence[str]
) -> tuple[list[tuple[str, str]], list[str], list[str], str]:
    """``(pairs, only_in_a, only_in_b, pairing)``: see the module docstring.

    Example:
        >>> pair_keys(["model.w", "model.b"], ["w", "b"])[0]
        [('model.w', 'w'), ('model.b', 'b')]
    """
    best: tuple[int, str, dict[str, str], dict[str, str]] | None = None
    candidates = (("exact", False, False), ("strip-a", True, False), ("strip-b", False, True),
                  ("strip-both", True, True))
    for label, strip_a, strip_b in candidates:
        names_a, names_b = _names(keys_a, strip_a), _names(keys_b, strip_b)
        if names_a is None or names_b is None:
            continue
        overlap = len(names_a.keys() & names_b.keys())
        if best is None or overlap > best[0]:
            best = (overlap, label, names_a, names_b)
    assert best is not None  # the exact pairing never collides
    _, label, names_a, names_b = best
    pairs = [(key, names_b[name]) for name, key in names_a.items() if name in names_b]
    only_a = [key for name, key in names_a.items() if name not in names_b]
    only_b = [key for name, key in names_b.items() if name not in names_a]
    return pairs, only_a, only_b, label


def _selected(names: Sequence[str], include: Sequence[str], exclude: Sequence[str]) -> bool:
    """Kept when some name is included (or nothing is asked for) and none is excluded."""
    if include and not any(fnmatch.fnmatchcase(k, g) for k in names for g in include):
        return False
    return not (exclude and any(fnmatch.fnmatchcase(k, g) for k in names for g in exclude))


def diff(
    a: str | Location,
    b: str | Location,
    *,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    block_bytes: int = BLOCK_BYTES,
    state_key: str | None = None,
    inert_globals: Sequence[str] = (),
    workers: int = 1,
    on_progress: Callable[[Progress], None] | None = None,
) -> DiffResult:
    """Compare the checkpoints at ``a`` and ``b`` key by key (see the module docstring).

    Args:
        a, b: any supported checkpoints.
        include, exclude: glob patterns; a pair is kept when either side's name matches
            an ``include`` pattern (or there are none) and neither matches an ``exclude``.
        block_bytes: memory bound per side for one block of rows, widened to 64 bits.
        state_key, inert_globals: as for :func:`~ema_ckpt.accumulate` (on both sides).
        workers: compare the keys in N processes (the result is the same for any N).
        on_progress: called as this process compares its share.

    Example:
        >>> result = diff("ckpts/ema", "ema.safetensors")     # doctest: +SKIP
        >>> result.equal(), result.only_in_a, result.only_in_b  # doctest: +SKIP
        (True, [], [])

    Raises:
        CheckpointNotFoundError, CheckpointFormatError: a path holds no readable checkpoint.
    """
    options = DiffOptions(a=as_path(a), b=as_path(b), include=tuple(include), exclude=tuple(exclude),
                          block_bytes=block_bytes, state_key=state_key, inert_globals=tuple(inert_globals),
                          workers=workers)
    return run_job(DiffJob(options), on_progress=on_progress)


@dataclass(frozen=True, kw_only=True)
class DiffOptions(KeyFields, ReadFields, RunFields):
    """Everything a :func:`diff` run needs; checked when made."""

    a: Location
    b: Location
    block_bytes: int = BLOCK_BYTES


@dataclass
class DiffJob(ReadingJob[None, DiffResult]):
    options: DiffOptions

    def plan(self, notes: list[str]) -> None:
        return None

    def compute(self, plan: None, context: JobContext) -> DiffResult:
        """:func:`diff` on one worker: every worker pairs the keys alike; each pair is compared by one."""
        a, b, include, exclude = self.options.a, self.options.b, self.options.include, self.options.exclude
        # every worker opens both: a bad path fails alike everywhere
        reader_a, reader_b = context.check(lambda: (context.open(a), context.open(b)))
        specs_a, specs_b = reader_a.specs(), reader_b.specs()
        pairs, only_a, only_b, pairing = pair_keys(list(specs_a), list(specs_b))
        result = DiffResult(a, b, reader_a.format_name, reader_b.format_name, pairing=pairing)
        result.only_in_a = [k for k in only_a if _selected((k,), include, exclude)]
        result.only_in_b = [k for k in only_b if _selected((k,), include, exclude)]
        pieces = []
        for key_a, key_b in pairs:
            if _selected((key_a, key_b), include, exclude):
                spec_a, spec_b = specs_a[key_a], specs_b[key_b]
                cost = spec_a.nbytes + spec_b.nbytes if spec_a.shape == spec_b.shape else 0
                pieces.append(Piece(cost, functools.partial(_compare_key, reader_a, reader_b, spec_a, spec_b,
                                                            self.options.block_bytes)))
        compared = context.share_out(pieces)
        result.keys = [k for k, _ in compared]
        result.bytes_read = sum(n for _, n in compared)
        return result


def _compare_key(
    reader_a: CheckpointReader,
    reader_b: CheckpointReader,
    spec_a: TensorSpec,
    spec_b: TensorSpec,
    block_bytes: int,
    tally: Tally,
) -> tuple[KeyDiff, int]:
    """How ``spec_a``'s key compares with ``spec_b``'s, and the bytes read."""
    out = KeyDiff(
        spec_a.key, spec_b.key, spec_a.shape, spec_b.shape,
        name_of(spec_a.dtype), name_of(spec_b.dtype), numel=spec_a.numel,
    )
    if spec_a.shape != spec_b.shape:
        return out, 0
    complex_ = spec_a.dtype.is_complex or spec_b.dtype.is_complex
    floating = complex_ or spec_a.dtype.is_floating_point or spec_b.dtype.is_floating_point
    wide = torch.complex128 if complex_ else (torch.float64 if floating else torch.int64)
    limit = max(1, block_bytes // (16 if complex_ else 8))
    max_abs = max_b = 0.0
    mismatched = nbytes = 0
    for box in row_blocks(spec_a.shape, list(reader_a.layout(spec_a.key)), limit):
        if box.numel == 0:
            continue
        block_a = reader_a.read(spec_a.key, box)
        block_b = reader_b.read(spec_b.key, box)
        nbytes += block_a.nbytes + block_b.nbytes
        tally.add(block_a.nbytes + block_b.nbytes, spec_a.key)
        x, y = block_a.to(wide), block_b.to(wide)
        del block_a, block_b
        block_abs, block_max_b, block_mismatched = _compare_block(x, y, floating)
        max_abs = max(max_abs, block_abs)
        max_b = max(max_b, block_max_b)
        mismatched += block_mismatched
    out.max_abs = max_abs
    out.mismatched = mismatched
    if max_abs == 0:
        out.max_rel = 0.0
    elif max_b == 0 or math.isinf(max_abs):
        out.max_rel = math.inf
    else:
        out.max_rel = max_abs / max_b
    return out, nbytes


def _compare_block(x: torch.Tensor, y: torch.Tensor, floating: bool) -> tuple[float, float, int]:
    """``(max |x − y|, max finite |y|, elements not equal)`` of one block."""
    if not floating:
        unequal = x != y
        count = int(unequal.sum())
        if count == 0:
            return 0.0, float(y.to(torch.float64).abs().max()), 0
        # Exact in int64 would overflow for far-apart values: report the difference in float64.
        delta = (x[unequal].to(torch.float64) - y[unequal].to(torch.float64)).abs()
        return float(delta.max()), float(y.to(torch.float64).abs().max()), count
    same = (x == y) | (torch.isnan(x) & torch.isnan(y))
    count = int((~same).sum())
    finite_b = y[torch.isfinite(y)].abs()
    max_b = float(finite_b.max()) if finite_b.numel() else 0.0
    if count == 0:
        return 0.0, max_b, 0
    delta = torch.nan_to_num((x[~same] - y[~same]).abs(), nan=math.inf, posinf=math.inf)
    return float(delta.max()), max_b, count
