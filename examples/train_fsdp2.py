"""Train a small model with FSDP2 and save DCP checkpoints that ema-ckpt reads.

Every ``--save-every`` optimizer steps, all ranks save ``{"model": ..., "optim": ...}`` with
``torch.distributed.checkpoint.save`` into ``OUT/step_<N>``; ``--keep K`` deletes all but the
newest K, like a training job's retention policy. Runs on GPUs (NCCL) or on CPU (gloo)::

    torchrun --nproc-per-node 2 examples/train_fsdp2.py --out ckpts --steps 40 --save-every 10
    ema-ckpt accumulate ckpts --decay 0.99       # EMA of the checkpoints in ckpts/ema
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, residual MLP blocks, a final norm and an output head."""

    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder (OUT/step_<N>)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps to train")
    p.add_argument("--save-every", type=int, default=10, help="save a checkpoint every N steps")
    p.add_argument("--keep", type=int, default=0, help="keep only the newest K checkpoints (0: keep all)")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def save_checkpoint(model: nn.Module, optim: torch.optim.Optimizer, out: Path, step: int, keep: int) -> Path:
    """Save ``OUT/step_<step>`` from every rank; then rank 0 applies the retention policy."""
    path = out / f"step_{step}"
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=str(path))  # .metadata is written last: readers skip it until then
    if keep > 0 and dist.get_rank() == 0:
        saved = sorted(out.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        for old in saved[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = TinyLM(args.vocab, args.dim, args.layers).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    args.out.mkdir(parents=True, exist_ok=True)
    data = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batches
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=data).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if step % args.save_every == 0 or step == args.steps:
            path = save_checkpoint(model, optim, args.out, step, args.keep)
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}, saved {path}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
