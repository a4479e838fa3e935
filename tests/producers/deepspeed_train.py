"""Train a tiny model with DeepSpeed ZeRO on CPU and save checkpoints (a test fixture producer).

Run under torchrun with ``DS_ACCELERATOR=cpu`` (see ``ds_launch.py``)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 \\
        --master-addr 127.0.0.1 --master-port 29512 tests/producers/deepspeed_train.py \\
        --out /tmp/ds --stage 3 --dtype bf16 --steps 2,4

(or ``--runs runs.json`` for several configurations in one launch, one after another).

Writes ``<out>/latest`` and ``<out>/global_step<N>/`` for each step in ``--steps`` (through
``engine.save_checkpoint(out)``), and beside them two oracles written by rank 0:

- ``<out>/frozen_reference.pt``: the frozen parameters as initialised, in fp32;
- ``<out>/producer.json``: the configuration and DeepSpeed's optimizer class name;
- ``<out>/masters_step<N>.pt``: every trainable parameter's fp32 master weights at step N, as
  DeepSpeed's live optimizer holds them (``safe_get_full_fp32_param``). This is an oracle
  independent of ``zero_to_fp32``, and the only one for BF16_Optimizer checkpoints, which
  ``zero_to_fp32`` rejects.

The model has what makes ZeRO reconstruction tricky: frozen parameters, an embedding tied to the
output projection, a float and an integer buffer, LayerNorm, two optimizer parameter groups,
and sizes divisible by neither 2 nor 3 (so every world size leaves padding). ZeRO-3 runs use a
small ``sub_group_size`` so the fp32 partition is split into several sub-groups.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
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


def _config(stage: int, dtype: str, bf16_optimizer: bool, zero_options: dict | None = None) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update(sub_group_size=150, stage3_param_persistence_threshold=0)
    zero.update(zero_options or {})  # e.g. round_robin_gradients, parameter_alignment
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


def train_and_save(
    out: Path,
    *,
    stage: int,
    dtype: str,
    steps: list[int],
    bf16_optimizer: bool,
    seed: int,
    zero_options: dict | None = None,
) -> None:
    """One run: a fresh model and engine, trained to ``steps[-1]``, saved at each of ``steps``."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    rank = torch.distributed.get_rank()
    torch.manual_seed(seed)
    model = TinyTied()
    frozen_reference = {f"frozen.{k}": v.detach().clone() for k, v in model.frozen.named_parameters()}
    matrices = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() > 1]
    vectors = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() <= 1]
    optimizer = torch.optim.AdamW(  # a client optimizer: DeepSpeed's FusedAdam would JIT-compile
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=3e-2,
        foreach=False,
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=_config(stage, dtype, bf16_optimizer, zero_options)
    )

    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(frozen_reference, out / "frozen_reference.pt")
    generator = torch.Generator().manual_seed(seed + 1 + rank)  # each rank sees its own data
    for step in range(1, steps[-1] + 1):
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
        logits = engine(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens.roll(1, dims=1).reshape(-1))
        engine.backward(loss)
        engine.step()
        if step in steps:
            if engine.global_steps != step:
                raise SystemExit(f"engine.global_steps={engine.global_steps}, expected {step}")
            engine.save_checkpoint(str(out))
            masters = {}
            for name, param in engine.module.named_parameters():
                if param.requires_grad:
                    full = safe_get_full_fp32_param(param)  # a collective under ZeRO-3
                    masters[name] = full.detach().cpu().clone()
            if rank == 0:
                torch.save(masters, out / f"masters_step{step}.pt")
    if rank == 0:
        (out / "producer.json").write_text(
            json.dumps(
                {
                    "stage": stage,
                    "dtype": dtype,
                    "steps": steps,
                    "world_size": torch.distributed.get_world_size(),
                    "bf16_optimizer": bf16_optimizer,
                    "zero_options": zero_options or {},
                    "optimizer": type(engine.optimizer).__name__,
                }
            )
        )
    torch.distributed.barrier()
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="checkpoint folder of a single run")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3))
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--bf16-optimizer", action="store_true")
    parser.add_argument(
        "--runs",
        type=Path,
        help="JSON file: a list of {out, stage, dtype, bf16_optimizer, zero} run one after another in "
        "this process group (saves the start-up cost of one torchrun per configuration)",
    )
    parser.add_argument("--steps", default="2", help="comma-separated global steps to save at")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    steps = sorted({int(s) for s in args.steps.split(",") if s})
    if args.runs is not None:
        runs = json.loads(args.runs.read_text())
    elif args.out is not None and args.stage is not None:
        runs = [
            {
                "out": str(args.out),
                "stage": args.stage,
                "dtype": args.dtype,
                "bf16_optimizer": args.bf16_optimizer,
            }
        ]
    else:
        parser.error("give --out and --stage, or --runs")

    import deepspeed  # imported late: torchrun sets the env DeepSpeed reads at import

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (g++, ninja, ~1 min) when
    # the communicator is created; gloo alone is enough for a test fixture, so skip the build.
    # (``import deepspeed.comm.torch as m`` would bind the ``torch`` that deepspeed.comm imports.)
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    for run in runs:
        train_and_save(
            Path(run["out"]),
            stage=int(run["stage"]),
            dtype=run.get("dtype", "fp32"),
            steps=steps,
            bf16_optimizer=bool(run.get("bf16_optimizer", False)),
            seed=args.seed,
            zero_options=run.get("zero"),
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
