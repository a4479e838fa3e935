"""Produce a sequence of real FSDP1 / FSDP2 DCP checkpoints for tests.

Meant to be run under torchrun on CPU with the gloo backend, e.g.::

    python -m torch.distributed.run --nproc-per-node 3 tests/producers/fsdp_train.py \
        --out /tmp/ckpts --kind fsdp2 --steps 3,7,20,21

It trains a tiny, deterministic model continuously (optimizer-step counter
starts at 0) and, right after each optimizer step listed in ``--steps``, saves a
DCP checkpoint into ``OUT/<name-format.format(step=N)>``.

The model deliberately contains awkward tensors for sharding:

* shapes whose dim 0 is not divisible by 2 or 3 (Linear(13, 7), Embedding(11, 5), ...),
* a parameter whose dim 0 (2) is smaller than a world size of 3 (empty shard),
* a 1-element parameter (``head.scale``; FSDP1/FSDP2 reject 0-d parameters),
* a LayerNorm,
* float buffers (``running_stat`` of shape (7,), 0-d ``running_loss``) and a 0-d
  int64 buffer (``num_batches_tracked``), all updated every step and synchronised
  across ranks so they stay replicated.

Each rank trains on its own slice of a global batch drawn from a seeded generator, so a
run is deterministic for a given (--seed, world size); FSDP1 and FSDP2 runs with the same
seed follow the same trajectory (bit-identical at W=2, ~1e-7 apart at W=3 in float32).

Note: with ``--with-optim`` and step 0 in ``--steps``, torch's ``get_state_dict`` initialises
the empty AdamW state with a fake lr=0 step, so the saved AdamW ``step`` is then one ahead of
the real optimizer-step count for the rest of that run (``num_batches_tracked`` is not).
"""

from __future__ import annotations

import argparse
import faulthandler
import inspect
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

VOCAB = 11
EMB = 5
HIDDEN = 13
MID = 97
OUT = 7
FEAT = 4
CLASSES = 2  # dim 0 of ``head.weight``: smaller than world size 3
SEQ = 6
BATCH = 8  # per rank


