"""Generate a real DeepSpeed ZeRO-3 checkpoint sequence on CPU (~1 GiB of fp32 masters per step).

Trains ``BigTied`` (``tests/producers/deepspeed_train.py``: a 125 MiB embedding tied to the
head, 19 blocks of 16/12/4 MiB matrices plus norms and biases, a small frozen layer and a
buffer; 272M trainable parameters, 1.01 GiB in fp32) with DeepSpeed ZeRO-3 on ``--ranks`` CPU
ranks (torchrun, gloo, ``DS_ACCELERATOR=cpu``), fp32, micro-batch 1, and saves with
``engine.save_checkpoint`` at irregular steps. Plain SGD without momentum by default, so the
optimizer files hold the fp32 masters and little else (``--optimizer adamw`` triples them).

Usage: python benchmarks/make_deepspeed_sequence.py [OUT] [--steps 3,7,8,13] [--ranks 3]
[--optimizer sgd|adamw] (default OUT: bench-data/zero3-1g). Does nothing when OUT already holds
every step; a run is written to ``OUT.partial`` and renamed into place when complete. About 4
minutes on 2 cores, ~12 GiB of RAM at peak (3 ranks, ~4 GiB each). ``bench_deepspeed.py``
asks for ``bench-data/zero3-adam-1g --ranks 2 --optimizer adamw``: 12.2 GiB on disk, of
which 4 GiB are fp32 masters, 4.3 minutes, ~6 GiB of RAM per rank.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.producers.ds_launch import make_deepspeed_sequences  # noqa: E402

DEFAULT_STEPS = "3,7,8,13"
# sub_group_size 3e7 (default 1e9; counted per rank) splits each rank's fp32 partition into a few
# flat groups, so keys straddle group boundaries as in larger models. The bucket and live-parameter limits
# (defaults 5e8 / 1e9 elements, i.e. the whole model) are lowered so that 3 ranks training
# 1 GiB of fp32 fit in ~10 GiB; they change nothing in the saved layout.
ZERO3 = {
    "sub_group_size": 30_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "reduce_bucket_size": 20_000_000,
    "stage3_prefetch_bucket_size": 20_000_000,
    "stage3_max_live_parameters": 50_000_000,
    "stage3_max_reuse_distance": 50_000_000,
}


def complete(out: Path, steps: list[int]) -> bool:
    return (out / "latest").is_file() and all((out / f"global_step{s}").is_dir() for s in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=Path("bench-data/zero3-1g"))
    parser.add_argument("--steps", default=DEFAULT_STEPS, help="global steps to save at (irregular)")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=19, help="model blocks (19: 1.01 GiB of fp32 masters)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    steps = sorted({int(s) for s in args.steps.split(",") if s})
    if complete(args.out, steps):
        print(f"{args.out}: already holds steps {steps}")
        return
    if args.out.exists():
        raise SystemExit(f"{args.out} exists but does not hold steps {steps}; remove it first")
    partial = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    run = {
        "out": str(partial),
        "stage": 3,
        "dtype": "fp32",
        "zero": ZERO3,
        "model": "big",
        "big_blocks": args.blocks,
        "optimizer": args.optimizer,
        "oracles": False,
    }
    started = time.perf_counter()
    make_deepspeed_sequences([run], world_size=args.ranks, steps=steps, timeout=args.timeout)
    partial.rename(args.out)
    info = json.loads((args.out / "producer.json").read_text())
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(
        f"{args.out}: steps {steps}, {args.ranks} ranks, {info['optimizer']}, "
        f"{size / 2**30:.2f} GiB on disk, {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
