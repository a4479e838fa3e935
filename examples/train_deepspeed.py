"""Train a small model with DeepSpeed ZeRO (stage 1, 2 or 3) and save checkpoints that ema-ckpt reads.

Every ``--save-every`` steps, ``engine.save_checkpoint(OUT)`` writes ``OUT/global_step<N>/`` and
``OUT/latest``; ema-ckpt reads that folder as it is, no ``zero_to_fp32`` conversion needed::

    torchrun --nproc-per-node 2 examples/train_deepspeed.py --out ds_ckpts --stage 3 --steps 30
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/train_deepspeed.py --out ds_ckpts  # no GPU
    ema-ckpt accumulate ds_ckpts --decay 0.99      # EMA of the fp32 master weights in ds_ckpts/ema
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)  # LayerNorm, not BatchNorm: fine in bf16 and under ZeRO-3
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
    p.add_argument("--out", type=Path, required=True, help="save folder (OUT/global_step<N>, OUT/latest)")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=2, help="ZeRO stage")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="training dtype")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps to train")
    p.add_argument("--save-every", type=int, default=10, help="save a checkpoint every N steps")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": args.dtype == "bf16"},
        "zero_allow_untested_optimizer": True,  # the torch AdamW passed to deepspeed.initialize
        "steps_per_print": 10**9,
    }


def use_plain_gloo_on_cpu() -> None:
    """With DS_ACCELERATOR=cpu, DeepSpeed compiles a shared-memory all-reduce when its communicator
    starts (about a minute, needs g++); plain gloo is enough for a small CPU run, so skip the build."""
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def main() -> None:
    args = parse_args()
    on_cpu = get_accelerator().device_name() == "cpu"
    if on_cpu:
        use_plain_gloo_on_cpu()
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else None)
    rank = torch.distributed.get_rank()

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = TinyLM(args.vocab, args.dim, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(args))

    data = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batches
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=data)
        tokens = tokens.to(engine.device)
        logits = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        if step % args.save_every == 0 or step == args.steps:
            engine.save_checkpoint(str(args.out))  # every rank: OUT/global_step<N>/, then OUT/latest
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}, saved {args.out}/global_step{step}", flush=True)

    torch.distributed.barrier()
    engine.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
