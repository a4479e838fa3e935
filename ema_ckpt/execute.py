"""Run the engine on this worker's share of the regions and assemble DCP outputs.

The glue between :mod:`ema_ckpt.engine` (the loop over data), :mod:`ema_ckpt.dist` (who
does which files) and :mod:`ema_ckpt.writers.dcp` (records and metadata): every worker
writes its own data files into the shared staging directories; the coordinator gathers what
each wrote and writes ``.metadata`` last.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ._gc import frozen_heap
from .dist import Workers
from .engine import (
    DEFAULT_FILE_BYTES,
    EngineStats,
    OutputSpec,
    PlannedRegion,
    Progress,
    combine_regions,
    owned_regions,
    split_files,
)
from .formats import open_checkpoint
from .formats.base import CheckpointReader
from .formats.dcp import DcpReader
from .layout import TensorSpec
from .writers.dcp import DcpWriter, WrittenFile

if TYPE_CHECKING:
    import torch


def open_checkpoints(workers: Workers, paths: Sequence[Path], stack: contextlib.ExitStack) -> list[CheckpointReader]:
    """Open every checkpoint on every worker, parsing each DCP ``.metadata`` only once.

    Parsing metadata (a restricted pure-Python unpickle) costs about a second per 10,000
    keys. With N workers, worker r parses inputs r, r+N, … and the parsed indexes are
    exchanged, so the parse is split instead of repeated. Readers close with ``stack``.
    """
    readers = _open_checkpoints(workers, paths, stack)
    stack.enter_context(frozen_heap())  # their indexes live as long as the readers: see ema_ckpt._gc
    return readers


def _open_checkpoints(workers: Workers, paths: Sequence[Path], stack: contextlib.ExitStack
                      ) -> list[CheckpointReader]:
    if workers.world_size == 1:
        return [stack.enter_context(contextlib.closing(open_checkpoint(p))) for p in paths]

    def open_mine() -> dict[int, CheckpointReader]:
        return {i: stack.enter_context(contextlib.closing(open_checkpoint(p)))
                for i, p in enumerate(paths) if i % workers.world_size == workers.rank}

    mine = workers.run(open_mine)
    shared: dict[int, dict] = {}
    for part in workers.exchange({i: r.share() for i, r in mine.items() if isinstance(r, DcpReader)}):
        shared.update(part)

    def open_rest() -> list[CheckpointReader]:
        readers = []
        for i, path in enumerate(paths):
            if i in mine:
                readers.append(mine[i])
            elif i in shared:
                readers.append(stack.enter_context(contextlib.closing(DcpReader(path, shared=shared[i]))))
            else:
                readers.append(stack.enter_context(contextlib.closing(open_checkpoint(path))))
        return readers

    return workers.run(open_rest)


@dataclass(slots=True)
class WrittenOutputs:
    """Files of each output (filled on the coordinator) and totals over all workers."""

    files: list[list[WrittenFile]] = field(default_factory=list)
    bytes_read: int = 0
    bytes_written: int = 0


@frozen_heap()  # also sets aside the specs and regions made since the inputs were opened
def write_dcp_outputs(
    workers: Workers,
    sources: Sequence[CheckpointReader],
    outputs: Sequence[OutputSpec],
    stagings: Sequence[Path],
    regions: Sequence[PlannedRegion],
    specs: Mapping[str, TensorSpec],
    *,
    copy_source: int,
    accumulate_dtype: torch.dtype,
    planner_data: dict[str, tuple[str, ...]] | None,
    output_dtype: Callable[[TensorSpec], torch.dtype] | None = None,
    max_file_bytes: int | None = DEFAULT_FILE_BYTES,
    on_progress: Callable[[Progress], None] | None = None,
    device: str = "cpu",
    check_finite: Sequence[int] = (),
) -> WrittenOutputs:
    """Compute every output region this worker owns, write it, and (coordinator) the metadata."""
    regions = split_files(regions, specs, max_file_bytes)
    mine = owned_regions(regions, specs, workers.rank, workers.world_size)
    key_order = list(dict.fromkeys(r.key for r in regions))
    writers = [DcpWriter(s) for s in stagings]

    def compute() -> tuple[list, EngineStats]:
        stats = combine_regions(
            sources, outputs, writers, mine, specs, copy_source=copy_source,
            accumulate_dtype=accumulate_dtype, output_dtype=output_dtype, on_progress=on_progress,
            device=device, check_finite=check_finite,
        )
        # keys no region of this worker touched still need declaring on the coordinator
        return [w.close() for w in writers], stats

    try:
        states, stats = workers.run(compute)
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    gathered = workers.exchange((states, stats.bytes_read, stats.bytes_written))
    result = WrittenOutputs(bytes_read=sum(g[1] for g in gathered), bytes_written=sum(g[2] for g in gathered))
    if workers.is_coordinator:
        out_dtype = output_dtype or (lambda spec: accumulate_dtype if spec.is_float else spec.dtype)

        def finish() -> list[list[WrittenFile]]:
            files = []
            for k, writer in enumerate(writers):
                for key in key_order:  # declare every key, even those only peers wrote
                    writer.declare(key, specs[key].shape, out_dtype(specs[key]))
                others = [g[0][k] for rank, g in enumerate(gathered) if rank != workers.rank]
                files.append(writer.finish(planner_data, others=others, key_order=key_order))
            return files

        result.files = workers.run(finish)
    else:
        workers.run(lambda: None)
    return result
