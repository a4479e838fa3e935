"""``consolidate``: any supported checkpoint → safetensors, the HF sharded layout, or a torch file.

Streams: headers are written from metadata first, then each tensor's bytes block by block
as they are read (and cast), so memory holds one block of rows, never the model or the file.
When a safetensors output needs no cast and every tensor is stored as plain runs of bytes
(dim-0 shards of a DCP checkpoint), the kernel copies those runs file to file and torch is
never imported. Nothing is written in place: the output is built beside its final path and
swapped in.

Example:
    >>> consolidate("ckpts/ema", "ema.safetensors", dtype="bfloat16")   # doctest: +SKIP
    >>> consolidate("ckpts/step_1000", "hf-out/", max_shard_size="2GB")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .dist import assign_by_bytes, current_workers, in_worker_group, run_workers
from .dtypes import is_float, itemsize, torch_dtype
from .errors import OutputError, UsageError
from .formats import open_checkpoint
from .formats.base import ByteRangeReader, CheckpointReader, stored_tensors
from .fs import OutputLock, discard_on_error, fsync_dir, new_staging_dir, output_path, publish, recover
from .layout import Box, row_blocks
from .progress import Progress
from .selection import container_prefix, output_names, select_keys
from .writers.safetensors import (
    INDEX_NAME,
    SafetensorsFileWriter,
    check_key,
    plan_shards,
    shard_file_names,
    write_index,
)

OUTPUT_DTYPES = ("bfloat16", "float16", "float32", "float64")
BLOCK_BYTES = 64 << 20
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``5GB`` (10⁹, as Hugging Face counts), ``500MiB`` or ``20KB``.

    Example:
        >>> parse_size("5GB"), parse_size("20KB"), parse_size("1MiB")
        (5000000000, 20000, 1048576)
    """
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS:
        raise UsageError(f"size {text!r} not understood; use e.g. 5GB, 500MB, 20KB or 1GiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"size {text!r} must be positive")
    return value


Layout = Literal["safetensors", "hf-sharded", "torch"]


@dataclass(slots=True)
class ConsolidateResult:
    """What :func:`consolidate` wrote."""

    out: Path
    layout: Layout
    files: list[tuple[str, int]] = field(default_factory=list)
    keys: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    renamed_prefix: str | None = None
    """The DCP container level removed from every key (``"model."``), or None."""
    notes: list[str] = field(default_factory=list)


def output_layout(out: Path) -> Layout:
    """``.safetensors`` → one file; ``.pt``/``.bin`` → a torch file; anything else → HF sharded dir."""
    suffix = out.suffix.lower()
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in (".pt", ".bin", ".pth"):
        return "torch"
    return "hf-sharded"


def _check_not_overlapping(src: Path, out: Path) -> None:
    a, b = src.resolve(), out.resolve()
    if a == b or a in b.parents or b in a.parents:
        raise UsageError(f"--out {out} overlaps the source {src}; write the output elsewhere")


def consolidate(
    src: str | Path,
    out: str | Path,
    *,
    max_shard_size: str | int = "5GB",
    dtype: str | None = None,
    keep_prefix: bool = False,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    overwrite: bool = False,
    wait_seconds: float = 0.0,
    workers: int = 1,
    on_progress: Callable[[Progress], None] | None = None,
) -> ConsolidateResult:
    """Stream the checkpoint at ``src`` into one loadable file or an HF sharded folder.

    Args:
        src: any supported checkpoint (an ema-ckpt output, DCP, DeepSpeed, safetensors).
        out: ``*.safetensors``, ``*.pt``/``*.bin``, or a directory (HF sharded layout).
        max_shard_size: shard limit for the directory layout (``5GB``, ``500MB``, …).
        dtype: cast floating tensors to ``bfloat16``/``float16``/``float32``/``float64``.
        keep_prefix: keep the ``model.`` prefix of a DCP ``{"model": …}`` checkpoint.
        include, exclude: glob patterns on the source keys.
        overwrite: replace an existing output.
        workers: write the shards of a directory output in N processes (a single-file
            output is written by one of them).
    """
    if workers > 1 and not in_worker_group():
        return run_workers(workers, consolidate, src, out, max_shard_size=max_shard_size, dtype=dtype,
                           keep_prefix=keep_prefix, include=include, exclude=exclude, overwrite=overwrite,
                           wait_seconds=wait_seconds, local_kwargs={"on_progress": on_progress})
    started = time.perf_counter()
    src, out = Path(src), output_path(out)
    _check_not_overlapping(src, out)
    layout = output_layout(out)
    shard_bytes = parse_size(max_shard_size)
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(OUTPUT_DTYPES)}, got {dtype!r}")
    cast = dtype
    group = current_workers()
    with contextlib.ExitStack() as stack:

        def prepare() -> Path | None:
            stack.enter_context(OutputLock(out, wait_seconds=wait_seconds))
            recover(out)
            if out.exists() and not overwrite:
                raise UsageError(f"{out} exists; pass --overwrite to replace it")
            return new_staging_dir(out) if layout == "hf-sharded" else None

        staging = group.broadcast(group.run(prepare if group.is_coordinator else lambda: None))

        def open_source() -> tuple[CheckpointReader, list[str]]:
            reader = stack.enter_context(contextlib.closing(open_checkpoint(src)))
            keys = select_keys(reader, include, exclude)
            if not keys:
                raise UsageError(f"{src}: no tensor keys to write")
            return reader, keys

        with discard_on_error([staging], owner=group.is_coordinator):
            reader, keys = group.run(open_source)
            names = output_names(reader, keys, keep_prefix=keep_prefix)
            if layout != "torch":  # before anything is written: a key the format cannot hold
                for name in names.values():
                    check_key(name, out)
            stored = stored_tensors(reader)
            out_dtype = {k: (cast if cast is not None and is_float(stored[k][1]) else stored[k][1]) for k in keys}
            result = ConsolidateResult(out, layout, keys=len(keys))
            result.renamed_prefix = None if keep_prefix else container_prefix(reader, keys)
            if result.renamed_prefix:
                result.notes.append(f"keys written without the DCP container level {result.renamed_prefix!r} "
                                    "(--keep-prefix keeps it)")
            progress = _ProgressCounter(sum(math.prod(stored[k][0]) * itemsize(stored[k][1]) for k in keys),
                                        on_progress)
            if layout == "hf-sharded":
                assert staging is not None
                _write_sharded(group, reader, keys, names, out_dtype, out, staging, shard_bytes, result, progress)
            else:
                group.run(
                    (lambda: _write_single(reader, keys, names, out_dtype, out, layout, result, progress))
                    if group.is_coordinator else lambda: None
                )
    result.bytes_written = sum(size for _, size in result.files)
    result.seconds = time.perf_counter() - started
    return result


