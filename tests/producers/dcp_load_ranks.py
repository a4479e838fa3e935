"""Load a DCP checkpoint with ``dcp.load`` on N ranks into dim-0-sharded DTensors and compare.

Run under torchrun (gloo, CPU)::

    python -m torch.distributed.run --nproc-per-node 2 tests/producers/dcp_load_ranks.py \
        --ckpt DIR --expected want.safetensors [--rel 1e-6]

``want.safetensors`` holds the expected full tensors under the checkpoint's keys. Every key is
loaded as a ``Shard(0)`` DTensor on a mesh of all ranks (how FSDP2 and torchtitan hold a model),
so each rank reads only its rows; the full tensors are then gathered and compared. Rank 0
exits non-zero naming the first key off by more than ``--rel`` of its scale.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--expected", required=True)
    parser.add_argument("--rel", type=float, default=1e-6)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    want = load_file(args.expected)
    state = {
        key: distribute_tensor(
            torch.full(value.shape, float("nan"), dtype=torch.float32),
            mesh,
            [Shard(0) if value.dim() else Replicate()],
        )
        for key, value in want.items()
    }
    dcp.load(state, checkpoint_id=args.ckpt)
    failure = None
    for key, value in want.items():
        got = state[key].full_tensor()
        scale = value.abs().max().item() or 1.0
        error = (got.double() - value.double()).abs().max().item()
        if not error <= args.rel * scale:  # NaN (a row never loaded) fails too
            failure = failure or f"{key}: off by {error} (scale {scale})"
    dist.barrier()
    if dist.get_rank() == 0:
        print(failure or f"OK: {len(want)} keys on {dist.get_world_size()} ranks", flush=True)
    dist.destroy_process_group()
    return 1 if failure else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: gloo threads can abort it ("terminate called ...")
