"""Train the demo's tiny transformer with FSDP2 at a deliberately noisy learning rate, as cluster jobs do.

All ranks save ``{"model": ..., "optim": ...}`` with ``torch.distributed.checkpoint.save`` into
``OUT/step_<N>`` every ``--save-every`` steps and at the job's last step. ``--stop-after N`` ends the
job at step N (its time limit: the last step is saved, as a preempted job's handler does);
``--resume`` continues from the newest checkpoint in OUT. ``--keep K`` deletes all but the newest K
checkpoints after each save, like a trainer's retention policy::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/demo/train.py \\
        --out demo/ckpts --steps 400 --stop-after 215 --save-every 25 --keep 20
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/demo/train.py \\
        --out demo/ckpts --steps 400 --resume --save-every 10 --keep 20
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from task import TinyTransformer, lm_loss, markov_table, sample
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder (OUT/step_<N>)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps of the whole training")
    p.add_argument("--stop-after", type=int, help="this job's last step (its time limit); default --steps")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT")
    p.add_argument("--save-every", type=int, default=10, help="save a checkpoint every N steps")
    p.add_argument("--keep", type=int, default=0, help="keep only the newest K checkpoints (0: keep all)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (constant)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def step_of(path: Path) -> int:
    return int(path.name.split("_")[-1])


def saved(out: Path) -> list[Path]:
    """The complete checkpoints in ``out`` by step (DCP writes ``.metadata`` last)."""
    return sorted((p for p in out.glob("step_*") if (p / ".metadata").is_file()), key=step_of)


def retention(out: Path, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints; the names deleted."""
    old = saved(out)[:-keep] if keep > 0 else []
    for path in old:
        shutil.rmtree(path)
    return [p.name for p in old]


def names(paths: list[str]) -> str:
    return ", ".join(paths) if len(paths) <= 4 else f"{paths[0]}, {paths[1]}, …, {paths[-1]} ({len(paths)})"


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

    start = 0
    if args.resume:
        newest = saved(args.out)[-1]
        model_state, optim_state = get_state_dict(model, optim)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(newest))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = step_of(newest)
        if rank == 0:
            print(f"resumed from {newest.name}", flush=True)

    stop = min(args.stop_after or args.steps, args.steps)
    table = markov_table()
    # each rank its own batches, and a resumed job new ones
    data = torch.Generator().manual_seed(args.seed + 1 + rank + 1000 * start)
    began, recent, new, deleted = time.perf_counter(), [], [], []
    for step in range(start + 1, stop + 1):
        seq = sample(table, args.batch_size, data)
        loss = lm_loss(model(seq[:, :-1]), seq)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        recent.append(loss.item())
        if step % args.save_every == 0 or step == stop:
            model_state, optim_state = get_state_dict(model, optim)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(args.out / f"step_{step}"))
            new.append(f"step_{step}")
            if rank == 0:
                deleted += retention(args.out, args.keep)
            dist.barrier()  # the next save starts after the deletions
        if rank == 0 and (step % 50 == 0 or step == stop):
            mean = sum(recent) / len(recent)
            print(f"step {step:4d}  train loss {mean:.3f} (mean of the last {len(recent)} steps)", flush=True)
            recent = []
    if rank == 0:
        print(f"trained steps {start + 1}–{stop} in {time.perf_counter() - began:.1f} s; saved {names(new)}")
        if args.keep:
            print(f"retention (the newest {args.keep} kept) deleted {names(deleted) if deleted else 'nothing'}")
        if stop < args.steps:
            print(f"stopped at step {stop} (the job's time limit); --resume continues from step_{stop}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every checkpoint is written and the group is destroyed: skip the interpreter's teardown,
    # where gloo's threads can abort the process ("terminate called without an active exception").
    os._exit(0)