class _ProgressCounter:
    def __init__(self, total: int, callback: Callable[[Progress], None] | None) -> None:
        self.total, self.done, self.regions, self.callback = total, 0, 0, callback

    def advance(self, nbytes: int, key: str) -> None:
        self.done += nbytes
        self.regions += 1
        if self.callback is not None:
            self.callback(Progress(self.done, self.total, self.regions, 0, key))


def _blocks(reader: CheckpointReader, key: str):
    spec = reader.specs()[key]
    limit = max(1, BLOCK_BYTES // max(spec.dtype.itemsize, 1))
    for box in row_blocks(spec.shape, list(reader.layout(key)), limit):
        yield box, reader.read(key, box)


def _byte_runs(
    reader: CheckpointReader, keys: Sequence[str], out_dtype: dict[str, str]
) -> dict[str, list[tuple[str, int, int]]] | None:
    """{key: byte ranges} when every key can be copied as stored bytes, else None."""
    if not isinstance(reader, ByteRangeReader):
        return None
    stored = reader.stored()
    runs = {}
    for key in keys:
        if out_dtype[key] != stored[key][1]:
            return None
        ranges = reader.byte_ranges(key)
        if ranges is None:
            return None
        runs[key] = ranges
    return runs


def _stream_safetensors(reader, keys, names, out_dtype, path: Path, progress: _ProgressCounter) -> int:
    stored = stored_tensors(reader)
    runs = _byte_runs(reader, keys, out_dtype)
    writer = SafetensorsFileWriter(path)
    writer.begin([(names[k], stored[k][0], out_dtype[k]) for k in keys])
    try:
        for key in keys:
            if runs is not None:
                for file, offset, length in runs[key] or [("", 0, 0)]:  # an empty tensor has no runs
                    fd = reader.open_data(file) if length else -1
                    writer.copy_range(names[key], reader.path / file, fd, offset, length)
                    progress.advance(length, key)
                continue
            cast = torch_dtype(out_dtype[key])
            for _box, part in _blocks(reader, key):
                writer.write(names[key], part.to(cast))
                progress.advance(part.numel() * part.element_size(), key)
        return writer.finish()
    except BaseException:
        writer.abort()
        raise


def _write_single(reader, keys, names, out_dtype, out: Path, layout: str, result, progress) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        if layout == "safetensors":
            size = _stream_safetensors(reader, keys, names, out_dtype, tmp, progress)
        else:
            from .writers.torch_file import TorchFileWriter

            specs = reader.specs()
            writer = TorchFileWriter(tmp)
            writer.begin([(names[k], specs[k].shape, torch_dtype(out_dtype[k])) for k in keys])
            for key in keys:
                value = reader.read(key, Box.full(specs[key].shape))
                writer.write(names[key], value.to(torch_dtype(out_dtype[key])))
                progress.advance(value.numel() * value.element_size(), key)
                del value
            size = writer.finish()
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{out}: cannot write ({err.strerror})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    result.files.append((out.name, size))


def _write_sharded(group, reader, keys, names, out_dtype, out: Path, staging: Path, shard_bytes: int,
                   result, progress) -> None:
    stored = stored_tensors(reader)
    sizes = [(k, math.prod(stored[k][0]) * itemsize(out_dtype[k])) for k in keys]
    shards = plan_shards(sizes, shard_bytes)
    files = shard_file_names(len(shards))
    lookup = dict(sizes)
    owners = assign_by_bytes([sum(lookup[k] for k in shard) for shard in shards], group.world_size)

    def write_mine() -> list[tuple[str, int]]:
        written = []
        for shard, name, owner in zip(shards, files, owners, strict=True):
            if owner == group.rank:
                written.append((name, _stream_safetensors(reader, shard, names, out_dtype, staging / name, progress)))
        return written

    mine = group.run(write_mine)
    everything = dict(pair for part in group.all_gather(mine) for pair in part)

    def finish() -> None:
        result.files.extend((name, everything[name]) for name in files)
        if len(files) > 1:
            weight_map = {names[k]: name for shard, name in zip(shards, files, strict=True) for k in shard}
            write_index(staging, weight_map, sum(n for _, n in sizes))
            result.files.append((INDEX_NAME, (staging / INDEX_NAME).stat().st_size))
        publish(staging, out)

    group.run(finish if group.is_coordinator else lambda: None)
