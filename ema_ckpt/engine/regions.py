"""The one loop over tensor data: region by region, every output at once.

Each output is a combination of the sources, given as ordered updates:

* ``fold`` outputs apply ``acc ← lerp(acc, θₛ, w)`` in source order (the first update, w = 1,
  initialises ``acc``): a one-shot run and an incremental one give the same bits.
* ``sum`` outputs compute ``acc = Σ wₛ·θₛ``; a sweep (sum outputs over the same sources) is one
  K × N product per block where the BLAS gives the loop's bits (:mod:`.blas_probe`).

Each source's box of a region is read once for every output, the results written one region
behind and freed: memory is a few regions, never the model. Non-floating tensors are copied
from one source (the newest checkpoint).

Example:
    >>> outputs = [OutputSpec("ema", (Update(0, 1.0), Update(1, 0.1)))]
    >>> combine_regions(readers, outputs, [writer], regions, tensors, copy_source=1)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .._lazy import torch
from ..dtypes import is_float, torch_dtype
from ..errors import NonFiniteError, OptionError
from ..formats.base import CheckpointReader
from ..layout import Box, TensorSpec
from ..progress import Progress
from ..writers.base import OutputTensor, OutputWriter, PlannedRegion
from . import blas_probe  # through the module: tests replace its functions there
from .buffers import Buffers, WriteBehind, read_box


@dataclass(frozen=True, slots=True)
class Update:
    """Use source ``source`` with weight ``weight`` (a lerp weight or a sum coefficient)."""

    source: int
    weight: float


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """One output of a run: a fold or a weighted sum over the sources."""

    name: str
    updates: tuple[Update, ...]
    mode: Literal["fold", "sum", "copy"] = "fold"

    def __post_init__(self) -> None:
        if self.mode == "copy" and len(self.updates) != 1:
            raise ValueError(f"{self.name}: a copy takes exactly one source")
        sources = [u.source for u in self.updates]
        if sources != sorted(set(sources)):
            raise ValueError(f"{self.name}: updates must name each source once, in source order")
        if self.mode == "fold" and self.updates and self.updates[0].weight != 1.0:
            raise ValueError(f"{self.name}: a fold starts with weight 1 on its first source")


@dataclass(slots=True)
class EngineStats:
    """What a run read and wrote."""

    regions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    per_output_bytes: list[int] = field(default_factory=list)

    def add(self, other: EngineStats) -> None:
        """Count ``other`` (another part of one run, with the same outputs) in these totals."""
        self.regions += other.regions
        self.bytes_read += other.bytes_read
        self.bytes_written += other.bytes_written
        self.seconds += other.seconds
        self.per_output_bytes = [a + b for a, b in zip(self.per_output_bytes, other.per_output_bytes, strict=True)]


def check_device(device: str) -> None:
    """Refuse a device this machine does not have, with one clear line, before any work."""
    if device == "cpu":
        return
    if not device.startswith("cuda"):
        raise OptionError("device", f"must be cpu or cuda, got {device!r}", value=device)
    try:
        index = torch.device(device).index
    except RuntimeError:
        raise OptionError("device", f"must be cpu, cuda or cuda:N, got {device!r}", value=device) from None
    if not torch.cuda.is_available():
        raise OptionError("device", f"{device}: no CUDA device is available here; use {{device=cpu}}",
                          value=device)
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        names = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise OptionError("device", f"{device}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                          f"({names})", value=device)


def combine_regions(
    sources: Sequence[CheckpointReader],
    outputs: Sequence[OutputSpec],
    writers: Sequence[OutputWriter],
    regions: Sequence[PlannedRegion],
    tensors: Mapping[str, OutputTensor],
    *,
    copy_source: int,
    accumulate_dtype: torch.dtype | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    device: str = "cpu",
    check_finite: Sequence[int] = (),
) -> EngineStats:
    """Stream every region through the outputs' updates and into their writers, each tensor in its
    ``tensors[key].dtype``; the sources in ``check_finite`` are checked for NaN/Inf, and ``raw``
    regions copied as stored bytes from ``copy_source``."""
    if len(writers) != len(outputs):
        raise ValueError("one writer per output")
    if any(r.raw for r in regions) and not all(out.mode == "copy" for out in outputs):
        raise ValueError("raw regions copy stored bytes: only copy outputs may plan them")
    started = time.perf_counter()
    stats = EngineStats(per_output_bytes=[0] * len(outputs))
    total = sum(r.nbytes for r in regions)
    done = 0
    needed = sorted({u.source for out in outputs for u in out.updates})
    buffers = Buffers()
    finite = frozenset(check_finite)
    kinds: dict[str, tuple[torch.dtype, bool]] = {}  # key -> (stored dtype of the output, floating)
    with _one_compute_thread(device, computes=not all(r.raw for r in regions)), WriteBehind(len(writers)) as behind:
        for region_index, region in enumerate(regions):
            if region.raw:
                behind.wait()  # raw copies and tensor writes to one file stay in order
                for k, writer in enumerate(writers):
                    writer.copy_stored(region, sources[copy_source])
                    stats.per_output_bytes[k] += region.nbytes
                stats.bytes_read += region.nbytes
            else:
                kind = kinds.get(region.key)
                if kind is None:  # once per key, not per region
                    tensor = tensors[region.key]
                    kind = kinds[region.key] = (torch_dtype(tensor.dtype),
                                                is_float(tensor.stored_dtype) and not tensor.copied)
                _combine_one(sources, outputs, writers, region, kind, needed, copy_source,
                             accumulate_dtype, device, buffers, finite, region_index % 2, stats, behind)
            stats.regions += 1
            done += region.nbytes
            if on_progress is not None:
                on_progress(Progress(done, total, region_index + 1, len(regions), region.key))
    stats.bytes_written = sum(stats.per_output_bytes)
    stats.seconds = time.perf_counter() - started
    return stats


def _combine_one(
    sources: Sequence[CheckpointReader],
    outputs: Sequence[OutputSpec],
    writers: Sequence[OutputWriter],
    region: PlannedRegion,
    kind: tuple[torch.dtype, bool],
    needed: Sequence[int],
    copy_source: int,
    accumulate_dtype: torch.dtype | None,
    device: str,
    buffers: Buffers,
    check_finite: frozenset[int],
    parity: int,
    stats: EngineStats,
    behind: WriteBehind,
) -> None:
    """One region: read, combine, and hand every output's result to the write-behind thread."""
    # what goes to the writer alternates buffer slots: region i-1 may still be being written
    target, floating = kind
    if not floating:
        copy = sources[copy_source]
        value = read_box(copy, region.key, region.box, copy.specs()[region.key], buffers, slot=("copy", parity))
        stats.bytes_read += value.numel() * value.element_size()
        results = [value if value.dtype == target else value.to(target)] * len(writers)
    else:
        dtype = accumulate_dtype if accumulate_dtype is not None else torch.float32
        accs = _accumulate_region(sources, outputs, needed, region, dtype, stats, device, buffers,
                                  check_finite, parity)
        results = []
        for k, acc in enumerate(accs):
            if acc.device.type == "cpu" and acc.dtype != target:
                results.append(buffers.get(("out", k, parity), region.box.sizes, target).copy_(acc))
            else:
                results.append(acc.to(device="cpu", dtype=target))
        del accs
    writes: list[list[Callable[[], None]]] = []
    region_bytes = 0
    for k, (writer, result) in enumerate(zip(writers, results, strict=True)):
        writes.append([functools.partial(writer.write, region, result)])
        stats.per_output_bytes[k] += result.numel() * result.element_size()
        region_bytes += result.numel() * result.element_size()
    del results
    behind.submit(writes, background=region_bytes >= _WRITE_BEHIND_BYTES)


