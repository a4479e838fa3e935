"""Region I/O for the engine: reads into reused page-aligned buffers, and writes one region behind.

Example:
    >>> buffers = Buffers()
    >>> buffers.get("read", (2, 3), torch.float32).shape
    torch.Size([2, 3])
    >>> with WriteBehind() as behind:
    ...     behind.submit([[lambda: None]])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from .._lazy import torch
from ..formats.base import CheckpointReader
from ..layout import Box, TensorSpec


class WriteBehind:
    """Runs each region's sink calls on background threads (one per sink, calls in order), at
    most one region behind: :meth:`submit` first waits for the previous region's writes, so the
    engine can alternate two buffer pools. A write error surfaces at the next submit or on exit.
    """

    def __init__(self, sinks: int = 1) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, sinks), thread_name_prefix="ema-ckpt-write")
        self._pending: list[Future[None]] = []

    def submit(self, calls_per_sink: Sequence[Sequence[Callable[[], None]]], *, background: bool = True) -> None:
        self.wait()
        if background:
            self._pending = [self._pool.submit(_run_all, list(calls)) for calls in calls_per_sink if calls]
        else:
            for calls in calls_per_sink:
                _run_all(calls)

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]  # every write ends before the buffers are reused
        for error in errors:
            if error is not None:
                raise error

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, exc_type: object, *_rest: object) -> None:
        try:
            if exc_type is None:
                self.wait()
            else:
                for pending in self._pending:
                    pending.exception()  # let the writes in flight end; the first error wins
        finally:
            self._pool.shutdown(wait=True)


def _run_all(calls: Sequence[Callable[[], None]]) -> None:
    for call in calls:
        call()


class Buffers:
    """Reused flat buffers, one per slot and dtype, grown to the largest region seen (fresh
    ones cost page faults on every region); page-aligned, for ``O_DIRECT`` writes."""

    def __init__(self) -> None:
        self._flat: dict[tuple[object, torch.dtype], torch.Tensor] = {}

    def get(self, slot: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self._flat.get((slot, dtype))
        if flat is None or flat.numel() < numel:
            flat = _page_aligned(numel, dtype)
            self._flat[(slot, dtype)] = flat
        return flat[:numel].view(shape)


_PAGE = 4096


def _page_aligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``numel`` elements whose data starts on a page boundary."""
    raw = torch.empty(numel * dtype.itemsize + _PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % _PAGE
    return raw[skip:skip + numel * dtype.itemsize].view(dtype)


def read_box(reader: CheckpointReader, key: str, box: Box, spec: TensorSpec, buffers: Buffers | None,
             slot: object = "read", out: torch.Tensor | None = None) -> torch.Tensor:
    """``box`` of ``key``: into ``out`` when given, else into the reused buffer ``slot``."""
    if buffers is not None and reader.supports_out:
        target = out if out is not None else buffers.get(slot, box.sizes, spec.dtype)
        return reader.read(key, box, out=target)
    value = reader.read(key, box).detach()
    return out.copy_(value) if out is not None else value
