"""A list whose items are made while a JSON encoder walks it, so a report of 200,000 tensors
is written without 200,000 dicts existing at once.

Example:
    >>> import json
    >>> squares = StreamedList(range(3), lambda n: {"n": n, "square": n * n})
    >>> len(squares), "".join(json.JSONEncoder().iterencode({"items": squares}))
    (3, '{"items": [{"n": 0, "square": 0}, {"n": 1, "square": 1}, {"n": 2, "square": 4}]}')
    >>> list(squares)[2]
    {'n': 2, 'square': 4}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any


class StreamedList(list):  # type: ignore[type-arg]
    """``[make(item) for item in source]``, each item made when iterated: a ``list`` so that
    ``JSONEncoder.iterencode`` writes it as an array (not ``json.dumps`` without ``indent``,
    whose C encoder reads a list's storage and would see none)."""

    def __init__(self, source: Sequence[Any], make: Callable[[Any], Any]) -> None:
        super().__init__()
        self._source = source
        self._make = make

    def __iter__(self) -> Iterator[Any]:
        return map(self._make, self._source)

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._make(item) for item in self._source[index]]
        return self._make(self._source[index])

    def __eq__(self, other: object) -> bool:
        return list(self) == other

    __hash__ = None

    def __repr__(self) -> str:
        return repr(list(self))

    def mapped(self, then: Callable[[Any], Any]) -> StreamedList:
        """The same items, each passed through ``then`` too (still made when iterated)."""
        make = self._make
        return StreamedList(self._source, lambda item: then(make(item)))