_WRITE_BEHIND_BYTES = 1 << 20  # smaller regions are written inline: a thread handoff would cost more


@contextlib.contextmanager
def _one_compute_thread(device: str, *, computes: bool = True) -> Iterator[None]:
    """The run's arithmetic on one intra-op thread (CPU), the previous setting restored after.

    The arithmetic is cheap next to the I/O: the cores serve the write-behind threads and
    ``--workers`` better (OpenMP's idle threads spin). Byte copies only never import torch.
    """
    if device != "cpu" or not computes:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _accumulate_region(
    sources: Sequence[CheckpointReader],
    outputs: Sequence[OutputSpec],
    needed: Sequence[int],
    region: PlannedRegion,
    dtype: torch.dtype,
    stats: EngineStats,
    device: str = "cpu",
    buffers: Buffers | None = None,
    check_finite: frozenset[int] = frozenset(),
    parity: int = 0,
) -> list[torch.Tensor]:
    """Every output's values over ``region``, row block by row block, sources in order
    (a sweep's outputs one matrix product per block)."""
    weights = [{u.source: u.weight for u in out.updates} for out in outputs]
    shape = region.box.sizes
    inputs = []
    for source in needed:
        users = [k for k in range(len(outputs)) if source in weights[k]]
        spec = sources[source].specs().get(region.key) if users else None
        if spec is not None:  # None: a key added during training (allow_new_keys) starts where it appears
            inputs.append((source, spec, users))
    results: list[torch.Tensor | None] = [None] * len(outputs)

    def result(k: int, result_dtype: torch.dtype) -> torch.Tensor:
        if results[k] is None:
            results[k] = (buffers.get(("acc", k, parity), shape, result_dtype) if buffers is not None and
                          device == "cpu" else torch.empty(shape, dtype=result_dtype, device=device))
        return results[k]

    # blocks keep a block of every input in cache while each output uses it; a pure copy
    # (consolidate, reshard) has nothing to keep and reads each region whole
    copies_only = all(out.mode == "copy" for out in outputs)
    sweep = None if copies_only or device != "cpu" else _sweep(outputs, weights, inputs, region.box.numel, dtype)
    if sweep is not None:
        # the sweep's outputs are rows of one buffer, so a block's product lands in place
        together = (buffers.get(("sweep", parity), (len(sweep.outputs), region.box.numel), dtype)
                    if buffers is not None else torch.empty((len(sweep.outputs), region.box.numel), dtype=dtype))
        for row, k in enumerate(sweep.outputs):
            results[k] = together[row].view(shape)
    stacked = len(sweep.sources) if sweep is not None else 1
    # every output of a sweep uses every one of its sources, so a NaN or Inf in any of them
    # makes every output non-finite at that element (c · Inf is ±Inf or NaN, even for c = 0):
    # checking the first output checks them all
    unchecked = sweep.members - {sweep.outputs[0]} if sweep is not None else frozenset()
    # a sweep's other outputs (rare: ones over other sources) take the sweep's blocks
    accumulators = sum(out.mode != "copy" for out in outputs)
    budget = blas_probe.block_budget(accumulators) if sweep is None else blas_probe.SWEEP_STACK_BYTES
    blocks = [region.box] if copies_only else blas_probe.row_blocks(region.box, dtype.itemsize * stacked, device,
                                                                    budget)
    row_numel = region.box.numel // shape[0] if shape and shape[0] else 1
    for block in blocks:
        where = block.relative_to(region.box).slices()
        started = [False] * len(outputs)
        if sweep is not None:
            stack = (buffers.get("stack", (stacked, block.numel), dtype) if buffers is not None
                     else torch.empty((stacked, block.numel), dtype=dtype))
        for source, spec, users in inputs:
            if sweep is not None and source in sweep.row_of:
                target = stack[sweep.row_of[source]].view(block.sizes)
                raw = read_box(sources[source], region.key, block, spec, buffers,
                               out=target if spec.dtype == dtype else None)
                stats.bytes_read += raw.numel() * raw.element_size()
                if raw.data_ptr() != target.data_ptr():
                    target.copy_(raw)
                for k in users:
                    if k not in sweep.members:
                        _apply(outputs[k], weights[k][source], target, raw, result, dtype, where, started, k)
                continue
            # a copy, or a fold's first update, is the input itself: read it straight into the
            # output's buffer (saves a pass over the block)
            first = users[0]
            into = None
            if device == "cpu" and len(users) == 1 and not started[first]:
                if outputs[first].mode == "copy" and sources[source].supports_out:
                    into = result(first, spec.dtype)[where]
                elif outputs[first].mode == "fold" and spec.dtype == dtype:
                    into = result(first, dtype)[where]
            raw = read_box(sources[source], region.key, block, spec, buffers, out=into)
            stats.bytes_read += raw.numel() * raw.element_size()
            if into is not None:
                started[first] = True
                continue
            if all(outputs[k].mode == "copy" for k in users):
                for k in users:  # written as stored (or cast to the output dtype), never converted
                    if results[k] is None and copies_only and not sources[source].supports_out:
                        results[k] = raw  # a tensor of its own, the whole region: it is the result
                    else:
                        result(k, raw.dtype)[where].copy_(raw)
                continue
            if device != "cpu":  # through pinned memory, asynchronously: reads, transfers and compute overlap
                value = raw.pin_memory().to(device, non_blocking=True).to(dtype)
            elif raw.dtype == dtype:
                value = raw
            else:
                value = (buffers.get("convert", block.sizes, dtype).copy_(raw) if buffers is not None
                         else raw.to(dtype))
            for k in users:
                _apply(outputs[k], weights[k][source], value, raw, result, dtype, where, started, k)
            del raw, value
        if sweep is not None:
            first_row = (block.offsets[0] - region.box.offsets[0]) * row_numel if shape else 0
            sweep.combine(stack, together[:, first_row:first_row + block.numel])
        if check_finite and not all(_all_finite(r[where]) for k, r in enumerate(results)
                                    if r is not None and k not in unchecked):
            _find_nonfinite(sources, inputs, region.key, block, buffers, check_finite)
    return [r if r is not None else torch.zeros(shape, dtype=dtype, device=device) for r in results]


