"""--workers 2 against 1 on a CPU-bound case: averaging checkpoints of many small tensors.

Per-chunk work (parsing a record, reading it, folding it, writing a record) is Python-bound;
large tensors are memory-bound instead, and torch already spreads their arithmetic over the
cores of one process.

Usage: python benchmarks/bench_workers.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import EMA, Measurement, machine_description, run_timed, table


def make(root: Path, count: int, tensors: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    for i in range(count):
        path = root / f"step_{(i + 1) * 100}"
        if (path / ".metadata").exists():
            continue
        model = {f"blocks.{j}.norm.weight": torch.randn(1024, generator=g) for j in range(tensors)}
        dcp.save({"model": model}, checkpoint_id=str(path), no_dist=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path("bench-data/small-4x20k"))
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--tensors", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    make(args.data, args.count, args.tensors)
    out = args.data.parent / "bench-workers"
    runs = {f"average --workers {n}": n for n in (1, 2)}
    results = {name: Measurement(name, [], []) for name in runs}
    for _ in range(args.repeat):
        for name, n in runs.items():
            shutil.rmtree(out, ignore_errors=True)
            wall, rss = run_timed([EMA, "average", str(args.data), "--last", str(args.count),
                                   "--out", str(out), "--quiet", "--workers", str(n)])
            results[name].wall.append(wall)
            results[name].rss_mib.append(rss)
    shutil.rmtree(out, ignore_errors=True)
    one, two = results.values()
    print(f"Machine: {machine_description()}")
    print(f"Input: {args.count} DCP checkpoints of {args.tensors} fp32 tensors of 4 KiB; "
          f"medians of {args.repeat} runs\n")
    print(table([(m.name, f"{m.wall_median:.2f}", f"{m.rss_median:.0f}") for m in results.values()],
                ("command", "wall s", "peak RSS MiB (largest process)")))
    print(f"\nspeed-up with 2 workers = {one.wall_median / two.wall_median:.2f}×")


if __name__ == "__main__":
    main()
