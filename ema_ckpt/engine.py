"""The one loop over tensor data: region by region, every output at once.

Each output is a combination of the sources, given as ordered updates:

* ``fold`` outputs apply ``acc ← lerp(acc, θₛ, w)`` in source order (the first update,
  with w = 1, initialises ``acc``). This is how an EMA is kept, and doing it the same way
  in a one-shot run and in an incremental run makes both produce the same bits.
* ``sum`` outputs compute ``acc = Σ wₛ·θₛ`` (post-hoc EMA, where weights may be negative).

For each region (one stored chunk of the output layout), each source's matching box is
read once and folded into every output that uses it, then the results are written and
freed: memory is a few regions, never the model. Non-floating tensors are copied from one
source (the newest checkpoint). Writing runs one region behind on a background thread, so
the disk takes region i while region i+1 is read and combined.

Example:
    >>> outputs = [OutputSpec("ema", (Update(0, 1.0), Update(1, 0.1)))]
    >>> combine_regions(readers, outputs, [writer], regions, specs, copy_source=1)  # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ._lazy import torch
from .dist import assign_by_bytes
from .errors import NonFiniteError, UsageError
from .formats.base import CheckpointReader
from .layout import Box, TensorSpec, split_rows
from .progress import Progress


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


@dataclass(frozen=True, slots=True)
class PlannedRegion:
    """One region of the output layout and the file it goes to: ``__<rank>_<part>.distcp``."""

    key: str
    box: Box
    rank: int = 0
    part: int = 0


class RegionSink(Protocol):
    """Where an output's regions go (a DCP writer, a safetensors writer, …)."""

    def declare(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None: ...

    def write(self, key: str, box: Box, tensor: torch.Tensor, *, rank: int = 0, part: int = 0) -> None: ...


@dataclass(slots=True)
class EngineStats:
    """What a run read and wrote."""

    regions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    per_output_bytes: list[int] = field(default_factory=list)


def layout_regions(reader: CheckpointReader, keys: Sequence[str]) -> list[PlannedRegion]:
    """The regions of ``keys`` as ``reader`` stores them, each tagged with its rank file."""
    regions: list[PlannedRegion] = []
    chunks_of = getattr(reader, "chunks", None)
    for key in keys:
        if chunks_of is not None:
            for chunk in chunks_of(key):
                regions.append(PlannedRegion(key, chunk.box, chunk.rank or 0))
        else:
            regions.extend(PlannedRegion(key, box, 0) for box in reader.layout(key))
        if not regions or regions[-1].key != key:  # every stored chunk was empty
            shape = reader.specs()[key].shape
            regions.append(PlannedRegion(key, Box.full(shape), 0))
    return regions


DEFAULT_FILE_BYTES = 256 << 20
MIN_FILE_BYTES = 16 << 20
# Each region also costs fixed Python work (records to parse, a record to write), about what
# reading 256 KiB costs: counted in, files of many small tensors split finely enough to share out.
REGION_OVERHEAD_BYTES = 256 << 10


def region_cost(region: PlannedRegion, specs: Mapping[str, TensorSpec]) -> int:
    """The work of one region, in bytes: its data plus the fixed per-region overhead."""
    return region.box.numel * specs[region.key].dtype.itemsize + REGION_OVERHEAD_BYTES


def check_device(device: str) -> None:
    """Refuse a device this machine does not have, with one clear line."""
    if device == "cpu":
        return
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA device is available here; use --device cpu")
        return
    raise UsageError(f"--device must be cpu or cuda, got {device!r}")


def split_files(
    regions: Sequence[PlannedRegion], specs: Mapping[str, TensorSpec], max_file_bytes: int | None
) -> list[PlannedRegion]:
    """Give each rank's regions consecutive parts of at most ``max_file_bytes`` of work.

    Work is :func:`region_cost`. Files are the unit workers share out, so the split depends
    only on the layout, never on the number of workers: the output is the same bytes whatever
    N. ``None``: one file per rank.
    """
    out: list[PlannedRegion] = []
    used: dict[int, tuple[int, int]] = {}  # rank -> (part, work in it)
    rank_bytes: dict[int, int] = {}
    for region in regions:
        rank_bytes[region.rank] = rank_bytes.get(region.rank, 0) + region_cost(region, specs)
    for region in regions:
        nbytes = region_cost(region, specs)
        part, size = used.get(region.rank, (0, 0))
        # about 8 parts per rank file (16 MiB to max_file_bytes each): enough to share out
        cap = None if max_file_bytes is None else min(max_file_bytes, max(MIN_FILE_BYTES, rank_bytes[region.rank] // 8))
        if cap is not None and size and size + nbytes > cap:
            part, size = part + 1, 0
        used[region.rank] = (part, size + nbytes)
        out.append(PlannedRegion(region.key, region.box, region.rank, part))
    return out


def owned_regions(
    regions: Sequence[PlannedRegion], specs: Mapping[str, TensorSpec], rank: int, world_size: int
) -> list[PlannedRegion]:
    """The regions whose files this worker writes (files balanced across workers by work)."""
    if world_size == 1:
        return list(regions)
    files: dict[tuple[int, int], int] = {}
    for region in regions:
        key = (region.rank, region.part)
        files[key] = files.get(key, 0) + region_cost(region, specs)
    names = sorted(files)
    owners = dict(zip(names, assign_by_bytes([files[n] for n in names], world_size), strict=True))
    return [r for r in regions if owners[(r.rank, r.part)] == rank]


def combine_regions(
    sources: Sequence[CheckpointReader],
    outputs: Sequence[OutputSpec],
    sinks: Sequence[RegionSink],
    regions: Sequence[PlannedRegion],
    specs: Mapping[str, TensorSpec],
    *,
    copy_source: int,
    accumulate_dtype: torch.dtype | None = None,
    output_dtype: Callable[[TensorSpec], torch.dtype] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    device: str = "cpu",
    check_finite: Sequence[int] = (),
) -> EngineStats:
    """Stream every region through the outputs' updates and into their sinks.

    ``output_dtype`` chooses the stored dtype of floating tensors (default: the
    accumulation dtype, so an EMA kept across runs never loses precision). Floating regions
    of the sources in ``check_finite`` are checked for NaN/Inf (:class:`NonFiniteError`).
    """
    if len(sinks) != len(outputs):
        raise ValueError("one sink per output")
    started = time.perf_counter()
    if accumulate_dtype is None:
        accumulate_dtype = torch.float32
    stats = EngineStats(per_output_bytes=[0] * len(outputs))
    out_dtype = output_dtype or (lambda spec: accumulate_dtype if spec.is_float else spec.dtype)
    declared: set[str] = set()
    total = sum(specs[r.key].dtype.itemsize * r.box.numel for r in regions)
    done = 0
    needed = sorted({u.source for out in outputs for u in out.updates})
    buffers = _Buffers()
    with _WriteBehind(len(sinks)) as behind:
        for region_index, region in enumerate(regions):
            parity = region_index % 2  # what goes to the writer alternates slots: i-1 may still be written
            spec = specs[region.key]
            writes: list[list[Callable[[], None]]] = [[] for _ in sinks]  # per sink, in order
            if region.key not in declared:
                for sink, calls in zip(sinks, writes, strict=True):
                    calls.append(lambda sink=sink, key=region.key, spec=spec: sink.declare(key, spec.shape,
                                                                                         out_dtype(spec)))
                declared.add(region.key)
            if not spec.is_float:
                value = _read(sources[copy_source], region.key, region.box, sources[copy_source].specs()[region.key],
                              buffers, slot=("copy", parity))
                stats.bytes_read += value.numel() * value.element_size()
                results = [value] * len(sinks)
            else:
                accs = _accumulate_region(sources, outputs, needed, region, accumulate_dtype, stats, device,
                                          buffers, frozenset(check_finite), parity)
                results = []
                for k, acc in enumerate(accs):
                    target = out_dtype(spec)
                    if acc.device.type == "cpu" and acc.dtype != target:
                        results.append(buffers.get(("out", k, parity), region.box.sizes, target).copy_(acc))
                    else:
                        results.append(acc.to(device="cpu", dtype=target))
                del accs
            region_bytes = 0
            for k, (sink, result) in enumerate(zip(sinks, results, strict=True)):
                writes[k].append(lambda sink=sink, result=result, region=region: sink.write(
                    region.key, region.box, result, rank=region.rank, part=region.part))
                stats.per_output_bytes[k] += result.numel() * result.element_size()
                region_bytes += result.numel() * result.element_size()
            del results
            behind.submit(writes, background=region_bytes >= _WRITE_BEHIND_BYTES)
            stats.regions += 1
            done += spec.dtype.itemsize * region.box.numel
            if on_progress is not None:
                on_progress(Progress(done, total, region_index + 1, len(regions), region.key))
    stats.bytes_written = sum(stats.per_output_bytes)
    stats.seconds = time.perf_counter() - started
    return stats


_WRITE_BEHIND_BYTES = 1 << 20  # smaller regions are written inline: a thread handoff would cost more


class _WriteBehind:
    """Runs each region's sink calls on background threads, at most one region behind.

    Writing (page-cache copies, CRC-32, the disk's back-pressure) and reading/arithmetic all
    release the GIL, so they overlap. Each sink's calls run in order on one thread; the sinks
    of a multi-output run write side by side, since copying into the page cache costs kernel
    time per byte (about 1.4 s per GiB here) that one thread would pay for all of them.
    :meth:`submit` first waits for the previous region's writes, which is what lets the
    engine alternate between two buffer pools; a write error surfaces at the next submit or
    on exit.
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

    def __enter__(self) -> _WriteBehind:
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


class _Buffers:
    """Reused flat buffers, one per slot and dtype, grown to the largest region seen.

    Fresh multi-megabyte allocations cost page faults on every region (as much as the read
    itself); reusing a few buffers keeps memory at a few regions and reads at memory speed.
    """

    def __init__(self) -> None:
        self._flat: dict[tuple[object, torch.dtype], torch.Tensor] = {}

    def get(self, slot: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self._flat.get((slot, dtype))
        if flat is None or flat.numel() < numel:
            flat = torch.empty(numel, dtype=dtype)
            self._flat[(slot, dtype)] = flat
        return flat[:numel].view(shape)


def _read(reader: CheckpointReader, key: str, box: Box, spec: TensorSpec, buffers: _Buffers | None,
          slot: object = "read", out: torch.Tensor | None = None) -> torch.Tensor:
    """``box`` of ``key``: into ``out`` when given, else into the reused buffer ``slot``."""
    if buffers is not None and getattr(reader, "supports_out", False):
        target = out if out is not None else buffers.get(slot, box.sizes, spec.dtype)
        return reader.read(key, box, out=target)  # type: ignore[call-arg]
    value = reader.read(key, box).detach()
    return out.copy_(value) if out is not None else value


# Row blocks of a region, per source: small enough to stay in the CPU's cache while every
# output uses them, so each input byte crosses memory once however many outputs there are.
_BLOCK_BYTES = 2 << 20


def _blocks(box: Box, itemsize: int, device: str) -> list[Box]:
    if device != "cpu" or not box.sizes:  # a GPU wants large transfers
        return [box]
    return split_rows(box, max(1, _BLOCK_BYTES // itemsize))


def _accumulate_region(
    sources: Sequence[CheckpointReader],
    outputs: Sequence[OutputSpec],
    needed: Sequence[int],
    region: PlannedRegion,
    dtype: torch.dtype,
    stats: EngineStats,
    device: str = "cpu",
    buffers: _Buffers | None = None,
    check_finite: frozenset[int] = frozenset(),
    parity: int = 0,
) -> list[torch.Tensor]:
    """Every output's values over ``region``, computed row block by row block.

    Elementwise arithmetic on blocks gives the same bits as on the whole region; within a
    block, sources are applied in order, as in a one-shot or incremental run.
    """
    weights = [{u.source: u.weight for u in out.updates} for out in outputs]
    shape = region.box.sizes
    inputs = []
    for source in needed:
        users = [k for k in range(len(outputs)) if source in weights[k]]
        spec = sources[source].specs().get(region.key) if users else None
        if spec is not None:  # None: a key added during training (--allow-new-keys) starts where it appears
            inputs.append((source, spec, users))
    results: list[torch.Tensor | None] = [None] * len(outputs)

    def result(k: int, result_dtype: torch.dtype) -> torch.Tensor:
        if results[k] is None:
            results[k] = (buffers.get(("acc", k, parity), shape, result_dtype) if buffers is not None and
                          device == "cpu" else torch.empty(shape, dtype=result_dtype, device=device))
        return results[k]  # type: ignore[return-value]

    for block in _blocks(region.box, dtype.itemsize, device):
        where = block.relative_to(region.box).slices()
        started = [False] * len(outputs)
        for source, spec, users in inputs:
            # a copy, or a fold's first update, is the input itself: read it straight into the
            # output's buffer (saves a pass over the block)
            first = users[0]
            into = None
            if device == "cpu" and len(users) == 1 and not started[first]:
                if outputs[first].mode == "copy":
                    into = result(first, spec.dtype)[where]
                elif outputs[first].mode == "fold" and spec.dtype == dtype:
                    into = result(first, dtype)[where]
            raw = _read(sources[source], region.key, block, spec, buffers, out=into)
            stats.bytes_read += raw.numel() * raw.element_size()
            if into is not None:
                started[first] = True
                continue
            if all(outputs[k].mode == "copy" for k in users):
                for k in users:  # written as stored (or cast to the output dtype), never converted
                    result(k, raw.dtype)[where].copy_(raw)
                continue
            if device != "cpu":
                value = _to_device(raw, device, dtype)
            elif raw.dtype == dtype:
                value = raw
            else:
                value = (buffers.get("convert", block.sizes, dtype).copy_(raw) if buffers is not None
                         else raw.to(dtype))
            for k in users:
                w = weights[k][source]
                acc = result(k, dtype)[where]
                if not started[k]:
                    started[k] = True
                    if outputs[k].mode == "fold":
                        acc.copy_(value)
                    else:
                        torch.mul(value, w, out=acc)
                elif outputs[k].mode == "fold":
                    acc.lerp_(value, w)
                else:
                    acc.add_(value, alpha=w)
            del raw, value
        if check_finite and not all(_all_finite(r[where]) for r in results if r is not None):
            _find_nonfinite(sources, inputs, region.key, block, buffers, check_finite)
    return [r if r is not None else torch.zeros(shape, dtype=dtype, device=device) for r in results]


def _find_nonfinite(sources: Sequence[CheckpointReader], inputs: Sequence[tuple[int, TensorSpec, list[int]]],
                    key: str, block: Box, buffers: _Buffers | None, check_finite: frozenset[int]) -> None:
    """Name the checked source that made a block non-finite (:class:`NonFiniteError`).

    A NaN or Inf in any input reaches every output that uses it (lerp and weighted sums
    propagate them, even at weight 0), so the outputs are checked, and the inputs only when
    an output fails: one pass over the results instead of one per input. A non-finite
    result without a checked culprit (a previous EMA) is left as it is.
    """
    for source, spec, _users in inputs:
        if source in check_finite and not _all_finite(_read(sources[source], key, block, spec, buffers)):
            raise NonFiniteError(source, f"{sources[source].path}: key {key!r} holds NaN or Inf values")


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf: min and max in one vectorised pass (NaN propagates into both, Inf shows).

    About 20× faster than ``isfinite(t).all()`` or a float64 sum on CPU.
    """
    if tensor.numel() == 0:
        return True
    try:
        low, high = torch.aminmax(tensor)
    except (RuntimeError, NotImplementedError):  # a dtype without aminmax
        return bool(torch.isfinite(tensor).all())
    return math.isfinite(float(low)) and math.isfinite(float(high))


def _to_device(raw: torch.Tensor, device: str, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` as ``dtype`` on ``device``; to a GPU through pinned memory, asynchronously.

    The copy and the arithmetic queue on the GPU while the CPU goes on reading the next
    source, so reads, transfers and compute overlap.
    """
    if device == "cpu":
        return raw.to(dtype)
    return raw.pin_memory().to(device, non_blocking=True).to(dtype)
