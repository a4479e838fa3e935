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

Benchmarks add per-run options (all optional, defaults keep the fixture above): ``"model":
"big"`` (:class:`BigTied`, ``"big_blocks"`` transformer-ish MLP blocks, about 1 GiB fp32 at the
default 19), ``"optimizer": "sgd"`` (plain SGD without momentum: the fp32 masters and nothing
else in the optimizer files) and ``"oracles": false`` (skip ``masters_step<N>.pt``).
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


BIG_VOCAB, BIG_DIM, BIG_HIDDEN, BIG_SEQ = 32000, 1024, 4096, 4


class BigBlock(nn.Module):
    """A transformer-sized block without attention: qkv-shaped and MLP matrices, norms, biases."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(BIG_DIM)
        self.qkv = nn.Linear(BIG_DIM, 3 * BIG_DIM)
        self.proj = nn.Linear(BIG_DIM, BIG_DIM)
        self.norm2 = nn.LayerNorm(BIG_DIM)
        self.fc1 = nn.Linear(BIG_DIM, BIG_HIDDEN)
        self.fc2 = nn.Linear(BIG_HIDDEN, BIG_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(q * torch.sigmoid(k) + v)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class BigTied(nn.Module):
    """About ``blocks * 12.6M + 32.8M`` parameters (19 blocks: 272M, 1.01 GiB in fp32).

    Mixed sizes: a 125 MiB embedding tied to the output head, 16 MiB MLP matrices, 12 MiB
    qkv, 4 MiB projections, 4 KiB-16 KiB norms and biases; a small frozen layer and a buffer.
    """

    def __init__(self, blocks: int = 19) -> None:
        super().__init__()
        self.embed = nn.Embedding(BIG_VOCAB, BIG_DIM)
        self.frozen = nn.Linear(BIG_DIM, 64)  # requires_grad=False below
        self.blocks = nn.ModuleList(BigBlock() for _ in range(blocks))
        self.norm = nn.LayerNorm(BIG_DIM)
        self.head = nn.Linear(BIG_DIM, BIG_VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(BIG_DIM))
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.scale
        x = x + self.frozen(x).mean(dim=-1, keepdim=True)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _config(
    stage: int,
    dtype: str,
    bf16_optimizer: bool,
    zero_options: dict | None = None,
    *,
    micro_batch: int = 2,
) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update(sub_group_size=150, stage3_param_persistence_threshold=0)
    zero.update(zero_options or {})  # e.g. round_robin_gradients, parameter_alignment
    config: dict = {
        "train_micro_batch_size_per_gpu": micro_batch,
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
    model_name: str = "tiny",
    big_blocks: int = 19,
    optimizer_name: str = "adamw",
    oracles: bool = True,
) -> None:
    """One run: a fresh model and engine, trained to ``steps[-1]``, saved at each of ``steps``."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    rank = torch.distributed.get_rank()
    torch.manual_seed(seed)
    if model_name == "tiny":
        model: nn.Module = TinyTied()
        vocab, seq, micro_batch = VOCAB, SEQ, 2
    elif model_name == "big":
        model = BigTied(big_blocks)
        vocab, seq, micro_batch = BIG_VOCAB, BIG_SEQ, 1
    else:
        raise SystemExit(f"model must be tiny or big, not {model_name!r}")
    frozen_reference = {f"frozen.{k}": v.detach().clone() for k, v in model.frozen.named_parameters()}
    matrices = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() > 1]
    vectors = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() <= 1]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
    # A client optimizer: DeepSpeed's FusedAdam would JIT-compile.
    if optimizer_name == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=3e-2, foreach=False)
    elif optimizer_name == "sgd":  # no momentum: no state beyond DeepSpeed's fp32 masters
        optimizer = torch.optim.SGD(groups, lr=1e-2, momentum=0.0, foreach=False)
    else:
        raise SystemExit(f"optimizer must be adamw or sgd, not {optimizer_name!r}")
    config = _config(stage, dtype, bf16_optimizer, zero_options, micro_batch=micro_batch)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    del model, optimizer, groups, matrices, vectors

    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(frozen_reference, out / "frozen_reference.pt")
    generator = torch.Generator().manual_seed(seed + 1 + rank)  # each rank sees its own data
    for step in range(1, steps[-1] + 1):
        tokens = torch.randint(0, vocab, (micro_batch, seq), generator=generator)
        logits = engine(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens.roll(1, dims=1).reshape(-1))
        engine.backward(loss)
        engine.step()
        if step in steps:
            if engine.global_steps != step:
                raise SystemExit(f"engine.global_steps={engine.global_steps}, expected {step}")
            engine.save_checkpoint(str(out))
            if not oracles:
                continue
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
                    "model": model_name,
                    "client_optimizer": optimizer_name,
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
    parser.add_argument("--model", choices=("tiny", "big"), default="tiny")
    parser.add_argument("--big-blocks", type=int, default=19, help="blocks of the big model (19: ~1 GiB)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--no-oracles", action="store_true", help="skip masters_step<N>.pt")
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
                "model": args.model,
                "big_blocks": args.big_blocks,
                "optimizer": args.optimizer,
                "oracles": not args.no_oracles,
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
            model_name=run.get("model", "tiny"),
            big_blocks=int(run.get("big_blocks", 19)),
            optimizer_name=run.get("optimizer", "adamw"),
            oracles=bool(run.get("oracles", True)),
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
