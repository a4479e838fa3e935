"""Train a tiny model with DeepSpeed ZeRO on CPU and save checkpoints (a test fixture producer).

Run under torchrun with ``DS_ACCELERATOR=cpu`` (see ``ds_launch.py``)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 \\
        --master-addr 127.0.0.1 --master-port 29512 tests/producers/deepspeed_train.py \\
        --out /tmp/ds --stage 3 --dtype bf16 --steps 2,4

Writes ``<out>/latest`` and ``<out>/global_step<N>/`` for each step in ``--steps`` (through
``engine.save_checkpoint(out)``), and beside them two oracles written by rank 0:

- ``<out>/frozen_reference.pt``: the frozen parameters as initialised, in fp32;
- ``<out>/masters_step<N>.pt``: every trainable parameter's fp32 master weights at step N, as
  DeepSpeed's live optimizer holds them (``safe_get_full_fp32_param``). This is an oracle
  independent of ``zero_to_fp32``, and the only one for BF16_Optimizer checkpoints, which
  ``zero_to_fp32`` rejects.

The model has what makes ZeRO reconstruction tricky: frozen parameters, an embedding tied to the
output projection, a float and an integer buffer, LayerNorm, two optimizer parameter groups,
and sizes divisible by neither 2 nor 3 (so every world size leaves padding).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 37, 11, 23, 5


class TinyTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)  # requires_grad=False below
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, two names
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))  # float buffer, 7 elements
        self.register_buffer("seen", torch.zeros(3, dtype=torch.int64))  # integer buffer
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.seen.add_(torch.tensor([1, tokens.shape[0], tokens.numel()], device=self.seen.device))
        x = self.embed(tokens)
        x = x + self.frozen(x)
        h = self.norm(F.gelu(self.fc1(x)))
        x = x + self.fc2(h) * self.scale.mean()
        return self.head(x)


def _config(stage: int, dtype: str, bf16_optimizer: bool) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update(sub_group_size=150, stage3_param_persistence_threshold=0)
    config: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
        if bf16_optimizer:
            # bf16 + fp32 gradient accumulation + stage 1 selects BF16_Optimizer.
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    elif dtype != "fp32":
        raise SystemExit(f"--dtype must be fp32 or bf16, not {dtype}")
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", default="2", help="comma-separated global steps to save at")
    parser.add_argument("--bf16-optimizer", action="store_true")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    steps = sorted({int(s) for s in args.steps.split(",") if s})

    import deepspeed  # imported late: torchrun sets the env DeepSpeed reads at import
    from deepspeed.utils import safe_get_full_fp32_param

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (g++, ninja, ~1 min) when
    # the communicator is created; gloo alone is enough for a test fixture, so skip the build.
    import deepspeed.comm.torch as ds_comm_torch

    ds_comm_torch.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()

    torch.manual_seed(args.seed)
    model = TinyTied()
    frozen_reference = {f"frozen.{k}": v.detach().clone() for k, v in model.frozen.named_parameters()}
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight") and p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not (n.endswith("weight") and p.dim() > 1)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-2,
        foreach=False,
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=_config(args.stage, args.dtype, args.bf16_optimizer)
    )

    args.out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(frozen_reference, args.out / "frozen_reference.pt")
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    for step in range(1, steps[-1] + 1):
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
        logits = engine(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens.roll(1, dims=1).reshape(-1))
        engine.backward(loss)
        engine.step()
        if step in steps:
            if engine.global_steps != step:
                raise SystemExit(f"engine.global_steps={engine.global_steps}, expected {step}")
            engine.save_checkpoint(str(args.out))
            masters = {}
            for name, param in engine.module.named_parameters():
                if param.requires_grad:
                    full = safe_get_full_fp32_param(param)  # collective under ZeRO-3
                    masters[name] = full.detach().cpu().clone()
            if rank == 0:
                torch.save(masters, args.out / f"masters_step{step}.pt")
    if rank == 0:
        (args.out / "producer.json").write_text(
            json.dumps({"stage": args.stage, "dtype": args.dtype, "steps": steps,
                        "world_size": torch.distributed.get_world_size(),
                        "bf16_optimizer": args.bf16_optimizer,
                        "optimizer": type(engine.optimizer).__name__})
        )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
