"""Generate 3 real DeepSpeed ZeRO-3 checkpoints of a model with N parameters of 4 fp32 each.

The shape of a mixture-of-experts model's many small tensors (``layers.3.mlp.experts.117.w1``,
as in ``bench_many_tensors.py``), trained by DeepSpeed itself with ZeRO-3 on CPU ranks
(torchrun, gloo, ``DS_ACCELERATOR=cpu``; the approach of ``tests/producers/ds_launch.py``),
fp32, ``torch.optim.AdamW`` as client optimizer, saved with ``engine.save_checkpoint`` after
global steps 1, 2 and 3. DeepSpeed's defaults otherwise: parameters under
``stage3_param_persistence_threshold`` (1e5 elements, so all of them) stay whole on every rank
between steps, and their fp32 masters are partitioned across the ranks in one flat group.

Usage: python benchmarks/deepspeed_many_params.py OUT --count N [--ranks 2] [--timeout 3600]
Does nothing when OUT already holds the 3 steps; a run is written to ``OUT.partial`` and renamed
into place when complete. DeepSpeed's set-up is per parameter (the ZeRO-3 conversion, the
gradient hooks, the checkpoint's ``param_shapes``): on 2 shared cores about 20 s for 1,000
parameters, 1 min for 5,000, 4.5 min for 20,000 (see ``bench_many_tensors.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STEPS = (1, 2, 3)
_TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES",
)  # fmt: skip


def param_name(i: int) -> str:
    """The i-th parameter's name, as ``bench_many_tensors.py`` names its tensors."""
    return f"layers.{i // 4000}.mlp.experts.{(i // 4) % 1000}.w{i % 4}"


def complete(out: Path) -> bool:
    return (out / "latest").is_file() and all((out / f"global_step{s}").is_dir() for s in STEPS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make(out: Path, count: int, *, ranks: int = 2, timeout: float = 3600) -> float:
    """Train and save into ``out`` unless it is complete; the seconds it took (0 if it was)."""
    if complete(out):
        return 0.0
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    started = time.perf_counter()
    for attempt in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--nnodes", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            str(Path(__file__).resolve()), "--worker", str(partial), "--count", str(count),
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RuntimeError(f"DeepSpeed producer ({count} parameters) timed out after {timeout} s") from None
        if proc.returncode == 0:
            break
        if attempt == 0 and "address already in use" in (output or "").lower():
            continue
        raise RuntimeError(f"DeepSpeed producer failed (exit {proc.returncode}):\n{(output or '')[-6000:]}")
    if not complete(partial):
        raise RuntimeError(f"DeepSpeed producer left {partial} incomplete:\n{(output or '')[-6000:]}")
    partial.rename(out)
    return time.perf_counter() - started


def _worker(out: Path, count: int) -> None:
    """One torchrun rank: build the model, ZeRO-3 it, train 3 steps, save after each."""
    import deepspeed
    import torch
    from torch import nn

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce when the communicator is
    # created; gloo is enough here (as in tests/producers/deepspeed_train.py).
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")

    class Expert(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            for k in range(n):
                self.register_parameter(f"w{k}", nn.Parameter(torch.randn(4)))

    class Many(nn.Module):
        """``count`` parameters of 4 elements in ``layers.L.mlp.experts.E.wK``; the forward pass
        uses them all at once (one stack), so a step costs DeepSpeed's per-parameter work only."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList()
            for i in range(0, count, 4):
                layer, expert = i // 4000, (i // 4) % 1000
                if layer == len(self.layers):
                    self.layers.append(nn.Module())
                    self.layers[layer].mlp = nn.Module()
                    self.layers[layer].mlp.experts = nn.ModuleList()
                self.layers[layer].mlp.experts.append(Expert(min(4, count - i)))
                assert len(self.layers[layer].mlp.experts) == expert + 1
            for p in self.parameters():  # used by this module's forward, not their owners'
                deepspeed.zero.register_external_parameter(self, p)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weights = torch.stack(list(self.parameters()))  # (count, 4); all persistent under ZeRO-3
            return (x @ weights.T).tanh()

    torch.manual_seed(1234)
    model = Many()
    names = [n for n, _ in model.named_parameters()]
    assert names == [param_name(i) for i in range(count)], names[:8]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(1235 + rank)
    for step in range(1, STEPS[-1] + 1):
        x = torch.randn(2, 4, generator=generator)
        loss = (engine(x) - 0.5).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if step in STEPS:
            engine.save_checkpoint(str(out))
    if rank == 0:
        (out / "producer.json").write_text(json.dumps({"parameters": count, "steps": list(STEPS),
                                                      "world_size": torch.distributed.get_world_size()}))
    torch.distributed.barrier()
    engine.destroy()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a torchrun rank's output folder
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.count)
        return
    if args.out is None:
        parser.error("OUT is required")
    took = make(args.out, args.count, ranks=args.ranks, timeout=args.timeout)
    print(f"{args.out}: {'already there' if not took else f'generated in {took:.0f} s'}")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