class Head(nn.Module):
    """A bare parameter of shape (2, 4) plus a 1-element scale parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(CLASSES, FEAT) * 0.5)
        # FSDP1 and FSDP2 both reject 0-d parameters ("doesn't support scalar
        # parameters"), so the scale is 1-element; the 0-d tensor is a buffer instead.
        self.scale = nn.Parameter(torch.tensor([0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.t()) * self.scale


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB)  # (11, 5)
        self.proj = nn.Linear(EMB, HIDDEN)  # (13, 5) + (13,)
        self.norm = nn.LayerNorm(HIDDEN)  # (13,) + (13,)
        self.fc1 = nn.Linear(HIDDEN, MID)  # (97, 13) + (97,)
        self.fc2 = nn.Linear(MID, HIDDEN)  # (13, 97) + (13,)
        self.out = nn.Linear(HIDDEN, OUT)  # (7, 13) + (7,)
        self.feat = nn.Linear(OUT, FEAT, bias=False)  # (4, 7)
        self.head = Head()  # weight (2, 4), scale ()
        self.register_buffer("running_stat", torch.zeros(OUT))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        self.register_buffer("running_loss", torch.tensor(0.0))  # 0-d float buffer

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(tokens).mean(dim=1)
        h = self.norm(torch.tanh(self.proj(h)))
        h = h + self.fc2(F.gelu(self.fc1(h)))
        o = self.out(h)
        logits = self.head(torch.tanh(self.feat(o)))
        return logits, o


def parse_steps(text: str) -> list[int]:
    steps = sorted({int(s) for s in text.split(",") if s.strip()})
    if not steps or steps[0] < 0:
        raise argparse.ArgumentTypeError(f"bad --steps {text!r}")
    return steps


def supports_use_collectives() -> bool:
    return "use_collectives" in inspect.signature(dcp.save).parameters


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--kind", required=True, choices=["fsdp1", "fsdp2"])
    p.add_argument("--steps", required=True, type=parse_steps, help="comma separated steps to save after")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--optim", default="adamw", choices=["adamw", "sgd"])
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--with-optim", action="store_true", help='save {"model": ..., "optim": ...}')
    p.add_argument("--name-format", default="step_{step}", help="dir name, e.g. 'global_step{step}'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rank-local-metadata",
        action="store_true",
        help="dcp.save(..., use_collectives=False): every rank writes its own metadata",
    )
    return p.parse_args(argv)


def wrap(model: nn.Module, kind: str) -> nn.Module:
    if kind == "fsdp1":
        from torch.distributed.fsdp import (
            FullyShardedDataParallel as FSDP,
        )
        from torch.distributed.fsdp import (
            ShardedStateDictConfig,
            StateDictType,
        )
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapped = FSDP(
            model,
            device_id=torch.device("cpu"),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear, nn.Embedding}),
            use_orig_params=True,
        )
        FSDP.set_state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig())
        return wrapped

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for sub in (model.emb, model.proj, model.norm, model.fc1, model.fc2, model.out, model.feat, model.head):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def inner(model: nn.Module) -> TinyModel:
    m = getattr(model, "module", model)
    assert isinstance(m, TinyModel), type(m)
    return m


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.enable()  # Python stacks on SIGABRT/SIGSEGV from C++ (gloo) land
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)

    torch.manual_seed(args.seed)  # identical init on all ranks
    model = TinyModel()
    if dtype != torch.float32:
        model = model.to(dtype)  # keeps the long buffer long
    model = wrap(model, args.kind)

    params = [p for p in model.parameters() if p.requires_grad]
    if args.optim == "adamw":
        optim: torch.optim.Optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    else:
        optim = torch.optim.SGD(params, lr=args.lr, momentum=0.9)

    save_kwargs = {}
    if args.rank_local_metadata:
        if not supports_use_collectives():
            raise SystemExit("this torch's dcp.save has no use_collectives argument")
        save_kwargs["use_collectives"] = False

    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(10_000 + args.seed)
    last = args.steps[-1]
    todo = set(args.steps)

    def save(step: int) -> None:
        if args.with_optim:
            msd, osd = get_state_dict(model, optim)
            sd = {"model": msd, "optim": osd}
        else:
            sd = {"model": get_model_state_dict(model)}
        ckpt = args.out / args.name_format.format(step=step)
        dcp.save(sd, checkpoint_id=str(ckpt), **save_kwargs)
        if rank == 0:
            print(f"saved step {step} -> {ckpt}", flush=True)

    step = 0
    if 0 in todo:
        save(0)
    m = inner(model)
    while step < last:
        # One global batch drawn identically on every rank; each rank trains on its slice.
        tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ), generator=gen)
        target = torch.randint(0, CLASSES, (world * BATCH,), generator=gen)
        sl = slice(rank * BATCH, (rank + 1) * BATCH)
        logits, feats = model(tokens[sl])
        loss = F.cross_entropy(logits.float(), target[sl])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        step += 1
        with torch.no_grad():  # SyncBN-style buffer update, keeps buffers replicated
            stat = torch.cat([feats.detach().float().mean(dim=0), loss.detach().float().reshape(1)])
            dist.all_reduce(stat)
            stat /= world
            m.running_stat.mul_(0.8).add_(stat[:-1].to(m.running_stat.dtype), alpha=0.2)
            m.running_loss.mul_(0.8).add_(stat[-1].to(m.running_loss.dtype), alpha=0.2)
            m.num_batches_tracked.add_(1)
        if step in todo:
            save(step)

    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every checkpoint is fully written (dcp.save returned, process group destroyed).
    # Skip interpreter/C++ static teardown: on a loaded 2-core box gloo teardown has been
    # seen (rarely) to abort with "terminate called without an active exception".
    os._exit(rc)
