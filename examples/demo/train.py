"""Train the demo's tiny transformer with FSDP2 at a deliberately noisy learning rate.

Every ``--save-every`` steps all ranks save ``{"model": ..., "optim": ...}`` with
``torch.distributed.checkpoint.save`` into ``OUT/step_<N>``, as a real FSDP2 job does::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/demo/train.py --out demo/ckpts
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from task import TinyTransformer, lm_loss, markov_table, sample
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder (OUT/step_<N>)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps")
    p.add_argument("--save-every", type=int, default=10, help="save a checkpoint every N steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (constant)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = TinyTransformer()
    # One FSDP2 group for this tiny model, kept gathered between forward and backward (fewer collectives).
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)

    table = markov_table()
    data = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batches
    start, recent = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        seq = sample(table, args.batch_size, data)
        loss = lm_loss(model(seq[:, :-1]), seq)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        recent.append(loss.item())
        if step % args.save_every == 0 or step == args.steps:
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
            dcp.save(state, checkpoint_id=str(args.out / f"step_{step}"))
        if rank == 0 and (step % 50 == 0 or step == args.steps):
            mean = sum(recent) / len(recent)
            print(f"step {step:4d}  train loss {mean:.3f} (mean of the last {len(recent)} steps)", flush=True)
            recent = []
    if rank == 0:
        print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every checkpoint is written and the group is destroyed: skip the interpreter's teardown,
    # where gloo's threads can abort the process ("terminate called without an active exception").
    os._exit(0)
