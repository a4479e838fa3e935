"""Format-independent description of tensors and the boxes they are stored in.

A :class:`Box` is a rectangular region of a tensor (DCP's ``ChunkStorageMetadata``); a
:class:`TensorSpec` is what a key is, from metadata alone.

Example:
    >>> a = Box((0, 0), (4, 6))
    >>> b = Box((2, 3), (4, 6))
    >>> a.intersect(b)
    Box(offsets=(2, 3), sizes=(2, 3))
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def as_tuple(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """``shape`` as a tuple, the same object when it is one (no copy per tensor of a plan).

    Example:
        >>> shape = (2, 3)
        >>> as_tuple(shape) is shape, as_tuple([2, 3])
        (True, (2, 3))
    """
    return shape if type(shape) is tuple else tuple(shape)


@dataclass(frozen=True, slots=True)
class Box:
    """A rectangular region of a tensor: ``tensor[o0:o0+s0, o1:o1+s1, ...]``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        """The box covering a whole tensor of ``shape`` (one object per shape: boxes never change)."""
        if cls is not Box or type(shape) is not tuple:
            return cls(tuple(0 for _ in shape), tuple(shape))
        box = _FULL_BOXES.get(shape)
        if box is None:
            box = Box(tuple(0 for _ in shape), shape)
            if len(_FULL_BOXES) < _MOST_FULL_BOXES:
                _FULL_BOXES[shape] = box
        return box

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or None when they do not overlap."""
        offsets = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        ends = tuple(min(a, b) for a, b in zip(self.ends, other.ends, strict=True))
        if any(e <= o for o, e in zip(offsets, ends, strict=True)):
            return None
        return Box(offsets, tuple(e - o for o, e in zip(offsets, ends, strict=True)))

    def relative_to(self, outer: Box) -> Box:
        """This box expressed in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets, strict=True)), self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))


_FULL_BOXES: dict[tuple[int, ...], Box] = {}
_MOST_FULL_BOXES = 1 << 16


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a tensor key is, from metadata alone."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


def boxes_cover(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """True when ``boxes`` (each inside ``shape``; empty ones ignored) cover every element exactly once.

    Example:
        >>> boxes_cover((3, 2), [Box((0, 0), (2, 2)), Box((2, 0), (1, 2))])
        True
    """
    if any(d < 0 for d in shape):
        return False
    for b in boxes:
        if len(b.offsets) != len(shape) or len(b.sizes) != len(shape):
            return False
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(b.offsets, b.sizes, shape, strict=True)):
            return False
    live = [b for b in boxes if b.numel > 0]
    if sum(b.numel for b in live) != math.prod(shape):
        return False
    if not shape:
        return len(live) == 1
    live.sort(key=lambda b: b.offsets[0])
    if all(b.sizes[1:] == shape[1:] for b in live):
        return all(a.offsets[0] + a.sizes[0] == b.offsets[0] for a, b in itertools.pairwise(live))
    for i, a in enumerate(live):  # volumes add up, so no overlap means exact cover
        end = a.offsets[0] + a.sizes[0]
        for b in live[i + 1 :]:
            if b.offsets[0] >= end:
                break
            if a.intersect(b) is not None:
                return False
    return True


def split_rows(box: Box, max_numel: int) -> list[Box]:
    """Split ``box`` along dim 0 into boxes of at most ``max_numel`` elements (at least one row).

    Example:
        >>> [b.sizes for b in split_rows(Box((0, 0), (5, 4)), 8)]
        [(2, 4), (2, 4), (1, 4)]
    """
    if not box.sizes or box.numel <= max_numel or box.sizes[0] <= 1:
        return [box]
    row = max(1, box.numel // box.sizes[0])
    rows = max(1, max_numel // row)
    return [Box((box.offsets[0] + start, *box.offsets[1:]), (min(rows, box.sizes[0] - start), *box.sizes[1:]))
            for start in range(0, box.sizes[0], rows)]


def dim0_shard_regions(shape: tuple[int, ...], world_size: int) -> list[tuple[int, Box]]:
    """(rank, box) of the ranks that hold rows of a tensor sharded on dim 0 as FSDP shards it
    (``torch.chunk``: ceil(n/W) rows a rank), and one empty box at offset n for the ranks past them.

    Example:
        >>> [(r, b.sizes) for r, b in dim0_shard_regions((5, 2), 100_000)]
        [(0, (1, 2)), (1, (1, 2)), (2, (1, 2)), (3, (1, 2)), (4, (1, 2)), (5, (0, 2))]
    """
    if not shape:
        return [(0, Box((), ()))]
    rows = math.ceil(shape[0] / world_size) if shape[0] else 0
    held = math.ceil(shape[0] / rows) if rows else 0
    regions = [(rank, Box((rank * rows, *[0] * (len(shape) - 1)), (min(rows, shape[0] - rank * rows), *shape[1:])))
               for rank in range(held)]
    if held < world_size:
        regions.append((held, Box((shape[0], *[0] * (len(shape) - 1)), (0, *shape[1:]))))
    return regions


def row_blocks(shape: tuple[int, ...], stored: list[Box], max_numel: int) -> list[Box]:
    """Boxes of whole rows covering a tensor in order, each at most ``max_numel`` elements (at
    least one row), following the ``stored`` boxes where they span all trailing dims."""
    full = Box.full(shape)
    if not shape or shape[0] == 0 or full.numel == 0:
        return [full]
    if stored and all(b.sizes[1:] == shape[1:] for b in stored):
        ordered = sorted((b for b in stored if b.numel), key=lambda b: b.offsets[0])
        return [part for box in ordered for part in split_rows(box, max_numel)]
    return split_rows(full, max_numel)