def _apply(output: OutputSpec, weight: float, value: torch.Tensor, raw: torch.Tensor,
           result: Callable[[int, torch.dtype], torch.Tensor], dtype: torch.dtype, where: tuple[slice, ...],
           started: list[bool], k: int) -> None:
    """One source's update of output ``k`` over a block (``value``: the source in ``dtype``)."""
    if output.mode == "copy":
        result(k, raw.dtype)[where].copy_(raw)
        return
    acc = result(k, dtype)[where]
    if not started[k]:
        started[k] = True
        if output.mode == "fold":
            acc.copy_(value)
        else:
            torch.mul(value, weight, out=acc)
    elif output.mode == "fold":
        acc.lerp_(value, weight)
    else:
        acc.add_(value, alpha=weight)


def _sweep(outputs: Sequence[OutputSpec], weights: Sequence[Mapping[int, float]],
           inputs: Sequence[tuple[int, TensorSpec, list[int]]], numel: int,
           dtype: torch.dtype) -> blas_probe.Sweep | None:
    """The largest set (two or more) of sum outputs that use exactly the same present sources (an
    output that skips a source must not see it at weight 0: 0 · Inf is NaN, -0 could become +0)."""
    if numel < 2:
        return None
    present = [source for source, _spec, _users in inputs]
    by_sources: dict[tuple[int, ...], list[int]] = {}
    for k, output in enumerate(outputs):
        if output.mode == "sum":
            used = tuple(s for s in present if s in weights[k])
            if used:
                by_sources.setdefault(used, []).append(k)
    if not by_sources:
        return None
    used, members = max(by_sources.items(), key=lambda item: len(item[1]))
    if len(members) < 2 or not blas_probe.product_is_exact(len(members), len(used), dtype):
        return None
    coefficients = torch.tensor([[weights[k][s] for s in used] for k in members], dtype=torch.float64).to(dtype)
    return blas_probe.Sweep(tuple(members), frozenset(members), used, {s: i for i, s in enumerate(used)},
                            coefficients)


def _find_nonfinite(sources: Sequence[CheckpointReader], inputs: Sequence[tuple[int, TensorSpec, list[int]]],
                    key: str, block: Box, buffers: Buffers | None, check_finite: frozenset[int]) -> None:
    """Name the checked source that made a block non-finite (:class:`NonFiniteError`).

    A NaN or Inf reaches every output that uses it, even at weight 0, so only the outputs are
    checked, and the inputs when one fails; without a checked culprit (a previous EMA) it stays.
    """
    for source, spec, _users in inputs:
        if source in check_finite and not _all_finite(read_box(sources[source], key, block, spec, buffers)):
            raise NonFiniteError(source, f"{sources[source].path}: key {key!r} holds NaN or Inf values")


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf: ``aminmax`` in one pass (about 20× faster than ``isfinite(t).all()`` on CPU)."""
    if tensor.numel() == 0:
        return True
    try:
        low, high = torch.aminmax(tensor)
    except (RuntimeError, NotImplementedError):  # a dtype without aminmax
        return bool(torch.isfinite(tensor).all())
    return math.isfinite(float(low)) and math.isfinite(float(high))
