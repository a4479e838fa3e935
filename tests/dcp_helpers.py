"""Small DCP checkpoints for tests, written by torch's own DCP saving code.

Every byte of the data files and of ``.metadata`` comes from torch (``dcp.save``, its
``DefaultSavePlanner`` and ``FileSystemWriter``), never from ema-ckpt's writer, so a bug the
project's writer and reader shared would still show. Sharded layouts (FSDP's dim-0
``torch.chunk`` or any boxes) are saved as the ranks of a real job would save them: one
planner and one writer per rank, each rank's chunks in its own ``__<rank>_0.distcp``, and the
coordinator's global plan and metadata.

Example:
    >>> write_dcp(Path("ck"), {"model.w": torch.ones(4, 3)}, world_size=2)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from ema_ckpt.formats.dcp.writer import DcpWriter
from ema_ckpt.layout import Box, dim0_shard_regions


def fsdp_boxes(shape: tuple[int, ...], world_size: int) -> list[Box]:
    """Dim-0 boxes of every rank as FSDP shards a tensor (the ranks past the rows share the empty one)."""
    boxes = [box for _rank, box in dim0_shard_regions(shape, world_size)]
    return boxes + boxes[-1:] * (world_size - len(boxes)) if shape else boxes


class _RankPlanner(DefaultSavePlanner):
    """torch's default planner for one rank, whose sharded keys are saved as the given chunks.

    ``chunks`` maps a flat key to this rank's pieces by offset; the key's value in the state
    dict is the whole tensor, which gives the chunks' global size.
    """

    def __init__(self, chunks: Mapping[str, Mapping[tuple[int, ...], torch.Tensor]]) -> None:
        super().__init__()
        self._chunks = chunks

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.index.fqn not in self._chunks]
        for fqn, pieces in self._chunks.items():
            size = self.state_dict[fqn].size()
            for offsets, piece in pieces.items():
                where = torch.Size(offsets)
                data = TensorWriteData(chunk=ChunkStorageMetadata(offsets=where, sizes=piece.size()),
                                       properties=TensorProperties.create_from_tensor(piece), size=size)
                item = WriteItem(index=MetadataIndex(fqn, where), type=WriteItemType.SHARD, tensor_data=data)
                items.append(item)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self._chunks:
            return self._chunks[index.fqn][tuple(index.offset or ())]
        return super().lookup_object(index)


def _nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"model.w": t}`` → ``{"model": {"w": t}}`` (split at the first dot, as a trainer nests)."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            nested[key] = value
    return nested


def _is_whole(boxes: list[Box], value: Any) -> bool:
    if not isinstance(value, torch.Tensor):
        return True
    return len(boxes) == 1 and boxes[0] == Box.full(tuple(value.shape))


def write_dcp(
    path: Path,
    tensors: Mapping[str, Any],
    *,
    world_size: int = 1,
    boxes: Mapping[str, list[Box]] | None = None,
    rank_of: Mapping[str, int] | None = None,
) -> Path:
    """Save ``tensors`` (flat keys like ``model.w``) as a DCP checkpoint with torch's own saver.

    A tensor is cut into ``boxes[key]`` (default: FSDP's dim-0 chunks over ``world_size``
    ranks), box ``i`` saved by rank ``i % world_size``. A value that is not cut (one box
    covering it, or not a tensor: saved as torch's BYTE_IO) is saved by ``rank_of[key]``
    (default 0).
    """
    ranks = max(world_size, 1)
    states: list[dict[str, Any]] = [{} for _ in range(ranks)]
    chunks: list[dict[str, dict[tuple[int, ...], torch.Tensor]]] = [{} for _ in range(ranks)]
    for key, value in tensors.items():
        key_boxes = (boxes or {}).get(key) or (
            fsdp_boxes(tuple(value.shape), ranks) if isinstance(value, torch.Tensor) else [])
        if _is_whole(key_boxes, value):
            states[(rank_of or {}).get(key, 0) % ranks][key] = value
            continue
        for i, box in enumerate(key_boxes):
            rank = i % ranks
            states[rank][key] = value
            # each piece owns its storage, as a rank's local shard does
            chunks[rank].setdefault(key, {})[box.offsets] = value[box.slices()].clone(
                memory_format=torch.contiguous_format)
    planners = [_RankPlanner(rank_chunks) for rank_chunks in chunks]
    if ranks == 1:
        writer = FileSystemWriter(path, sync_files=False)
        save(_nested(states[0]), storage_writer=writer, planner=planners[0], no_dist=True)
        return path
    _save_as_ranks(path, [_nested(state) for state in states], planners)
    return path


def _save_as_ranks(path: Path, states: list[dict[str, Any]], planners: list[_RankPlanner]) -> None:
    """The steps ``dcp.save`` takes on every rank of a job, taken here for each rank in turn."""
    writers = [FileSystemWriter(path, sync_files=False) for _ in states]
    local_plans = []
    for rank, (state, planner, writer) in enumerate(zip(states, planners, writers, strict=True)):
        writer.reset(path)
        planner.set_up_planner(state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        local_plans.append(writer.prepare_local_plan(planner.create_local_plan()))
    global_plans, metadata = planners[0].create_global_plan(local_plans)
    global_plans = writers[0].prepare_global_plan(global_plans)
    results = []
    for planner, writer, plan in zip(planners, writers, global_plans, strict=True):
        future = writer.write_data(planner.finish_plan(plan), planner)
        future.wait()
        results.append(future.value())
    writers[0].finish(metadata, results)


def write_dcp_with_dcp_writer(
    path: Path, tensors: Mapping[str, torch.Tensor], *, world_size: int = 1
) -> Path:
    """The same layout as :func:`write_dcp`, written by ema-ckpt's ``DcpWriter``: for tests of that writer."""
    writer = DcpWriter(path)
    for key, value in tensors.items():
        writer.declare(key, tuple(value.shape), value.dtype)
        for rank, box in enumerate(fsdp_boxes(tuple(value.shape), world_size)):
            part = value[box.slices()] if box.sizes else value
            writer.write(key, box, part.contiguous(), rank=rank % max(world_size, 1))
    writer.finish({k: tuple(k.split(".", 1)) for k in tensors})
    return path


def torch_load_flat(path: Path, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load keys with torch's own ``dcp.load`` (the oracle) into fresh buffers shaped like ``like``."""
    state = {k: torch.empty_like(v) for k, v in like.items()}
    load(state, checkpoint_id=str(path), no_dist=True)
    return state


PAGE = 4096


def save_random_dcp(folder: Path, step: int) -> Path:
    """``folder/step_<step>``: a two-rank dcp.save checkpoint of ``model.w`` (128 KiB) and ``model.b``."""
    torch.manual_seed(step)
    return write_dcp(folder / f"step_{step}", {"model.w": torch.randn(4096, 8), "model.b": torch.randn(4)},
                     world_size=2)


def zero_page_inside(file: Path, start: int, size: int) -> None:
    """A zero-filled hole of one page, page-aligned, inside bytes ``[start, start + size)`` of ``file``
    (what a parallel copier into a preallocated file, or a torn write, leaves)."""
    page = -(-(start + 1) // PAGE) * PAGE
    assert page + PAGE <= start + size, "the range is too small to hold a whole page"
    with open(file, "r+b") as handle:
        handle.seek(page)
        handle.write(b"\0" * PAGE)


def dcp_sequence_with_hole(ckpts: Path) -> Path:
    """Steps 1–3 of :func:`save_random_dcp` with a page of step 2's ``model.w`` record zeroed; the damaged file."""
    from ema_ckpt.formats import open_checkpoint

    for step in (1, 2, 3):
        save_random_dcp(ckpts, step)
    with open_checkpoint(ckpts / "step_2") as reader:
        file, start, length = reader.byte_ranges("model.w")[0]
    zero_page_inside(ckpts / "step_2" / file, start, length)
    return ckpts / "step_2" / file
