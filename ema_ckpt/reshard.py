"""``reshard``: any supported checkpoint → a DCP checkpoint laid out for N ranks.

Each tensor is cut on dim 0 as FSDP2's ``fully_shard`` cuts it (``torch.chunk``
boundaries) and rank r's chunks go to ``__r_0.distcp``, so each of N ranks reads only its
own file when it loads. Streams one chunk at a time.

Example:
    >>> reshard("ckpts/ema", world_size=16, out="ema-16")   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .consolidate import OUTPUT_DTYPES, _check_not_overlapping
from .engine import Progress
from .errors import UsageError
from .formats import open_checkpoint
from .fs import OutputLock, new_staging_dir, publish, recover
from .layout import dim0_shard_boxes
from .manifest import MANIFEST_NAME, Manifest
from .selection import select_keys
from .writers.dcp import DcpWriter


@dataclass(slots=True)
class ReshardResult:
    """What :func:`reshard` wrote."""

    out: Path
    world_size: int
    keys: int
    files: list[tuple[str, int]]
    bytes_written: int
    seconds: float


def reshard(
    src: str | Path,
    *,
    world_size: int,
    out: str | Path,
    dtype: str | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    all_keys: bool = False,
    overwrite: bool = False,
    wait_seconds: float = 0.0,
    on_progress: Callable[[Progress], None] | None = None,
) -> ReshardResult:
    """Write ``src`` as a DCP checkpoint sharded on dim 0 for ``world_size`` ranks.

    Keys are kept as they are (``model.…`` stays ``model.…``). ``all_keys`` also carries
    non-model tensors (optimizer state) instead of the model part only.
    """
    started = time.perf_counter()
    src, out = Path(src), Path(out)
    if world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {world_size}")
    _check_not_overlapping(src, out)
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(OUTPUT_DTYPES)}, got {dtype!r}")
    cast = OUTPUT_DTYPES.get(dtype) if dtype else None
    with OutputLock(out, wait_seconds=wait_seconds):
        recover(out)
        if out.exists() and not overwrite:
            raise UsageError(f"{out} exists; pass --overwrite to replace it")
        with contextlib.closing(open_checkpoint(src)) as reader:
            specs = reader.specs()
            keys = list(specs) if all_keys else select_keys(reader, include, exclude)
            if not keys:
                raise UsageError(f"{src}: no tensor keys to write")
            total = sum(specs[k].nbytes for k in keys)
            staging = new_staging_dir(out)
            try:
                writer = DcpWriter(staging)
                done = 0
                for key in keys:
                    spec = specs[key]
                    target = cast if cast is not None and spec.is_float else spec.dtype
                    writer.declare(key, spec.shape, target)
                    for rank, box in enumerate(dim0_shard_boxes(spec.shape, world_size)):
                        part = reader.read(key, box)
                        writer.write(key, box, part.to(target), rank=rank)
                        done += part.numel() * part.element_size()
                        if on_progress is not None:
                            on_progress(Progress(done, total, 0, 0, key))
                        del part
                written = writer.finish(getattr(reader, "planner_data", None))
                manifest = Manifest.read(src) if src.is_dir() and (src / MANIFEST_NAME).exists() else None
                if manifest is not None:
                    manifest.files = {f.name: {"size": f.size, "crc32": f.crc32} for f in written}
                    manifest.write(staging)
                publish(staging, out)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
    files = [(f.name, f.size) for f in written]
    return ReshardResult(out, world_size, len(keys), files, sum(s for _, s in files),
                         time.perf_counter() - started)
