"""``reshard``: any supported checkpoint → a DCP checkpoint laid out for N ranks.

Each tensor is cut on dim 0 as FSDP2's ``fully_shard`` cuts it (``torch.chunk``
boundaries) and rank r's chunks go to ``__r_0.distcp``, so each of N ranks reads only its
own file when it loads. Streams one chunk at a time.

Example:
    >>> reshard("ckpts/ema", world_size=16, out="ema-16")   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ._lazy import torch
from .consolidate import OUTPUT_DTYPES, _check_not_overlapping
from .dtypes import torch_dtype
from .dist import current_workers, in_worker_group, run_workers
from .engine import OutputSpec, PlannedRegion, Progress, Update
from .errors import UsageError
from .execute import write_dcp_outputs
from .formats import open_checkpoint
from .formats.base import CheckpointReader
from .fs import OutputLock, discard_on_error, new_staging_dir, output_path, publish, recover
from .layout import dim0_shard_regions
from .manifest import MANIFEST_NAME, Manifest
from .selection import select_keys


@dataclass(slots=True)
class ReshardResult:
    """What :func:`reshard` wrote."""

    out: Path
    world_size: int
    keys: int
    files: list[tuple[str, int]]
    bytes_written: int
    seconds: float
    notes: list[str] = field(default_factory=list)


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
    workers: int = 1,
    on_progress: Callable[[Progress], None] | None = None,
) -> ReshardResult:
    """Write ``src`` as a DCP checkpoint sharded on dim 0 for ``world_size`` ranks.

    Keys are kept as they are (``model.…`` stays ``model.…``). ``all_keys`` also carries
    non-model tensors (optimizer state) instead of the model part only.
    """
    if workers > 1 and not in_worker_group():
        return run_workers(workers, reshard, src, world_size=world_size, out=out, dtype=dtype, include=include,
                           exclude=exclude, all_keys=all_keys, overwrite=overwrite, wait_seconds=wait_seconds,
                           local_kwargs={"on_progress": on_progress})
    started = time.perf_counter()
    src, out = Path(src), output_path(out)
    if world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {world_size}")
    _check_not_overlapping(src, out)
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(OUTPUT_DTYPES)}, got {dtype!r}")
    cast = torch_dtype(dtype) if dtype else None
    group = current_workers()
    notes: list[str] = []
    with contextlib.ExitStack() as stack:

        def prepare() -> Path:
            stack.enter_context(OutputLock(out, wait_seconds=wait_seconds))
            recover(out)
            if out.exists() and not overwrite:
                raise UsageError(f"{out} exists; pass --overwrite to replace it")
            return new_staging_dir(out)

        staging = group.broadcast(group.run(prepare if group.is_coordinator else lambda: None))
        with discard_on_error([staging], owner=group.is_coordinator):

            def open_source() -> tuple[CheckpointReader, list[str]]:
                reader = stack.enter_context(contextlib.closing(open_checkpoint(src)))
                keys = list(reader.specs()) if all_keys else select_keys(reader, include, exclude)
                if not keys:
                    raise UsageError(f"{src}: no tensor keys to write")
                return reader, keys

            reader, keys = group.run(open_source)
            specs = reader.specs()
            regions = [PlannedRegion(key, box, rank) for key in keys
                       for rank, box in dim0_shard_regions(specs[key].shape, world_size)]
            rows = max((specs[k].shape[0] for k in keys if specs[k].shape), default=0)
            if world_size > rows:
                notes.append(f"--world-size {world_size} is more than the largest tensor's {rows} rows: "
                             f"ranks {rows} and above hold nothing")
            written = write_dcp_outputs(
                group, [reader], [OutputSpec("reshard", (Update(0, 1.0),), mode="copy")], [staging], regions,
                specs, copy_source=0, accumulate_dtype=torch.float32,
                output_dtype=lambda spec: cast if cast is not None and spec.is_float else spec.dtype,
                planner_data=getattr(reader, "planner_data", None), max_file_bytes=None,
                on_progress=on_progress,
            )

            def publish_all() -> None:
                manifest = Manifest.read(src) if src.is_dir() and (src / MANIFEST_NAME).exists() else None
                if manifest is not None:
                    manifest.files = {f.name: {"size": f.size, "crc32": f.crc32} for f in written.files[0]}
                    manifest.write(staging)
                publish(staging, out)

            group.run(publish_all if group.is_coordinator else lambda: None)
    files = [(f.name, f.size) for f in written.files[0]] if written.files else []
    return ReshardResult(out, world_size, len(keys), files, sum(s for _, s in files),
                         time.perf_counter() - started, notes)
