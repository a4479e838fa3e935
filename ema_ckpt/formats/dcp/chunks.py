"""The chunks every worker's :class:`~.writer.DcpWriter` wrote, merged key by key for ``.metadata``.

The table holds the workers' columns and an order over them, never an object per key or chunk:
:meth:`ChunkTable.items` makes each key's entry (sorted by offsets, as DCP lists them) as asked.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import ItemsView, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from ...dtypes import name_of
from ...layout import Box, boxes_cover

if TYPE_CHECKING:
    import torch

    from .writer import WriterState

ChunkRecord = tuple[tuple[int, ...], tuple[int, ...], "tuple[str, int, int] | None"]
Entry = tuple[str, tuple[int, ...], list[ChunkRecord]]


class ChunkTable(Mapping[str, Entry]):
    """{key: (dtype name, shape, [(offsets, sizes, record or None), …])} over writers' states.

    Keys: every declared key, then those only the states hold, in ``key_order`` first. Each key's
    chunks come in state order, then in the order written, then sorted by offsets (a stable sort);
    a chunk's record is the last one written at its key and offsets.
    """

    def __init__(self, declared: dict[str, tuple[tuple[int, ...], torch.dtype]], states: Sequence[WriterState],
                 key_order: Sequence[str] | None) -> None:
        self._declared = declared
        self._extra: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for state in states:
            for key, shape, dtype in zip(state.keys, state.shapes, state.dtypes, strict=True):
                if key not in declared and key not in self._extra:
                    self._extra[key] = (shape, dtype)
        order = dict.fromkeys(k for k in (key_order or ()) if k in self)
        for key in itertools.chain(declared, self._extra):
            order.setdefault(key)
        self._order = list(order)
        del order
        filled = [state for state in states if state.keys]
        self._rows: WriterState | None = filled[0] if len(filled) == 1 else _concatenated(filled)
        self._sorted: array[int] | None = None  # the rows in key order, where they are not already
        self._counts = self._group()
        self._names: dict[object, str] = {}
        self._index: dict[str, int] | None = None

    def _group(self) -> array[int]:
        """Each key's number of rows, in key order, sorting the rows where needed."""
        rows = self._rows
        counts = array("q", bytes(8 * len(self._order)))
        if rows is None:
            return counts
        keys, boxes, n, row = rows.keys, rows.boxes, len(rows.keys), 0
        for index, key in enumerate(self._order):  # already in key order, offsets sorted: the usual case
            start = row
            while row < n and keys[row] == key:
                if row > start and boxes[row].offsets < boxes[row - 1].offsets:
                    break
                row += 1
            else:
                counts[index] = row - start
                continue
            break
        if row == n:
            return counts
        position = {key: index for index, key in enumerate(self._order)}
        self._sorted = array("q", sorted(range(n), key=lambda r: (position[keys[r]], boxes[r].offsets)))
        counts = array("q", bytes(8 * len(self._order)))
        for r in self._sorted:
            counts[position[keys[r]]] += 1
        return counts

    def _rows_of(self) -> Iterator[tuple[str, tuple[int, ...], torch.dtype, list[int]]]:
        """(key, shape, dtype, its rows) in key order."""
        ordered: Sequence[int] = self._sorted if self._sorted is not None else range(
            len(self._rows.keys) if self._rows is not None else 0)
        at = 0
        for key, count in zip(self._order, self._counts, strict=True):
            shape, dtype = self._kind(key)
            yield key, shape, dtype, [ordered[i] for i in range(at, at + count)]
            at += count

    def _kind(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        kind = self._declared.get(key)
        return kind if kind is not None else self._extra[key]

    def check_cover(self) -> None:
        """Refuse a key whose chunks do not cover its shape exactly once (the first, in key order)."""
        boxes = self._rows.boxes if self._rows is not None else []
        for key, shape, _dtype, rows in self._rows_of():
            if not boxes_cover(shape, [boxes[r] for r in rows]):
                raise ValueError(f"{key}: written chunks do not cover shape {list(shape)}")

    def _entries(self) -> Iterator[tuple[str, Entry]]:
        rows = self._rows
        for key, shape, dtype, numbers in self._rows_of():
            name = self._names.get(dtype)
            if name is None:
                name = self._names[dtype] = name_of(dtype)
            assert rows is not None or not numbers
            yield key, (name, shape, _chunks(rows, numbers) if rows is not None else [])

    def items(self) -> ItemsView[str, Entry]:
        return _Items(self)

    def __getitem__(self, key: str) -> Entry:
        if self._index is None:
            self._index = {k: i for i, k in enumerate(self._order)}
        return next(itertools.islice(self._entries(), self._index[key], None))[1]

    def __contains__(self, key: object) -> bool:
        return key in self._declared or key in self._extra

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class _Items(ItemsView[str, Entry]):
    _mapping: ChunkTable

    def __iter__(self) -> Iterator[tuple[str, Entry]]:
        return self._mapping._entries()


def _chunks(rows: WriterState, numbers: list[int]) -> list[ChunkRecord]:
    boxes: list[Box] = [rows.boxes[r] for r in numbers]
    if len(numbers) == 1:
        return [(boxes[0].offsets, boxes[0].sizes, rows.record(numbers[0]))]
    last: dict[tuple[int, ...], tuple[str, int, int]] = {}
    for r, box in sorted(zip(numbers, boxes, strict=True), key=lambda item: item[0]):  # in the order written
        record = rows.record(r)
        if record is not None:
            last[box.offsets] = record
    return [(box.offsets, box.sizes, last.get(box.offsets)) for box in boxes]


def _concatenated(states: Sequence[WriterState]) -> WriterState | None:
    """One state's columns holding every row of ``states`` in order (their files renumbered)."""
    from .writer import WriterState

    if not states:
        return None
    merged = WriterState()
    numbers: dict[str, int] = {}
    for state in states:
        merged.keys.extend(state.keys)
        merged.shapes.extend(state.shapes)
        merged.dtypes.extend(state.dtypes)
        merged.boxes.extend(state.boxes)
        renumber = [numbers.setdefault(name, len(numbers)) for name in state.names]
        for row in range(len(state.keys)):
            file, offset, length = state.where[3 * row:3 * row + 3]
            merged.where.extend((renumber[file] if file >= 0 else file, offset, length))
    merged.names.extend(numbers)
    return merged
