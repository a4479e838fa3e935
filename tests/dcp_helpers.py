"""Small DCP checkpoints for tests, chunked like FSDP (dim-0 ``torch.chunk``) or at random."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ema_ckpt.layout import Box, dim0_shard_boxes
from ema_ckpt.writers.dcp import DcpWriter


def fsdp_boxes(shape: tuple[int, ...], world_size: int) -> list[Box]:
    """Dim-0 boxes as FSDP shards a tensor."""
    return dim0_shard_boxes(shape, world_size)


def write_dcp(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    world_size: int = 1,
    boxes: Mapping[str, list[Box]] | None = None,
) -> Path:
    """Write ``tensors`` (flat keys like ``model.w``) as a DCP checkpoint with ema-ckpt's writer."""
    writer = DcpWriter(path)
    for key, value in tensors.items():
        writer.declare(key, tuple(value.shape), value.dtype)
        key_boxes = (boxes or {}).get(key) or fsdp_boxes(tuple(value.shape), world_size)
        for rank, box in enumerate(key_boxes):
            part = value[box.slices()] if box.sizes else value
            writer.write(key, box, part.contiguous(), rank=rank % max(world_size, 1))
    writer.finish({k: tuple(k.split(".", 1)) for k in tensors})
    return path


def torch_load_flat(path: Path, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load keys with torch's own ``dcp.load`` (the oracle) into fresh buffers shaped like ``like``."""
    state = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state
