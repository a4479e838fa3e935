"""Streaming writer of ``torch.save``-format files (``.pt`` / ``.bin``) holding a flat state dict.

``torch.save`` needs the whole state dict in memory. The format itself does not: its
``data.pkl`` only names storages by key, and each storage is a separate zip member. So the
pickle is written first from shapes and dtypes alone, then each tensor's storage as it is
produced; memory holds one tensor at a time. ``torch.load(..., weights_only=True)`` reads it.

Example:
    >>> w = TorchFileWriter(Path("model.pt"))                       # doctest: +SKIP
    >>> w.begin([("w", (2, 3), torch.float32)])                     # doctest: +SKIP
    >>> w.write("w", torch.ones(2, 3)); w.finish()                  # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import OutputError
from ..torch_records import state_dict_pickle


class TorchFileWriter:
    """Write a flat ``{key: tensor}`` torch file, one tensor at a time, in ``begin`` order."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._order: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._cursor = 0
        self._zip: Any = None

    def begin(self, tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        data = state_dict_pickle({key: (tuple(shape), dtype) for key, shape, dtype in tensors})
        self._order.extend((key, tuple(shape), dtype) for key, shape, dtype in tensors)
        try:
            self._zip = torch._C.PyTorchFileWriter(str(self.path))
            self._zip.write_record("data.pkl", data, len(data))
            self._zip.write_record(".format_version", "1", 1)
            self._zip.write_record(".storage_alignment", "64", 2)
            self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        except (OSError, RuntimeError) as err:
            raise OutputError(f"{self.path}: cannot write ({err})") from None

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """The whole tensor of the next key."""
        expected_key, shape, dtype = self._order[self._cursor]
        if key != expected_key or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"expected {expected_key} {shape} {dtype}, got {key} {tuple(tensor.shape)} {tensor.dtype}")
        tensor = tensor.contiguous()
        if tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        try:
            self._zip.write_record(f"data/{self._cursor}", tensor.untyped_storage(),
                                   tensor.numel() * tensor.element_size())
        except (OSError, RuntimeError) as err:
            raise OutputError(f"{self.path}: write failed ({err})") from None
        self._cursor += 1

    def finish(self) -> int:
        if self._cursor != len(self._order):
            raise ValueError(f"{self.path}: {len(self._order) - self._cursor} tensors were not written")
        try:
            self._zip.write_end_of_file()
            self._zip = None
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except (OSError, RuntimeError) as err:
            raise OutputError(f"{self.path}: write failed ({err})") from None
        return self.path.stat().st_size

    def abort(self) -> None:
        self._zip = None
